"""scape.overlap with basis "dct" on 2-4 gloo ranks: the exchange starts in step(), each weight's
update waits for the forward of its module, and parameters, error feedback and bytes are the
non-overlapped path's bit for bit; resume mid-run; through DeepSpeed's engine with
ds_configs/scape_dct_overlap.json (the workers of the last two are test_overlap.py's)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from scape_ds.optim import ScapeAdamS

from .harness import run_ranks
from .models import flat_params, make_batch
from .test_overlap import _Net, _worker_attach, _worker_engine, _worker_resume

pytestmark = pytest.mark.timeout(300)

# 16 x 16 tiles; every weight of test_overlap's _Net (8192, 16384 and 8192 elements) a bucket of its own
DCT = dict(basis="dct", mask="per_rank", sparsity=0.95, chunk_size=256, clip_local=1.0, ef_decay=0.999,
           dense_numel_threshold=1024, bucket_mb=8192 * 4 / 2**20)


class _OddNet(torch.nn.Module):
    """Weights whose sides are not multiples of the 16 x 16 tile (padded tiles), and a flat buffer
    with padding at its end."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b, self.c = torch.nn.Linear(64, 100), torch.nn.Linear(100, 72), torch.nn.Linear(72, 64)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.nn.functional.gelu(self.a(x)))))


def _build(seed, scape, overlap, hooked=True, net=_Net):
    model = net(seed)
    opt = ScapeAdamS(model.parameters(), lr=3e-3, weight_decay=0.1, scape=dict(scape, overlap=overlap))
    if overlap and hooked:
        opt.attach_model(model)
    return model, opt


def _train(model, opt, rank, steps, first=0, seen=None, autocast=False):
    for step in range(first, first + steps):
        opt.zero_grad()
        x, y = make_batch(step, rank)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):  # the hooks run under it too
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        loss.backward()
        opt.step()
        if seen is not None and opt._groups[0].overlap is not None:
            seen.append(len(opt._groups[0].overlap._in_flight))  # buckets not yet applied after step()
        yield step


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _worker_equal(rank, world_size, tmp_path, steps, scape, hooked, net, autocast):
    ref_model, ref = _build(5, scape, False, net=net)
    model, opt = _build(5, scape, True, hooked, net=net)
    unequal, replicas, byte_mismatch, pending = [], 0, 0, []
    ref_steps = _train(ref_model, ref, rank, steps, autocast=autocast)
    for step in _train(model, opt, rank, steps, seen=pending, autocast=autocast):
        next(ref_steps)
        byte_mismatch += int(opt.comm_stats["bytes_sent"] != ref.comm_stats["bytes_sent"])
        if not torch.equal(opt._groups[0].error, ref._groups[0].error):
            unequal.append((step, "error feedback"))
        if step % 2 and step != steps - 1:
            continue  # odd steps: the next training forward applies the buckets
        x, _ = make_batch(10_000, rank)
        with torch.no_grad():  # a forward waits for its modules' buckets
            if not torch.equal(model(x), ref_model(x)):
                unequal.append((step, "forward"))
        flat = flat_params(model)  # every module ran: nothing left in flight
        if not torch.equal(flat, flat_params(ref_model)):
            unequal.append((step, "parameters"))
        replicas += sum(not torch.equal(flat, c) for c in _gather(flat))
    return unequal, replicas, byte_mismatch, pending, len(opt._groups[0].overlap.buckets)


@pytest.mark.parametrize("world_size,scape,hooked,net,autocast", [
    (2, DCT, True, _Net, False),
    (4, DCT, True, _Net, False),  # the sum is in rank order on both paths: bitwise at any D
    (2, dict(DCT, dct_update="rms"), True, _Net, False),
    (2, dict(DCT, dct_update="signum", bucket_mb=1.0), True, _Net, False),  # one bucket for all three weights
    (2, DCT, False, _Net, False),  # no model attached: step() applies every bucket itself
    (2, DCT, True, _OddNet, False),  # padded tiles, a padded flat buffer
    (2, DCT, True, _Net, True),  # forwards under bf16 autocast: the decode in the hook must not be
], ids=["d2", "d4", "rms", "signum-one-bucket", "no-model", "padded", "autocast"])
def test_dct_overlap_equals_the_non_overlapped_path(tmp_path, world_size, scape, hooked, net, autocast):
    for unequal, replicas, bytes_, pending, n_buckets in run_ranks(_worker_equal, world_size, tmp_path, 8, scape,
                                                                   hooked, net, autocast):
        assert n_buckets == (1 if scape["bucket_mb"] == 1.0 else 3), n_buckets
        # hooked: after step() every bucket waits for the forward; without a model step() applied them
        assert pending == [n_buckets if hooked else 0] * 8, pending
        assert unequal == [] and replicas == 0 and bytes_ == 0, (unequal, replicas, bytes_)


def test_attach_model_applies_the_updates_in_flight_first(tmp_path):
    # a later attach_model that moves a group's exchange into step() first applies what is in flight
    assert run_ranks(_worker_attach, 2, tmp_path, DCT) == [True, True]


def test_dct_overlap_resumes_exactly_mid_run(tmp_path):
    # the optimizer's state_dict() waits for the updates still in flight; a resume from it into another
    # model and optimizer continues bit for bit (the worker of the coordinate basis's test)
    assert run_ranks(_worker_resume, 2, tmp_path, 9, 4, DCT) == [True, True]


def test_dct_overlap_through_the_engine(tmp_path):
    # ds_configs/scape_dct_overlap.json through scape_ds.initialize (its WarmupCosineLR changes the lr
    # every step: the update applied in the next forward must use the lr of the step that sent it):
    # the same losses and parameters as the same config without overlap, over several buckets
    for equal, (_, n_buckets, hooked) in run_ranks(_worker_engine, 2, tmp_path, 1, "scape_dct_overlap.json"):
        assert equal and hooked and n_buckets > 2, (equal, n_buckets, hooked)
