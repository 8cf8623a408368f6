"""The multi-rank tests' rank launcher, kept here for their ``from .harness import run_ranks``.

It lives in :mod:`scape_ds.spawn` (benchmarks use it too); see there. A hang cannot outlive a test:
gloo's ``timeout_s`` ends one inside a collective, ``run_ranks``'s ``deadline_s`` one anywhere else
(the ranks are killed and the call raises with their stacks), and the test's ``pytest.mark.timeout``
(``pytest.ini``'s 300 s by default, signal method) interrupts the wait, which kills the ranks too.
"""
from __future__ import annotations

from scape_ds.spawn import DEADLINE_S, TIMEOUT_S, free_port, run_ranks

__all__ = ["run_ranks", "free_port", "TIMEOUT_S", "DEADLINE_S"]
