"""The recipe's `model.timing`: a modelled step time, inline or from a profile (a "timed engine").

With a timing the engine does not run the model. Each step takes its modelled time (the engine waits it
out) and samples deterministic token ids; KV hand-overs take their modelled transfer time. Everything
else is the real engine: scheduler, block manager, prefix cache, chunking, preemption, roles, transports'
bookkeeping. A 2-core box can then run several "GPUs" at GPU time scales, and a test can hold measured
TTFT and ITL against queueing theory. Runs with a timing are *modelled* (`ModelSpec.modelled`): their
times are the profile's, not the hardware's, and every output says so.

    step time = fixed_ms + prefill_token_ms * prefill tokens
                + prefill_attention_ms * (prefill token x context pairs) / 1000
                + decode_seq_ms * decode sequences + context_token_ms * context tokens of the decodes
                + chunk_ms * prefill chunks
                + fresh_pair_ms * (fresh chunk tokens x (tokens + 1) / 2) / 1000
                + resumed_pair_ms * (resumed chunk tokens x (start + tokens)) / 1000
                + resumed_context_ms * context tokens of resumed chunks
                + knee_token_ms * min(prefill tokens + decode sequences, knee_tokens)

A *fresh* chunk starts a prompt, a *resumed* one continues it (start > 0: chunked prefill, a prefix-cache
hit); on a CPU the two take different code paths (pdlab.engine.timed.StepCounts), hence their own terms.
The knee prices a step's first tokens apart: small batches use the weights less well than large ones.

    model: {preset: tiny-llama, timing: {fixed_ms: 5, prefill_token_ms: 0.5, decode_seq_ms: 1}}   # inline
    model: {preset: gpu-0.6b, timing: h200-0.6b-analytic}        # a profile shipped in pdlab/profiles/
    model: {preset: cpu-demo, timing: runs/cpu-demo.profile.yaml}   # a file written by `pdlab profile`

A profile file is YAML, readable without pdlab: `name`, `source` (measured | analytic), `device`,
`date`, `model`, `step` (the terms above), `kv_bytes_per_token`, `kv_memory_gb` (what "auto" KV sizing
may use on the modelled device), `transfer` ({transport: {gbps, latency_ms}}), `host` (a worker's own time
between steps and the message hops: the simulator adds them), and, when measured, `kernels` (the CPU kernels
the measured steps ran, pdlab.engine.kernel_check), `pace_ms` (the box's pace then, pdlab.timing.pace),
`memory_pace_ms` (its memory half), `pace_read_mib` (the MiB that half read) and `fit` (how well the step model
fits held-out steps); once checked against
runs, `drift` (the box's pace against the profile in them, pdlab.timing.drift: a simulation's band,
pdlab.sim.band).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import yaml

from pdlab.constants import DRIFT_LEVELS, DRIFT_MIN_FACTORS, SPREAD_LEVELS, TRANSPORTS
from pdlab.fields import RecipeError, Section, did_you_mean, optional, plain, section, spec, to_float, to_int, to_text

MS = "a number of milliseconds >= 0"
PROFILE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiles")
SOURCES = ("measured", "analytic", "inline")
_non_negative = to_float(0.0, lo_open=False)


def _ms(v: Any) -> float:
    v = _non_negative(v)
    if not math.isfinite(v):
        raise ValueError
    return v


@dataclass(frozen=True)
class StepTiming(Section):
    """A step's modelled time, linear in what the step computes (all terms in milliseconds)."""

    fixed_ms: float = spec(0.0, f"{MS} (per step)", _ms)
    prefill_token_ms: float = spec(0.0, f"{MS} (per prefill token in the step)", _ms)
    prefill_attention_ms: float = spec(0.0, f"{MS} (per 1000 prefill token x context token pairs)", _ms)
    decode_seq_ms: float = spec(0.0, f"{MS} (per decode sequence in the step)", _ms)
    context_token_ms: float = spec(0.0, f"{MS} (per context token attended by the step's decode sequences)", _ms)
    chunk_ms: float = spec(0.0, f"{MS} (per prefill chunk in the step)", _ms)
    fresh_pair_ms: float = spec(0.0, f"{MS} (per 1000 causal token pairs of chunks that start a prompt)", _ms)
    resumed_pair_ms: float = spec(0.0, f"{MS} (per 1000 token x context pairs of chunks that resume a prompt)", _ms)
    resumed_context_ms: float = spec(0.0, f"{MS} (per context token of chunks that resume a prompt)", _ms)
    knee_token_ms: float = spec(0.0, f"{MS} (per token of the step's first knee_tokens: prefill tokens and decode "
                                     "sequences)", _ms)
    knee_tokens: int = spec(0, "an integer >= 0 (tokens a step's knee_token_ms applies to)", to_int(0))

    def check(self, where: str) -> None:
        if not any(getattr(self, k) > 0 for k in self.keys() if k != "knee_tokens"):
            raise RecipeError(f"{where}: every term is 0; expected at least one of {', '.join(self.keys())} > 0 "
                              "(or timing: null for the real step time)")

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, prefill_pairs: int = 0,
               chunks: int = 0, fresh_pairs: int = 0, resumed_pairs: int = 0, resumed_context: int = 0) -> float:
        """The modelled time of a step, in seconds (the counts: pdlab.engine.timed.StepCounts). `prefill_pairs`:
        sum over the step's prefill chunks of tokens x the context each attends (the quadratic part of
        attention)."""
        return (self.fixed_ms + self.prefill_token_ms * prefill_tokens + self.prefill_attention_ms * prefill_pairs
                / 1000.0 + self.decode_seq_ms * decode_seqs + self.context_token_ms * context_tokens
                + self.chunk_ms * chunks + self.fresh_pair_ms * fresh_pairs / 1000.0
                + self.resumed_pair_ms * resumed_pairs / 1000.0 + self.resumed_context_ms * resumed_context
                + self.knee_token_ms * min(prefill_tokens + decode_seqs, self.knee_tokens)) / 1000.0


