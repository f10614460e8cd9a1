"""The server's batch over time, from its Prometheus /metrics where it has them (vLLM's names, which pdlab
serve uses too): `vllm:num_requests_running` and `vllm:num_requests_waiting`, summed over engines.

This is what an ITL miss that no prefill explains may follow instead: a batch that grew. The reads are
part of the plan (one per METRICS_INTERVAL_S, at most `metrics_polls`); a server without /metrics, or
without these gauges, is read once and then left alone.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Callable, Optional

import aiohttp

from pdlab.diagnose.plan import METRICS_INTERVAL_S
from pdlab.external.probe import root_of

RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
READ_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class LoadSample:
    t: float  # time.monotonic() when the answer came
    running: float
    waiting: float


def parse_load(text: str) -> Optional[tuple[float, float]]:
    """(running, waiting) summed over every engine label, or None when the text has no running gauge. A scan of
    the lines that start with the two names, not a full parse: this runs on the loop that stamps the streams,
    and vLLM's /metrics is a hundred kilobytes of histograms."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:num_requests_"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in (RUNNING, WAITING):
            try:
                rest = line.rsplit("}", 1)[1] if "}" in line else line.split(None, 1)[1]
                found[name] = found.get(name, 0.0) + float(rest.split()[0])
            except (ValueError, IndexError):
                return None
    if RUNNING not in found:
        return None
    return found[RUNNING], found.get(WAITING, 0.0)


class ServerLoad:
    def __init__(self, session: aiohttp.ClientSession, url: str, headers: dict, limit: int,
                 clock: Callable[[], float] = time.monotonic):
        self.session, self.url, self.headers, self.limit, self.clock = session, f"{root_of(url)}/metrics", headers, \
            limit, clock
        self.samples: list[LoadSample] = []
        self.reads = 0
        self.absent: Optional[str] = None  # why there is no series

    async def run(self) -> None:
        """Read until cancelled, the plan's reads are spent, or the server shows it has no such gauges."""
        while self.reads < self.limit and self.absent is None:
            await self.read_once()
            await asyncio.sleep(METRICS_INTERVAL_S)

    async def read_once(self) -> None:
        self.reads += 1
        try:
            async with self.session.get(self.url, headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=READ_TIMEOUT_S)) as resp:
                if resp.status != 200:
                    self.absent = f"{self.url}: HTTP {resp.status}"
                    return
                text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, UnicodeDecodeError) as e:
            self.absent = f"{self.url}: {e.__class__.__name__}"
            return
        load = parse_load(text)
        if load is None:
            self.absent = f"{self.url}: no {RUNNING} gauge"
            return
        self.samples.append(LoadSample(self.clock(), *load))

    def to_dict(self) -> dict:
        return {"url": self.url, "reads": self.reads, "absent": self.absent,
                "samples": [[s.t, s.running, s.waiting] for s in self.samples]}
