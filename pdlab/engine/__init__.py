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

from pdlab.engine.config import EngineConfig, RequestError, SamplingParams
from pdlab.engine.engine import Engine, HandoffInfo, Reservation, StepOutput, StepRecord, TokenOut
from pdlab.engine.model import PRESETS, ModelLoadError, load_model

__all__ = [
    "Engine", "EngineConfig", "SamplingParams", "RequestError", "StepOutput", "StepRecord", "TokenOut",
    "HandoffInfo", "Reservation", "load_model", "ModelLoadError", "PRESETS",
]
