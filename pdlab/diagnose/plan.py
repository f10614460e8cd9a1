"""What `pdlab diagnose URL` will send, decided before it sends anything, with hard caps.

The options carry the defaults (this module is their one home, as a recipe's keys keep theirs on their
dataclass fields): low ones, because the service may be a production one. The plan turns them into what is
sent: background streams, probes, the mixed phase, and the most each may cost. The caps bind every send
(pdlab.diagnose.budget refuses what would exceed them), so the printed plan is an upper bound of the traffic,
not an estimate: at most `max_requests` requests (the checks and /metrics reads included), `tokens` prompt
plus output tokens asked for, `concurrency` in flight, `rate` sends per second, `duration_s` from the first
send on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

# Round thousands rather than powers of two: an engine that does not chunk prefills and whose step budget is a
# power of two (2048) cannot fit a 2048-token prompt beside running decodes, and would hold such a probe back.
DEFAULT_LENGTHS = (500, 1000, 2000, 4000, 8000)
CHECK_REQUESTS = 5  # /v1/models read here, then the endpoint probe's /models, up to 2 tiny completions, /version
METRICS_INTERVAL_S = 1.0  # the server's /metrics, read this often while measuring (when it has one)


class PlanError(ValueError):
    """An option that cannot make a plan; one line naming it."""


@dataclass(frozen=True)
class Caps:
    """Hard limits of one diagnosis: nothing is sent beyond them."""

    concurrency: int = 8  # requests in flight at once
    rate: float = 4.0  # sends per second (at least 1/rate apart)
    tokens: int = 200_000  # prompt + max_tokens summed over every request sent
    duration_s: float = 150.0  # from the first send: then every stream is cut and nothing more is sent


@dataclass(frozen=True)
class Options:
    url: str
    model: str
    itl_ms: float = 50.0  # the ITL target a gap misses above
    concurrency: int = 4  # background streams
    lengths: tuple[int, ...] = DEFAULT_LENGTHS  # probe prompt lengths (tokens)
    repeats: int = 3  # probes per length
    max_model_len: Optional[int] = None  # when the server's /v1/models does not say
    lengths_from: tuple[int, ...] = ()  # the mixed phase's prompt lengths (from --lengths-from FILE)
    mixed_rate: float = 1.0  # mixed phase: Poisson sends per second
    mixed_requests: int = 20  # at most this many of the file's lengths are replayed
    steady_s: float = 8.0  # background streams alone before the first probe
    probe_gap_s: float = 1.0  # background alone between one probe's end and the next probe
    background_prompt: int = 64
    background_output: int = 1024
    probe_output: int = 1  # a probe's max_tokens: its window is send -> first token
    mixed_output: int = 16
    seed: int = 0  # the mixed phase's order and arrivals; prompts are drawn anew on every run (phases.Runner)
    api_key_env: Optional[str] = None  # the environment variable holding the API key
    metrics: bool = True  # read the server's /metrics (running requests over time) where it has one
    caps: Caps = field(default_factory=Caps)


@dataclass(frozen=True)
class Probe:
    index: int
    prompt_len: int
    max_tokens: int


@dataclass(frozen=True)
class Plan:
    options: Options
    max_prompt: Optional[int]  # the longest prompt the server takes; None: not known yet (a dry run)
    probes: tuple[Probe, ...]
    dropped: tuple[int, ...]  # probe lengths over the server's limit
    mixed: tuple[int, ...]  # mixed phase prompt lengths, in sending order
    background_max: int  # background requests at most (what the token cap leaves after probes and mixed)
    metrics_polls: int

    @property
    def caps(self) -> Caps:
        return self.options.caps

    @property
    def probe_tokens(self) -> int:
        return sum(p.prompt_len + p.max_tokens for p in self.probes)

    @property
    def mixed_tokens(self) -> int:
        return sum(n + self.options.mixed_output for n in self.mixed)

    @property
    def completion_slots(self) -> int:
        """Completions in flight at most: the concurrency cap, less the one a /metrics read may hold."""
        return self.caps.concurrency - (1 if self.metrics_polls else 0)

    @property
    def max_requests(self) -> int:
        return CHECK_REQUESTS + self.metrics_polls + len(self.probes) + len(self.mixed) + self.background_max


def _check(opts: Options) -> None:
    c = opts.caps
    positive = {"--itl-ms": opts.itl_ms, "--concurrency": opts.concurrency, "--repeats": opts.repeats,
                "--steady-s": opts.steady_s, "--max-concurrency": c.concurrency, "--max-rate": c.rate,
                "--max-tokens-total": c.tokens, "--max-duration": c.duration_s, "--mixed-rate": opts.mixed_rate,
                "--background-output": opts.background_output, "--background-prompt": opts.background_prompt}
    for name, v in positive.items():
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise PlanError(f"{name} {v}: expected a number > 0")
    if opts.probe_gap_s < 0 or not math.isfinite(opts.probe_gap_s):
        raise PlanError(f"--probe-gap-s {opts.probe_gap_s}: expected seconds >= 0")
    if not opts.lengths or any(n < 1 for n in opts.lengths):
        raise PlanError(f"--lengths {','.join(map(str, opts.lengths))}: expected prompt lengths >= 1 token")
    if opts.max_model_len is not None and opts.max_model_len < 2:
        raise PlanError(f"--max-model-len {opts.max_model_len}: expected tokens >= 2")
    need = opts.concurrency + 1 + int(opts.metrics)
    if need > c.concurrency:
        raise PlanError(f"--concurrency {opts.concurrency}: the background streams, a probe"
                        f"{' and a /metrics read' if opts.metrics else ''} need {need} requests in flight; "
                        f"--max-concurrency is {c.concurrency}")


def build_plan(opts: Options, server_max_len: Optional[int] = None) -> Plan:
    """The plan for `opts`; `server_max_len`: the tokens (prompt + output) one request may take, as the server
    said (else --max-model-len, else unknown: a dry run before asking). PlanError when it cannot fit the caps."""
    _check(opts)
    limit = server_max_len or opts.max_model_len
    max_prompt = None if limit is None else limit - max(opts.probe_output, 1)
    keep = tuple(sorted(n for n in set(opts.lengths) if max_prompt is None or n <= max_prompt))
    dropped = tuple(sorted(n for n in set(opts.lengths) if n not in keep))
    if not keep:
        raise PlanError(f"--lengths: every probe length is over the {limit} tokens the server takes per request")
    if max_prompt is not None and opts.background_prompt + opts.background_output > limit:
        raise PlanError(f"--background-prompt {opts.background_prompt} + --background-output "
                        f"{opts.background_output}: over the {limit} tokens the server takes per request")
    probes = tuple(Probe(i, n, opts.probe_output)
                   for i, n in enumerate(n for n in keep for _ in range(opts.repeats)))
    mixed = tuple(n for n in opts.lengths_from[:opts.mixed_requests] if max_prompt is None or n <= max_prompt)
    polls = math.ceil(opts.caps.duration_s / METRICS_INTERVAL_S) + 1 if opts.metrics else 0
    fixed = sum(p.prompt_len + p.max_tokens for p in probes) + sum(n + opts.mixed_output for n in mixed)
    per_stream = opts.background_prompt + opts.background_output
    left = opts.caps.tokens - fixed
    if left < opts.concurrency * per_stream:
        raise PlanError(f"--max-tokens-total {opts.caps.tokens}: the probes and the mixed phase ask for {fixed} "
                        f"tokens and {opts.concurrency} background streams for {opts.concurrency * per_stream} "
                        "more; raise it, or use fewer --lengths / --repeats")
    return Plan(opts, max_prompt, probes, dropped, mixed, left // per_stream, polls)


def expected_s(plan: Plan) -> float:
    """The shortest the measurement can take (the probes' own time comes on top): steady phase, gaps between
    probes, the mixed phase's arrivals, the rate cap's spacing."""
    o = plan.options
    spacing = (o.concurrency + len(plan.probes) + len(plan.mixed)) / plan.caps.rate
    return o.steady_s + len(plan.probes) * o.probe_gap_s + len(plan.mixed) / o.mixed_rate + spacing


def render(plan: Plan) -> str:
    """The plan as printed before anything is sent (and by --dry-run)."""
    o, c = plan.options, plan.caps
    lengths = sorted({p.prompt_len for p in plan.probes})
    cap = (f"the server's limit of {plan.max_prompt + o.probe_output} tokens per request" if plan.max_prompt
           else "the server's max_model_len (asked first; --max-model-len where it does not say)")
    lines = [
        f"pdlab diagnose plan for {o.url} (model {o.model}), ITL target {o.itl_ms:g} ms",
        f"  steady:     {o.concurrency} background streams ({o.background_prompt}-token prompts, up to "
        f"{o.background_output} output tokens, renewed when one ends), {o.steady_s:g} s alone first",
        f"  probes:     {len(plan.probes)} prompts, one at a time, {o.probe_gap_s:g} s apart: "
        f"{', '.join(map(str, lengths))} tokens x {o.repeats}, {o.probe_output} output token(s) each; capped by {cap}"
        + (f" (dropped: {', '.join(map(str, plan.dropped))})" if plan.dropped else ""),
    ]
    if plan.mixed:
        lines.append(f"  mixed:      {len(plan.mixed)} prompts of your lengths ({min(plan.mixed)}-{max(plan.mixed)} "
                     f"tokens) at {o.mixed_rate:g}/s (Poisson), {o.mixed_output} output tokens each")
    if plan.metrics_polls:
        lines.append(f"  /metrics:   read every {METRICS_INTERVAL_S:g} s where the server has it (running requests)")
    lines += [
        f"  hard caps:  at most {plan.max_requests} requests ({CHECK_REQUESTS} checks, {plan.metrics_polls} /metrics "
        f"reads, up to {plan.background_max} background), {c.tokens} prompt+output tokens, {c.concurrency} in "
        f"flight, {c.rate:g} completions/s, {c.duration_s:g} s",
        f"  takes:      at least {expected_s(plan):.0f} s plus the probes' own time; Ctrl-C stops at once and keeps "
        "what was measured",
    ]
    return "\n".join(lines)
