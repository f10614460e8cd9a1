"""The `pdlab` command line. Commands only: every heavy import lives inside its command module,
so `pdlab --help` stays fast."""

from __future__ import annotations

from typing import Any, List, Optional

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption

from pdlab.constants import API_KEY_ENV, JOIN_TIMEOUT_S, SERVE_HOST, SERVE_PORT, SERVE_SHUTDOWN_TIMEOUT_S


def _clean_types(params: list) -> list:
    """Help that reads cleanly: an option that takes a value shows its metavar (RECIPE, DIR, R, LIST), a flag
    and an argument show nothing; Typer's type tags (<str>, <bool>, <float>, <list[str]>) are left out."""
    for p in params:
        if "display_type_rich" not in vars(p):  # once per parameter (the help option is created lazily)
            valued = isinstance(p, TyperOption) and not p.is_flag and p.metavar
            p.display_type_rich = (lambda ctx, m=(p.metavar if valued else None): m)
    return params


class _Command(TyperCommand):
    """A command with clean help (_clean_types); the usage line names arguments by their metavar, without
    Typer's braces: `pdlab compare [OPTIONS] RUN...`."""

    def get_params(self, ctx: Any) -> list:
        return _clean_types(super().get_params(ctx))

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):
            if not isinstance(p, TyperOption):
                name = p.metavar or (p.name or "").upper()
                pieces.append(f"{name}..." if p.nargs != 1 else name)
        return pieces


class _Group(TyperGroup):
    def get_params(self, ctx: Any) -> list:
        return _clean_types(super().get_params(ctx))