@dataclass(frozen=True)
class HostTiming(Section):
    """A worker's own time around its steps, which the step model leaves out (all in milliseconds): what the
    simulator adds so that its TTFT and ITL carry them, as a run's do."""

    gap_ms: float = spec(0.0, f"{MS} (a worker's own time between back-to-back steps: sending tokens and "
                              "records, reading messages)", _ms)
    hop_ms: float = spec(0.0, f"{MS} (a request's submission to its worker, as far as the worker's next step "
                              "can start: harness, router, socket)", _ms)
    handoff_ms: float = spec(0.0, f"{MS} (a finished prefill to the decode worker acting on it: prefill -> router "
                                  "-> decode)", _ms)
    send_ms: float = spec(0.0, f"{MS} (the harness and router's own time per request: requests due together reach "
                               "the router this far apart, as a burst does)", _ms)
    admit_ms: float = spec(0.0, f"{MS} (a decode worker's own time per hand-over it admits, beyond gap_ms: reading "
                                "it, reserving and pulling, admitting, sending its first token)", _ms)
    admit_ktok_ms: float = spec(0.0, f"{MS} per 1000 prompt tokens a decode worker pulls, beyond admit_ms (a pull's "
                                     "copy shares the worker's core: its next step waits for part of it)", _ms)


def _factor(v: Any) -> float:
    v = to_float(0.0)(v)
    if not math.isfinite(v):
        raise ValueError
    return v


def _spread(v: Any) -> tuple[float, ...]:
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)) or len(v) != len(SPREAD_LEVELS):
        raise ValueError
    qs = tuple(_factor(x) for x in v)
    if any(b < a for a, b in zip(qs, qs[1:])):
        raise ValueError
    return qs


