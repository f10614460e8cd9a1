"""torch.cpu's AVX-512 and AMX checks answered as on an AVX2-only CPU (bench_vllm_matrix --isa x86-64-v3).

Why: vLLM's CPU platform picks its kernel library (_C with AVX-512 BF16, _C_AVX512, or _C_AVX2) and its attention
path by these checks, in every process it starts, and its CPU platform starts its model worker with `spawn`: a
patch in the worker's parent does not reach it. This directory on PYTHONPATH (sitecustomize.py) applies the
patch in each of vLLM's processes at start-up.
"""

import torch

for _check in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_avx512_vnni_supported",
               "_is_amx_tile_supported", "_is_amx_fp16_supported"):
    if hasattr(torch.cpu, _check):
        setattr(torch.cpu, _check, lambda: False)
