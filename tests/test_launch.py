"""How pdlab starts its compute processes (pdlab.serve.launch): forked from the fork server, yet with what a
spawned child would have had from its starter at that moment, and ended with its starter."""

import os
import signal
import subprocess
import sys
import time

import pytest

from cli_helpers import ROOT, pdlab
from pdlab.serve import launch
from proc_helpers import name_of, running

TINY = os.path.join(ROOT, "tests", "data", "tiny-recipe.yaml")


def report(path: str, key: str) -> None:
    with open(path, "w") as f:
        f.write(f"{os.environ.get(key)}|{os.getcwd()}|{os.getppid()}|{name_of(os.getpid())}|"
                f"{sorted(os.sched_getaffinity(0))}")
    print("to the starter's stdout", flush=True)


def test_a_forked_process_has_its_starters_environment_directory_and_outputs(tmp_path, monkeypatch, capfd):
    launch.prepare()  # the server exists before what follows changes: the child must still see it
    monkeypatch.setenv("PDLAB_TEST_MARK", "set-after-the-server-started")
    monkeypatch.chdir(tmp_path)
    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})
    try:
        p = launch.start_process(report, (str(tmp_path / "out"), "PDLAB_TEST_MARK"), "pdlab-probe1")
    finally:
        os.sched_setaffinity(0, cores)
    p.join(60)
    assert p.exitcode == 0
    mark, cwd, ppid, name, cores_seen = (tmp_path / "out").read_text().split("|")
    assert mark == "set-after-the-server-started" and cwd == str(tmp_path) and name == "pdlab-probe1"
    assert cores_seen == str([min(cores)])  # the starter's cores when it started the process
    assert int(ppid) != os.getpid()  # a fork of the server, not a child of ours
    assert "to the starter's stdout" in capfd.readouterr().out


def test_spawn_on_request(tmp_path, monkeypatch):
    monkeypatch.setenv("PDLAB_WORKER_START", "spawn")
    p = launch.start_process(report, (str(tmp_path / "out"), "PDLAB_WORKER_START"), "pdlab-probe2")
    p.join(120)
    assert p.exitcode == 0
    assert (tmp_path / "out").read_text().split("|")[2] == str(os.getpid())  # our own child
    monkeypatch.setenv("PDLAB_WORKER_START", "fork")
    with pytest.raises(ValueError, match="PDLAB_WORKER_START"):
        launch.start_process(report, (str(tmp_path / "x"), "X"), "pdlab-probe3")
    r = pdlab("run", TINY, "--out", str(tmp_path / "run"))  # said before anything starts
    assert r.returncode == 2 and r.stderr.strip() == \
        "pdlab run: error: $PDLAB_WORKER_START: 'fork' is not one of fork-server, spawn"
    assert not (tmp_path / "run").exists()


STARTER = """
import sys, time
from pdlab.serve.launch import start_process
def sleep():
    time.sleep(300)
if __name__ == "__main__":
    p = start_process(sleep, (), "pdlab-sleeper")
    print(p.pid, flush=True)
    time.sleep(300)
"""


@pytest.mark.slow
def test_a_forked_process_ends_when_its_starter_is_killed(tmp_path):
    """PR_SET_PDEATHSIG would tie it to the fork server: a lifeline pipe ties it to pdlab itself."""
    script = tmp_path / "starter.py"
    script.write_text(STARTER)
    starter = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(starter.stdout.readline())
        deadline = time.monotonic() + 60  # deadlines against a hang, not speed bounds
        while name_of(child) != "pdlab-sleeper" and time.monotonic() < deadline:  # named once it runs
            time.sleep(0.05)
        assert name_of(child) == "pdlab-sleeper"
        starter.send_signal(signal.SIGKILL)
        starter.wait(30)
        deadline = time.monotonic() + 60
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not running(child), "the child outlived its starter"
    finally:
        if starter.poll() is None:
            starter.kill()
