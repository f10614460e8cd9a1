"""`pdlab ARGS` in the test process: typer's runner, the command's own code, no interpreter to start.

Why: a `pdlab run` in a subprocess spent ~10 s of a core before its first request (importing torch and
transformers, then its fork server importing them again), and the suite runs dozens. In this process the
imports are done and the workers fork from the session's fork server. What needs a process of its own stays
a subprocess: signals (Ctrl-C, SIGTERM), killing pdlab, its exit and what it leaves behind."""

import _thread
import contextlib
import faulthandler
import multiprocessing
import os
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def _within(cwd: str, env: dict | None):
    """In `cwd`, with `env` added; then back as we were: directory, environment, and the cores `pdlab run`
    moves its main process to (off the workers')."""
    old_cwd, old_env, old_cores = os.getcwd(), dict(os.environ), os.sched_getaffinity(0)
    os.chdir(cwd)
    os.environ.update(env or {})
    try:
        yield
    finally:
        os.chdir(old_cwd)
        os.environ.clear()
        os.environ.update(old_env)
        os.sched_setaffinity(0, old_cores)


DEADLINE_S = 900.0  # against a hang, not a speed bound


def _hung(args: tuple, deadline: float) -> None:
    """The command outran its deadline: every thread's stack to stderr, then Ctrl-C, which a command turns into
    a clean, partial end (and the test fails on the exit code) instead of a suite that never ends."""
    print(f"cli_helpers: pdlab {' '.join(map(str, args))} outran {deadline:g}s; stacks:", file=sys.__stderr__)
    faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
    _thread.interrupt_main()


def pdlab(*args: str, cwd: str = ROOT, env: dict | None = None, timeout: float | None = None) -> \
        subprocess.CompletedProcess:
    """Run `pdlab ARGS`; returns what subprocess.run(capture_output=True, text=True) would. An exception the
    command did not turn into an exit code fails the test (it would be a traceback for a user); so does a
    process it left running. A command still running after `timeout` (DEADLINE_S by default) is interrupted
    as Ctrl-C would, after its stacks are printed."""
    from typer.testing import CliRunner

    from pdlab.cli import app

    children = multiprocessing.active_children()
    watchdog = threading.Timer(timeout or DEADLINE_S, _hung, (args, timeout or DEADLINE_S))
    watchdog.daemon = True
    with _within(str(cwd), env):
        watchdog.start()
        try:
            r = CliRunner().invoke(app, [str(a) for a in args])
        finally:
            watchdog.cancel()
    assert r.exception is None or isinstance(r.exception, SystemExit), repr(r.exception)
    assert multiprocessing.active_children() == children, "a process was left running"
    return subprocess.CompletedProcess(["pdlab", *args], r.exit_code, r.stdout, r.stderr)
