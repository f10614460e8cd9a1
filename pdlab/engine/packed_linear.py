"""Packed GEMMs for the CPU linears: the weight reordered once into a library's own layout, each step
multiplied by it, as torch's Inductor does for float32 CPU linears and vLLM's CPU backend does with oneDNN.
Three packings, the fastest here of them and F.linear chosen per weight shape (`check`):

- MKL's (`torch.ops.mkl._mkl_reorder_linear_weight`, `_mkl_linear`), for decode steps of MIN_ROWS to
  MAX_ROWS rows, where its output equals F.linear's bit for bit. A decode step's linears have one row per
  running sequence (tens), and there `F.linear` spends its time on the weight's layout rather than on
  arithmetic: on the developers' AVX2 box, one core, 32 x 1024 -> 5632 took 15.3 ms with `F.linear` and
  11.6 ms packed. Past a few hundred rows it is slower, and below MIN_ROWS MKL's `F.linear` takes another
  path whose bits differ. Equal bits hold for 4 rows and more with one thread on the box it was measured on
  (with two threads they do not), and MKL picks its kernels by ISA, so the check compares them per shape and
  thread count at several row counts.
- oneDNN's (`torch.ops.mkldnn._reorder_linear_weight`, `_linear_pointwise`), for every row count. On AMD
  CPUs MKL runs its generic kernels (`mkl_blas_def_*`), and there oneDNN's took the same GEMM to 9.0 ms
  against F.linear's 15.5 (2026-12-02). Its bits are not F.linear's, so it serves a weight only where a row's
  bits do not depend on the rows batched with it (1 to 512 rows: a request's logits are the same alone, in
  a batch, in a prefill or on a decode worker) and stay within ANY_ROWS_RTOL of F.linear's (`_fits`).
- pdlab's own (csrc/gemm.c through pdlab.engine.gemm_kernel), for every row count, on the same terms as
  oneDNN's. A row's bits are independent of its batch by construction (each output a sum in order over k).
  At 32 rows it took qwen2-d64's gate/up (512 -> 3072) to 1.99 ms against oneDNN's 2.69 and MKL's packed
  2.9 on the AVX2 box (2026-12-02); at 512 rows it is about level with oneDNN.

The race runs at PROBE_ROWS rows over copies of the weight that do not fit in cache together, as a model's
layers do not. The timed verdict is cached on disk as the C kernels' are (pdlab.engine.kernel_check.
cached_times), keyed by torch's build, the CPU, the shape and the thread count: on narrow linears the race is
close, and processes timing for themselves chose differently within one run (qwen2-d64: packed in one
worker of three).

The cost: a second copy of every packed weight (the original stays for the other row counts and for anyone
who reads the weights). A weight replaced after packing (tensor-parallel sharding) is noticed by its data
pointer and served by `F.linear` until packed again.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any, Optional

import torch
import torch.nn.functional as F

from pdlab.constants import CPU_KERNEL_ENV, PACKED_LINEAR as PACKED
from pdlab.engine import cpu_kernel, gemm_kernel
from pdlab.engine.kernel_build import cache_dir, cpu_flags
from pdlab.engine.kernel_check import Choice, _best, cached_times

MIN_ROWS = 4  # fewer rows: MKL's F.linear takes a path whose bits differ from the packed GEMM's
MAX_ROWS = 128  # more rows (a prefill chunk): F.linear is as fast or faster
PROBE_ROWS = 32  # the row count the check times (a decode step of 32 sequences)
CHECK_ROWS = (4, 7, 32, MAX_ROWS)  # row counts whose bits the check compares
COLD_BYTES = 64 << 20  # the race cycles through copies of the weight adding up to this (more than a CPU's cache)
MAX_COPIES = 16
RACE = "cold-2"  # how the race is run, in the verdict file's name: a changed race does not read old verdicts
# oneDNN's GEMM (`torch.ops.mkldnn._linear_pointwise` on a weight reordered once), as vLLM's CPU backend uses:
# on AMD CPUs MKL runs its generic kernels (`mkl_blas_def_*`), and there oneDNN's took 32 x 1024 -> 5632 from
# 15.5 ms (F.linear) to 9.0 (BENCHMARKS.md, 2026-12-02). Its bits, and pdlab's own GEMM's, are not F.linear's:
# each is used where a row's bits do not depend on the rows beside it (checked at ANY_ROWS_CHECK) and are within
# ANY_ROWS_RTOL of F.linear's (of the output's largest magnitude), for every row count, so that batching never
# changes a request's logits.
ANY_ROWS_CHECK = (1, 4, 7, 32, MAX_ROWS, 512)
ANY_ROWS_RTOL = 1e-4
NAME_OF = {"mkl": PACKED, "dnnl": PACKED + "_dnnl", "gemm": PACKED + "_gemm"}  # a kind's entry in the verdict file
KIND_OF = {v: k for k, v in NAME_OF.items()}
LABEL = {"mkl": "MKL packed", "dnnl": "oneDNN", "gemm": "pdlab GEMM"}
ANY_ROWS = ("dnnl", "gemm")  # the packings that serve every row count, with their own bits

_verdicts: dict[tuple, tuple[Choice, str]] = {}  # (in, out, bias, timed, torch threads) -> choice, packing


def available() -> bool:
    return (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
            and cpu_kernel.mode() != "off")


def dnnl_available() -> bool:
    return (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and cpu_kernel.mode() != "off")


def gemm_available() -> bool:
    return cpu_kernel.mode() != "off" and gemm_kernel.load() is not None


class Packed:
    """A weight (and bias) with its packed copy: MKL's (`kind` "mkl", F.linear's bits, for MIN_ROWS..MAX_ROWS
    rows), oneDNN's ("dnnl") or pdlab's own ("gemm"), these two with their own bits, for every row count (see
    ANY_ROWS_CHECK)."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor], kind: str = "mkl"):
        self.weight, self.bias, self.kind = weight, bias, kind
        self.ptr = weight.data_ptr()
        if kind == "dnnl":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PROBE_ROWS)
            self.rows = (1, 1 << 62)
        elif kind == "gemm":
            self.packed = gemm_kernel.Panels(weight, bias)
            self.rows = (1, 1 << 62)
        else:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PROBE_ROWS)
            self.rows = (MIN_ROWS, MAX_ROWS)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x @ weight.T + bias: packed where the rows fit and the weight is the one packed, else F.linear."""
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        if (self.rows[0] <= rows <= self.rows[1] and weight.data_ptr() == self.ptr and bias is self.bias
                and x.dtype == torch.float32 and (x.is_contiguous() or self.kind in ANY_ROWS)):
            x2 = x.reshape(rows, x.shape[-1])
            if self.kind == "dnnl":  # every row, strided or not: its bits must not depend on how it came
                y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.packed, bias, "none", [], "")
            elif self.kind == "gemm":  # any row stride; the same bits as contiguous rows
                y = self.packed(x2 if x2.stride(-1) == 1 else x2.contiguous())
            else:
                y = torch.ops.mkl._mkl_linear(x2, self.packed, weight, bias, rows)
            return y.reshape(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)


def _fits(kind: str, w: torch.Tensor, b: Optional[torch.Tensor], g: torch.Generator) -> Optional[str]:
    """Why packing `kind` (one of ANY_ROWS) cannot serve this weight (None: it can): a row's bits must not
    depend on how many rows came with it (so a request decoded alone, in a batch or on a decode worker gets the
    same logits), and they must be within ANY_ROWS_RTOL of F.linear's."""
    p = Packed(w, b, kind)
    x = torch.randn(max(ANY_ROWS_CHECK), w.shape[1], generator=g)
    first = p(x[:1], w, b)
    for rows in ANY_ROWS_CHECK:
        y, ref = p(x[:rows], w, b), F.linear(x[:rows], w, b)
        if not torch.equal(y[:1], first):
            return f"its bits at {rows} rows differ from those at 1 row"
        scale = float(ref.abs().max()) or 1.0
        if float((y - ref).abs().max()) > ANY_ROWS_RTOL * scale:
            return f"{float((y - ref).abs().max()) / scale:.1e} from F.linear at {rows} rows"
    return None


