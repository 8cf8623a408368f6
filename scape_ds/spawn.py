"""Start ranks for tests and benchmarks: in-process gloo ranks, and free ports for launched ones.

``run_ranks(worker, world_size, tmp_path, *args)`` starts ``world_size`` processes running
``worker(rank, world_size, tmp_path, *args)`` inside an initialized gloo group (FileStore in
tmp_path, ``timeout_s`` collective timeout, 60 s by default); each returns a picklable result,
collected in rank order. A failing rank fails the call with its traceback. A rank that hangs in a
collective is ended by the collective timeout; one that hangs anywhere else (a loop, a lock, a
sleep) is ended by ``deadline_s``, the wall-clock bound of the whole call (``DEADLINE_S`` by
default): the ranks still running are asked for their Python stacks (``faulthandler`` on
``SIGUSR1``), killed, and the call raises ``TimeoutError`` with those stacks. The FileStore needs no
port; a launcher that does gets one from :func:`free_port` (never a fixed number, which a second run
on the same machine would collide with).
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import signal
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "free_port", "TIMEOUT_S", "DEADLINE_S"]

TIMEOUT_S = 60
"""Default collective timeout of :func:`run_ranks`'s gloo group, in seconds."""

DEADLINE_S = 3600
"""Default wall-clock bound of one :func:`run_ranks` call, in seconds (tests set tighter ones with
``pytest.mark.timeout``, which ends the call the same way: the ranks are killed on the way out)."""

_STACK_WAIT_S = 2.0  # how long the ranks get to write their stacks before they are killed
_stack_file = None  # this rank's stack file, open for faulthandler for the life of the rank


def free_port() -> int:
    """A TCP port that no socket on this machine holds now (the OS picks it; free on every interface)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _stacks_path(tmp_path, rank) -> str:
    return os.path.join(tmp_path, f"stacks_{rank}.txt")


def _entry(rank, world_size, tmp_path, worker, args, timeout_s):
    global _stack_file
    faulthandler.enable()  # a native crash (SIGABRT, SIGSEGV) prints the Python stack of every thread
    _stack_file = open(_stacks_path(tmp_path, rank), "w")  # noqa: SIM115 (open as long as the rank runs)
    faulthandler.register(signal.SIGUSR1, file=_stack_file, all_threads=True)  # run_ranks's deadline asks
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    out = os.path.join(tmp_path, f"result_{rank}.pkl")
    try:
        store = dist.FileStore(os.path.join(tmp_path, "store"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        result = worker(rank, world_size, tmp_path, *args)
        dist.barrier()  # every rank is past its last collective ...
        with open(out, "wb") as f:
            pickle.dump(("ok", result), f)
        store.add("finished", 1)  # ... and out of the barrier, before any socket closes
        deadline = time.monotonic() + timeout_s
        while store.add("finished", 0) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError("peers did not finish")
            time.sleep(0.01)
    except BaseException:
        with open(out, "wb") as f:
            pickle.dump(("error", traceback.format_exc()), f)
        raise
    # The work is done and reported: exit without tearing gloo down. Its teardown (process-group
    # destruction, interpreter finalization) has aborted a finished rank ("terminate called
    # without an active exception") about once in 25 runs of a 2-rank test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _end(ctx) -> list[int]:
    """Kill the ranks of ``ctx`` still running and reap them; returns the ranks that were killed."""
    alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
    for r in alive:
        ctx.processes[r].kill()
    for p in ctx.processes:
        p.join(timeout=30)
    return alive


def _hung(ctx, tmp_path: str, deadline_s: float) -> TimeoutError:
    """Ask the ranks still running for their stacks, kill them, and describe them."""
    alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
    for r in alive:
        try:
            os.kill(ctx.processes[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(_STACK_WAIT_S)
    _end(ctx)
    parts = []
    for r in alive:
        path = _stacks_path(tmp_path, r)
        stacks = open(path).read().strip() if os.path.exists(path) else ""
        parts.append(f"rank {r}, its stacks at the deadline:\n{stacks or '(none written)'}")
    return TimeoutError(f"run_ranks: ranks {alive} still running after the {deadline_s:g} s deadline; killed\n"
                        + "\n".join(parts))


def run_ranks(worker, world_size: int, tmp_path, *args, timeout_s: float = TIMEOUT_S,
              deadline_s: float = DEADLINE_S) -> list:
    """Run ``worker(rank, world_size, tmp_path, *args)`` on ``world_size`` gloo ranks.

    ``worker`` must be a module-level function (the ranks are spawned, so it is pickled by name).
    ``timeout_s`` bounds each collective (gloo's timeout); ``deadline_s`` bounds the whole call.

    Returns:
        The per-rank results, in rank order.

    Raises:
        AssertionError: a rank failed; the message holds every failing rank's traceback.
        TimeoutError: ranks still ran at ``deadline_s``; they were killed, and the message holds
            the Python stacks of each at the deadline.
    """
    tmp_path = str(tmp_path)
    os.makedirs(tmp_path, exist_ok=True)
    deadline = time.monotonic() + deadline_s
    ctx = mp.start_processes(_entry, args=(world_size, tmp_path, worker, args, timeout_s), nprocs=world_size,
                             join=False, start_method="spawn")
    try:
        while not ctx.join(timeout=max(0.0, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise _hung(ctx, tmp_path, deadline_s)
    except mp.ProcessRaisedException as e:
        errors = []
        for r in range(world_size):
            path = os.path.join(tmp_path, f"result_{r}.pkl")
            if os.path.exists(path):
                with open(path, "rb") as f:
                    status, payload = pickle.load(f)
                if status == "error":
                    errors.append(f"rank {r}:\n{payload}")
        raise AssertionError("a rank failed:\n" + ("\n".join(errors) or str(e))) from None
    finally:  # whatever ended the wait (a failure, the deadline, pytest's timeout, Ctrl-C): no rank outlives it
        _end(ctx)
    results = []
    for r in range(world_size):
        with open(os.path.join(tmp_path, f"result_{r}.pkl"), "rb") as f:
            status, payload = pickle.load(f)
        assert status == "ok", payload
        results.append(payload)
    return results
