"""Tensor parallelism inside one worker: Megatron-style sharding of a transformers decoder by the model's own
plan, and the step broadcast that keeps the ranks of a group in lockstep.

What to shard comes from the model: transformers' `config.base_model_tp_plan` names, per decoder layer, the
column-wise and row-wise projections (Llama's q/k/v/gate/up and o/down; Phi-3's fused qkv_proj and
gate_up_proj; GPT-NeoX's query_key_value), and pdlab honours it for every architecture described that way.
How to shard is pdlab's: transformers applies plans through DTensor at `from_pretrained` time, while pdlab
also builds presets from a config with seeded random weights and runs its own paged attention, so it slices
the loaded weights in place and every rank's modules stay plain transformers modules. Each rank holds:
- column-wise projections split by output into this rank's query heads, KV heads or MLP columns, a fused
  projection part by part (q | k | v, gate | up), so no output is gathered; row-wise ones split by input,
  with a sum all-reduce on their outputs: two all-reduces per layer, as Megatron;
- KV heads: a contiguous slice when kv_heads >= tp, else one KV head replicated on tp / kv_heads ranks (as
  vLLM does); its paged KV pool then holds only its heads; attention modules see the rank's head counts;
- embeddings, norms and lm_head whole (replicated), so every rank's hidden state is the full one.
A model without a plan, or with one pdlab cannot honour (another style inside a layer, a norm over all of
q), is refused before anything starts, naming its model type (pdlab.engine.tp_plan).

The scheduler runs once, on rank 0 (the worker). Each step it broadcasts what the runner needs (per request:
context start, tokens this step, their ids, the block table) as msgpack bytes; the other ranks ("followers",
pdlab.serve.tp_follower) rebuild the same attention context and run the same forward. Only rank 0 samples.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from pdlab.engine.tp_plan import Dims, check_plan, layer_plan, parts_of, shard_heads

OP_STEP, OP_STOP = 1, 2
# Seconds this process spent in the model's all-reduces (waiting for the slower rank included) and how
# many: what benchmarks/bench_tp.py reports as TP's communication share of a step.
COMM = {"seconds": 0.0, "calls": 0}


def _index(parts: list[slice]) -> torch.Tensor:
    return torch.cat([torch.arange(p.start, p.stop) for p in parts])


def _keep_out(linear: torch.nn.Linear, parts: list[slice]) -> None:
    """Keep output features `parts`, in order (column parallel; a fused q/k/v or gate/up keeps each part's)."""
    idx = _index(parts)
    linear.weight = torch.nn.Parameter(linear.weight.data.index_select(0, idx.to(linear.weight.device)),
                                       requires_grad=False)
    if linear.bias is not None:
        linear.bias = torch.nn.Parameter(linear.bias.data.index_select(0, idx.to(linear.bias.device)),
                                         requires_grad=False)
    linear.out_features = linear.weight.shape[0]


def _keep_in(linear: torch.nn.Linear, parts: list[slice], rank: int, group: Any, fast: Any = None) -> None:
    """Keep input features `parts` (row parallel) and sum the ranks' outputs; the bias is added once."""

    idx = _index(parts).to(linear.weight.device)
    linear.weight = torch.nn.Parameter(linear.weight.data.index_select(1, idx).contiguous(), requires_grad=False)
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


def _local_heads(module: Any, d: Dims, heads: int, kv_heads: int) -> None:
    """An attention module that reads head counts (its own attributes, or its config, as Phi-3 reads
    config.num_attention_heads to split its fused q/k/v) sees this rank's: a config copy of its own."""
    cfg = copy.copy(module.config) if hasattr(module, "config") else None
    if cfg is not None:
        cfg.num_attention_heads, cfg.num_key_value_heads = heads, kv_heads
        module.config = cfg
    for name, value in (("num_heads", heads), ("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                        ("num_key_value_groups", heads // kv_heads)):
        if isinstance(getattr(module, name, None), int):
            setattr(module, name, value)
    if getattr(module, "hidden_size", None) == d.heads * d.head_dim:
        module.hidden_size = heads * d.head_dim


def shard_model(model: Any, rank: int, world: int, group: Any = None, fast_reduce: Any = None) -> Any:
    """Slice `model`'s decoder layers in place for `rank` of `world` by the model's own plan (`layer_plan`; see
    the module docstring). `fast_reduce(t) -> bool`: an in-place sum all-reduce to try first
    (pdlab.engine.shm_allreduce). Raises TpPlanError for a model it cannot shard."""
    check_plan(model, world)
    pieces = layer_plan(model)
    d = Dims.of(model.config)
    kv = shard_heads(d.kv_heads, world, rank)
    heads = d.heads // world
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    for layer in backbone.layers:
        for p in pieces:
            mod = layer.get_submodule(p.path)
            parts = parts_of(p.layout, d, rank, world)
            if p.rowwise:
                _keep_in(mod, parts, rank, group, fast_reduce)
            else:
                _keep_out(mod, parts)
        for m in layer.modules():
            if type(m).__name__.endswith("Attention"):
                _local_heads(m, d, heads, len(kv))
    model.pdlab_tp = {"rank": rank, "world": world, "kv_heads": len(kv)}
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
        dist.broadcast(torch.tensor([op, len(payload)], dtype=torch.int64), src=0, group=self.group)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.group)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def recv(self) -> tuple[int, bytes]:
        head = torch.empty(2, dtype=torch.int64)
        dist.broadcast(head, src=0, group=self.group)
        op, n = int(head[0]), int(head[1])
        if not n:
            return op, b""
        buf = torch.empty(n, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return op, buf.numpy().tobytes()
