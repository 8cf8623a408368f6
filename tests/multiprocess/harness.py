"""The multi-rank tests' rank launcher, kept here for their ``from .harness import run_ranks``.

It lives in :mod:`scape_ds.spawn` (benchmarks use it too); see there.
"""
from __future__ import annotations

from scape_ds.spawn import TIMEOUT_S, free_port, run_ranks

__all__ = ["run_ranks", "free_port", "TIMEOUT_S"]
