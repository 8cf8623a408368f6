"""Rank script for the cluster tests: time an all-reduce across the shaped links.

    allreduce_bw.py MB REPEATS           # gloo; ranks from RANK/WORLD_SIZE (Cluster.launch)
    allreduce_bw.py MB REPEATS --mpi     # ranks from MPI (Cluster.launch_mpi): mpi4py's Allreduce,
                                         # then gloo with rank 0's node address sent over MPI
    allreduce_bw.py MB REPEATS --intra   # also an all-reduce inside each node (LOCAL_WORLD_SIZE ranks)

Rank 0 prints ``BW {json}`` per backend with the bytes each rank sent (ring all-reduce:
2 (D-1)/D x size) and the achieved rate in bits per second (best of REPEATS, after one warm-up),
plus every rank's node address (``hostname -I``), so a test can check where the ranks ran.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from scape_ds.comm import collective_bytes


def _best_of(repeats: int, barrier, allreduce) -> float:
    allreduce()  # warm-up: connections, buffers
    best = float("inf")
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        allreduce()
        best = min(best, time.perf_counter() - t0)
    return best


def _report(backend: str, t: torch.Tensor, world: int, seconds: float, addrs: list[str]) -> None:
    sent = collective_bytes("all_reduce", t.numel() * t.element_size(), world)
    print("BW " + json.dumps(dict(backend=backend, world=world, bytes_sent=sent, seconds=seconds,
                                  bits_per_s=sent * 8 / seconds, node=os.environ.get("SCAPE_CLUSTER_NODE"),
                                  addrs=addrs)), flush=True)


def main() -> None:
    mb = float(sys.argv[1]) if len(sys.argv) > 1 else 32.0
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    use_mpi = "--mpi" in sys.argv
    addr = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()[0]
    addrs = [addr]
    if use_mpi:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        addrs = comm.allgather(addr)
        a = torch.ones(int(mb * 2**20) // 4)
        out = torch.empty_like(a)
        best = _best_of(repeats, comm.Barrier, lambda: comm.Allreduce(a.numpy(), out.numpy(), op=MPI.SUM))
        assert float(out[0]) == comm.Get_size()
        if comm.Get_rank() == 0:
            _report("mpi", a, comm.Get_size(), best, addrs)
        os.environ.update(RANK=str(comm.Get_rank()), WORLD_SIZE=str(comm.Get_size()), MASTER_ADDR=addrs[0])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    D = dist.get_world_size()
    t = torch.ones(int(mb * 2**20) // 4)
    best = _best_of(repeats, dist.barrier, lambda: dist.all_reduce(t))
    assert float(t[0]) == D ** (repeats + 1)
    if dist.get_rank() == 0:
        _report("gloo", t, D, best, addrs)
    if "--intra" in sys.argv:  # the node's ranks only: their traffic should not touch the shaped links
        G = int(os.environ["LOCAL_WORLD_SIZE"])
        groups = [dist.new_group(list(range(n, n + G))) for n in range(0, D, G)]
        node = groups[dist.get_rank() // G]
        best = _best_of(repeats, lambda: dist.barrier(group=node), lambda: dist.all_reduce(t, group=node))
        if dist.get_rank() == 0:
            _report("gloo-intra", t, G, best, addrs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
