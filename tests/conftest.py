import collections
import os
import signal

import pytest

# Tests never reach a model hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# A shell without job control starts a background command with SIGINT ignored, and every process the suite
# starts would inherit that: the Ctrl-C tests' pdlab would never see their Ctrl-C. Take Python's own handler,
# which a child resets to the default at exec.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    # The suite runs in two processes (pytest-xdist, `--dist loadfile` in pyproject: a module's tests stay in one
    # process, so a module-scoped fixture, such as a run several tests read, runs once). A module is handed to
    # whichever process is free, so the modules with the most end-to-end tests go first and the quick ones fill
    # in at the end, rather than one process finishing a long module alone.
    slow = collections.Counter(item.module.__name__ for item in items if item.get_closest_marker("slow"))
    items.sort(key=lambda item: -slow[item.module.__name__])  # stable: the order within a module is kept
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
