"""SimulatedCommunicator: one process playing rank r of D identical ranks, metered like the real ones."""
from __future__ import annotations

import pytest
import torch

from scape_ds.comm import Communicator, SimulatedCommunicator, collective_bytes
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

    n = 6 * 4  # input bytes
    assert dict(comm.meter.total) == {"ag": collective_bytes("all_gather", n, D),
                                      "rs": collective_bytes("reduce_scatter", 4 * D * 3, D),
                                      "ar": collective_bytes("all_reduce", n, D), "bc": 0}  # rank 1 is no root
    root = SimulatedCommunicator(D, rank=0)
    root.broadcast(x, 0, "bc")
    assert root.meter.total["bc"] == n


def test_scape_step_bytes_equal_the_closed_form():
    """ScapeAdamS over the simulated communicator sends, per rank, a packed reduce-scatter and
    all-gather of k values on sparse steps, and a dense step plus the encoded masks on a refresh."""
    D, C, T = 4, 256, 4
    p = torch.nn.Parameter(torch.randn(64, D * C * 8 // 64))  # no padding: S = numel / D, 8 chunks a shard
    opt = ScapeAdamS([p], lr=1e-3, comm=SimulatedCommunicator(D),
                     scape=dict(sparsity=0.9, chunk_size=C, mask_refresh_interval=T, dense_numel_threshold=1024))
    S, kc = p.numel() // D, opt.cfg.k_per_chunk
    k = S // C * kc  # kept values per shard
    sparse = collective_bytes("reduce_scatter", D * k * 4, D) + collective_bytes("all_gather", k * 4, D)
    refresh = 2 * (D - 1) * S * 4 + (D - 1) * (S // C) * min(C // 8, 2 * kc)  # dense RS + AG, masks
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
