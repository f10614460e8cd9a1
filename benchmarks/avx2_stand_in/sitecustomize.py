"""Run by Python at start-up where this directory is on PYTHONPATH: see avx2_only.py."""

import avx2_only  # noqa: F401
