"""Which of a model's projections tensor parallelism splits, and how: the model's own plan (transformers'
`config.base_model_tp_plan`) read as pdlab shards it (pdlab.engine.tensor_parallel applies it), the sizes that
must divide, and which KV heads each rank holds. Checked before any worker starts (`check_spec`): a model
without a plan, or with one pdlab cannot honour, is refused naming its model type."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from pdlab.engine.model import model_config


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


def rows_of(n: int, rank: int, world: int) -> slice:
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
    # deferred: transformers
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(spec))
    check_plan(model, tp)


def parts_of(layout: tuple[str, ...], d: Dims, rank: int, world: int) -> list[slice]:
    """The feature slices of this rank, one per part of `layout`, as offsets into the whole width."""
    out, at = [], 0
    kv = shard_heads(d.kv_heads, world, rank)
    for part in layout:
        if part == "q":
            q = rows_of(d.heads, rank, world)
            out.append(slice(at + q.start * d.head_dim, at + q.stop * d.head_dim))
            at += d.heads * d.head_dim
        elif part in ("k", "v"):
            out.append(slice(at + kv.start * d.head_dim, at + kv.stop * d.head_dim))
            at += d.kv_heads * d.head_dim
        else:
            m = rows_of(d.intermediate, rank, world)
            out.append(slice(at + m.start, at + m.stop))
            at += d.intermediate
    return out
