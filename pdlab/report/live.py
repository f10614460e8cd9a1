"""The live view of `pdlab run`: fed by snapshots and events, knows nothing of engines or sockets.

On a terminal it is a rich Live panel (workers, progress per variant and rate, latency and SLO so far);
elsewhere (CI, pipes) it prints a plain progress line every few seconds and when a rate completes.
Feed it from the run loop:

    view = LiveView(slo=recipe_slo)
    view.plan("unified", 2.0, total=60)               # repeat=i for repeats after the first
    with view:
        view.status("unified: warming up for 2 req/s")
        view.update_worker("unified0", role="unified", devices="cpu:0", running=3, waiting=1,
                           kv_used=40, kv_total=512, steps=1234)
        view.update_requests("unified", 2.0, sent=10, records=[finished request records])
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from pdlab.recipe.slo import SLO


@dataclass
class _Worker:
    name: str
    role: str = ""
    devices: str = ""
    running: int = 0
    waiting: int = 0
    kv_used: Optional[int] = None
    kv_total: Optional[int] = None
    steps: int = 0
    steps_per_s: float = 0.0
    transport: str = ""  # disaggregated: the KV transport, then the path its hand-overs actually took
    _last: Optional[tuple[float, int]] = None


@dataclass
class _Progress:
    total: int = 0
    sent: int = 0
    done: int = 0
    met: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)


def _p(values: list[float], q: float) -> str:
    return "—" if not values else f"{1000 * float(np.percentile(values, q)):.0f}"


def _rate(rate: float) -> str:
    return "inf" if rate == float("inf") else f"{rate:g}"


class LiveView:
    def __init__(self, title: str = "pdlab run", slo: Optional[SLO] = None, console: Any = None,
                 live: Optional[bool] = None, line_interval_s: float = 5.0, out: Any = None):
        self.title, self.slo = title, slo
        self.out = out or sys.stdout
        self.live = self.out.isatty() if live is None else live
        self.console = console
        self.line_interval_s = line_interval_s
        self.workers: dict[str, _Worker] = {}
        self.progress: dict[tuple[str, float, int], _Progress] = {}
        self.notes: list[str] = []
        self.state = "starting"  # what the run is doing now: loading workers, warming up, measuring
        self._lock = threading.Lock()
        self._live: Any = None
        self._last_line = float("-inf")  # the first update prints at once

    # feeding -----------------------------------------------------------------------------------------
    def plan(self, variant: str, rate: float, total: int, repeat: int = 0) -> None:
        with self._lock:
            self.progress.setdefault((variant, rate, repeat), _Progress()).total = total

    def status(self, text: str) -> None:
        """What the run is doing now (starting workers, calibrating, warming up, measuring)."""
        with self._lock:
            self.state = text
        if not self.live:
            print(text, file=self.out, flush=True)

    def set_slo(self, slo: SLO) -> None:
        """The SLO once resolved (a relative SLO is known only after calibration)."""
        with self._lock:
            self.slo = slo

    def update_worker(self, name: str, role: Optional[str] = None, devices: Optional[str] = None,
                      running: Optional[int] = None, waiting: Optional[int] = None, kv_used: Optional[int] = None,
                      kv_total: Optional[int] = None, steps: Optional[int] = None, now: Optional[float] = None,
                      transport: Optional[str] = None) -> None:
        """A worker snapshot; `steps` is its cumulative step count (steps/s comes from the differences)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            w = self.workers.setdefault(name, _Worker(name))
            for k, v in (("role", role), ("devices", devices), ("running", running), ("waiting", waiting),
                         ("kv_used", kv_used), ("kv_total", kv_total), ("transport", transport)):
                if v is not None:
                    setattr(w, k, v)
            if steps is not None:
                if w._last is not None and now > w._last[0]:
                    w.steps_per_s = (steps - w._last[1]) / (now - w._last[0])
                w._last, w.steps = (now, steps), steps

    def drop_workers(self) -> None:
        """Forget the workers shown (a variant's cluster has stopped; the next one brings its own)."""
        with self._lock:
            self.workers.clear()

    def update_requests(self, variant: str, rate: float, sent: Optional[int] = None,
                        records: Optional[list[dict]] = None, repeat: int = 0) -> None:
        """`sent`: requests sent so far at this rate; `records`: newly finished request records."""
        with self._lock:
            p = self.progress.setdefault((variant, rate, repeat), _Progress())
            if sent is not None:
                p.sent = sent
            for r in records or []:
                if r.get("warmup"):
                    continue
                p.done += 1
                p.met += bool(r.get("slo_ok"))
                if r.get("ttft") is not None:
                    p.ttft.append(r["ttft"])
                p.itl.extend(r.get("itl") or [])
            finished = p.total and p.done >= p.total
        if not self.live:
            self._maybe_line(variant, rate, repeat, force=bool(finished))

    def note(self, text: str) -> None:
        with self._lock:
            self.notes = (self.notes + [text])[-4:]
        if not self.live:
            print(text, file=self.out, flush=True)

    # output ------------------------------------------------------------------------------------------
    def line(self, variant: str, rate: float, repeat: int = 0) -> str:
        p = self.progress[(variant, rate, repeat)]
        att = f"{100 * p.met / p.done:.0f}%" if p.done else "—"
        rep = f" #{repeat + 1}" if repeat else ""
        return (f"[{variant} @ {_rate(rate)} req/s{rep}] {p.done}/{p.total or '?'} done ({p.sent} sent)  "
                f"TTFT p50/p99 {_p(p.ttft, 50)}/{_p(p.ttft, 99)} ms  ITL p50/p99 {_p(p.itl, 50)}/{_p(p.itl, 99)} ms  "
                f"SLO {att}")

    def _maybe_line(self, variant: str, rate: float, repeat: int, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._last_line >= self.line_interval_s:
            self._last_line = now
            with self._lock:
                text = self.line(variant, rate, repeat)
            print(text, file=self.out, flush=True)

    def render(self) -> Any:
        # deferred: rich
        from rich.console import Group
        from rich.table import Table

        with self._lock:
            wt = Table(title="workers", title_justify="left", expand=False)
            for c in ("worker", "role", "devices", "running", "waiting", "KV use", "steps/s", "KV transport"):
                wt.add_column(c, justify="right" if c not in ("worker", "role", "devices", "KV transport") else "left")
            for w in self.workers.values():
                kv = f"{100 * w.kv_used / w.kv_total:.0f}%" if w.kv_used is not None and w.kv_total else "—"
                wt.add_row(w.name, w.role, w.devices, str(w.running), str(w.waiting), kv, f"{w.steps_per_s:.1f}",
                           w.transport or "—")
            slo = self.slo
            head = (f"SLO (per request): TTFT ≤ {slo.ttft_ms:.0f} ms and ITL {slo.itl_stat} ≤ {slo.itl_ms:.0f} ms"
                    if slo and not slo.relative else "SLO: relative, resolved after calibration")
            pt = Table(title=f"{self.title}   {head}", title_justify="left")
            for c in ("variant", "rate", "progress", "TTFT p50/p99 ms", "ITL p50/p99 ms", "SLO met"):
                pt.add_column(c, justify="left" if c == "variant" else "right")
            for (v, rate, repeat), p in self.progress.items():
                bar = _bar(p.done, p.total)
                att = f"{p.met}/{p.done} ({100 * p.met / p.done:.0f}%)" if p.done else "—"
                pt.add_row(v + (f" #{repeat + 1}" if repeat else ""), _rate(rate), f"{bar} {p.done}/{p.total}",
                           f"{_p(p.ttft, 50)}/{_p(p.ttft, 99)}", f"{_p(p.itl, 50)}/{_p(p.itl, 99)}", att)
            return Group(f"[bold]{self.state}[/bold]", wt, pt, *self.notes)

    def start(self) -> "LiveView":
        if self.live and self._live is None:
            # deferred: rich
            from rich.console import Console
            from rich.live import Live

            self._live = Live(get_renderable=self.render, console=self.console or Console(file=self.out),
                              refresh_per_second=4, transient=False)
            self._live.start()
        return self

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __enter__(self) -> "LiveView":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _bar(done: int, total: int, width: int = 12) -> str:
    if not total:
        return ""
    k = min(width, int(width * done / total))
    return "█" * k + "·" * (width - k)
