"""scape_ds.spawn.run_ranks's deadline: a rank that hangs outside any collective (where gloo's
timeout cannot end it) is killed at the deadline, and the call raises with the rank's stack."""
from __future__ import annotations

import os
import signal
import time

import pytest

from .harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _rank_1_sleeps_forever(rank, world_size, tmp_path):
    with open(os.path.join(tmp_path, f"pid_{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        while True:  # not in a collective: only the deadline ends this
            time.sleep(1)
    return rank


def _finishes(rank, world_size, tmp_path):
    return rank * 10


def test_hanging_rank_is_killed_at_the_deadline_and_the_call_raises_with_its_stack(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as info:
        run_ranks(_rank_1_sleeps_forever, 2, tmp_path, timeout_s=60, deadline_s=8)
    elapsed = time.monotonic() - t0
    # the deadline, plus the 2 s the ranks get to write their stacks, plus the kill: far below gloo's 60 s
    assert 8 <= elapsed < 25, elapsed
    msg = str(info.value)
    # rank 0 finished its worker and waits in run_ranks's closing barrier; rank 1 sleeps in the worker
    assert "ranks [0, 1] still running after the 8 s deadline; killed" in msg, msg
    stacks_1 = msg.split("rank 1, its stacks at the deadline:")[1]
    if (tmp_path / "pid_1").exists():  # rank 1 was in the worker by the deadline (a very busy machine may be slower)
        assert "_rank_1_sleeps_forever" in stacks_1, msg
    assert _spawned_children() == []  # killed and reaped: no rank outlives the call
    for rank in (0, 1):
        if (tmp_path / f"pid_{rank}").exists():
            with pytest.raises(ProcessLookupError):
                os.kill(int((tmp_path / f"pid_{rank}").read_text()), 0)


def _spawned_children() -> list[int]:
    """The live processes this one spawned as ranks (multiprocessing's spawn_main in their command line)."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except (FileNotFoundError, ProcessLookupError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"spawn_main" in cmdline:
            pids.append(int(entry))
    return pids


def test_a_call_interrupted_like_pytests_timeout_kills_its_ranks(tmp_path):
    """pytest-timeout's signal method raises from SIGALRM inside the waiting call: the ranks must die with it."""
    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        if all((tmp_path / f"pid_{rank}").exists() for rank in (0, 1)):  # both ranks in the worker
            raise Interrupted
        signal.setitimer(signal.ITIMER_REAL, 0.5)

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 2)
    try:
        with pytest.raises(Interrupted):
            run_ranks(_rank_1_sleeps_forever, 2, tmp_path, deadline_s=300)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert _spawned_children() == []
    for rank in (0, 1):
        with pytest.raises(ProcessLookupError):
            os.kill(int((tmp_path / f"pid_{rank}").read_text()), 0)


def test_ranks_that_finish_before_the_deadline_return_their_results(tmp_path):
    assert run_ranks(_finishes, 2, tmp_path, deadline_s=60) == [0, 10]
