"""scape_ds.stop without a process group: requests, their agreement on one rank, the launcher lookup."""
from __future__ import annotations

import os
import signal
import sys

import pytest

from scape_ds.stop import STOP_EXIT_CODE, Stopped, StopRequest, launcher_processes, set_parent_death_signal


def test_no_request_no_stop_and_the_highest_request_wins():
    stop = StopRequest()
    assert stop.agreed() is None
    stop._on_signal(signal.SIGINT, None)
    assert stop.agreed() == "SIGINT"
    stop._on_signal(signal.SIGTERM, None)
    stop._on_signal(signal.SIGINT, None)
    assert stop.agreed() == "SIGTERM"
    stop.request(3)
    assert stop.agreed() == "the launcher ended"
    assert STOP_EXIT_CODE == 143 and Stopped(4, "SIGTERM", None).step == 4


def test_a_plain_run_watches_no_launcher(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert launcher_processes() == []


def test_under_a_launcher_the_parent_is_watched(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert [p.pid for p in launcher_processes()] == [os.getppid()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
def test_parent_death_signal_is_set():
    import ctypes

    assert set_parent_death_signal(signal.SIGTERM)
    got = ctypes.c_int(-1)
    assert ctypes.CDLL(None).prctl(2, ctypes.byref(got), 0, 0, 0) == 0  # PR_GET_PDEATHSIG
    assert got.value == signal.SIGTERM
    assert set_parent_death_signal(0)  # back to none, for the rest of this test process
