"""Models: a transformers causal LM from a local directory / the local HF cache, or a synthetic preset.

Presets are transformers configs with seeded random weights, so tests and CPU recipes need no download.
The init is scaled up from transformers' default (std 0.02): at these tiny widths the default makes the
residual stream nearly constant and greedy decoding collapses into one repeated token, which would make
parity tests prove little.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from pdlab.constants import DTYPES
from pdlab.engine.fused_rotary import fuse_rotary


class ModelLoadError(ValueError):
    """The model could not be found or loaded (bad path, unknown preset, no model files)."""


@dataclass(frozen=True)
class Preset:
    arch: str  # "llama" | "qwen3"
    vocab_size: int
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    max_position_embeddings: int
    init_std: float
    eos_token_id: int = 2
    head_dim: Optional[int] = None  # None: hidden_size // heads
    # the dimensions of a model too large to build here: a config for a timed engine or the simulator
    # (load_stand_in, model_config), never weights (load_model refuses it)
    stand_in_only: bool = False


PRESETS: dict[str, Preset] = {
    # tests: small enough to run hundreds of generations in seconds
    "tiny-llama": Preset("llama", 512, 64, 2, 4, 2, 128, 2048, 0.08),
    "tiny-qwen3": Preset("qwen3", 512, 64, 2, 4, 2, 160, 2048, 0.08),
    # CPU demo: a 1.5-2k-token prefill takes a few hundred ms on one core, a batch-8 decode step a few ms,
    # which is the ratio that makes prefill interference visible on a CPU box.
    "cpu-demo": Preset("llama", 4096, 256, 4, 8, 2, 768, 4096, 0.04),
    # GPU benchmark shape (~0.6B parameters, Qwen3-0.6B-like)
    "gpu-0.6b": Preset("qwen3", 151936, 1024, 28, 16, 8, 3072, 40960, 0.02),
    # Qwen3-235B-A22B's attention and KV dimensions (94 layers, 64 query heads, 4 KV heads, head_dim 128 !=
    # 4096 / 64), for timed runs with the mi300x-qwen3-235b-fp8-* profiles. Its MoE (128 experts of width
    # 1536, 8 per token) is not represented: a stand-in uses only the KV shape and the vocabulary;
    # intermediate_size is the config's dense value, unused by the real model.
    "qwen3-235b-a22b": Preset("qwen3", 151936, 4096, 94, 64, 4, 12288, 40960, 0.02, head_dim=128,
                              stand_in_only=True),
}



def preset_config(name: str) -> Any:
    """The transformers config of a preset (raises ModelLoadError for an unknown name)."""
    if name not in PRESETS:
        raise ModelLoadError(f"unknown model preset {name!r}; known presets: {', '.join(sorted(PRESETS))}")
    p = PRESETS[name]
    common = dict(
        vocab_size=p.vocab_size, hidden_size=p.hidden_size, num_hidden_layers=p.layers,
        num_attention_heads=p.heads, num_key_value_heads=p.kv_heads, intermediate_size=p.intermediate_size,
        max_position_embeddings=p.max_position_embeddings, initializer_range=p.init_std,
        eos_token_id=p.eos_token_id, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False,
    )
    head_dim = p.head_dim or p.hidden_size // p.heads
    if p.arch == "llama":
        # deferred: transformers
        from transformers import LlamaConfig

        return LlamaConfig(**common, **({"head_dim": head_dim} if p.head_dim else {}))
    # deferred: transformers
    from transformers import Qwen3Config

    return Qwen3Config(head_dim=head_dim, **common)


def _torch_dtype(dtype: str) -> Any:
    # deferred: torch
    import torch

    key = DTYPES.get(str(dtype).lower())
    if key is None:
        raise ModelLoadError(f"unknown dtype {dtype!r}; expected one of float32, bfloat16, float16, auto")
    return key if key == "auto" else getattr(torch, key)


def load_model(spec: Any, dtype: str = "float32", device: str = "cpu", seed: int = 0) -> Any:
    """Load a causal LM, ready for pdlab's attention.

    `spec` is a preset name, a local model directory, a model id already in the local HF cache, a recipe's
    ModelSpec, or a dict of its fields ``{preset: NAME}`` / ``{path: DIR, dtype: ..., device: ...}``.
    Nothing is downloaded.
    """
    # deferred: torch
    import torch

    from pdlab.engine.attention import ATTN_NAME, register
    from pdlab.engine.fused_norm import fuse_rms_norms

    if not isinstance(spec, str):
        # a recipe's model section may carry device/dtype: None ("the worker's default"): keep ours then
        dtype = _field(spec, "dtype") or dtype
        device = _field(spec, "device") or device
        seed = _field(spec, "seed") if _field(spec, "seed") is not None else seed
    spec = _source(spec)
    if spec in PRESETS and PRESETS[spec].stand_in_only:
        raise ModelLoadError(f"preset {spec} has the dimensions of a {_size(spec)} model only: use it with "
                             "model.timing (a timed engine or the simulator)")
    register()
    tdtype = _torch_dtype(dtype)
    if spec in PRESETS:
        # deferred: transformers
        from transformers import AutoModelForCausalLM

        cfg = preset_config(spec)
        torch.manual_seed(seed)
        with torch.device("cpu"):
            model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        if tdtype != "auto":
            model = model.to(tdtype)
        model.name_or_path = spec
    else:
        model = _from_disk(spec, tdtype)
    model = model.to(device).eval()
    model.requires_grad_(False)
    model.config._attn_implementation = ATTN_NAME
    fuse_rms_norms(model)
    if next(model.parameters()).device.type == "cpu":
        fuse_rotary(model)
    return model


def _size(name: str) -> str:
    """'235B': a preset's parameter count as its name gives it (qwen3-235b-a22b), else 'large'."""
    part = next((x for x in name.split("-") if x[:-1].isdigit() and x[-1] in "bB"), None)
    return part.upper() if part else "large"