app = typer.Typer(
    cls=_Group,
    help="pdlab: should we disaggregate prefill and decode? Measure it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command(cls=_Command)
def run(
    recipe: str = typer.Argument(..., metavar="RECIPE", help="Recipe YAML file"),
    set_: Optional[List[str]] = typer.Option(None, "--set", metavar="KEY=VALUE",
                                             help="Override a recipe key, e.g. engine.chunked_prefill=true "
                                                  "(repeatable)"),
    out: Optional[str] = typer.Option(None, "--out", metavar="DIR", help="Run directory (default: "
                                                                          "runs/<recipe>-<time>)"),
    variants: Optional[str] = typer.Option(None, "--variants", metavar="A,B", help="Run only these variants "
                                                                                   "(comma-separated)"),
    simulate: Optional[bool] = typer.Option(None, "--simulate/--no-simulate",
                                            help="Run in virtual time (pdlab's simulator) instead of on worker "
                                                 "processes; every variant needs model.timing (default: the "
                                                 "recipe's simulate key)"),
) -> None:
    """Run every variant of a recipe at every rate; prints the run directory."""
    from pdlab.commands.run import main

    raise typer.Exit(main(recipe, set_ or [], out, variants, simulate))


@app.command(cls=_Command)
def compare(
    runs: List[str] = typer.Argument(..., metavar="RUN", help="Run directories (runs/<recipe>-<time>)"),
    baseline: Optional[str] = typer.Option(None, "--baseline", metavar="VARIANT",
                                           help="Judge every row against this one (default: each engine's first "
                                                "unified variant: like with like)"),
    rate: Optional[float] = typer.Option(None, "--rate", metavar="R",
                                         help="Report latencies at R req/s (grid runs; default: the highest rate "
                                              "at which every variant's median TTFT meets the target)"),
    slo_scale: Optional[str] = typer.Option(None, "--slo-scale", metavar="LIST",
                                            help="Also re-score goodput with the TTFT and ITL targets times each "
                                                 "scale, e.g. 0.5,1,2 (from the records, no re-run)"),
    json_: bool = typer.Option(False, "--json", help="Machine-readable output (JSON on stdout)"),
    plot: Optional[str] = typer.Option(None, "--plot", metavar="DIR", help="Write comparison plots to DIR"),
) -> None:
    """Side-by-side table of runs: goodput, SLO-met requests, throughput, TTFT/ITL, misses, verdicts. Exit 3 when
    a run was cut short or failed (the table is printed, headed PARTIAL with the reason)."""
    from pdlab.commands.compare import main

    raise typer.Exit(main(runs, baseline, json_, plot, rate, slo_scale))


@app.command(cls=_Command)
def doctor(
    json_: bool = typer.Option(False, "--json", help="Machine-readable output (JSON on stdout)"),
    probe_mb: float = typer.Option(0.0, "--probe-mb", metavar="MB", show_default=False,
                                   help="Size of each probe hand-over in megabytes (10^6 bytes) of float32 KV, "
                                        "rounded down to whole KV blocks; the GPU probes copy the same blocks in "
                                        "bfloat16, half the bytes (default: a 2048-token cpu-demo prompt's KV, "
                                        "4.2 MB)"),
    peer: Optional[str] = typer.Option(None, "--peer", metavar="tcp://HOST:PORT",
                                       help="Instead: listen there as a run's router would, wait for a node's "
                                            "`pdlab worker --join`, and measure NIXL to it (pull and push at a few "
                                            "sizes, latency, the path UCX took)"),
    keys: Optional[str] = typer.Option(None, "--keys", metavar="DIR", help="--peer: the cluster's keys (pdlab keys "
                                                                           "init)"),
    insecure: bool = typer.Option(False, "--insecure", help="--peer: plain TCP, no keys"),
    ucx_tls: str = typer.Option("auto", "--ucx-tls", metavar="LIST", help="--peer: UCX_TLS on this side, as "
                                                                         "nixl.ucx_tls"),
    wait: float = typer.Option(JOIN_TIMEOUT_S, "--wait", metavar="S", help="--peer: seconds to wait for the node"),
) -> None:
    """Devices, memory, GPU peer topology and a measured probe per KV transport; or NIXL to another node."""
    from pdlab.commands.doctor import main

    raise typer.Exit(main(json_, probe_mb, peer, keys, insecure, ucx_tls, wait))


@app.command(cls=_Command)
def worker(
    join: str = typer.Option(..., "--join", metavar="tcp://HOST:PORT", help="The run's control address (the "
                                                                             "recipe's control.address)"),
    devices: List[str] = typer.Option(..., "--devices", metavar="DEVICES", help="The devices this node lends, e.g. "
                                                                                 "cpu:2-3 or cuda:0-7"),
    name: Optional[str] = typer.Option(None, "--name", metavar="NAME", help="This node's name in recipes (b: "
                                                                           "devices b:cpu:2; default: the host "
                                                                           "name)"),
    keys: Optional[str] = typer.Option(None, "--keys", metavar="DIR", help="The cluster's keys (pdlab keys init "
                                                                           "DIR, copied here)"),
    insecure: bool = typer.Option(False, "--insecure", help="Plain TCP, no keys (a recipe with control: "
                                                             "{insecure: true})"),
    once: bool = typer.Option(False, "--once", help="Exit after one run's workers here ended (default: wait for "
                                                    "the next)"),
) -> None:
    """Offer this machine's devices to runs: start the workers a run places on this node, stop them when it
    ends or its router goes away."""
    from pdlab.commands.worker import main

    raise typer.Exit(main(join, devices, name, keys, insecure, once))


keys_app = typer.Typer(cls=_Group, help="A cluster's CurveZMQ keys, for a control plane on TCP.", no_args_is_help=True)
app.add_typer(keys_app, name="keys")


@keys_app.command("init", cls=_Command)
def keys_init(
    directory: str = typer.Argument(..., metavar="DIR", help="A new (or empty) directory for the keys"),
) -> None:
    """Write a new cluster's keys to DIR, readable by you only; copy DIR to every node."""
    from pdlab.commands.keys import init_main

    raise typer.Exit(init_main(directory))


@app.command(cls=_Command)
def generate(
    model: str = typer.Option("cpu-demo", "--model", metavar="NAME|DIR", help="Preset name or local model directory"),
    prompts: int = typer.Option(8, "--prompts", metavar="N", help="Number of random prompts"),
    prompt_len: int = typer.Option(256, "--prompt-len", metavar="N", help="Tokens per prompt"),
    max_tokens: int = typer.Option(32, "--max-tokens", metavar="N", help="New tokens per prompt"),
    device: str = typer.Option("cpu", "--device", metavar="DEVICE", help="cpu or cuda:N"),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Seed of the random prompts"),
) -> None:
    """Offline generation with the engine (no workers): a quick check that a model loads and runs."""
    from pdlab.commands.generate import main

    raise typer.Exit(main(model, prompts, prompt_len, max_tokens, device, seed))


@app.command(cls=_Command)
def profile(
    model: str = typer.Option("cpu-demo", "--model", metavar="NAME|DIR", help="Preset name or local model directory"),
    device: str = typer.Option("cpu", "--device", metavar="DEVICE", help="cpu or cuda:N"),
    dtype: Optional[str] = typer.Option(None, "--dtype", metavar="DTYPE",
                                        help="float32, bfloat16, float16 (default: float32 on cpu, bfloat16 on "
                                             "cuda)"),
    out: Optional[str] = typer.Option(None, "--out", metavar="FILE",
                                      help="Profile YAML to write (default: profiles/<model>-<device>.yaml)"),
    steps: int = typer.Option(400, "--steps", metavar="N",
                              help="Engine steps to measure, about (cpu-demo on one core: about a minute)"),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Seed of the designed steps, prompts and split"),
    threads: Optional[int] = typer.Option(None, "--threads", metavar="N",
                                          help="torch threads (default: 1 on cpu, as a worker on one core)"),
    cores: Optional[str] = typer.Option(None, "--cores", metavar="LIST",
                                        help="Cores to pin the measurement to, as a worker on them (default: the "
                                             "last one)"),
    no_host: bool = typer.Option(False, "--no-host", help="Skip the host-time probe (a small real deployment)"),
    check: Optional[str] = typer.Option(None, "--check", metavar="RUN_DIR",
                                        help="Measure nothing: hold a profile against this run's own steps"),
    profile_: Optional[str] = typer.Option(None, "--profile", metavar="NAME|FILE",
                                           help="With --check: the profile to check (default: the one the run's "
                                                "recipe names)"),
    write_host: bool = typer.Option(False, "--write-host",
                                    help="With --check and --profile FILE: write the run's host time and "
                                         "contention into it"),
    write_drift: bool = typer.Option(False, "--write-drift",
                                     help="With --check and --profile FILE: add the run's pace against the profile "
                                          "(each worker's, rate by rate) to its drift, which gives a simulation a "
                                          "band (run --simulate)"),
    replay: bool = typer.Option(False, "--replay",
                                help="With --check: also simulate the run with the profile at the run's own pace "
                                     "(its steps' measured / predicted time) and set its TTFT, ITL, attainment "
                                     "and saturation beside the run's"),
) -> None:
    """Measure this device's engine steps, KV transfers and host time as a worker runs them; fit and write a
    timing profile (model.timing). --check RUN_DIR: how well a profile predicts a run's steps."""
    from pdlab.commands.profile import check as check_run, main

    if check is not None:
        raise typer.Exit(check_run(check, profile_, write_host, replay, write_drift))
    given = tuple(f for f, on in (("--profile", profile_ is not None), ("--write-host", write_host),
                                  ("--write-drift", write_drift)) if on)
    raise typer.Exit(main(model, device, dtype, out, steps, seed, threads, cores=cores, host=not no_host,
                          replay=replay, check_only=given))


@app.command(cls=_Command)
def plan(
    recipe: str = typer.Argument(..., metavar="RECIPE", help="Recipe YAML file (its first variant's model, "
                                                             "timing, engine, workload and SLO)"),
    devices: int = typer.Option(4, "--devices", metavar="N", help="Device budget: one device per worker"),
    modes: str = typer.Option("push", "--modes", metavar="LIST", help="Hand-over modes to try: pull, push or "
                                                                       "pull,push"),
    validate: int = typer.Option(2, "--validate", metavar="K", help="Run the best K for real (worker processes, "
                                                                    "the same timing) and compare; 0: none"),
    set_: Optional[List[str]] = typer.Option(None, "--set", metavar="KEY=VALUE", help="Override a recipe key"),
    out: Optional[str] = typer.Option(None, "--out", metavar="DIR", help="Directory for plan.json (the whole "
                                                                         "ranking), planned.yaml and the validation "
                                                                         "run, DIR/run (default: "
                                                                         "runs/<recipe>-plan-<time>)"),
    json_: bool = typer.Option(False, "--json", help="Machine-readable output (JSON on stdout)"),
) -> None:
    """Rank deployments for a device budget by simulated goodput; validate the best by real runs."""
    from pdlab.commands.plan import main

    raise typer.Exit(main(recipe, set_ or [], devices, modes, validate, out, json_))


trace_app = typer.Typer(cls=_Group, help="Production traces (Mooncake, Azure, BurstGPT, jsonl) that a workload "
                                         "replays (workload.trace).", no_args_is_help=True)
app.add_typer(trace_app, name="trace")


@trace_app.command("stats", cls=_Command)
def trace_stats(
    path: str = typer.Argument(..., metavar="FILE", help="Trace file"),
    format_: Optional[str] = typer.Option(None, "--format", metavar="F", help="mooncake, azure, burstgpt or jsonl "
                                                                              "(default: from the file's first line)"),
    bin_s: Optional[float] = typer.Option(None, "--bin-s", metavar="S", help="Seconds per bin of the rate over "
                                                                             "time (default: at most 60 bins, of "
                                                                             "10 arrivals at the mean rate or more)"),
    plot: Optional[str] = typer.Option(None, "--plot", metavar="PNG", help="Plot file (default: "
                                                                           "runs/traces/<file>-stats.png)"),
    no_plot: bool = typer.Option(False, "--no-plot", help="Table only"),
    json_: bool = typer.Option(False, "--json", help="Machine-readable output (JSON on stdout)"),
) -> None:
    """What a trace holds: requests and drops, rate over time, length percentiles, burstiness, prefix reuse."""
    from pdlab.commands.trace import stats_main

    raise typer.Exit(stats_main(path, format_, bin_s, plot, no_plot, json_))


@app.command(cls=_Command)
def serve(
    recipe: str = typer.Argument(..., metavar="RECIPE", help="Recipe YAML file"),
    variant: str = typer.Option(..., "--variant", metavar="NAME", help="The variant whose deployment to serve"),
    host: str = typer.Option(SERVE_HOST, "--host", metavar="HOST", help="Address to listen on (not loopback: a "
                                                                         "warning; give an API key)"),
    port: int = typer.Option(SERVE_PORT, "--port", metavar="PORT", help="Port to listen on (0: any free port)"),
    set_: Optional[List[str]] = typer.Option(None, "--set", metavar="KEY=VALUE", help="Override a recipe key "
                                                                                      "(repeatable)"),
    out: Optional[str] = typer.Option(None, "--out", metavar="DIR", help="Run directory (default: "
                                                                         "runs/<recipe>-serve-<variant>-<time>)"),
    api_key: Optional[str] = typer.Option(None, "--api-key", metavar="KEY",
                                          help=f"Every route but /health needs `Authorization: Bearer KEY` "
                                               f"(default: ${API_KEY_ENV}; neither: no key)"),
    served_model_name: Optional[str] = typer.Option(None, "--served-model-name", metavar="NAME",
                                                    help="The model's name in the API (default: the recipe's "
                                                         "preset or path)"),
    drain: bool = typer.Option(True, "--drain/--no-drain", help="On SIGTERM or Ctrl-C, let the requests in flight "
                                                                "finish (default) or cancel them"),
    shutdown_timeout: float = typer.Option(SERVE_SHUTDOWN_TIMEOUT_S, "--shutdown-timeout", metavar="S",
                                           help="Draining: cancel what still runs after S seconds"),
) -> None:
    """Serve one variant's deployment as an OpenAI-compatible API; records what it serves in a run directory."""
    from pdlab.commands.serve import main

    raise typer.Exit(main(recipe, variant, host, port, set_ or [], out, api_key, served_model_name, drain,
                          shutdown_timeout))


@app.command(cls=_Command)
def report(
    runs: List[str] = typer.Argument(..., metavar="RUN", help="Run directories (runs/<recipe>-<time>)"),
    html: str = typer.Option(..., "--html", metavar="FILE", help="The HTML file to write: one self-contained page"),
    baseline: Optional[str] = typer.Option(None, "--baseline", metavar="VARIANT",
                                           help="Judge every row against this one (default: each engine's first "
                                                "unified variant)"),
    rate: Optional[float] = typer.Option(None, "--rate", metavar="R", help="Latencies at R req/s (grid runs)"),
) -> None:
    """One HTML file of runs to attach to a ticket: tables, verdict, plots, environment, warnings, recipe.
    Exit 3 when a run was cut short (written anyway, with the reason)."""
    from pdlab.commands.report import main

    raise typer.Exit(main(runs, html, baseline, rate))


# the defaults' one home (light: dataclasses only, no heavy import)
from pdlab.diagnose.plan import Caps as _Caps, Options as _Options  # noqa: E402

_DIAG, _DIAG_CAPS = _Options("", ""), _Caps()


@app.command(cls=_Command)
def diagnose(
    target: str = typer.Argument(..., metavar="URL|RUN_DIR",
                                 help="A running OpenAI-compatible server's API base (http://HOST:PORT/v1), or a "
                                      "pdlab run directory to analyse offline"),
    model: Optional[str] = typer.Option(None, "--model", metavar="NAME", help="The served model (URL: required)"),
    itl_ms: Optional[float] = typer.Option(None, "--itl-ms", metavar="MS",
                                           help=f"ITL target: a gap longer is a miss (default {_DIAG.itl_ms:g}; "
                                                "RUN_DIR: the run's own absolute target where it had one)"),
    concurrency: int = typer.Option(_DIAG.concurrency, "--concurrency", metavar="N",
                                    help="Background streams (short prompts, long outputs)"),
    lengths: str = typer.Option(",".join(map(str, _DIAG.lengths)), "--lengths", metavar="LIST",
                                help="Probe prompt lengths in tokens, capped by the model's length"),
    repeats: int = typer.Option(_DIAG.repeats, "--repeats", metavar="N", help="Probes per length"),
    max_model_len: Optional[int] = typer.Option(None, "--max-model-len", metavar="N",
                                                help="Tokens per request the server takes, where its /v1/models "
                                                     "does not say"),
    lengths_from: Optional[str] = typer.Option(None, "--lengths-from", metavar="FILE",
                                               help="Also replay your prompt-length mix: one length per line, or a "
                                                    "pdlab requests.jsonl"),
    mixed_rate: float = typer.Option(_DIAG.mixed_rate, "--mixed-rate", metavar="R", help="Mixed phase: sends/s"),
    mixed_requests: int = typer.Option(_DIAG.mixed_requests, "--mixed-requests", metavar="N",
                                       help="Mixed phase: at most N of the file's lengths"),
    steady_s: float = typer.Option(_DIAG.steady_s, "--steady-s", metavar="S",
                                   help="Background streams alone before the first probe"),
    probe_gap_s: float = typer.Option(_DIAG.probe_gap_s, "--probe-gap-s", metavar="S",
                                      help="Background alone between two probes"),
    max_concurrency: int = typer.Option(_DIAG_CAPS.concurrency, "--max-concurrency", metavar="N",
                                        help="Hard cap: requests in flight"),
    max_rate: float = typer.Option(_DIAG_CAPS.rate, "--max-rate", metavar="R", help="Hard cap: sends per second"),
    max_tokens_total: int = typer.Option(_DIAG_CAPS.tokens, "--max-tokens-total", metavar="N",
                                         help="Hard cap: prompt + max output tokens of all requests"),
    max_duration: float = typer.Option(_DIAG_CAPS.duration_s, "--max-duration", metavar="S",
                                       help="Hard cap: seconds from the first send"),
    api_key_env: Optional[str] = typer.Option(None, "--api-key-env", metavar="VAR",
                                              help="Environment variable holding the API key (never written)"),
    metrics: bool = typer.Option(_DIAG.metrics, "--metrics/--no-metrics",
                                 help="Read the server's /metrics (running requests) once a second"),
    seed: int = typer.Option(_DIAG.seed, "--seed", metavar="N",
                             help="Seed of the mixed phase's order and arrivals (prompts are new on every run)"),
    out: Optional[str] = typer.Option(None, "--out", metavar="DIR",
                                      help="Output directory (default: runs/diagnose-<time>; RUN_DIR/diagnose)"),
    html: Optional[str] = typer.Option(None, "--html", metavar="FILE", help="Also write a self-contained HTML page"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and send nothing"),
    json_: bool = typer.Option(False, "--json", help="The summary as JSON on stdout"),
    steps_from: Optional[str] = typer.Option(None, "--steps-from", metavar="DIR",
                                             help="Hold the tags against this pdlab serve run's steps.jsonl (same "
                                                  "machine)"),
) -> None:
    """Is prefill interference what breaks a service's ITL? Background streams, isolated probes of growing prompt
    length, every gap tagged steady or stall, a fit and a plain-words verdict, within a printed plan's hard caps."""
    from pdlab.commands.diagnose import main

    raise typer.Exit(main(target, model=model, itl_ms=itl_ms, concurrency=concurrency, lengths=lengths,
                          repeats=repeats, max_model_len=max_model_len, lengths_from=lengths_from,
                          mixed_rate=mixed_rate, mixed_requests=mixed_requests, steady_s=steady_s,
                          probe_gap_s=probe_gap_s, max_concurrency=max_concurrency, max_rate=max_rate,
                          max_tokens_total=max_tokens_total, max_duration=max_duration, api_key_env=api_key_env,
                          metrics=metrics, seed=seed, out=out, html=html, dry_run=dry_run, json_=json_,
                          steps_from=steps_from))


if __name__ == "__main__":
    app()
