"""Which CPU kernels a runner uses: each one where it applies and, on this machine, beats the torch path it
replaces.

Why a check: a kernel tuned on one CPU can lose on another. csrc/prefill_attention.c beat torch's SDPA on an
AVX-512 box and was 3.2x slower than it on an AVX2-only AMD EPYC (one 1,800-token cpu-demo prefill: 1.6 s
against 0.5 s), and every run there paid it. So the first runner of a model shape on a build times each
kernel against its torch path on inputs of that shape (a few alternated repetitions, the best of each:
about a second in all), keeps the kernel only where it was faster, and caches the verdict beside the build
($PDLAB_KERNEL_CACHE/check-<build>.json, keyed by shape, under the build's file lock), so later runners and
workers starting together read it instead of timing again. $PDLAB_CPU_KERNEL=on skips the timing (every kernel
that applies is used), off uses none.

The choice is per process (pdlab.engine.cpu_kernel.turn_off): a worker runs one model. What was chosen, and
the two timings, is `Choice`, which the worker reports in its Ready message.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from pdlab.constants import CPU_KERNEL_ENV, CPU_KERNELS
from pdlab.engine import cpu_kernel
from pdlab.engine.attention import decode_gathered, prefill_sdpa
from pdlab.engine.blocks import padded_tables
from pdlab.engine.kernel_build import cache_dir, locked

REPS, MIN_REPS, BUDGET_S = 7, 2, 0.25  # alternated repetitions of each side (the best of each is compared)
PREFILL_TOKENS = (128, 512)  # chunks timed for the prefill kernel (the times are summed)
DECODE_BATCH, DECODE_CONTEXT, BLOCK = 16, (256, 768), 16  # decode requests, their context range, block size
ROWS = 512  # tokens timed for rotary, SwiGLU and RMSNorm


@dataclass(frozen=True)
class Shape:
    """What a runner's kernels see of its model (per tensor-parallel rank)."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int

    def key(self) -> str:
        return f"h{self.heads}-kv{self.kv_heads}-d{self.head_dim}-w{self.hidden}-i{self.intermediate}"


@dataclass(frozen=True)
class Choice:
    use: bool
    why: str  # "faster here", "on (untimed)", "slower here", "not built: ...", "does not apply: ..."
    kernel_ms: Optional[float] = None
    torch_ms: Optional[float] = None

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        timed = (f" ({self.kernel_ms:.3g} ms vs torch {self.torch_ms:.3g} ms)"
                 if self.kernel_ms is not None and self.torch_ms is not None else "")
        return f"{'kernel' if self.use else 'torch'}: {self.why}{timed}"


def _best(fn: Callable[[], Any], other: Callable[[], Any]) -> tuple[float, float]:
    """The best of alternated runs of each, in ms, after one warm-up each: at least MIN_REPS, then more until
    BUDGET_S is spent or REPS are done (a long prefill is timed fewer times than a short norm)."""
    fn(), other()
    a: list[float] = []
    b: list[float] = []
    start = time.perf_counter()
    for i in range(REPS):
        if i >= MIN_REPS and time.perf_counter() - start > BUDGET_S:
            break
        for f, acc in ((fn, a), (other, b)) if i % 2 == 0 else ((other, b), (fn, a)):
            t = time.perf_counter()
            f()
            acc.append(time.perf_counter() - t)
    return min(a) * 1e3, min(b) * 1e3


