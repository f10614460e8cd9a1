"""What pdlab checks of a running server before it measures it (engine.backend: endpoint).

`/v1/models` and one tiny streamed completion. Each way it can be wrong is one line naming the URL: the
server is unreachable, it wants an API key or refused the one given, it does not serve the recipe's model
(the line lists what it serves), it does not stream. The completion also finds out how to talk to it:
prompts as token ids (vLLM and SGLang take them) or, when it refuses those, as text decoded with the
recipe's tokenizer; outputs as token ids (vLLM's `return_token_ids`) or as text counted with that tokenizer.

The API key is read from the environment variable the recipe names and goes into the Authorization header
only: no message here quotes a header.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

import aiohttp

from pdlab.constants import ENDPOINT_PROBE_TIMEOUT_S
from pdlab.external.stream import StreamError, chunk_tokens, completion_body, request_json, stream_completion
from pdlab.serve.topology import ClusterError

PROBE_IDS = [1, 2, 3, 4]  # ids every vocabulary has
PROBE_TEXT = "Hello"
PROBE_TOKENS = 2  # two, so that the stream has more than one chunk to show
AUTH_CODES = (401, 403)
REFUSED_PROMPT_CODES = (400, 422)  # how OpenAI-compatible servers refuse a prompt they cannot read


@dataclass(frozen=True)
class EndpointInfo:
    """How to talk to one endpoint, as the probe found it."""

    url: str
    model: str
    models: tuple[str, ...]  # what its /v1/models lists
    prompt_as: str  # token_ids | text
    output_as: str  # token_ids | text
    version: Optional[str]  # its /version, when it has one (vLLM)

    def to_dict(self) -> dict:
        return {"url": self.url, "model": self.model, "models": list(self.models), "prompt_as": self.prompt_as,
                "output_as": self.output_as, "version": self.version}


def root_of(url: str) -> str:
    """scheme://host:port of an API base (vLLM serves /version and /reset_prefix_cache there)."""
    u = urlsplit(url)
    return f"{u.scheme}://{u.netloc}"


def api_key(backend: Any, where: str) -> Optional[str]:
    """The key from the environment variable engine.api_key_env names; ClusterError when it is unset."""
    name = backend.api_key_env
    if name is None:
        return None
    key = os.environ.get(name, "")
    if not key:
        raise ClusterError(f"{where}.engine.api_key_env: the environment variable {name} is not set (it should "
                           f"hold the API key of {backend.url})")
    return key


def auth_headers(key: Optional[str]) -> dict:
    return {"Authorization": f"Bearer {key}"} if key else {}


def redact(text: str, key: Optional[str]) -> str:
    """`text` without the key, should a server have echoed it into an error message."""
    return text.replace(key, "[API key]") if key else text


def _auth_error(backend: Any, e: StreamError) -> ClusterError:
    if backend.api_key_env:
        return ClusterError(f"endpoint {backend.url}: HTTP {e.status}: the server refused the API key in "
                            f"${backend.api_key_env}")
    return ClusterError(f"endpoint {backend.url}: HTTP {e.status}: the server wants an API key; put it in an "
                        "environment variable and name that in engine.api_key_env")


def _fail(backend: Any, e: StreamError) -> ClusterError:
    if e.status in AUTH_CODES:
        return _auth_error(backend, e)
    if e.connection:
        return ClusterError(f"endpoint {backend.url}: unreachable ({str(e).split(': ', 1)[-1]})")
    return ClusterError(f"endpoint {e}")


async def probe(session: aiohttp.ClientSession, backend: Any, key: Optional[str],
                has_tokenizer: Callable[[], bool]) -> EndpointInfo:
    """The checks of the module docstring; ClusterError (one line) for the first that fails."""
    url, headers, t = backend.url, auth_headers(key), ENDPOINT_PROBE_TIMEOUT_S
    try:
        listing = await request_json(session, "GET", f"{url}/models", headers=headers, timeout=t)
    except StreamError as e:
        raise _fail(backend, e) from None
    data = listing.get("data") if isinstance(listing, dict) else None
    if not isinstance(data, list):
        raise ClusterError(f"endpoint {url}/models: not an OpenAI model list (no `data` list); is {url} the API "
                           "base (it usually ends in /v1)?")
    models = tuple(str(m.get("id")) for m in data if isinstance(m, dict) and m.get("id") is not None)
    if backend.model not in models:
        raise ClusterError(f"endpoint {url}: no model {backend.model!r} there; it serves: "
                           f"{', '.join(models) or '(nothing)'}")
    got: list[dict] = []
    prompt_as = "token_ids"
    for prompt in (PROBE_IDS, PROBE_TEXT):
        body = completion_body(prompt, PROBE_TOKENS, stream=True, model=backend.model)
        try:
            await stream_completion(session, f"{url}/completions", body, lambda ev, _t: got.append(ev),
                                    headers=headers, timeout=t)
            break
        except StreamError as e:
            if e.status in REFUSED_PROMPT_CODES and prompt is PROBE_IDS:
                prompt_as, got = "text", []
                continue  # token ids refused: try text
            if e.not_streamed:
                raise ClusterError(f"endpoint {e}") from None
            raise _fail(backend, e) from None
    if not got:
        raise ClusterError(f"endpoint {url}/completions: does not stream: its event stream carried no completion "
                           "chunk")
    output_as = "token_ids" if any(chunk_tokens(ev) for ev in got) else "text"
    if "text" in (prompt_as, output_as) and not has_tokenizer():
        why = "refuses token-id prompts" if prompt_as == "text" else "streams text without token ids"
        raise ClusterError(f"endpoint {url}: the server {why} and the recipe's model has no tokenizer to "
                           "translate; give model.path a directory with the served model's tokenizer")
    try:
        version = await request_json(session, "GET", f"{root_of(url)}/version", headers=headers, timeout=t)
        version = version.get("version") if isinstance(version, dict) else None
    except StreamError:
        version = None
    return EndpointInfo(url, backend.model, models, prompt_as, output_as,
                        str(version) if version is not None else None)


def check_endpoint(v: Any) -> EndpointInfo:
    """Probe variant `v`'s endpoint from the calling thread (before anything starts); ClusterError on failure."""
    from pdlab.external.loop import ClientLoop

    key = api_key(v.backend, f"variants.{v.name}")
    loop = ClientLoop(f"probe-{v.name}", ENDPOINT_PROBE_TIMEOUT_S)
    loop.start()
    try:
        return loop.call(probe(loop.session, v.backend, key, lambda: load_tokenizer(v.model) is not None))
    except ClusterError as e:
        raise ClusterError(redact(str(e), key)) from None
    finally:
        loop.close()


def load_tokenizer(model: Any) -> Any:
    """The recipe's tokenizer; None for a preset, which has none (pdlab.engine.model.load_tokenizer), said
    without importing the engine: the import is deferred, transformers is heavy."""
    if model.path is None:
        return None
    from pdlab.engine.model import load_tokenizer as load

    return load(model)
