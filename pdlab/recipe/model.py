"""The recipe's `model` section: which model every worker of a variant serves, and optionally a modelled
timing (`timing`, see pdlab/recipe/timing.py): then the engine does not run the model, its steps take the
modelled time."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from pdlab.constants import DTYPES
from pdlab.engine.model import PRESETS
from pdlab.fields import RecipeError, Section, did_you_mean, key_of, optional, spec, to_int, to_str
from pdlab.recipe.timing import TimingProfile, parse_timing

FORM = "{preset: NAME} or {path: DIR, dtype: bfloat16}"
DEFAULT_PRESET = "cpu-demo"


def _dtype(v: object) -> str:
    key = DTYPES.get(str(v).lower()) if isinstance(v, str) else None
    if key is None:
        raise ValueError
    return key


@dataclass(frozen=True)
class ModelSpec(Section):
    preset: Optional[str] = spec(None, "a preset name such as cpu-demo", optional(to_str))
    path: Optional[str] = spec(None, "a local model directory or an id in the local HF cache", optional(to_str))
    # None: the variant's device decides (float32 on cpu, bfloat16 on cuda); see Variant
    dtype: Optional[str] = spec(None, "one of float32, bfloat16, float16, auto", optional(_dtype))
    device: Optional[str] = spec(None, "a device string; workers use their deployment devices", optional(to_str))
    seed: int = spec(0, "an integer >= 0 (weights seed of a preset)", to_int(0))
    # None: the model runs; a profile (a name, a path, or inline step terms): steps take the modelled time
    timing: Optional[TimingProfile] = spec(None, parse=parse_timing)
    # a model that runs: the timing profile its steps are held against at the end of a run (pdlab.timing.check);
    # with `timing` set the steps are checked against that profile instead (a base model may carry both)
    check_timing: Optional[TimingProfile] = spec(None, parse=parse_timing)

    @classmethod
    def from_raw(cls, raw: object, where: str) -> "ModelSpec":
        return super().from_raw({"preset": DEFAULT_PRESET} if raw is None else raw, where)

    @property
    def source(self) -> str:
        """The preset name or the path."""
        return self.preset if self.preset is not None else str(self.path)

    @property
    def modelled(self) -> bool:
        """True when step times come from `timing`, not from the hardware: say so wherever times are shown."""
        return self.timing is not None

    def check(self, where: str) -> None:
        if (self.preset is None) == (self.path is None):
            raise RecipeError(f"{where}: give exactly one of preset or path; expected {FORM}")
        if self.preset is not None:  # the engine owns the preset list (pdlab.engine.model loads torch lazily)
            if self.preset not in PRESETS:
                raise RecipeError(f"{key_of(where, 'preset')}: unknown preset {self.preset!r}"
                                  + (did_you_mean(self.preset, PRESETS) or f"; known: {', '.join(sorted(PRESETS))}"))
            if PRESETS[self.preset].stand_in_only and self.timing is None:
                raise RecipeError(f"{key_of(where, 'preset')}: {self.preset} has a model's dimensions only (no "
                                  "weights pdlab could run): give it a model.timing profile")
        elif self.path.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(self.path)):
            raise RecipeError(f"{key_of(where, 'path')}: {self.path} is not a directory")
