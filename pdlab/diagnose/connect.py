"""The checks before `pdlab diagnose URL` measures anything: the endpoint probe every pdlab client of a running
server makes (pdlab.external.probe: /v1/models, one tiny streamed completion, token ids or text, the API
key), plus the server's `max_model_len` where its /v1/models lists one (vLLM and pdlab serve do), which caps
the probe lengths.

Every failure is one line naming the URL (DiagnoseError, exit 2). The API key is read from the variable
--api-key-env names, kept in memory for the Authorization header, and taken out of any message.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlsplit

import aiohttp

from pdlab.constants import ENDPOINT_PROBE_TIMEOUT_S
from pdlab.external.probe import auth_headers, probe, redact
from pdlab.external.stream import StreamError, request_json
from pdlab.serve.topology import ClusterError


class DiagnoseError(RuntimeError):
    """A user-facing error of pdlab diagnose: one line, exit 2."""


@dataclass(frozen=True)
class EndpointSpec:
    """What pdlab.external.probe reads of an endpoint (a recipe's engine section has the same fields)."""

    url: str
    model: str
    api_key_env: Optional[str] = None


@dataclass(frozen=True)
class Target:
    url: str
    model: str
    prompt_as: str  # token_ids | text
    output_as: str  # token_ids | text
    max_model_len: Optional[int]  # as /v1/models says, else None
    version: Optional[str]
    headers: dict = field(default_factory=dict, repr=False)  # the Authorization header: never written

    def to_dict(self) -> dict:
        return {"url": self.url, "model": self.model, "prompt_as": self.prompt_as, "output_as": self.output_as,
                "max_model_len": self.max_model_len, "version": self.version}


def check_url(url: str) -> str:
    """The API base without a trailing slash; DiagnoseError when it is not an http(s) URL."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.netloc:
        raise DiagnoseError(f"{url}: expected the API base of an OpenAI-compatible server, such as "
                            "http://127.0.0.1:8000/v1 (or a pdlab run directory)")
    return url.rstrip("/")


def api_key(env: Optional[str]) -> Optional[str]:
    if env is None:
        return None
    key = os.environ.get(env, "")
    if not key:
        raise DiagnoseError(f"--api-key-env {env}: the environment variable {env} is not set (it should hold the "
                            "API key)")
    return key


def model_len(listing: object, model: str) -> Optional[int]:
    """`max_model_len` of `model` in a /v1/models answer, when the server lists one."""
    data = listing.get("data") if isinstance(listing, dict) else None
    for m in data if isinstance(data, list) else []:
        if isinstance(m, dict) and str(m.get("id")) == model:
            value = m.get("max_model_len")
            return int(value) if isinstance(value, (int, float)) and value > 1 else None
    return None


async def connect(session: aiohttp.ClientSession, spec: EndpointSpec) -> Target:
    key = api_key(spec.api_key_env)
    headers = auth_headers(key)
    try:
        try:
            listing = await request_json(session, "GET", f"{spec.url}/models", headers=headers,
                                         timeout=ENDPOINT_PROBE_TIMEOUT_S)
        except StreamError:
            listing = None  # the probe asks again and says what is wrong in its words
        info = await probe(session, spec, key, lambda: True)  # no tokenizer needed: text prompts are words
    except ClusterError as e:
        text = str(e).replace("engine.api_key_env", "--api-key-env").replace(
            "the recipe's model has no tokenizer", "pdlab diagnose cannot count its tokens")
        raise DiagnoseError(redact(text, key)) from None
    return Target(spec.url, spec.model, info.prompt_as, info.output_as, model_len(listing, spec.model),
                  info.version, headers)
