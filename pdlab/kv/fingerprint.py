"""What two workers must agree on before KV blocks can move between them, checked once at hand-over set-up.

A hand-over copies raw block bytes: a decode worker reading a prefill worker's blocks only makes sense when
both run the same model (same weights: preset and its seed, or the same checkpoint path), in the same dtype,
with the same block size and the same per-block KV layout and shape (the model's, all KV heads). Their
tensor-parallel degrees may differ: a hand-over between groups re-slices heads (pdlab.kv.sharded), so `tp`
is reported, not compared.
Each worker reports its fingerprint in `Ready`, over the control plane (so this holds across nodes as
well); the launcher pairs every prefill worker with every decode worker and refuses, in one line naming the
first difference, before any request is sent. Copies check shapes too (pdlab.kv.copy.copy_blocks), but
only per request, and equal shapes do not mean equal models.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

LAYOUT = "layers,kv,blocks,block_size,kv_heads,head_dim"  # the engine's pool tensor, pdlab.engine.engine


class PairingError(ValueError):
    """Two workers whose KV blocks cannot be exchanged."""


@dataclass(frozen=True)
class KvFingerprint:
    model: str  # "preset:cpu-demo seed 0" or "path:/models/x"
    dtype: str  # "float32"
    block_size: int
    layout: str
    block_shape: tuple[int, ...]  # one block across layers: (layers, 2, block_size, kv_heads, head_dim)
    tp: int = 1  # tensor-parallel degree of the worker (its pool is tp shards of the heads)

    @classmethod
    def of(cls, model_spec: Any, engine: Any, tp: int = 1) -> "KvFingerprint":
        """The fingerprint of a worker's engine (pdlab.engine.Engine) built from `model_spec`; the block
        shape is the whole model's (all KV heads), whatever shard of it this rank holds."""
        ident = (f"preset:{model_spec.preset} seed {model_spec.seed}" if model_spec.preset is not None
                 else f"path:{model_spec.path}")
        s = list(engine.kv.shape)
        if tp > 1:
            cfg = engine.model.config
            s[4] = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        return cls(ident, str(engine.dtype).removeprefix("torch."), engine.config.block_size, LAYOUT,
                   (s[0], s[1], *s[3:]), tp)

    def to_raw(self) -> dict:
        raw = asdict(self)
        raw["block_shape"] = list(self.block_shape)
        return raw

    @classmethod
    def from_raw(cls, raw: dict) -> "KvFingerprint":
        names = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or set(raw) != names:
            raise PairingError(f"not a KV fingerprint: {raw!r}")
        return cls(**{**raw, "block_shape": tuple(raw["block_shape"])})


def check_pair(prefill: str, p: KvFingerprint, decode: str, d: KvFingerprint) -> None:
    """Raise PairingError naming the first field on which the two workers differ."""
    for f in fields(KvFingerprint):
        if f.name == "tp":
            continue  # different TP on the two sides is re-sliced by the hand-over
        a, b = getattr(p, f.name), getattr(d, f.name)
        if a != b:
            show = (lambda x: "x".join(map(str, x))) if f.name == "block_shape" else str
            raise PairingError(f"{prefill} and {decode} cannot exchange KV: {f.name} differs "
                               f"({prefill}: {show(a)}, {decode}: {show(b)})")