_SPREAD = (f"a list of {len(SPREAD_LEVELS)} numbers > 0, non-decreasing (a decode step's time over its model's "
           f"median, at probabilities {', '.join(f'{x:g}' for x in SPREAD_LEVELS)})")


@dataclass(frozen=True)
class ContentionTiming(Section):
    """What a worker's step costs beyond the step model on a host it shares with the deployment's other
    workers (pdlab.timing.contention): the profile's steps were measured alone and back to back, a run's are
    not. A step with prefill tokens takes `prefill_x` times its model while every other worker steps too
    (`decode_x` a decode-only step; linear in the share of the others stepping), and a step that starts
    constants.COLD_AFTER_MS or more after its worker's last one takes `cold_ms` more (its caches went cold).
    A decode-only step k steps after its worker's last step with prefill tokens takes 1 + (`after_prefill_x` -
    1) x `after_prefill_decay`^k times its model (k = 0: the next one): the prefill's work evicted the decode's
    weights and KV from the caches.

    A decode-only step also spreads around that time: `decode_spread` (alone) and `decode_spread_beside` (all
    other workers stepping) are the quantiles, at constants.SPREAD_LEVELS, of such steps' measured over
    predicted time divided by their median. A request's p99 ITL is its slowest steps: without the spread a
    simulated decode worker steps like a metronome and its ITL tail is the model's mean.

    `main_step_ms`: the main process's (router and harness) time per worker step, as the workers lose it where it
    shares their cores (pdlab.timing.contention.main_step; its own CPU time per step is about half of it).
    Where a deployment leaves it no core of its own the simulator takes it from them (pdlab.sim.host_load).

    `join_ktok_ms`: what a decode worker's next step after it admitted hand-overs takes more, per 1000 prompt
    tokens admitted: the step reads their KV first, written by another core (pdlab.timing.join)."""

    prefill_x: float = spec(1.0, "a number > 0 (a step with prefill tokens, all other workers stepping: x its "
                                 "model)", _factor)
    decode_x: float = spec(1.0, "a number > 0 (a decode-only step, all other workers stepping: x its model)",
                           _factor)
    cold_ms: float = spec(0.0, f"{MS} (added to a step that starts after its worker idled)", _ms)
    after_prefill_x: float = spec(1.0, "a number > 0 (a decode-only step right after its worker's step with "
                                       "prefill tokens: x its model)", _factor)
    after_prefill_decay: float = spec(0.0, "a number in [0, 1] (how much of after_prefill_x's excess each later "
                                           "decode step keeps)", to_float(0.0, 1.0, lo_open=False))
    decode_spread: tuple[float, ...] = spec((), _SPREAD + ", alone", _spread)
    decode_spread_beside: tuple[float, ...] = spec((), _SPREAD + ", all other workers stepping", _spread)
    main_step_ms: float = spec(0.0, f"{MS} (the main process's time per worker step, router and harness, as the "
                                    "workers lose it where they share its cores: the simulator takes it from them)",
                               _ms)
    join_ktok_ms: float = spec(0.0, f"{MS} per 1000 prompt tokens (a decode worker's step after it admitted "
                                    "hand-overs: their KV, written by another core, read there first)", _ms)

    def to_raw(self) -> dict:
        raw = super().to_raw()
        for k in ("decode_spread", "decode_spread_beside"):
            if not raw.get(k):
                raw.pop(k, None)
        return raw

    def spread(self, u: float, others_busy: float) -> float:
        """A decode step's factor at probability `u` of its spread, for the share of the others stepping (1.0
        without a spread). Alone and beside are read at the same `u` and weighted by the share."""
        alone = float(np.interp(u, SPREAD_LEVELS, self.decode_spread)) if self.decode_spread else 1.0
        beside = float(np.interp(u, SPREAD_LEVELS, self.decode_spread_beside)) if self.decode_spread_beside \
            else alone
        return alone + (beside - alone) * others_busy

    def after_prefill(self, since: Optional[int]) -> float:
        """A decode-only step's factor `since` decode steps after its worker's last step with prefill tokens
        (0: right after it; None: none yet)."""
        if since is None or self.after_prefill_x == 1.0:
            return 1.0
        return 1.0 + (self.after_prefill_x - 1.0) * self.after_prefill_decay ** since

    def step_s(self, model_s: float, has_prefill: bool, others_busy: float, cold: bool,
               u: Optional[float] = None, since_prefill: Optional[int] = None) -> float:
        """A step's time from its model's, the share of the other workers stepping at its start and whether
        its worker idled before it; with `u` (a uniform draw), a decode-only step is drawn from its spread, and
        with `since_prefill`, it carries what its worker's last prefill left (after_prefill)."""
        x = self.prefill_x if has_prefill else self.decode_x
        extra = 1.0 if has_prefill else self.after_prefill(since_prefill)
        spread = self.spread(u, others_busy) if u is not None and not has_prefill else 1.0
        return (model_s * (1.0 + (x - 1.0) * others_busy) * extra * spread
                + (self.cold_ms / 1000.0 if cold else 0.0))


