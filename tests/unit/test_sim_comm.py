"""SimulatedCommunicator: one process playing rank r of D identical ranks, metered like the real ones."""
from __future__ import annotations

import pytest
import torch

from scape_ds.comm import Communicator, SimulatedCommunicator
from scape_ds.optim import ScapeAdamS


def test_collectives_compute_the_identical_ranks_answer_and_meter_exact_bytes():
    D = 4
    comm = SimulatedCommunicator(D, rank=1)
    assert isinstance(comm, Communicator) and comm.device == torch.device("cpu")
    x = torch.arange(6, dtype=torch.float32)  # (n,) every rank's input

    out = torch.empty(D * 6)
    comm.all_gather_async(out, x, "ag").wait()
    assert torch.equal(out, x.repeat(D))
    rs = torch.empty(3)
    comm.reduce_scatter(rs, torch.arange(D * 3, dtype=torch.float32), "rs")
    assert torch.equal(rs, D * torch.tensor([3.0, 4.0, 5.0]))  # segment 1, summed over D equal ranks
    t = x.clone()
    comm.all_reduce(t, "ar")
    assert torch.equal(t, D * x)
    comm.broadcast(x, 0, "bc")
    comm.barrier()
    a2a = torch.empty(D * 3)
    comm.all_to_all(a2a, torch.arange(D * 3, dtype=torch.float32), "a2a")
    assert torch.equal(a2a, torch.tensor([3.0, 4.0, 5.0]).repeat(D))  # segment 1 of each of D equal ranks

    # by hand, for D = 4 ranks and 6 fp32 values (24 bytes) per rank (ring algorithms):
    # all-gather: its 24 bytes to each of the 3 others = 72; reduce-scatter of 12 values (48 bytes):
    # 3 of its 4 segments of 12 bytes = 36; all-reduce of 24 bytes: reduce-scatter + all-gather of
    # 3/4 of it each = 2 * 18 = 36; broadcast: only the root sends (the 24 bytes)
    # all-to-all of 12 values: 3 of its 4 segments of 12 bytes = 36
    assert dict(comm.meter.total) == {"ag": 72, "rs": 36, "ar": 36, "bc": 0, "a2a": 36}  # rank 1 is no root
    root = SimulatedCommunicator(D, rank=0)
    root.broadcast(x, 0, "bc")
    assert root.meter.total["bc"] == 24


def test_scape_step_bytes_equal_the_closed_form():
    """ScapeAdamS over the simulated communicator sends, per rank, a packed reduce-scatter and
    all-gather of k values on sparse steps, and a dense step plus the encoded masks on a refresh."""
    D, C, T = 4, 256, 4
    p = torch.nn.Parameter(torch.randn(64, D * C * 8 // 64))  # no padding: S = numel / D, 8 chunks a shard
    opt = ScapeAdamS([p], lr=1e-3, comm=SimulatedCommunicator(D),
                     scape=dict(sparsity=0.9, chunk_size=C, mask_refresh_interval=T, dense_numel_threshold=1024))
    S, kc = p.numel() // D, opt.cfg.k_per_chunk
    assert (S, kc) == (2048, 26)  # 8192 / 4 values a shard, 8 chunks of 256; ceil(0.1 * 256) kept a chunk
    # by hand: k = 8 * 26 = 208 kept values a shard. Sparse step: a reduce-scatter of the D packed
    # shards (4 * 208 fp32 = 3328 bytes, 3/4 of it sent: 2496) and an all-gather of its 208 values
    # (832 bytes to each of 3 ranks: 2496). Refresh: a dense reduce-scatter and all-gather of the
    # 2048-value shards (2 * 3 * 2048 * 4 = 49152) and each chunk's mask to 3 ranks, as a 32-byte
    # bitmap (cheaper than 26 two-byte offsets): 3 * 8 * 32 = 768
    sparse = 2496 + 2496
    refresh = 49152 + 768
    sent = []
    for _ in range(T + 2):
        p.grad = torch.randn(p.shape)
        opt.step()
        sent.append((opt.comm_stats["dense_step"], opt.comm_stats["bytes_sent"]))
    assert sent == [(True, refresh)] + [(False, sparse)] * (T - 1) + [(True, refresh), (False, sparse)]


@pytest.mark.parametrize("world_size,rank", [(0, 0), (2, 2), (2, -1)])
def test_bad_world_or_rank_is_refused(world_size, rank):
    with pytest.raises(ValueError, match="world_size|rank"):
        SimulatedCommunicator(world_size, rank)
