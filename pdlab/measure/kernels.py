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
        # variant -> worker -> the box's pace at its start (pdlab.timing.pace.Pace), reported with the kernels
        self.paces: dict[str, dict[str, Any]] = {}
        self.warnings: list[str] = []

    def record(self, variant: str, workers: list[Any]) -> Optional[str]:
        """A variant's cluster is up: keep what each worker reported; warn once if any fell back."""
        if any(getattr(w, "kernels", None) is None for w in workers):
            return None  # an external server: its kernels are its own
        got = {w.name: dict(w.kernels) for w in workers}
        self.by_variant[variant] = got
        self.rd.update_env(cpu_kernels=self.by_variant)
        paced = {w.name: w.pace for w in workers if getattr(w, "pace", None) is not None}
        if paced:  # each worker's own figures, and the read it timed (a node may run another checkout)
            self.paces[variant] = paced
            self.rd.update_env(**self._pace_env())
        self.view.note(f"{variant}: {describe(got)}")
        lost = fell_back(got)
        if not lost:
            return None
        warning = (f"{variant}: CPU kernels fell back to torch ops ({'; '.join(lost[:3])}"
                   f"{'; ...' if len(lost) > 3 else ''}): steps are slower than with them; see pdlab doctor")
        self.warnings.append(warning)
        self.view.note(f"warning: {warning}")
        return warning

    def _pace_env(self) -> dict:
        """env.json's view of the paces: variant -> worker -> the whole, its memory half, the MiB that half read."""
        def each(attr: str) -> dict:
            return {v: {w: getattr(p, attr) for w, p in ws.items()} for v, ws in self.paces.items()}

        return {"worker_pace_ms": each("total_ms"), "worker_memory_pace_ms": each("memory_ms"),
                "worker_pace_read_mib": each("read_mib")}

    def reported(self) -> dict:
        """What the workers reported, as pdlab.timing.check.run_facts takes it (its keyword arguments): their
        kernels, and their paces with the read each timed (as env.json keeps them)."""
        env = self._pace_env()
        return {"kernels": self.by_variant, "paces": env["worker_pace_ms"],
                "memory_paces": env["worker_memory_pace_ms"], "pace_reads": env["worker_pace_read_mib"]}

    def facts(self) -> dict:
        return {variant: {"workers": workers, "describe": describe(workers)}
                for variant, workers in self.by_variant.items()}
