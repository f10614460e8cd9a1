"""Attention on CUDA: a fused kernel for GQA and paged / variable-length K/V, never SDPA's math fallback.

On CPU pdlab calls SDPA with `enable_gqa` (pdlab.engine.attention), which is exact and fast there. On CUDA
that call cannot use the flash kernel once a mask is given, and `enable_gqa` with a mask sends decode and
chunked prefill to the math kernel on gathered K/V. So a CUDA runner picks one of:

- `flash-attn` (pdlab[flash] installed, fp16/bf16, head_dim <= 256): one `flash_attn_varlen_func` call per
  layer for the whole packed batch. Causal masking in flash-attn >= 2.1 aligns each request's queries to the
  end of its keys, which is exactly decode (1 query, whole context) and chunked prefill (a chunk after its
  earlier context). With a block size that is a multiple of 256 (flash-attn's paged page size) the pool is
  passed as is with a block table (paged KV, no gather); otherwise each request's context is gathered
  from its blocks into one packed K/V by index arithmetic on the device (no host sync).
- `sdpa-expanded`: SDPA with the K/V heads repeated to the query heads (repeat_interleave), so no
  `enable_gqa` and a fused kernel (flash for plain causal, memory-efficient with a mask) applies.

CPU runs pdlab's kernels or SDPA (pdlab.engine.kernel_check). `kernel_for` decides; the engine benchmark and env.json record it.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pdlab.constants import FLASH_PAGE_MULTIPLE


@functools.lru_cache(maxsize=1)
def flash_module() -> Any:
    """flash_attn if it is installed and imports (it needs a CUDA build); None otherwise."""
    try:
        # deferred: flash_attn (optional)
        import flash_attn  # noqa: F401
        from flash_attn import flash_attn_varlen_func  # noqa: F401

        return flash_attn
    except Exception:  # noqa: BLE001 - not installed, or built for another torch/CUDA: fall back to SDPA
        return None


def flash_version() -> Optional[str]:
    mod = flash_module()
    return None if mod is None else str(getattr(mod, "__version__", "unknown"))


def kernel_for(device_type: str, dtype: torch.dtype, head_dim: int, flash: Optional[Any] = None) -> str:
    """The attention kernel a runner on this device uses: `sdpa` (CPU), `flash-attn` or `sdpa-expanded`."""
    if device_type != "cuda":
        return "sdpa"
    if flash is not None and dtype in (torch.float16, torch.bfloat16) and head_dim <= 256:
        return "flash-attn"
    return "sdpa-expanded"


def supports_paged(flash: Any, block_size: int) -> bool:
    """flash-attn's varlen entry point takes a block table (>= 2.6) and the pool's pages fit it."""
    if block_size % FLASH_PAGE_MULTIPLE:
        return False
    try:
        return "block_table" in inspect.signature(flash.flash_attn_varlen_func).parameters
    except (TypeError, ValueError):
        return False


@dataclass
class FlashMeta:
    """One step's batch for flash-attn's varlen call, built once per step, used by every layer."""

    cu_q: torch.Tensor  # [S+1] int32: query offsets of each request in the packed batch
    cu_k: torch.Tensor  # [S+1] int32: key offsets (each request's whole context)
    max_q: int
    max_k: int
    block_table: Optional[torch.Tensor] = None  # paged: [S, max_blocks] int32
    kv_index: Optional[torch.Tensor] = None  # gathered: [sum of contexts] pool slot of every context token


def expand_kv(k: torch.Tensor, v: torch.Tensor, heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K/V with their heads (at `dim`) repeated to `heads`, as transformers' repeat_kv does (query head h
    reads K/V head h // group)."""
    group = heads // k.shape[dim]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=dim), v.repeat_interleave(group, dim=dim)


def gather_index(blocks: torch.Tensor, block_starts: torch.Tensor, k_lens: torch.Tensor, cu_k: torch.Tensor,
                 total_k: int, block_size: int) -> torch.Tensor:
    """Pool slots of every context token of every request, packed: for key i of request s at position p,
    blocks[block_starts[s] + p // block_size] * block_size + p % block_size. Sizes are known on the host,
    so nothing here waits for the device."""
    seq_of = torch.repeat_interleave(torch.arange(k_lens.numel(), device=k_lens.device), k_lens,
                                     output_size=total_k)
    pos = torch.arange(total_k, device=k_lens.device) - cu_k[:-1].long()[seq_of]
    return blocks[block_starts[seq_of] + pos // block_size] * block_size + pos % block_size


def flash_attend(meta: FlashMeta, q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor,
                 scaling: Optional[float], flash: Any = None) -> torch.Tensor:
    """Attention of the packed queries q [T, H, D] over the pool's K/V [blocks, block_size, Hkv, D]."""
    fa = flash or flash_module()
    kw: dict[str, Any] = {"softmax_scale": scaling, "causal": True}
    if meta.block_table is not None:
        k, v = k_blocks, v_blocks
        kw["block_table"] = meta.block_table
    else:
        kv_heads, head_dim = k_blocks.shape[2], k_blocks.shape[3]
        k = k_blocks.view(-1, kv_heads, head_dim).index_select(0, meta.kv_index)
        v = v_blocks.view(-1, kv_heads, head_dim).index_select(0, meta.kv_index)
    return fa.flash_attn_varlen_func(q, k, v, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k, **kw)


def describe(device_type: str, dtype: torch.dtype, head_dim: int, block_size: int) -> dict:
    """What a runner with these settings uses, for benchmark output and env.json."""
    flash = flash_module() if device_type == "cuda" else None
    kernel = kernel_for(device_type, dtype, head_dim, flash)
    return {"kernel": kernel, "paged": kernel == "flash-attn" and supports_paged(flash, block_size),
            "flash_attn": flash_version() if device_type == "cuda" else None}


def env_summary() -> dict:
    """env.json's `attention`: the kernel a CUDA worker gets in this environment (a run's workers choose by the
    same rule: pdlab.engine.runner). What CPU workers ran is per worker and measured on the machine: env.json's
    `cpu_kernels` (pdlab.measure.kernels)."""
    flash = flash_module()
    return {"cuda_fp16_bf16": "flash-attn" if flash is not None else "sdpa-expanded",
            "cuda_fp32": "sdpa-expanded", "flash_attn": flash_version()}
