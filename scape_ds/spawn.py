"""Start ranks for tests and benchmarks: in-process gloo ranks, and free ports for launched ones.

``run_ranks(worker, world_size, tmp_path, *args)`` starts ``world_size`` processes running
``worker(rank, world_size, tmp_path, *args)`` inside an initialized gloo group (FileStore in
tmp_path, ``timeout_s`` collective timeout, 60 s by default); each returns a picklable result,
collected in rank order. A failing rank fails the call with its traceback; a rank that hangs is
ended by the collective timeout. The FileStore needs no port; a launcher that does gets one from
:func:`free_port` (never a fixed number, which a second run on the same machine would collide with).
"""
from __future__ import annotations

import datetime
import faulthandler
import os
import pickle
import socket
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "free_port", "TIMEOUT_S"]

TIMEOUT_S = 60
"""Default collective timeout of :func:`run_ranks`'s gloo group, in seconds."""


def free_port() -> int:
    """A TCP port that no socket on this machine holds now (the OS picks it; free on every interface)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, tmp_path, worker, args, timeout_s):
    faulthandler.enable()  # a native crash (SIGABRT, SIGSEGV) prints the Python stack of every thread
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


def run_ranks(worker, world_size: int, tmp_path, *args, timeout_s: float = TIMEOUT_S) -> list:
    """Run ``worker(rank, world_size, tmp_path, *args)`` on ``world_size`` gloo ranks.

    ``worker`` must be a module-level function (the ranks are spawned, so it is pickled by name).

    Returns:
        The per-rank results, in rank order.

    Raises:
        AssertionError: a rank failed; the message holds every failing rank's traceback.
    """
    tmp_path = str(tmp_path)
    os.makedirs(tmp_path, exist_ok=True)
    ctx = mp.start_processes(_entry, args=(world_size, tmp_path, worker, args, timeout_s), nprocs=world_size,
                             join=False, start_method="spawn")
    try:
        while not ctx.join(timeout=2 * timeout_s + 60):
            pass
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
    results = []
    for r in range(world_size):
        with open(os.path.join(tmp_path, f"result_{r}.pkl"), "rb") as f:
            status, payload = pickle.load(f)
        assert status == "ok", payload
        results.append(payload)
    return results
