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
q), is refused before anything starts, naming its model type (`check_plan`).

The scheduler runs once, on rank 0 (the worker). Each step it broadcasts what the runner needs (per request:
context start, tokens this step, their ids, the block table) as msgpack bytes; the other ranks ("followers",
pdlab.serve.tp_follower) rebuild the same attention context and run the same forward. Only rank 0 samples.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any, Optional

import msgpack
import torch

OP_STEP, OP_STOP = 1, 2
# Seconds this process spent in the model's all-reduces (waiting for the slower rank included) and how
# many: what benchmarks/bench_tp.py reports as TP's communication share of a step.
COMM = {"seconds": 0.0, "calls": 0}


class TpPlanError(ValueError):
    """A model pdlab cannot shard: no tensor-parallel plan, or one it cannot honour; names the model type."""


COLWISE = ("colwise", "colwise_gather_output", "local_colwise")
ROWWISE = ("rowwise", "rowwise_split_input", "local_rowwise")
REPLICATED = ("replicated_with_grad_allreduce", "replicate", "local")


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


def shard_heads(kv_heads: int, tp: int, rank: int) -> range:
    """The model's KV heads held by `rank` of a `tp`-rank group: a contiguous slice when kv_heads >= tp, else one
    head, replicated on tp / kv_heads ranks (as vLLM does). pdlab.kv.sharded re-slices by the same rule."""
    if kv_heads >= tp:
        k = kv_heads // tp
        return range(rank * k, (rank + 1) * k)
    h = rank * kv_heads // tp
    return range(h, h + 1)


def _rows_of(n: int, rank: int, world: int) -> slice:
    k = n // world
    return slice(rank * k, (rank + 1) * k)


@dataclass(frozen=True)
class Dims:
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int

    @classmethod
    def of(cls, cfg: Any) -> "Dims":
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        return cls(heads, kv, getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, cfg.intermediate_size)


@dataclass(frozen=True)
class Piece:
    """One planned linear of a decoder layer and how its features split: `layout` names the parts of its
    output (colwise) or input (rowwise) in order: q (query heads), k / v (KV heads), mlp (MLP columns)."""

    path: str  # within a layer, e.g. self_attn.qkv_proj
    rowwise: bool
    layout: tuple[str, ...]


def _layout(path: str, attention: bool, width: int, d: Dims) -> Optional[tuple[str, ...]]:
    """How a projection's `width` features are laid out, by where it sits and its size (None: unknown)."""
    q, kv = d.heads * d.head_dim, d.kv_heads * d.head_dim
    if attention:
        known = {q: ("q",), q + 2 * kv: ("q", "k", "v")} | ({} if kv == q else {kv: ("k",)})
        part = known.get(width)
        if part == ("k",) and path.rsplit(".", 1)[-1].startswith("v"):
            return ("v",)
        return part
    return {d.intermediate: ("mlp",), 2 * d.intermediate: ("mlp", "mlp")}.get(width)