@dataclass(frozen=True)
class TransferTiming(Section):
    gbps: float = spec(expected="a number > 0 (GB/s, 1e9 bytes)", conv=to_float(0.0))
    latency_ms: float = spec(0.0, f"{MS} (fixed cost per hand-over)", _ms)

    def transfer_s(self, nbytes: int) -> float:
        return self.latency_ms / 1000.0 + nbytes / (self.gbps * 1e9)


def _transfers(v: Any, key: str) -> tuple[tuple[str, TransferTiming], ...]:
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise RecipeError(f"{key}: expected a mapping transport -> {{gbps, latency_ms}}, got {v!r}")
    out = []
    for name, t in v.items():
        if name not in TRANSPORTS:
            raise RecipeError(f"{key}.{name}: unknown transport" + (did_you_mean(name, TRANSPORTS) or
                                                                   f"; expected one of {', '.join(TRANSPORTS)}"))
        out.append((str(name), TransferTiming.from_raw(t, f"{key}.{name}")))
    return tuple(out)


def _texts(v: Any) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
        raise ValueError
    return tuple(v)


def _factors(v: Any) -> tuple[float, ...]:
    if v is None:
        return ()
    if not isinstance(v, (list, tuple)):
        raise ValueError
    return tuple(_factor(x) for x in v)


@dataclass(frozen=True)
class Drift(Section):
    """How far the box's pace strayed from the profile in the runs checked against it (pdlab.timing.drift):
    `factors`, each a worker's steps in one rate and repeat of a run over the profile's prediction for them (in
    their context: the contention the profile models), as the replay reads them (pdlab.timing.replay); `runs`,
    how many runs gave them. The profile's own steps say nothing of this: they were measured in a minute or two,
    and a shared box drifts over minutes (x0.92-1.23 in whole runs on the developers' VM, BENCHMARKS.md).
    `band()` is the simulator's band (pdlab.sim.band). `runs` counts every run added, including those whose
    paces the latest DRIFT_KEEP no longer hold; `sources`, each run's start time (its env.json `time`), so that
    one run is taken once."""

    factors: tuple[float, ...] = spec((), "a list of numbers > 0 (a worker's steps over the profile's prediction in "
                                          "one rate and repeat of a run)", _factors)
    runs: int = spec(0, "an integer >= 0 (runs the factors came from)", to_int(0))
    sources: tuple[str, ...] = spec((), "a list of strings (each run's start time)", _texts)

    def band(self) -> Optional[tuple[float, float]]:
        """The factors' quantiles at constants.DRIFT_LEVELS; None with fewer than DRIFT_MIN_FACTORS."""
        if len(self.factors) < DRIFT_MIN_FACTORS:
            return None
        lo, hi = (float(q) for q in np.quantile(np.asarray(self.factors), DRIFT_LEVELS))
        return lo, hi

    def median(self) -> Optional[float]:
        """The factors' median; None with fewer than DRIFT_MIN_FACTORS (as band())."""
        return float(np.median(self.factors)) if len(self.factors) >= DRIFT_MIN_FACTORS else None

    def describe(self) -> str:
        """'x0.96-1.19 (5-95% of 32 paces from 1 run)', or what is missing."""
        band = self.band()
        if band is None:
            return (f"its drift has {len(self.factors)} of the {DRIFT_MIN_FACTORS} paces a band needs (the box's "
                    "pace in a real run: pdlab profile --check RUN --profile FILE --write-drift)")
        lo, hi = (f"{100 * q:g}" for q in DRIFT_LEVELS)
        return (f"x{band[0]:.2f}-{band[1]:.2f} ({lo}-{hi}% of {len(self.factors)} paces from {self.runs} "
                f"run{'s' if self.runs != 1 else ''})")

    def to_raw(self) -> dict:
        return {"factors": list(self.factors), "runs": self.runs, "sources": list(self.sources)} if self.factors else {}


