"""The `pdlab` command line. Commands only: every heavy import lives inside its command module,
so `pdlab --help` stays fast."""

from __future__ import annotations

from typing import List, Optional

import typer

app = typer.Typer(
    help="pdlab: should we disaggregate prefill and decode? Measure it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.command()
def run(
    recipe: str = typer.Argument(..., help="Recipe YAML file"),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a key: engine.chunked_prefill=true"),
    out: Optional[str] = typer.Option(None, "--out", help="Run directory (default runs/<recipe>-<time>)"),
    variants: Optional[str] = typer.Option(None, "--variants", help="Comma-separated variants to run"),
) -> None:
    """Run every variant of a recipe at every rate; prints the run directory."""
    from pdlab.commands.run import main

    raise typer.Exit(main(recipe, set_ or [], out, variants))


@app.command()
def compare(
    runs: List[str] = typer.Argument(..., help="Run directories"),
    baseline: Optional[str] = typer.Option(None, "--baseline", help="Baseline variant for relative goodput"),
    json_: bool = typer.Option(False, "--json", help="Machine-readable output"),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write comparison plots to this directory"),
) -> None:
    """Side-by-side table of runs: SLO-met requests, goodput, throughput, TTFT/ITL, misses."""
    from pdlab.commands.compare import main

    raise typer.Exit(main(runs, baseline, json_, plot))


@app.command()
def doctor(
    json_: bool = typer.Option(False, "--json", help="Machine-readable output"),
    probe_mb: float = typer.Option(0.0, "--probe-mb", help="Bytes per probe hand-over (default: a 2k-token cpu-demo KV)"),
) -> None:
    """Devices, memory, GPU peer topology and a measured probe per KV transport."""
    from pdlab.commands.doctor import main

    raise typer.Exit(main(json_, probe_mb))


@app.command()
def generate(
    model: str = typer.Option("cpu-demo", "--model", help="Preset name or local model directory"),
    prompts: int = typer.Option(8, "--prompts", help="Number of random prompts"),
    prompt_len: int = typer.Option(256, "--prompt-len", help="Tokens per prompt"),
    max_tokens: int = typer.Option(32, "--max-tokens", help="New tokens per prompt"),
    device: str = typer.Option("cpu", "--device"),
    seed: int = typer.Option(0, "--seed"),
) -> None:
    """Offline generation with the engine (no workers): a quick check that a model loads and runs."""
    from pdlab.commands.generate import main

    raise typer.Exit(main(model, prompts, prompt_len, max_tokens, device, seed))


if __name__ == "__main__":
    app()