def layer_plan(model: Any) -> list[Piece]:
    """The model's own tensor-parallel plan (transformers' `config.base_model_tp_plan`: which modules of a
    decoder layer are column- or row-wise) as pdlab shards it: every planned linear of the first layer with
    the layout of its features. Raises TpPlanError, naming the model type, where there is no plan or one pdlab
    cannot honour: a style other than colwise / rowwise / replicated inside a layer, a planned module that is
    not a Linear, a size that is neither heads nor MLP columns, or a parameter outside the plan that spans the
    heads or the MLP (a norm over all of q, as OLMo-2's: a rank holds only its part of q)."""
    cfg = model.config
    kind = getattr(cfg, "model_type", type(cfg).__name__)
    plan = getattr(cfg, "base_model_tp_plan", None) or {}
    entries = {k[len("layers.*."):]: v for k, v in plan.items() if k.startswith("layers.*.")}
    if not entries:
        raise TpPlanError(f"model type {kind} has no tensor-parallel plan (config.base_model_tp_plan), which pdlab "
                          "shards by; use tp: 1")
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layer = backbone.layers[0]
    d = Dims.of(cfg)
    pieces = []
    for path, style in entries.items():
        if style in REPLICATED:
            continue
        if style not in COLWISE + ROWWISE:
            raise TpPlanError(f"model type {kind}: layers.*.{path} is planned {style!r}, which pdlab's tensor "
                              "parallelism does not shard (colwise, rowwise and replicated only); use tp: 1")
        mod = layer.get_submodule(path)
        if not isinstance(mod, torch.nn.Linear):
            raise TpPlanError(f"model type {kind}: layers.*.{path} is a {type(mod).__name__}, not a Linear; use tp: 1")
        rowwise = style in ROWWISE
        attention = type(layer.get_submodule(path.split(".")[0])).__name__.endswith("Attention")
        width = mod.in_features if rowwise else mod.out_features
        layout = _layout(path, attention, width, d)
        if layout is None:
            raise TpPlanError(f"model type {kind}: layers.*.{path} has {width} {'inputs' if rowwise else 'outputs'}, "
                              f"neither heads x head_dim nor the MLP width; pdlab cannot split it; use tp: 1")
        pieces.append(Piece(path, rowwise, layout))
    planned = set(entries)
    split = {d.heads * d.head_dim, d.intermediate, 2 * d.intermediate} | (
        {d.kv_heads * d.head_dim} if d.kv_heads * d.head_dim > d.head_dim else set())
    for name, mod in layer.named_modules():
        if not name or name in planned or any(name.startswith(p + ".") for p in planned):
            continue
        own = [p for p in mod.parameters(recurse=False)]
        if any(mod is layer.get_submodule(p.split(".")[0]) for p in planned) or not own:
            continue
        if any(n in split for p in own for n in p.shape) and name.split(".")[0] in {p.split(".")[0] for p in planned}:
            raise TpPlanError(f"model type {kind}: layers.*.{name} ({type(mod).__name__}, {list(own[0].shape)}) "
                              "spans every head or the whole MLP, outside the tensor-parallel plan: a rank would "
                              "hold only its part of what it needs; use tp: 1")
    return pieces


def check_plan(model: Any, tp: int) -> None:
    """Raise TpPlanError if `model` cannot be sharded over `tp` ranks (its sizes or its plan)."""
    d = Dims.of(model.config)
    err = tp_error(d.heads, d.kv_heads, d.intermediate, tp)
    if err:
        raise TpPlanError(f"model type {getattr(model.config, 'model_type', '?')}: {err}")
    layer_plan(model)


def check_spec(spec: Any, tp: int) -> None:
    """`check_plan` for a model spec (preset or directory) before any worker starts: the model is built on the
    meta device from its config, so no weights are read."""
    from transformers import AutoModelForCausalLM

    from pdlab.engine.model import model_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(spec))
    check_plan(model, tp)


def _parts(layout: tuple[str, ...], d: Dims, rank: int, world: int) -> list[slice]:
    """The feature slices of this rank, one per part of `layout`, as offsets into the whole width."""
    out, at = [], 0
    kv = shard_heads(d.kv_heads, world, rank)
    for part in layout:
        if part == "q":
            q = _rows_of(d.heads, rank, world)
            out.append(slice(at + q.start * d.head_dim, at + q.stop * d.head_dim))
            at += d.heads * d.head_dim
        elif part in ("k", "v"):
            out.append(slice(at + kv.start * d.head_dim, at + kv.stop * d.head_dim))
            at += d.kv_heads * d.head_dim
        else:
            m = _rows_of(d.intermediate, rank, world)
            out.append(slice(at + m.start, at + m.stop))
            at += d.intermediate
    return out


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
    import torch.distributed as dist

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
            parts = _parts(p.layout, d, rank, world)
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
