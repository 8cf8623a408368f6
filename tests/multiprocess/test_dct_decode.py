"""``scape.decode`` (basis "dct", per_rank): the received coefficients' sum / D, or each one's mean over
the ranks that sent it, on 2 and 4 gloo ranks and on 2 nodes x 2 (hierarchy "node").

The oracle is computed here in fp64, independently of ``exchange/coefficients.py``: every rank's
coefficients from ``to_coefficients`` (checked against scipy in test_dct_oracles), the node sums, each
tile's top-k of each sender by ``torch.topk`` on the fp64 values, and the sums and sender counts by a
plain loop over senders.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from scape_ds.comm import build_dp_communicators
from scape_ds.config import parse_scape_config
from scape_ds.exchange.basis import TileLayout, dct_matrix, to_coefficients
from scape_ds.exchange.coefficients import exchange_dct
from scape_ds.exchange.node import FlatStage, NodeStage
from scape_ds.kernels import torch_kernels
from scape_ds.optim import ScapeAdamS

from .harness import run_ranks
from .models import flat_params, loss_fn, make_batch, make_mlp

pytestmark = pytest.mark.timeout(300)

T, KC = 16, 8  # 16 x 16 tiles, 8 coefficients per tile sent by each sender
SHAPE = (32, 48)  # 2 x 3 tiles


def _oracle(coefs: torch.Tensor, node_size: int, decode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, sent per sender) from every rank's (numel,) fp64 coefficients ``coefs`` (D, numel): each
    node's sum is one sender; each sender's top-KC of every tile; the sum over senders divided by D
    ("ranks") or by the number of senders of each coefficient times the node size ("senders")."""
    D, numel = coefs.shape
    senders = coefs.view(D // node_size, node_size, numel).sum(dim=1)  # (M, numel)
    total, count = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64)
    sent = torch.zeros_like(senders)
    for m in range(senders.shape[0]):
        for tile in range(numel // (T * T)):
            part = slice(tile * T * T, (tile + 1) * T * T)
            top = senders[m, part].abs().topk(KC).indices + tile * T * T
            sent[m, top] = senders[m, top]
            total[top] += senders[m, top]
            count[top] += 1
    if decode == "ranks":
        return total / D, sent
    return total / (count.clamp(min=1) * node_size), sent


def _worker_exchange(rank, world_size, tmp_path, node_size, decode):
    torch.manual_seed(100 + rank)
    grad = torch.randn(SHAPE[0] * SHAPE[1])  # this rank's gradient of one (32, 48) weight
    tiles = TileLayout.build([grad.view(SHAPE)], [0], world_size, T)
    hierarchy = dict(hierarchy="node", intra_node_size=node_size) if node_size > 1 else {}
    comm, intra = build_dp_communicators(parse_scape_config(dict(basis="dct", **hierarchy)))
    node = NodeStage(intra) if intra is not None else FlatStage()
    error = torch.zeros(tiles.numel // node_size)  # (numel / G,) this rank's slice of the error feedback
    mean, _ = exchange_dct(comm, torch_kernels, tiles, error, grad, dct_matrix(T, torch.float32), mask="per_rank",
                           k_per_chunk=KC, ef_decay=1.0, node=node, decode=decode)
    coef = torch.zeros(tiles.numel, dtype=torch.float64)
    to_coefficients(tiles, grad.double(), coef, dct_matrix(T, torch.float64), torch_kernels, decay=1.0)
    every = [torch.empty_like(coef) for _ in range(world_size)]
    dist.all_gather(every, coef)
    want, sent = _oracle(torch.stack(every), node_size, decode)
    n = tiles.numel // node_size
    mine = slice(node.rank * n, (node.rank + 1) * n) if node_size > 1 else slice(0, tiles.numel)
    node_sum = torch.stack(every).view(world_size // node_size, node_size, -1).sum(dim=1)[rank // node_size]
    kept_want = (node_sum - sent[rank // node_size])[mine]  # what this node's sender did not send, its slice
    return (float((mean.double() - want).abs().max()), float(want.abs().max()),
            float((error.double() - kept_want).abs().max()), float((want != 0).sum()))


@pytest.mark.parametrize("world_size,node_size", [(2, 1), (4, 1), (4, 2)])
@pytest.mark.parametrize("decode", ["ranks", "senders"])
def test_decode_is_the_sum_over_d_or_the_mean_over_senders(tmp_path, world_size, node_size, decode):
    results = run_ranks(_worker_exchange, world_size, tmp_path, node_size, decode)
    for worst, scale, kept_worst, nonzero in results:
        assert worst <= 1e-5 * scale, results  # the decoded mean, on every rank
        assert kept_worst <= 1e-5 * scale, results  # sent + kept == accumulated
        assert nonzero >= 6 * KC, results


def _worker_train(rank, world_size, tmp_path, decode, sparsity, steps=4):
    model = make_mlp(seed=3)
    opt = ScapeAdamS(model.parameters(), lr=1e-2, weight_decay=0.1,
                     scape=dict(basis="dct", chunk_size=256, sparsity=sparsity, dense_numel_threshold=1024,
                                decode=decode))
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model, *make_batch(step, rank)).backward()
        opt.step()
    params = flat_params(model)
    every = [torch.empty_like(params) for _ in range(world_size)]
    dist.all_gather(every, params)
    return params, all(torch.equal(params, p) for p in every)


def test_decode_senders_trains_replicas_equal_and_is_sum_over_d_when_every_rank_sends_all(tmp_path):
    dense = {d: run_ranks(_worker_train, 4, tmp_path / f"{d}_dense", d, 0.0) for d in ("ranks", "senders")}
    sparse = {d: run_ranks(_worker_train, 4, tmp_path / f"{d}_sparse", d, 0.9) for d in ("ranks", "senders")}
    for results in (*dense.values(), *sparse.values()):
        assert all(equal for _, equal in results), "replicas differ"
    assert torch.equal(dense["ranks"][0][0], dense["senders"][0][0])  # sparsity 0: every count is D
    assert not torch.equal(sparse["ranks"][0][0], sparse["senders"][0][0])  # at 0.9 the decode matters