@dataclass(frozen=True, kw_only=True)
class TimingProfile(Section):
    """A timing model: the step time, and the KV and transfer figures a timed run needs."""

    name: str = spec("inline", "a string", to_text)
    source: str = spec("inline", f"one of {', '.join(SOURCES)}", lambda v: _one(v, SOURCES))
    device: str = spec("", "a string (what was measured or modelled)", to_text)
    device_kind: str = spec("", "cpu, cuda, or empty (the kind of device measured or modelled)",
                            lambda v: _one(v, ("", "cpu", "cuda")))
    date: str = spec("", "a string", lambda v: to_text(str(v)))
    model: str = spec("", "a string (the model profiled)", to_text)
    # one modelled engine instance spans this many devices (its TP degree): a timed or simulated worker stands in
    # for all of them, so goodput per device divides by workers x devices, not by the stand-ins
    devices: int = spec(1, "an integer >= 1 (devices one modelled engine instance spans, e.g. its TP degree)",
                        to_int(1))
    step: StepTiming = spec(expected="the step-time terms", parse=section(StepTiming))
    kv_bytes_per_token: Optional[int] = spec(None, "an integer >= 1 (KV bytes per token, all layers)",
                                             optional(to_int(1)))
    kv_memory_gb: Optional[float] = spec(None, "a number > 0 (KV memory of the modelled device, GB)",
                                         optional(to_float(0.0)))
    transfer: tuple[tuple[str, TransferTiming], ...] = spec((), parse=_transfers)
    host: HostTiming = spec(HostTiming(), "a worker's host time (gap_ms, hop_ms, handoff_ms, send_ms)",
                            parse=section(HostTiming))
    contention: ContentionTiming = spec(ContentionTiming(), "a shared host's cost beyond the step model "
                                        f"({', '.join(ContentionTiming.keys())})", parse=section(ContentionTiming))
    drift: Drift = spec(Drift(), "the box's pace against the profile in runs checked with it (factors, runs)",
                        parse=section(Drift))
    # kernel -> {use, why, kernel_ms, torch_ms}: the CPU kernels the measured steps ran (pdlab.engine.kernel_check)
    kernels: Optional[dict] = spec(None, "a mapping kernel -> its choice (which CPU kernels the steps ran)",
                                   lambda v: _mapping(v))
    fit: Optional[dict] = spec(None, "a mapping (how well the step model fits held-out steps)",
                               lambda v: _mapping(v))
    # the box's pace while the steps were measured (pdlab.timing.pace): a run's workers time the same
    # computation, and `pdlab profile --check` sets the two side by side
    pace_ms: Optional[float] = spec(None, "a number > 0 (ms of pdlab.timing.pace's computation)",
                                    optional(to_float(0.0)))
    # its memory half (pdlab.timing.pace.Pace.memory_ms), which drifts apart from the rest on a shared box
    memory_pace_ms: Optional[float] = spec(None, "a number > 0 (ms of pdlab.timing.pace's memory half)",
                                           optional(to_float(0.0)))
    # the memory half's read in MiB (pdlab.timing.pace.READ_MIB); absent in profiles from before it was kept
    # (pdlab.timing.pace.OLD_READ_MIB)
    pace_read_mib: Optional[int] = spec(None, "an integer > 0 (MiB that pdlab.timing.pace's memory half read)",
                                        optional(to_int(1)))

    def step_s(self, prefill_tokens: int, decode_seqs: int, context_tokens: int, prefill_pairs: int = 0,
               chunks: int = 0, fresh_pairs: int = 0, resumed_pairs: int = 0, resumed_context: int = 0) -> float:
        return self.step.step_s(prefill_tokens, decode_seqs, context_tokens, prefill_pairs, chunks, fresh_pairs,
                                resumed_pairs, resumed_context)

    def scaled(self, factor: float) -> "TimingProfile":
        """This profile with every step term times `factor` (knee_tokens, a count, kept; host and transfers
        kept; a cold step's extra time scaled too), renamed '<name> x<factor>': what-ifs of slower or faster
        steps."""
        terms = {k: getattr(self.step, k) * factor for k in self.step.keys() if k != "knee_tokens"}
        return self.replace(step=self.step.replace(**terms), name=f"{self.name} x{factor:.3g}",
                            contention=self.contention.replace(cold_ms=self.contention.cold_ms * factor))

    def transfer_of(self, transport: str) -> Optional[TransferTiming]:
        return dict(self.transfer).get(transport)

    def describe(self) -> str:
        """'modelled timing: profile h200-0.6b-analytic (analytic, H200 141GB, 2026-11-30)'."""
        if self.source == "inline":
            return "modelled timing: inline step model"
        facts = ", ".join(x for x in (self.source, self.device, self.date) if x)
        return f"modelled timing: profile {self.name} ({facts})"

    def to_raw(self) -> dict:
        raw = super().to_raw()
        raw["transfer"] = {k: plain(t) for k, t in self.transfer}
        return raw