def _field(spec: Any, name: str) -> Any:
    """A key of a dict spec or an attribute of a ModelSpec."""
    return spec.get(name) if isinstance(spec, dict) else getattr(spec, name, None)


def _source(spec: Any) -> str:
    """The preset name or path a spec (string, ModelSpec or dict of its fields) names."""
    if not isinstance(spec, str):
        if _field(spec, "preset") is not None:
            preset_config(_field(spec, "preset"))  # unknown preset: say so, rather than look on disk
        spec = _field(spec, "preset") or _field(spec, "path") or ""
    if not spec:
        raise ModelLoadError("model: give a preset name or a local model directory")
    return spec


def _disk_config(path: str) -> Any:
    """The config of a model on disk (a directory or the local HF cache), with one-line errors."""
    # deferred: transformers
    from transformers import AutoConfig

    path = os.path.expanduser(path)
    local = os.path.isdir(path)
    looks_like_path = path.startswith((".", "/", "~")) or path.count("/") > 1
    if not local and (looks_like_path or os.path.exists(path)):
        raise ModelLoadError(f"model path {path!r} does not exist or is not a directory")
    if local and not os.path.isfile(os.path.join(path, "config.json")):
        raise ModelLoadError(f"model path {path!r} holds no model (no config.json)")
    try:
        return AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises many kinds; one line for the user
        if not local:
            raise ModelLoadError(
                f"model {path!r} is neither a local directory nor in the local HF cache (nothing is downloaded)"
            ) from None
        raise ModelLoadError(f"cannot load model config from {path!r}: {str(e).splitlines()[0]}") from None


def _from_disk(path: str, tdtype: Any) -> Any:
    # deferred: transformers
    from transformers import AutoModelForCausalLM

    _disk_config(path)
    try:
        return AutoModelForCausalLM.from_pretrained(
            os.path.expanduser(path), dtype=tdtype, local_files_only=True, attn_implementation="sdpa"
        )
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load model weights from {path!r}: {str(e).splitlines()[0]}") from None


def model_dims(model: Any) -> dict:
    """Shape facts the KV pool needs."""
    cfg = model.config
    heads = cfg.num_attention_heads
    return {
        "layers": cfg.num_hidden_layers,
        # a tensor-parallel rank holds only its KV heads (pdlab.engine.tensor_parallel)
        "kv_heads": (getattr(model, "pdlab_tp", None) or {}).get("kv_heads")
        or getattr(cfg, "num_key_value_heads", None) or heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        "max_model_len": getattr(cfg, "max_position_embeddings", 4096),
        "vocab_size": cfg.vocab_size,
        "eos_token_ids": _eos_ids(model),
    }


def _eos_ids(model: Any) -> list[int]:
    ids: Optional[Any] = getattr(model.generation_config, "eos_token_id", None) if getattr(
        model, "generation_config", None) is not None else None
    if ids is None:
        ids = model.config.eos_token_id
    if ids is None:
        return []
    return list(ids) if isinstance(ids, (list, tuple)) else [int(ids)]


def model_config(spec: Any) -> Any:
    """The model's config without loading weights (for vocabulary size and the like)."""
    name = _source(spec)
    return preset_config(name) if name in PRESETS else _disk_config(name)


def load_tokenizer(spec: Any) -> Any:
    """The model's tokenizer when it has one on disk (presets have none: prompts are token ids)."""
    path = _source(spec)
    if path in PRESETS:
        return None
    try:
        # deferred: transformers
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.path.expanduser(path), local_files_only=True)
    except Exception:  # noqa: BLE001 - a model directory without a tokenizer still serves token-id prompts
        return None


class ModelStandIn:
    """A model's dimensions without its weights: what a timed engine (pdlab.engine.timed) needs, so a timed
    run of a GPU-scale model neither loads nor computes it."""

    def __init__(self, config: Any, dtype: Any, device: Any):
        # deferred: torch
        import torch

        self.config = config
        self.generation_config = None
        self._param = torch.empty(0, dtype=dtype, device=device)

    def parameters(self) -> Any:
        yield self._param


def load_stand_in(spec: Any, dtype: str = "float32", device: str = "cpu") -> ModelStandIn:
    """The stand-in of a model spec (preset name, path, ModelSpec or dict): its config, no weights."""
    if not isinstance(spec, str):
        dtype = _field(spec, "dtype") or dtype
        device = _field(spec, "device") or device
    tdtype = _torch_dtype(dtype)
    if tdtype == "auto":
        # deferred: torch
        import torch

        tdtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return ModelStandIn(model_config(spec), tdtype, device)
