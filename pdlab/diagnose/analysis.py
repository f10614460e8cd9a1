"""One analysis, online and offline alike: streams in, tags, fit, figures and verdict out (summary.json's
`analysis`), and the agreement with a server's steps where there are some."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

from pdlab.diagnose.agreement import agreement
from pdlab.diagnose.fit import Fit, fit_stalls, isolated_points
from pdlab.diagnose.misses import correlation, itl_figures, miss_shares
from pdlab.diagnose.streams import Stream
from pdlab.diagnose.tagging import Tagging, tag
from pdlab.diagnose.verdict import Verdict, judge


@dataclass(frozen=True)
class Analysis:
    label: str  # `diagnose`, or the variant of another run
    target_ms: float
    streams: tuple[Stream, ...]
    tagging: Tagging
    fit: Fit
    itl: dict
    misses: dict
    correlation: dict
    verdict: Verdict
    probes_phase: Optional[tuple[float, float]] = None
    agreement: Optional[dict] = None

    def to_dict(self) -> dict:
        t = self.tagging
        in_windows = sum(g.in_window for g in t.gaps)
        return {"label": self.label, "itl_target_ms": self.target_ms, "verdict": self.verdict.to_dict(),
                "threshold": t.threshold.to_dict() if t.threshold else None, "itl": self.itl,
                "stall_share": {"of_gaps": len(t.of("stall")) / len(t.gaps) if t.gaps else None,
                                "of_gaps_in_windows": len(t.of("stall")) / in_windows if in_windows else None},
                "misses": self.misses, "correlation": self.correlation, "fit": self.fit.to_dict(),
                "windows": len(t.windows), "streams": sum(s.background for s in self.streams),
                "agreement": self.agreement}


def analyse(label: str, streams: Sequence[Stream], target_ms: float, *, probes_phase: Optional[Sequence[float]] = None,
            load: Optional[Sequence[Sequence[float]]] = None) -> Analysis:
    """`probes_phase`: [start, end] of a diagnosis' probe phase (its probes are the fit's points); None: the
    records of another run, every isolated window a point. `load`: [t, running, waiting] samples of the server."""
    streams = list(streams)
    tagging = tag(streams)
    online = any(s.phase == "probe" for s in streams)
    fit = fit_stalls(isolated_points(tagging, streams, "probe" if online else None))
    itl = itl_figures(tagging, probes_phase)
    misses = miss_shares(tagging.gaps, target_ms)
    corr = correlation(tagging, streams, target_ms, load)
    verdict = judge(itl, misses, fit, corr, tagging.threshold is not None, target_ms)
    return Analysis(label, target_ms, tuple(streams), tagging, fit, itl, misses, corr, verdict,
                    tuple(probes_phase) if probes_phase else None)


def with_agreement(a: Analysis, steps: list[dict], server_requests: Optional[list[dict]] = None) -> Analysis:
    return replace(a, agreement=agreement(a.tagging, list(a.streams), a.fit, steps, server_requests))
