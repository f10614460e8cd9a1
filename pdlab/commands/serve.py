"""`pdlab serve RECIPE --variant NAME`: one variant's deployment behind an OpenAI-compatible HTTP server
(pdlab.api), recording what it serves into a run directory as `pdlab run` does."""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import replace
from typing import Any, Optional

from pdlab.api.model import load_served_model
from pdlab.commands.run import place_main_process
from pdlab.constants import API_KEY_ENV, SERVE_BACKENDS
from pdlab.engine.model import ModelLoadError
from pdlab.measure.records import RunDir, collect_env, default_run_path
from pdlab.measure.transports import TransportPaths


def _err(msg: str) -> int:
    print(f"pdlab serve: error: {msg}", file=sys.stderr)
    return 2


class _Notes:
    """The live view's part that TransportPaths uses: notes go to stderr."""

    def update_worker(self, *args: Any, **kw: Any) -> None:
        pass

    def note(self, text: str) -> None:
        print(f"pdlab serve: {text}", file=sys.stderr, flush=True)


def scrub_argv(argv: list[str]) -> list[str]:
    """argv without the API key's value (env.json records argv)."""
    out, hide = [], False
    for a in argv:
        if hide:
            out.append("***")
        elif a.startswith("--api-key="):
            out.append("--api-key=***")
        else:
            out.append(a)
        hide = not hide and a == "--api-key"
    return out


def make_cluster(v: Any, rd: Any) -> Any:
    """The variant's deployment, as the harness builds it (pdlab.harness.Harness.cluster)."""
    if v.backend.external:
        # deferred: aiohttp, numpy
        from pdlab.external.cluster import ExternalCluster

        return ExternalCluster(v, v.deployment, label=v.name, log_dir=rd.file("servers"))
    # deferred: torch
    from pdlab.serve.cluster import Cluster

    return Cluster(v.model, v.engine, v.deployment, seed=v.seed)


def main(recipe_path: str, variant: str, host: str, port: int, sets: list[str], out: Optional[str],
         api_key: Optional[str], served_model_name: Optional[str], drain: bool, shutdown_timeout_s: float) -> int:
    try:
        return _main(recipe_path, variant, host, port, sets, out, api_key, served_model_name, drain, shutdown_timeout_s)
    except KeyboardInterrupt:
        print("pdlab serve: interrupted", file=sys.stderr)
        return 130


def _main(recipe_path: str, variant: str, host: str, port: int, sets: list[str], out: Optional[str],
          api_key: Optional[str], served_model_name: Optional[str], drain: bool, shutdown_timeout_s: float) -> int:
    # deferred: aiohttp, numpy, prometheus_client
    from pdlab.api.ledger import Ledger
    from pdlab.api.metrics import ServeMetrics
    from pdlab.api.serving import BindError, ServeOptions, bind, host_warning, serve, url_of
    from pdlab.external import check_variant
    from pdlab.harness import check_model
    from pdlab.recipe import RecipeError, load_recipe
    from pdlab.serve.topology import ClusterError, place

    key = api_key or os.environ.get(API_KEY_ENV) or None
    # Everything that can be wrong with the command line or the recipe is found here, before anything starts.
    try:
        if not 0 <= port <= 65535:
            raise RecipeError(f"--port {port}: expected 0 (any free port) to 65535")
        if not shutdown_timeout_s > 0:
            raise RecipeError(f"--shutdown-timeout {shutdown_timeout_s:g}: expected seconds > 0")
        recipe = load_recipe(recipe_path, sets)
        try:
            v = recipe.resolved(variant)
        except RecipeError as e:
            raise RecipeError(f"--variant: {e}") from None
        recipe = load_recipe(recipe_path, sets, variant)  # recipe.yaml holds the served variant only
        if v.backend.backend not in SERVE_BACKENDS:
            raise RecipeError(f"variants.{variant}.engine.backend: {v.backend.backend} cannot be served by pdlab serve "
                              f"(it serves {', '.join(SERVE_BACKENDS)}); an endpoint is a server already")
        place(v.deployment)
        check_variant(v)
        check_model(v)
        served = load_served_model(v, served_model_name)
    except (RecipeError, ClusterError, ModelLoadError) as e:
        return _err(str(e))
    path = out or default_run_path(f"{recipe.name}-serve-{variant}")
    if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
        return _err(f"--out {path}: exists and is not an empty directory")
    try:
        sock = bind(host, port)
    except BindError as e:
        return _err(str(e))
    warning = host_warning(host, key, API_KEY_ENV)
    warnings = [warning] if warning else []
    for w in warnings:
        print(f"pdlab serve: warning: {w}", file=sys.stderr, flush=True)
    cores, placed = place_main_process(recipe)
    rd = RunDir(path)
    rd.write_recipe(recipe)
    env = collect_env()
    env.update(argv=scrub_argv(list(sys.argv)), main_process_cores=cores, warnings=warnings + placed,
               served={"variant": variant, "url": url_of(sock), "model": served.name, "backend": v.backend.backend,
                       "api_key": key is not None, "drain": drain, "shutdown_timeout_s": shutdown_timeout_s})
    rd.write_env(env)
    print(f"run directory: {path}", flush=True)
    itl_target_s = 0.0 if recipe.slo.relative else recipe.slo.itl_ms / 1000.0
    metrics = ServeMetrics(served.name, itl_target_s)
    ledger = Ledger(rd, v.name, recipe.slo)
    cluster = make_cluster(v, rd)
    # SIGTERM while the workers start ends like Ctrl-C: cluster.start() stops what it started
    old_term = signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        print(f"pdlab serve: starting {variant} ({len(v.deployment.workers)} workers, {v.backend.describe()})",
              file=sys.stderr, flush=True)
        cluster.start()
    except (KeyboardInterrupt, ClusterError) as e:
        sock.close()
        ledger.close()
        if isinstance(e, KeyboardInterrupt):
            raise
        print(f"pdlab serve: error: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, old_term)
    paths = TransportPaths(rd, _Notes())
    paths.start(v.name, v.deployment)
    served = replace(served, kv_tokens=getattr(cluster, "kv_tokens", None))
    opts = ServeOptions(host, port, key, drain, shutdown_timeout_s)
    code = serve(cluster, ledger, metrics, served, paths, sock, opts,
                 f"serving {variant} of {recipe.name} ({served.name}) at {url_of(sock)}")
    print(f"run directory: {path}", flush=True)
    return code
