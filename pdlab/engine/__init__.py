"""The engine: one paged-KV, continuous-batching engine for three roles.

Public API (what worker processes wrap; the engine knows nothing of processes or sockets):

    from pdlab.engine import Engine, EngineConfig, SamplingParams, load_model

    model = load_model("cpu-demo", dtype="float32", device="cpu")   # preset name or local directory
    eng = Engine(model, EngineConfig(...), role="unified")            # "unified" | "prefill" | "decode"
    eng.add("r1", prompt_ids, SamplingParams(max_tokens=32))          # raises RequestError on bad input
    while eng.has_work():
        out = eng.step()          # StepOutput: .record (StepRecord), .tokens (list[TokenOut])
    eng.abort("r1")

Role prefill: a request finishes after its first sampled token (TokenOut.finished, reason "handoff");
its blocks stay allocated: `eng.handoff(req_id)` -> HandoffInfo (block ids, prompt, first token);
`eng.release(req_id)` frees them once the decode side has the KV.
Role decode: `eng.reserve(req_id, prompt_ids, first_token=None, params)` -> Reservation (block ids to
fill, blocks already held through the prefix cache) or None when there is no room; the caller writes KV
into `eng.kv` at those blocks, then `eng.admit(req_id, first_token)` starts decoding (the first token may
be given at either call: in push mode the reservation comes before it is sampled).
`eng.cancel_reservation(req_id)` undoes a reservation whose transfer failed.
`eng.kv` is the pool: a tensor [layers, 2, blocks, block_size, kv_heads, head_dim]; pass `kv_alloc`
to Engine to place it (e.g. in shared memory). `eng.layer_hook = fn(layer_idx)` is called after every
layer has written its KV during a step (push-mode transfers); `eng.step_requests()` tells which
requests the current step is running.
"""

import importlib
from typing import Any

# Names resolve on first use (PEP 562), so that importing pdlab.engine.config or .model does not pull in
# torch: a worker process sets CUDA_VISIBLE_DEVICES and its CPU affinity before torch is imported.
_WHERE = {
    "EngineConfig": "config", "SamplingParams": "config", "RequestError": "config",
    "Engine": "engine", "HandoffInfo": "engine", "Reservation": "engine", "StepOutput": "engine",
    "StepRecord": "engine", "TokenOut": "engine",
    "load_model": "model", "ModelLoadError": "model", "PRESETS": "model",
}
__all__ = list(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pdlab.engine' has no attribute {name!r}")

    return getattr(importlib.import_module(f"pdlab.engine.{_WHERE[name]}"), name)
