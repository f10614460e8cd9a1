"""Which CPU kernels each variant's workers ran, as their Ready messages reported them: env.json's
`cpu_kernels`, the summary's `kernels`, compare's header and one warning line for a run whose workers fell
back to torch for a reason other than speed (no compiler, a failed build, switched off).

Two runs on two machines can differ by 2-3x on CPU for this reason alone (a decode kernel that did not
build), so a run says what it ran instead of leaving it to be guessed.
"""

from __future__ import annotations

from typing import Any, Optional

FELL_BACK = ("not built", "off")  # a Choice's `why` that means the kernel could not run at all


def describe(workers: dict[str, dict]) -> str:
    """One line for a variant: its workers' kernels, grouped ("4 of 5 kernels; torch for prefill_attention
    (slower here: 55.7 vs 12.9 ms)")."""
    if not workers:
        return "no model runs (modelled timing)"
    first = next(iter(workers.values()))
    if not first:
        return "no model runs (modelled timing)"
    same = all(w == first for w in workers.values())
    parts = []
    for name, worker in (([("", first)] if same else sorted(workers.items()))):
        used = [k for k, c in worker.items() if c["use"]]
        torch_for = [f"{k} ({_short(c)})" for k, c in worker.items() if not c["use"]]
        head = f"{name}: " if name else ""
        if not used and torch_for and all(c["why"].startswith("does not apply: cuda") for c in worker.values()):
            parts.append(f"{head}GPU (no CPU kernels)")
            continue
        line = f"{head}{len(used)} of {len(worker)} CPU kernels"
        if torch_for:
            line += "; torch for " + ", ".join(torch_for)
        parts.append(line)
    return "; ".join(parts)


def _short(c: dict) -> str:
    why = c["why"]
    if c.get("kernel_ms") is not None and c.get("torch_ms") is not None:
        why += f": {c['kernel_ms']:.3g} vs {c['torch_ms']:.3g} ms"
    return why


def fell_back(workers: dict[str, dict]) -> list[str]:
    """`worker: kernel (why)` for every kernel a worker could not run at all."""
    return [f"{w}: {k} ({c['why']})" for w, ks in sorted(workers.items()) for k, c in ks.items()
            if not c["use"] and c["why"].startswith(FELL_BACK)]


class KernelLog:
    def __init__(self, rd: Any, view: Any):
        self.rd, self.view = rd, view
        self.by_variant: dict[str, dict[str, dict]] = {}  # variant -> worker -> kernel -> Choice dict
        # variant -> worker -> the box's pace at its start (pdlab.timing.pace), reported with the kernels: env.json
        self.paces: dict[str, dict[str, float]] = {}
        self.memory_paces: dict[str, dict[str, float]] = {}  # its memory half: env.json worker_memory_pace_ms
        self.pace_reads: dict[str, dict[str, int]] = {}  # the MiB that half read: env.json worker_pace_read_mib
        self.warnings: list[str] = []

    def record(self, variant: str, workers: list[Any]) -> Optional[str]:
        """A variant's cluster is up: keep what each worker reported; warn once if any fell back."""
        if any(getattr(w, "kernels", None) is None for w in workers):
            return None  # an external server: its kernels are its own
        got = {w.name: dict(w.kernels) for w in workers}
        self.by_variant[variant] = got
        self.rd.update_env(cpu_kernels=self.by_variant)
        paced = [(w.name, w.pace) for w in workers if getattr(w, "pace", None) is not None]
        if paced:  # each worker's own figures, and the read it timed (a node may run another checkout)
            self.paces[variant] = {n: p.total_ms for n, p in paced}
            self.memory_paces[variant] = {n: p.memory_ms for n, p in paced}
            self.pace_reads[variant] = {n: p.read_mib for n, p in paced}
            self.rd.update_env(worker_pace_ms=self.paces, worker_memory_pace_ms=self.memory_paces,
                               worker_pace_read_mib=self.pace_reads)
        self.view.note(f"{variant}: {describe(got)}")
        lost = fell_back(got)
        if not lost:
            return None
        warning = (f"{variant}: CPU kernels fell back to torch ops ({'; '.join(lost[:3])}"
                   f"{'; ...' if len(lost) > 3 else ''}): steps are slower than with them; see pdlab doctor")
        self.warnings.append(warning)
        self.view.note(f"warning: {warning}")
        return warning

    def reported(self) -> dict:
        """What the workers reported, as pdlab.timing.check.run_facts takes it (its keyword arguments): their
        kernels, and their paces with the read each timed."""
        return {"kernels": self.by_variant, "paces": self.paces, "memory_paces": self.memory_paces,
                "pace_reads": self.pace_reads}

    def facts(self) -> dict:
        return {variant: {"workers": workers, "describe": describe(workers)}
                for variant, workers in self.by_variant.items()}