def check(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Choice:
    """Whether this weight shape goes packed in this process (`verdict`'s choice)."""
    return verdict(weight, bias)[0]


def verdict(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple[Choice, str]:
    """Whether this weight shape goes packed in this process, and whose packing ("mkl", "dnnl" or "gemm";
    `Choice.why` names it too): MKL's where its bits are F.linear's, oneDNN's and pdlab's where `_fits`; the
    fastest of those and F.linear, timed once per shape and cached. PDLAB_CPU_KERNEL=on: MKL's wherever its
    bits agree, untimed."""
    n, k = weight.shape
    timed = cpu_kernel.mode() != "on"
    key = (k, n, bias is not None, timed, torch.get_num_threads())
    if key not in _verdicts:
        _verdicts[key] = _decide(n, k, bias is not None, timed)
    return _verdicts[key]


def _decide(n: int, k: int, has_bias: bool, timed: bool) -> tuple[Choice, str]:
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if has_bias else None
    why_not: list[str] = []
    kinds: list[str] = []
    if available():
        p = Packed(w, b)
        for rows in CHECK_ROWS:
            x = torch.randn(rows, k, generator=g)
            if not torch.equal(p(x, w, b), F.linear(x, w, b)):
                why_not.append(f"MKL's bits differ from F.linear at {rows} rows here")
                break
        else:
            kinds.append("mkl")
    if not timed:
        return (Choice(True, "on (untimed)") if kinds else Choice(False, f"does not apply: {why_not[0]}")), "mkl"
    for kind, there in (("dnnl", dnnl_available()), ("gemm", gemm_available())):
        if there:
            why = _fits(kind, w, b, g)
            why_not += [f"{LABEL[kind]}: {why}"] if why else []
            kinds += [] if why else [kind]
    if not kinds:
        return Choice(False, "does not apply: " + ("; ".join(why_not) or "no packed GEMM in this torch")), "mkl"
    x = torch.randn(PROBE_ROWS, k, generator=g)

    # copies of the weight, run one after another: in a model the next layer's weight is not in cache, and there
    # F.linear pays for copying it into MKL's layout on every call, which a race on one hot weight hides
    # (qwen2-d64's gate/up: 1.63 against 1.67 ms hot, while 15% of its decode steps went to that copying)
    # (made inside the race, which runs only when the verdict is not cached: they are up to COLD_BYTES of
    # weights, packed, which every worker's start would otherwise pay)
    def race(names: list[str]) -> dict[str, list[float]]:
        copies = max(1, min(MAX_COPIES, -(-COLD_BYTES // max(1, w.numel() * w.element_size()))))
        ws = [w] + [torch.randn(n, k, generator=g) for _ in range(copies - 1)]

        def torch_all() -> None:
            for wi in ws:
                F.linear(x, wi, b)

        out = {}
        for name in names:
            ps = [Packed(wi, b, KIND_OF[name]) for wi in ws]

            def packed_all() -> None:
                for pi, wi in zip(ps, ws):
                    pi(x, wi, b)

            packed_ms, torch_ms = _best(packed_all, torch_all)
            out[name] = [packed_ms / copies, torch_ms / copies]
        return out

    shape = f"{k}x{n}-{'bias' if has_bias else 'nobias'}-t{torch.get_num_threads()}"
    times = cached_times(_verdict_file(), shape, [NAME_OF[kind] for kind in kinds], race)
    best = min(kinds, key=lambda kind: times[NAME_OF[kind]][0])
    packed_ms, torch_ms = times[NAME_OF[best]]
    faster = packed_ms <= torch_ms
    return Choice(faster, f"faster here ({LABEL[best]})" if faster else "slower here", round(packed_ms, 4),
                  round(torch_ms, 4)), best


def _verdict_file() -> str:
    """The timed verdicts' file: one per torch build (which carries its MKL), CPU and build of pdlab's GEMM."""
    build = hashlib.sha256(f"{RACE} {torch.__version__} {torch.backends.cpu.get_cpu_capability()} {cpu_flags()} "
                           f"{gemm_kernel.build_name()}".encode()).hexdigest()
    return os.path.join(cache_dir(), f"packed-{build[:16]}.json")


def pack_linears(model: Any) -> Choice:
    """Pack the float32 CPU linears of `model` whose shape `check` passes; one Choice for the lot, in use when
    any linear is packed (its times: the sums over the packed ones at PROBE_ROWS rows)."""
    unpack(model)  # a model packed before (another engine, another mode) starts over
    if not (available() or dnnl_available() or gemm_available()):
        return Choice(False, "does not apply: no packed GEMM in this torch" if cpu_kernel.mode() != "off"
                      else f"off ({CPU_KERNEL_ENV}=off)")
    checked: list[Choice] = []
    kinds: set[str] = set()  # the packings in use
    for m in model.modules():
        group = getattr(m, "pdlab_fused", None)  # a fused q/k/v or gate/up: its concatenated weight, once
        if group is not None:
            if m is not group.mods[0] or not group.intact():
                continue
            weight, bias = group.weight, group.bias
        elif isinstance(m, torch.nn.Linear):
            weight, bias = m.weight, m.bias
        else:
            continue
        if not _float32_cpu(weight):
            continue
        c, kind = verdict(weight, bias)
        checked.append(c)
        if not c.use:
            continue
        kinds.add(kind)
        if group is not None:
            group.packed = Packed(weight, bias, kind)
        else:
            m.pdlab_packed = Packed(weight, bias, kind)
            m.forward = _packed_forward(m)
    used = [c for c in checked if c.use]
    slow = [c for c in checked if c.why == "slower here"]
    if used:
        if cpu_kernel.mode() == "on":
            return Choice(True, "on (untimed)")
        return _summed(True, f"faster here ({', '.join(LABEL[k] for k in LABEL if k in kinds)})", used)
    if slow:
        return _summed(False, "slower here", slow)
    return Choice(False, checked[0].why if checked else "does not apply: no float32 CPU linear")


def _summed(use: bool, why: str, choices: list[Choice]) -> Choice:
    """One Choice for several shapes' timed ones: their times summed."""
    return Choice(use, why, round(sum(c.kernel_ms or 0 for c in choices), 4),
                  round(sum(c.torch_ms or 0 for c in choices), 4))


def _float32_cpu(w: torch.Tensor) -> bool:
    return w.dtype == torch.float32 and w.device.type == "cpu"


def unpack(model: Any) -> None:
    """Every linear of `model` back to F.linear (packed copies dropped)."""
    for m in model.modules():
        if getattr(m, "pdlab_fused", None) is not None:
            m.pdlab_fused.packed = None
        if getattr(m, "pdlab_packed", None) is not None:
            del m.pdlab_packed
            m.__dict__.pop("forward", None)  # the class's forward again


def _packed_forward(m: torch.nn.Linear) -> Any:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return m.pdlab_packed(x, m.weight, m.bias)

    return forward