def _one(v: Any, options: tuple[str, ...]) -> str:
    if v not in options:
        raise ValueError
    return v


def _mapping(v: Any) -> Optional[dict]:
    if v is not None and not isinstance(v, dict):
        raise ValueError
    return v


def profile_path(name: str) -> Optional[str]:
    """A profile file: a path, or the name of one shipped in pdlab/profiles/."""
    for p in (os.path.expanduser(name), os.path.join(PROFILE_DIR, f"{name}.yaml")):
        if os.path.isfile(p):
            return p
    return None


def shipped_profiles() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".yaml")) if os.path.isdir(PROFILE_DIR) else []


def load_profile(name: str, where: str = "model.timing") -> TimingProfile:
    path = profile_path(name)
    if path is None:
        known = shipped_profiles()
        raise RecipeError(f"{where}: no profile {name!r} (a file, or one of: {', '.join(known) or 'none shipped'})"
                          + did_you_mean(name, known))
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise RecipeError(f"{where}: {path} cannot be read as YAML ({e.__class__.__name__})") from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: {path} is not a timing profile (expected a mapping)")
    raw = {k: v for k, v in raw.items() if k != "pdlab_timing_profile"}
    return TimingProfile.from_raw(raw, f"{where} ({path})")


def parse_timing(v: Any, key: str) -> Optional[TimingProfile]:
    """`timing:` null, a profile name or path, a full profile mapping, or inline step terms."""
    if v is None:
        return None
    if isinstance(v, str):
        return load_profile(v, key)
    if isinstance(v, dict) and "step" in v:
        return TimingProfile.from_raw(v, key)
    if isinstance(v, dict):
        return TimingProfile(step=StepTiming.from_raw(v, key))
    raise RecipeError(f"{key}: expected a profile name or path, or step terms such as {{fixed_ms: 5}}, got {v!r}")