def _race_decode(k: cpu_kernel.Kernels, s: Shape, g: torch.Generator) -> tuple[float, float]:
    lens = torch.randint(DECODE_CONTEXT[0], DECODE_CONTEXT[1] + 1, (DECODE_BATCH,), generator=g).tolist()
    need = [-(-n // BLOCK) for n in lens]
    order = torch.randperm(sum(need), generator=g).tolist()  # blocks scattered over the pool
    tables, i = [], 0
    for n in need:
        tables.append(order[i:i + n])
        i += n
    kv = torch.randn(2, sum(need), BLOCK, s.kv_heads, s.head_dim, generator=g)
    q = torch.randn(DECODE_BATCH, s.heads, s.head_dim, generator=g)
    out = torch.empty_like(q)
    batch = cpu_kernel.DecodeBatch(list(range(DECODE_BATCH)), tables, lens)
    flat, width = padded_tables(tables)
    blocks = torch.tensor(flat).view(DECODE_BATCH, width)
    mask = (torch.arange(width * BLOCK).unsqueeze(0) < torch.tensor(lens).unsqueeze(1))[:, None, None, :]
    rows_k, rows_v = kv[0].view(kv.shape[1], -1), kv[1].view(kv.shape[1], -1)
    scale = s.head_dim ** -0.5
    return _best(lambda: k.decode_attention(q, kv[0], kv[1], batch, scale, out),
                 lambda: decode_gathered(q, rows_k, rows_v, blocks, mask, s.kv_heads, scale))


def _race_prefill(k: cpu_kernel.Kernels, s: Shape, g: torch.Generator) -> tuple[float, float]:
    total = [0.0, 0.0]
    for n in PREFILL_TOKENS:
        q = torch.randn(n, s.heads, s.head_dim, generator=g)
        kk, v = (torch.randn(n, s.kv_heads, s.head_dim, generator=g) for _ in range(2))
        out = torch.empty_like(q)
        scale = s.head_dim ** -0.5
        a, b = _best(lambda: k.prefill_attention(q, kk, v, scale, out), lambda: prefill_sdpa(q, kk, v, scale))
        total[0] += a
        total[1] += b
    return total[0], total[1]


def _race_rotary(k: cpu_kernel.Kernels, s: Shape, g: torch.Generator) -> tuple[float, float]:
    q = torch.randn(1, ROWS, s.heads, s.head_dim, generator=g).transpose(1, 2)  # as a projection hands it over
    cos, sin = (torch.randn(1, ROWS, s.head_dim, generator=g) for _ in range(2))
    half = s.head_dim // 2

    def torch_rotary() -> torch.Tensor:  # transformers' apply_rotary_pos_emb, op for op
        c, si = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * c + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * si

    return _best(lambda: k.rotary(q, cos, sin), torch_rotary)


def _race_swiglu(k: cpu_kernel.Kernels, s: Shape, g: torch.Generator) -> tuple[float, float]:
    x = torch.randn(ROWS, 2 * s.intermediate, generator=g)
    w = s.intermediate
    return _best(lambda: k.swiglu(x), lambda: F.silu(x[:, :w]) * x[:, w:])


def _race_rms_norm(k: cpu_kernel.Kernels, s: Shape, g: torch.Generator) -> tuple[float, float]:
    x = torch.randn(ROWS, s.hidden, generator=g)
    w = torch.rand(s.hidden, generator=g) + 0.5
    return _best(lambda: k.rms_norm(x, w, 1e-6), lambda: F.rms_norm(x, (s.hidden,), w, 1e-6))


RACES = {"decode_attention": _race_decode, "prefill_attention": _race_prefill, "rotary": _race_rotary,
         "swiglu": _race_swiglu, "rms_norm": _race_rms_norm}
assert tuple(RACES) == CPU_KERNELS


def applies(name: str, s: Shape, dtype: torch.dtype) -> Optional[str]:
    """Why kernel `name` cannot serve this shape (None: it can)."""
    if dtype != torch.float32:
        return f"{str(dtype).replace('torch.', '')} (float32 only)"
    if name == "decode_attention" and not (s.heads % s.kv_heads == 0 and s.heads // s.kv_heads <= cpu_kernel.MAX_GROUP
                                           and s.head_dim <= cpu_kernel.MAX_DIM):
        return f"{s.heads // max(s.kv_heads, 1)} query heads per K/V head, head_dim {s.head_dim}"
    if name == "prefill_attention" and not (s.heads % s.kv_heads == 0 and s.heads // s.kv_heads <= cpu_kernel.PREFILL_ROWS
                                            and s.head_dim % 16 == 0 and s.head_dim <= cpu_kernel.MAX_DIM):
        return (f"{s.heads // max(s.kv_heads, 1)} query heads per K/V head (at most {cpu_kernel.PREFILL_ROWS}), "
                f"head_dim {s.head_dim} (a multiple of 16)")
    if name == "rotary" and s.head_dim % 2:
        return f"odd head_dim {s.head_dim}"
    return None


def cache_key(s: Shape, threads: int) -> str:
    """A verdict's key in the check file: the shape, and torch's threads (its side of the race runs on the
    process's threads, so one core and two get a verdict each; a CPU worker has one)."""
    return f"{s.key()}-t{threads}"


def _check_file(k: cpu_kernel.Kernels) -> str:
    """One verdict file per build of the kernels and per torch side: its version and the ISA its CPU kernels
    dispatch to (ATEN_CPU_CAPABILITY caps it: torch at AVX2 on an AVX-512 box races anew)."""
    kernels = " ".join(sorted(os.path.basename(p) for p in k.paths.values()))
    build = hashlib.sha256(f"{kernels} {torch.__version__} {torch.backends.cpu.get_cpu_capability()}".encode()
                           ).hexdigest()
    return os.path.join(cache_dir(), f"check-{build[:16]}.json")


def cached_times(path: str, key: str, names: list[str],
                 race: Callable[[list[str]], dict[str, list[float]]]) -> dict[str, list[float]]:
    """[kernel ms, torch ms] per name under `key` in the verdict file `path`: read, or raced now (`race` times
    the missing names) and written back, under the cache directory's lock so that workers starting together
    race once and all read the same verdict."""

    def read() -> dict:
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    have = read().get(key, {})
    if all(n in have for n in names):
        return have
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with locked(os.path.dirname(path)):
        everything = read()
        have = everything.get(key, {})
        missing = [n for n in names if n not in have]
        if missing:
            have.update({n: list(v) for n, v in race(missing).items()})
            everything[key] = have
            tmp = f"{path}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(everything, f, indent=1)
            os.replace(tmp, path)
    return have


def _timed(k: cpu_kernel.Kernels, s: Shape, names: list[str]) -> dict[str, list[float]]:
    """[kernel ms, torch ms] per kernel for this shape: from the cache, or timed now and cached."""

    def race(missing: list[str]) -> dict[str, list[float]]:
        g = torch.Generator().manual_seed(0)
        with torch.inference_mode():
            return {n: list(RACES[n](k, s, g)) for n in missing}

    return cached_times(_check_file(k), cache_key(s, torch.get_num_threads()), names, race)


def choose(s: Shape, dtype: torch.dtype, device_type: str = "cpu") -> dict[str, Choice]:
    """Each kernel's choice for a runner of this shape, applied to the process (cpu_kernel.turn_off)."""
    if device_type != "cpu":
        return {n: Choice(False, f"does not apply: {device_type}") for n in CPU_KERNELS}
    mode = cpu_kernel.mode()
    k = cpu_kernel.load() if mode != "off" else None
    out: dict[str, Choice] = {}
    for n in CPU_KERNELS:
        if mode == "off":
            out[n] = Choice(False, f"off ({CPU_KERNEL_ENV}=off)")
        elif k is None or n not in k.fns:
            out[n] = Choice(False, f"not built: {cpu_kernel.status() if k is None else k.errors.get(n, '?')}")
        elif (why := applies(n, s, dtype)) is not None:
            out[n] = Choice(False, f"does not apply: {why}")
    left = [n for n in CPU_KERNELS if n not in out]
    if mode == "on":
        out.update({n: Choice(True, f"on (untimed, {CPU_KERNEL_ENV}=on)") for n in left})
    elif left:
        assert k is not None
        times = _timed(k, s, left)
        for n in left:
            kern, ref = times[n]
            out[n] = Choice(kern <= ref, "faster here" if kern <= ref else "slower here", round(kern, 4),
                            round(ref, 4))
    for n, c in out.items():
        cpu_kernel.turn_off(n, None if c.use else c.describe())
    return {n: out[n] for n in CPU_KERNELS}

