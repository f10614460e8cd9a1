"""Typed recipe sections: frozen dataclasses parsed from plain YAML data with one-line errors.

A section is a frozen dataclass whose fields carry, in their metadata, what a recipe may write there
(`expected`, for the error message) and how to check it (`conv`: value -> normalized value, raising
ValueError or TypeError; or `parse`: (value, key) -> value, raising its own RecipeError, for nested
sections). `Section.from_raw(raw, where)` is the one parser: unknown keys (with a did-you-mean), missing
required keys, bad values and cross-field rules (`check`) all become a RecipeError naming the full key.
A field's default is the dataclass default: there is no second table of defaults.

`to_raw()` turns a section back into plain data (for recipe.yaml, spawn arguments and JSON), and
`from_raw(x.to_raw(), where)` gives `x` back.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any, Callable, Iterable, Optional, TypeVar

T = TypeVar("T", bound="Section")
REQUIRED = object()


class RecipeError(ValueError):
    """A user mistake in a recipe or an override: one line, naming the key and the expected form."""


def key_of(where: str, k: str) -> str:
    return f"{where}.{k}" if where else str(k)


def spec(default: Any = REQUIRED, expected: str = "", conv: Optional[Callable[[Any], Any]] = None,
         parse: Optional[Callable[[Any, str], Any]] = None, derived: bool = False) -> Any:
    """A section field. `derived` fields are computed by the section, never read from a recipe."""
    meta = {"expected": expected, "conv": conv, "parse": parse, "derived": derived}
    if default is REQUIRED:
        return dataclasses.field(metadata=meta)
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable default: use a tuple")
    return dataclasses.field(default=default, metadata=meta)


def did_you_mean(k: Any, options: Iterable[str]) -> str:
    hint = difflib.get_close_matches(str(k), list(options), n=1)
    return f" (did you mean {hint[0]!r}?)" if hint else ""


def check_keys(raw: dict, allowed: Iterable[str], where: str) -> None:
    allowed = list(allowed)
    for k in raw:
        if k not in allowed:
            hint = did_you_mean(k, allowed)
            raise RecipeError(f"{key_of(where, k)}: unknown key" + (hint or f"; expected one of {', '.join(allowed)}"))


def as_mapping(raw: Any, where: str, keys: Iterable[str]) -> dict:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{where or 'recipe'}: expected a mapping with keys {', '.join(keys)}, got {raw!r}")
    return raw


class Section:
    """Base of every recipe section (use with @dataclass(frozen=True))."""

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("derived")]

    @classmethod
    def read(cls, raw: Any, where: str, names: Optional[list[str]] = None) -> dict:
        """Check and convert the fields `names` (default: every recipe key) of `raw`; absent ones are left out
        (their dataclass default applies) unless required or a nested section (which fills its defaults)."""
        names = cls.keys() if names is None else names
        raw = as_mapping(raw, where, names)
        check_keys(raw, names, where)
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in names:
                continue
            key, meta = key_of(where, f.name), f.metadata
            if f.name not in raw:
                required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                if required and (meta.get("parse") is None or meta["expected"]):
                    raise RecipeError(f"{key}: missing; expected {meta['expected']}")
                if required:
                    out[f.name] = meta["parse"](None, key)
                continue
            value = raw[f.name]
            if meta.get("parse") is not None:
                out[f.name] = meta["parse"](value, key)
                continue
            try:
                out[f.name] = meta["conv"](value) if meta.get("conv") else value
            except (ValueError, TypeError):
                raise RecipeError(f"{key}: expected {meta['expected']}, got {value!r}") from None
        return out

    @classmethod
    def from_raw(cls: type[T], raw: Any, where: str) -> T:
        obj = cls(**cls.read(raw, where))
        obj.check(where)
        return obj

    def check(self, where: str) -> None:
        """Rules across fields; raise RecipeError naming the key."""

    def validate(self, where: str) -> None:
        """Check a section built in Python (not parsed) by parsing its plain form: one set of rules."""
        type(self).from_raw(self.to_raw(), where)

    def to_raw(self) -> dict:
        return {f.name: plain(getattr(self, f.name)) for f in dataclasses.fields(self) if not f.metadata.get("derived")}

    def replace(self: T, **changes: Any) -> T:
        return dataclasses.replace(self, **changes)


def plain(x: Any) -> Any:
    """Sections, tuples and dicts as plain YAML/JSON data."""
    if isinstance(x, Section):
        return x.to_raw()
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    if isinstance(x, dict):
        return {k: plain(v) for k, v in x.items()}
    return x


def section(cls: type[T], nullable: bool = False) -> Callable[[Any, str], Any]:
    """A `parse` for a nested section (None: its defaults, or None when `nullable`)."""
    def parse(v: Any, key: str) -> Any:
        if v is None and nullable:
            return None
        return cls.from_raw(v, key)
    return parse


# ---- converters: value -> normalized value, ValueError/TypeError when wrong ----

def to_int(lo: int = 0) -> Callable[[Any], int]:
    def conv(v: Any) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError
        return v
    return conv


def to_float(lo: float = 0.0, hi: float = math.inf, lo_open: bool = True) -> Callable[[Any], float]:
    def conv(v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
            raise ValueError
        if (v <= lo if lo_open else v < lo) or v > hi:
            raise ValueError
        return float(v)
    return conv


def to_bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError
    return v


def one_of(options: Iterable[str]) -> Callable[[Any], str]:
    opts = tuple(options)

    def conv(v: Any) -> str:
        if v not in opts:
            raise ValueError
        return v
    return conv


def optional(conv: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda v: None if v is None else conv(v)


def to_str(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError
    return v


def to_text(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError
    return v


def choices(options: Iterable[str]) -> str:
    """'a, b or c' for error messages."""
    opts = list(options)
    return opts[0] if len(opts) == 1 else f"{', '.join(opts[:-1])} or {opts[-1]}"
