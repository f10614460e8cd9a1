"""Tensor parallelism inside one worker: Megatron-style sharding of a transformers decoder, and the step
broadcast that keeps the ranks of a group in lockstep.

Why our own sharding rather than transformers' `tp_plan`: its plans shard through DTensor at
`from_pretrained` time, while pdlab also builds presets from a config with seeded random weights and runs its
own paged attention; slicing the loaded weights in place works for both and keeps every rank's modules plain
transformers modules. Each rank holds:
- q/k/v, gate/up split by output (query heads, KV heads, intermediate columns), o/down split by input, with
  a sum all-reduce on their outputs: two all-reduces per layer, as Megatron;
- KV heads: a contiguous slice when kv_heads >= tp, else one KV head replicated on tp / kv_heads ranks (as
  vLLM does); its paged KV pool then holds only its heads;
- embeddings, norms and lm_head whole (replicated), so every rank's hidden state is the full one.

The scheduler runs once, on rank 0 (the worker). Each step it broadcasts what the runner needs (per request:
context start, tokens this step, their ids, the block table) as msgpack bytes; the other ranks ("followers",
pdlab.serve.tp_follower) rebuild the same attention context and run the same forward. Only rank 0 samples.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

import msgpack
import torch

OP_STEP, OP_STOP = 1, 2
# Seconds this process spent in the model's all-reduces (waiting for the slower rank included) and how
# many: what benchmarks/bench_tp.py reports as TP's communication share of a step.
COMM = {"seconds": 0.0, "calls": 0}


def tp_error(heads: int, kv_heads: int, intermediate: int, tp: int) -> Optional[str]:
    """Why a model cannot be split over `tp` ranks (None: it can)."""
    if heads % tp:
        return f"{heads} attention heads do not split over tp {tp}"
    if kv_heads >= tp and kv_heads % tp:
        return f"{kv_heads} KV heads do not split over tp {tp}"
    if kv_heads < tp and tp % kv_heads:
        return f"{kv_heads} KV heads cannot be replicated evenly over tp {tp}"
    if intermediate % tp:
        return f"MLP width {intermediate} does not split over tp {tp}"
    return None


def local_kv_heads(kv_heads: int, tp: int) -> int:
    return max(1, kv_heads // tp)


def _rows_of(n: int, rank: int, world: int) -> slice:
    k = n // world
    return slice(rank * k, (rank + 1) * k)


def _keep_out(linear: torch.nn.Linear, part: slice) -> None:
    """Keep output features `part` (column parallel)."""
    linear.weight = torch.nn.Parameter(linear.weight.data[part].clone(), requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data[part].clone(), requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_in(linear: torch.nn.Linear, part: slice, rank: int, group: Any, fast: Any = None) -> None:
    """Keep input features `part` (row parallel) and sum the ranks' outputs; the bias is added once."""
    import torch.distributed as dist

    linear.weight = torch.nn.Parameter(linear.weight.data[:, part].clone(), requires_grad=False)
    linear.in_features = linear.weight.shape[1]
    if linear.bias is not None and rank != 0:
        linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias.data), requires_grad=False)

    def reduce(_mod: Any, _inp: Any, out: torch.Tensor) -> torch.Tensor:
        t = time.perf_counter()
        if fast is None or not fast(out):  # fast: a same-host shared-memory all-reduce (CPU), else the group's
            dist.all_reduce(out, group=group)
        COMM["seconds"] += time.perf_counter() - t
        COMM["calls"] += 1
        return out

    linear.register_forward_hook(reduce)


def shard_model(model: Any, rank: int, world: int, group: Any = None, fast_reduce: Any = None) -> Any:
    """Slice `model`'s decoder layers in place for `rank` of `world` (see the module docstring).
    `fast_reduce(t) -> bool`: an in-place sum all-reduce to try first (pdlab.engine.shm_allreduce)."""
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    err = tp_error(heads, kv_heads, cfg.intermediate_size, world)
    if err:
        raise ValueError(err)
    q = _rows_of(heads, rank, world)
    if kv_heads >= world:
        kv = _rows_of(kv_heads, rank, world)
    else:  # replicate: rank r serves query heads whose KV head is r * kv_heads // world
        h = rank * kv_heads // world
        kv = slice(h, h + 1)
    qcols = slice(q.start * head_dim, q.stop * head_dim)
    kvcols = slice(kv.start * head_dim, kv.stop * head_dim)
    mcols = _rows_of(cfg.intermediate_size, rank, world)
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for layer in backbone.layers:
        att, mlp = layer.self_attn, layer.mlp
        _keep_out(att.q_proj, qcols)
        _keep_out(att.k_proj, kvcols)
        _keep_out(att.v_proj, kvcols)
        _keep_in(att.o_proj, qcols, rank, group, fast_reduce)
        _keep_out(mlp.gate_proj, mcols)
        _keep_out(mlp.up_proj, mcols)
        _keep_in(mlp.down_proj, mcols, rank, group, fast_reduce)
    model.pdlab_tp = {"rank": rank, "world": world, "kv_heads": kv.stop - kv.start}
    return model


@dataclass
class SeqView:
    """What ModelRunner.prepare reads of a Sequence, rebuilt on a follower from the broadcast."""

    num_computed: int
    block_table: list[int]
    contiguous: bool
    num_tokens: int
    step_tokens: list[int]

    @property
    def output_ids(self) -> list[int]:
        return self.step_tokens  # a decode step's one token is the last output

    def tokens(self, start: int, end: int) -> list[int]:
        return self.step_tokens


def describe_step(seqs: list, num_tokens: list[int], decode: list[bool], block_size: int) -> bytes:
    """Rank 0: the batch as plain data for the followers (msgpack; control data is never pickled)."""
    items = []
    for s, n, d in zip(seqs, num_tokens, decode):
        start, end = s.num_computed, s.num_computed + n
        toks = [s.output_ids[-1]] if d else s.tokens(start, end)
        items.append([start, n, bool(d), s.block_table[: -(-end // block_size)], bool(s.contiguous), s.num_tokens,
                      list(toks)])
    return msgpack.packb(items)


def read_step(payload: bytes) -> tuple[list[SeqView], list[int], list[bool]]:
    seqs, ns, ds = [], [], []
    for start, n, d, table, contiguous, num_tokens, toks in msgpack.unpackb(payload):
        seqs.append(SeqView(start, table, contiguous, num_tokens, toks))
        ns.append(n)
        ds.append(d)
    return seqs, ns, ds


class StepChannel:
    """Rank 0 sends each step's description to the followers over the group (gloo: CPU tensors)."""

    def __init__(self, group: Any = None):
        self.group = group

    def send(self, op: int, payload: bytes = b"") -> None:
        import torch.distributed as dist

        dist.broadcast(torch.tensor([op, len(payload)], dtype=torch.int64), src=0, group=self.group)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.group)

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.group)

    def recv(self) -> tuple[int, bytes]:
        import torch.distributed as dist

        head = torch.empty(2, dtype=torch.int64)
        dist.broadcast(head, src=0, group=self.group)
        op, n = int(head[0]), int(head[1])
        if not n:
            return op, b""
        buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return op, buf.numpy().tobytes()
