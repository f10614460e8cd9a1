"""The run directory (DESIGN.md, Results): writer, reader, and the env.json collector.

Whole files (recipe.yaml, env.json, summary.json, trace.json) are written atomically: a temporary file in
the same directory, then os.replace, so a reader never sees half a file. Record files (requests, steps,
transfers) are append-only JSONL, flushed after every batch, so a run cut short keeps what it measured;
the reader skips a last line torn by a crash. JSON has no infinity: the rate `inf` is written as "inf"
and read back as float('inf') in the `rate` field of records.
"""

from __future__ import annotations

import json
import math
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml

RECORD_KINDS = ("requests", "steps", "transfers")


class RunDirError(ValueError):
    """Not a readable run directory."""


def _clean(x: Any) -> Any:
    if isinstance(x, float):
        if math.isinf(x):
            return "inf" if x > 0 else "-inf"
        return None if math.isnan(x) else x
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def dumps(obj: Any, **kw: Any) -> str:
    """Strict JSON (no Infinity/NaN tokens): inf -> "inf", nan -> null."""
    try:
        return json.dumps(obj, allow_nan=False, **kw)
    except ValueError:
        return json.dumps(_clean(obj), allow_nan=False, **kw)


def atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def default_run_path(recipe_name: str, root: str = "runs") -> str:
    """runs/<recipe>-<YYYYmmdd-HHMMSS>, with -2, -3 ... if that exists already."""
    base = os.path.join(root, f"{recipe_name}-{time.strftime('%Y%m%d-%H%M%S')}")
    path, n = base, 1
    while os.path.exists(path):
        n += 1
        path = f"{base}-{n}"
    return path


class RunDir:
    """Writer of one run directory. Append records as they come; write summary/trace at the end."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(path, exist_ok=True)
        self._files: dict[str, Any] = {}

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def write_recipe(self, recipe: Any) -> None:
        """`recipe`: a Recipe (its resolved to_dict()) or a plain dict."""
        data = recipe.to_dict() if hasattr(recipe, "to_dict") else recipe
        atomic_write(self.file("recipe.yaml"), yaml.safe_dump(data, sort_keys=False, default_flow_style=None, width=110))

    def write_env(self, env: Optional[dict] = None) -> None:
        atomic_write(self.file("env.json"), dumps(env if env is not None else collect_env(), indent=2))

    def update_env(self, **items: Any) -> None:
        """Add or replace top-level keys of env.json (facts learned while the run goes, e.g. `transports`)."""
        try:
            with open(self.file("env.json")) as f:
                env = json.load(f)
        except (OSError, ValueError):
            env = {}
        env.update(items)
        self.write_env(env)

    def write_summary(self, summary: dict) -> None:
        atomic_write(self.file("summary.json"), dumps(summary, indent=2))

    def write_trace(self, trace: dict) -> None:
        atomic_write(self.file("trace.json"), dumps(trace))

    def mark_partial(self, reason: str) -> None:
        """Say the run was cut short: sets `partial: true` and `reason` in summary.json (creating it if needed)."""
        summary: dict = {}
        if os.path.exists(self.file("summary.json")):
            try:
                with open(self.file("summary.json")) as f:
                    summary = json.load(f)
            except (OSError, json.JSONDecodeError):
                summary = {}
        summary.update(partial=True, reason=reason)
        self.write_summary(summary)

    def append(self, kind: str, records: list[dict]) -> None:
        """Append a batch of records to <kind>.jsonl and flush it."""
        if kind not in RECORD_KINDS:
            raise ValueError(f"unknown record kind {kind!r}; expected one of {RECORD_KINDS}")
        f = self._files.get(kind)
        if f is None:
            f = self._files[kind] = open(self.file(f"{kind}.jsonl"), "a")
        if records:
            f.write("".join(dumps(r) + "\n" for r in records))
            f.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> "RunDir":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def read_jsonl(path: str) -> list[dict]:
    """Records of a JSONL file ([] when absent); a torn last line (crash mid-write) is skipped."""
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        lines = f.read().split("\n")
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i >= len(lines) - 2:  # the last non-empty line: torn write
                continue
            raise RunDirError(f"{path}:{i + 1}: not valid JSON") from None
        if isinstance(rec.get("rate"), str):
            rec["rate"] = float(rec["rate"])  # "inf"
        out.append(rec)
    return out


@dataclass
class Run:
    path: str
    recipe: dict
    env: dict
    summary: dict
    requests: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    transfers: list[dict] = field(default_factory=list)

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.path))


def load_run(path: str, records: bool = True) -> Run:
    """Read a run directory back. Raises RunDirError (one line) when it is not one."""
    if not os.path.isdir(path):
        raise RunDirError(f"{path}: not a directory")
    if not any(os.path.exists(os.path.join(path, n)) for n in ("summary.json", "requests.jsonl", "recipe.yaml")):
        raise RunDirError(f"{path}: not a pdlab run directory (no summary.json, requests.jsonl or recipe.yaml)")

    def load(name: str, parse: Any) -> dict:
        p = os.path.join(path, name)
        if not os.path.exists(p):
            return {}
        try:
            with open(p) as f:
                return parse(f) or {}
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise RunDirError(f"{p}: cannot be parsed ({e.__class__.__name__})") from None

    run = Run(path=path, recipe=load("recipe.yaml", yaml.safe_load), env=load("env.json", json.load),
              summary=load("summary.json", json.load))
    if records:
        for kind in RECORD_KINDS:
            setattr(run, kind, read_jsonl(os.path.join(path, f"{kind}.jsonl")))
    return run


def collect_env() -> dict:
    """Versions, host and devices for env.json. torch is imported here, never at module import."""
    env: dict[str, Any] = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0],
        "platform": platform.platform(), "host": socket.gethostname(), "cpu_count": os.cpu_count(),
        "cpu_affinity": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": _mem_total(), "cpu_model": cpu_model(), "argv": sys.argv,
    }
    for mod in ("pdlab", "torch", "transformers", "numpy", "zmq"):
        try:
            v = getattr(__import__(mod), "__version__", None)
            env[f"{mod}_version"] = None if v is None else str(v)  # torch's is a str subclass
        except Exception:  # noqa: BLE001 - a missing or broken package is a fact to record, not an error
            env[f"{mod}_version"] = None
    env["cuda"] = _cuda_devices()
    try:
        # deferred: torch
        from pdlab.engine.cuda_attention import env_summary

        env["attention"] = env_summary()  # which attention kernel a worker of each kind runs
    except Exception as e:  # noqa: BLE001 - env.json must be written anyway
        env["attention"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["git_commit"] = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                                           text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["git_commit"] = None
    return env


def cpu_model() -> Optional[str]:
    """The CPU's model name (/proc/cpuinfo; platform's processor elsewhere): which box measured."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _mem_total() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cuda_devices() -> list[dict]:
    try:
        # deferred: torch
        import torch

        if not torch.cuda.is_available():
            return []
        out = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out.append({"index": i, "name": p.name, "memory_bytes": p.total_memory,
                        "capability": f"{p.major}.{p.minor}"})
        return out
    except Exception:  # noqa: BLE001 - env.json must be written even when CUDA is broken
        return []
