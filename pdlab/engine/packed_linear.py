"""MKL's packed GEMM for the linear layers of a CPU decode step: the weight reordered once into MKL's own
layout (`torch.ops.mkl._mkl_reorder_linear_weight`), each step multiplied by it (`_mkl_linear`), as
torch's Inductor does for float32 CPU linears and vLLM's CPU backend does with oneDNN.

Why: a decode step's linears have one row per running sequence (tens), and there `F.linear` spends its time
on the weight's layout rather than on arithmetic. On the developers' AVX2 box, one core: 32 x 1024 -> 5632
took 15.3 ms with `F.linear` and 11.6 ms packed; 8 rows 8.4 -> 5.0 ms (BENCHMARKS.md, issue 24). Past a few
hundred rows (a prefill) it is slower (2,048 rows: 346 -> 447 ms), so it serves steps of MIN_ROWS to
MAX_ROWS rows only; below MIN_ROWS, MKL's `F.linear` takes another path whose bits differ.

The same bits: where it is used, its output must equal `F.linear`'s bit for bit (so greedy tokens stay those
of transformers). That holds for 4 rows and more with one thread on the box it was measured on (with two
threads it does not), and MKL picks its kernels by ISA, so each process checks per weight shape and thread
count (`check`): equal bits at several row counts, and at PROBE_ROWS rows no more than `F.linear`'s time, timed
over copies of the weight that do not fit in cache together, as a model's layers do not;
otherwise the shape keeps `F.linear`. The timed verdict is cached on disk as the C kernels' are
(pdlab.engine.kernel_check.cached_times), keyed by torch's build, the CPU, the shape and the thread count: on
narrow linears the race is close, and processes timing for themselves chose differently within one run
(qwen2-d64: packed in one worker of three).

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
from pdlab.engine import cpu_kernel
from pdlab.engine.kernel_build import cache_dir, cpu_flags
from pdlab.engine.kernel_check import Choice, _best, cached_times

MIN_ROWS = 4  # fewer rows: MKL's F.linear takes a path whose bits differ from the packed GEMM's
MAX_ROWS = 128  # more rows (a prefill chunk): F.linear is as fast or faster
PROBE_ROWS = 32  # the row count the check times (a decode step of 32 sequences)
CHECK_ROWS = (4, 7, 32, MAX_ROWS)  # row counts whose bits the check compares
COLD_BYTES = 64 << 20  # the race cycles through copies of the weight adding up to this (more than a CPU's cache)
MAX_COPIES = 16
RACE = "cold-2"  # how the race is run, in the verdict file's name: a changed race does not read old verdicts

_verdicts: dict[tuple, Choice] = {}  # (in, out, bias, timed, torch threads) -> this process's choice


def available() -> bool:
    return (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")
            and cpu_kernel.mode() != "off")


class Packed:
    """A weight (and bias) with its packed copy."""

    def __init__(self, weight: torch.Tensor, bias: Optional[torch.Tensor]):
        self.weight, self.bias = weight, bias
        self.ptr = weight.data_ptr()
        self.packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), PROBE_ROWS)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
        """x @ weight.T + bias: packed where the rows fit and the weight is the one packed, else F.linear."""
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        if (MIN_ROWS <= rows <= MAX_ROWS and weight.data_ptr() == self.ptr and bias is self.bias
                and x.dtype == torch.float32 and x.is_contiguous()):
            y = torch.ops.mkl._mkl_linear(x.reshape(rows, x.shape[-1]), self.packed, weight, bias, rows)
            return y.reshape(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)


def check(weight: torch.Tensor, bias: Optional[torch.Tensor]) -> Choice:
    """Whether this weight shape goes packed in this process: equal bits, and faster (timed once per shape)."""
    n, k = weight.shape
    timed = cpu_kernel.mode() != "on"  # PDLAB_CPU_KERNEL=on: wherever the bits agree, untimed
    key = (k, n, bias is not None, timed, torch.get_num_threads())
    if key in _verdicts:
        return _verdicts[key]
    g = torch.Generator().manual_seed(n * 7 + k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias is not None else None
    p = Packed(w, b)
    for rows in CHECK_ROWS:
        x = torch.randn(rows, k, generator=g)
        if not torch.equal(p(x, w, b), F.linear(x, w, b)):
            _verdicts[key] = Choice(False, f"does not apply: bits differ from F.linear at {rows} rows here")
            return _verdicts[key]
    if not timed:
        _verdicts[key] = Choice(True, "on (untimed)")
        return _verdicts[key]
    x = torch.randn(PROBE_ROWS, k, generator=g)
    # copies of the weight, run one after another: in a model the next layer's weight is not in cache, and there
    # F.linear pays for copying it into MKL's layout on every call, which a race on one hot weight hides
    # (qwen2-d64's gate/up: 1.63 against 1.67 ms hot, while 15% of its decode steps went to that copying)
    # (made inside the race, which runs only when the verdict is not cached: they are up to COLD_BYTES of
    # weights, packed, which every worker's start would otherwise pay)
    def race(names: list[str]) -> dict[str, list[float]]:
        copies = max(1, min(MAX_COPIES, -(-COLD_BYTES // max(1, w.numel() * w.element_size()))))
        ws = [w] + [torch.randn(n, k, generator=g) for _ in range(copies - 1)]
        ps = [p] + [Packed(wi, b) for wi in ws[1:]]

        def packed_all() -> None:
            for pi, wi in zip(ps, ws):
                pi(x, wi, b)

        def torch_all() -> None:
            for wi in ws:
                F.linear(x, wi, b)

        packed_ms, torch_ms = _best(packed_all, torch_all)
        return {PACKED: [packed_ms / copies, torch_ms / copies]}

    shape = f"{k}x{n}-{'bias' if bias is not None else 'nobias'}-t{torch.get_num_threads()}"
    packed_ms, torch_ms = cached_times(_verdict_file(), shape, [PACKED], race)[PACKED]
    faster = packed_ms <= torch_ms
    _verdicts[key] = Choice(faster, "faster here" if faster else "slower here", round(packed_ms, 4),
                            round(torch_ms, 4))
    return _verdicts[key]


def _verdict_file() -> str:
    """The timed verdicts' file: one per torch build (which carries its MKL) and CPU."""
    build = hashlib.sha256(f"{RACE} {torch.__version__} {torch.backends.cpu.get_cpu_capability()} {cpu_flags()}"
                           .encode()).hexdigest()
    return os.path.join(cache_dir(), f"packed-{build[:16]}.json")


def pack_linears(model: Any) -> Choice:
    """Pack the float32 CPU linears of `model` whose shape `check` passes; one Choice for the lot, in use when
    any linear is packed (its times: the sums over the packed ones at PROBE_ROWS rows)."""
    unpack(model)  # a model packed before (another engine, another mode) starts over
    if not available():
        return Choice(False, "does not apply: no MKL packed GEMM in this torch" if cpu_kernel.mode() != "off"
                      else f"off ({CPU_KERNEL_ENV}=off)")
    checked: list[Choice] = []
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
        c = check(weight, bias)
        checked.append(c)
        if not c.use:
            continue
        if group is not None:
            group.packed = Packed(weight, bias)
        else:
            m.pdlab_packed = Packed(weight, bias)
            m.forward = _packed_forward(m)
    used = [c for c in checked if c.use]
    slow = [c for c in checked if c.why == "slower here"]
    if used:
        return Choice(True, "on (untimed)") if cpu_kernel.mode() == "on" else _summed(True, "faster here", used)
    if slow:
        return _summed(False, "slower here", slow)
    return Choice(False, "does not apply: bits differ from F.linear here" if checked else
                  "does not apply: no float32 CPU linear")


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
