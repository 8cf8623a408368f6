"""Rank script for the cluster test: time a gloo all-reduce across the shaped links.

Rank 0 prints ``BW {json}`` with the bytes each rank sent (ring all-reduce: 2 (D-1)/D x size) and
the achieved rate in bits per second (best of --repeats, after one warm-up).
"""
from __future__ import annotations

import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from scape_ds.comm import collective_bytes  # noqa: E402


def main() -> None:
    mb = float(sys.argv[1]) if len(sys.argv) > 1 else 32.0
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    D = dist.get_world_size()
    t = torch.ones(int(mb * 2**20) // 4)
    dist.all_reduce(t)  # warm-up: connections, buffers
    best = float("inf")
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(t)
        best = min(best, time.perf_counter() - t0)
    assert float(t[0]) == D ** (repeats + 1)
    sent = collective_bytes("all_reduce", t.numel() * t.element_size(), D)
    if dist.get_rank() == 0:
        print("BW " + json.dumps(dict(world=D, bytes_sent=sent, seconds=best, bits_per_s=sent * 8 / best,
                                      node=os.environ.get("SCAPE_CLUSTER_NODE"))), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
