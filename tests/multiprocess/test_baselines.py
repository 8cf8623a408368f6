"""The quality bench's DiLoCo and SparseLoCo baselines (bench/qualitybench/baselines.py), on 2 gloo ranks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from .harness import run_ranks

pytestmark = pytest.mark.timeout(300)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()


def _local_steps(model, opt, rank: int, steps: int, first: int) -> None:
    """Inner AdamW steps on this rank's own data (no exchange)."""
    for s in range(first, first + steps):
        gen = torch.Generator().manual_seed(1000 * rank + s)
        x, y = torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randn(8, 3, generator=gen,
                                                                                  dtype=torch.float64)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _worker_diloco(rank, world_size, tmp_path, H, rounds):
    from qualitybench.baselines import DiLoCo

    model = _model(seed=0)  # the same start on every rank
    engine = SimpleNamespace(module=model, enable_backward_allreduce=True)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(H=H)
    diloco.start(engine)
    assert engine.enable_backward_allreduce is False
    # the reference outer optimizer: torch's SGD with Nesterov momentum on theta_outer, grad = mean delta
    ref = torch.nn.Parameter(_flat(model).clone())
    ref_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    outer_ids, diffs = [], []
    for r in range(rounds):
        tensors = list(model.parameters())
        _local_steps(model, inner, rank, H, first=r * H)
        local = _flat(model)
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        assert not torch.equal(gathered[0], gathered[1]), "inner steps exchanged nothing: the ranks differ"
        for step in range((r + 1) * H - H + 1, (r + 1) * H + 1):
            diloco(step, engine)  # only the last of these is an outer step
        ref.grad = ref.detach() - torch.stack(gathered).mean(0)  # the mean outer gradient
        ref_opt.step()
        diffs.append(float((_flat(model) - ref.detach()).abs().max()))
        outer_ids.append(all(a is b for a, b in zip(tensors, model.parameters())))
    return _flat(model), diffs, outer_ids


def test_diloco_outer_step_is_torch_nesterov_sgd_on_the_mean_outer_gradient(tmp_path):
    results = run_ranks(_worker_diloco, 2, tmp_path, 3, 3)
    (p0, diffs0, same0), (p1, _, _) = results
    assert torch.equal(p0, p1), "replicas differ after an outer step"
    assert max(diffs0) < 1e-12, diffs0  # fp64: the same arithmetic up to rounding
    assert all(same0), "the outer step must copy into the inner optimizer's tensors, not replace them"


def test_diloco_bytes_are_the_dense_all_reduce_at_outer_steps_only():
    from qualitybench.baselines import DiLoCo, build_baseline

    rows = [dict(step=s, bytes_dense=100) for s in range(1, 61)]
    assert DiLoCo(H=30).bytes_sent(rows) == 200
    assert isinstance(build_baseline(dict(kind="diloco", H=7)), DiLoCo)
    assert build_baseline(None) is None
    with pytest.raises(ValueError, match="unknown baseline kind"):
        build_baseline(dict(kind="powersgd"))
    with pytest.raises(ValueError, match="H >= 1"):
        DiLoCo(H=0)


def test_sparseloco_compress_sends_k_two_bit_values_per_chunk_and_keeps_the_rest():
    from qualitybench.baselines import SparseLoCo

    slc = SparseLoCo(H=1, k=4, chunk=16, beta=0.5)
    slc.error = torch.zeros(48, dtype=torch.float64)  # 3 chunks; the model has 40 coordinates
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        delta = torch.randn(40, generator=gen, dtype=torch.float64)
        before = slc.error.clone()
        sent = slc.compress(delta)  # (40,)
        accumulated = 0.5 * before
        accumulated[:40] += delta
        torch.testing.assert_close(torch.cat([sent, torch.zeros(8, dtype=torch.float64)]) + slc.error, accumulated,
                                   rtol=0, atol=1e-14)  # sent + kept == accumulated
        chunks = torch.cat([sent, torch.zeros(8, dtype=torch.float64)]).view(3, 16)
        for c in range(3):
            nz = chunks[c][chunks[c] != 0]
            assert 0 < nz.numel() <= 4
            scale = nz.abs().max() / 1.5
            levels = torch.tensor([-1.5, -0.5, 0.5, 1.5], dtype=torch.float64) * scale
            assert all(bool(torch.isclose(levels, v).any()) for v in nz), "a value off the 2-bit levels"
    assert slc.payload_bytes() == 3 * (1 + 8 + 4)  # per chunk: 4 codes of 2 bits, 4 offsets of 16 bits, a scale


def _worker_sparseloco(rank, world_size, tmp_path):
    from qualitybench.baselines import SparseLoCo

    model = _model(seed=0)
    engine = SimpleNamespace(module=model, enable_backward_allreduce=True)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    slc = SparseLoCo(H=2, k=3, chunk=16, beta=0.9)
    slc.start(engine)
    outer = slc.outer.clone()
    _local_steps(model, inner, rank, 2, first=0)
    # what this rank will send, computed on a copy of its state
    probe = SparseLoCo(H=2, k=3, chunk=16, beta=0.9)
    probe.error = slc.error.clone()
    mine = probe.compress(outer - _flat(model))
    slc(1, engine)
    assert torch.equal(slc.outer, outer), "step 1 is not an outer step"
    slc(2, engine)
    sent = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(sent, mine)
    expected = outer - torch.stack(sent).sum(0) / world_size
    return _flat(model), float((slc.outer - expected).abs().max()), torch.equal(slc.error, probe.error)


def test_sparseloco_outer_step_applies_the_mean_message_on_every_rank(tmp_path):
    (p0, diff0, kept0), (p1, diff1, kept1) = run_ranks(_worker_sparseloco, 2, tmp_path)
    assert torch.equal(p0, p1), "replicas differ after an outer step"
    assert max(diff0, diff1) < 1e-14
    assert kept0 and kept1, "the accumulator after the outer step is not what compress kept"


def _demo_by_hand(weight0, grads, lrs, wd, decay, clip, accumulate, average):
    """DeMo's steps on one (64, 128) weight, computed from every rank's gradients with scipy's DCT:
    returns the weight after the steps. ``grads[s][r]``: rank r's gradient at step s, ``lrs[s]`` its lr."""
    import numpy as np
    from scipy.fft import dctn, idctn

    def tiles(x):  # (64, 128) -> (2, 64, 64): the two 64 x 64 tiles
        return np.stack([x[:, :64], x[:, 64:]])

    def untile(t):
        return np.concatenate([t[0], t[1]], axis=1)

    world = len(grads[0])
    w, deltas = weight0.numpy().astype(np.float64), [np.zeros((64, 128)) for _ in range(world)]
    for s, lr in enumerate(lrs):
        w = w * (1 - lr * wd)
        sent = []
        for r in range(world):
            g = grads[s][r].numpy().astype(np.float64)
            if clip:
                g = g * min(1.0, clip / (np.linalg.norm(g) + 1e-6))  # torch's clip_grad_norm_
            deltas[r] = decay * deltas[r] + (lr if accumulate == "lr_grad" else 1.0) * g
            coef = dctn(tiles(deltas[r]), axes=(1, 2), norm="ortho").reshape(2, -1)  # (2, 4096)
            keep = np.zeros_like(coef)
            top = np.argsort(-np.abs(coef), axis=1)[:, :32]
            np.put_along_axis(keep, top, np.take_along_axis(coef, top, 1), 1)
            deltas[r] = deltas[r] - untile(idctn(keep.reshape(2, 64, 64), axes=(1, 2), norm="ortho"))
            sent.append(keep)
        total, count = sum(sent), sum((m != 0).astype(np.float64) for m in sent)
        agg = total / world if average == "sum" else np.where(count > 0, total / np.maximum(count, 1), 0.0)
        w = w - lr * np.sign(untile(idctn(agg.reshape(2, 64, 64), axes=(1, 2), norm="ortho")))
    return torch.from_numpy(w)


LRS = [0.01, 0.002, 0.02, 0.005]  # a schedule: += lr * grad and += grad differ only when the lr changes


def _worker_demo(rank, world_size, tmp_path, accumulate, average, clip):
    from qualitybench.demo import DeMo

    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(64, 128) * 0.02)  # two 64 x 64 tiles
    w0 = weight.detach().clone()
    # decay 0.5 and an lr that changes every step, so that a wrong decay or accumulate shows in the signs
    opt = DeMo([weight], lr=0.01, weight_decay=0.1, decay=0.5, accumulate=accumulate, average=average, clip=clip)
    grads = []
    for s, lr in enumerate(LRS):
        opt.param_groups[0]["lr"] = lr
        gen = torch.Generator().manual_seed(100 * s + rank)
        weight.grad = torch.randn(64, 128, generator=gen) * (3.0 if s == 1 else 0.05)  # step 1 is clipped
        mine = weight.grad.clone()
        everyone = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(everyone, mine)
        grads.append(everyone)
        opt.step()
    return weight.detach().clone(), w0, grads, opt.payload_bytes


@pytest.mark.parametrize("accumulate, average, clip", [("grad", "sum", 1.0), ("lr_grad", "mean", 1.0),
                                                        ("grad", "sum", 0.0)])
def test_demo_steps_match_scipy_dct_by_hand(tmp_path, accumulate, average, clip):
    """The bench's independent DeMo against the same steps written with scipy.fft's DCT at 2 ranks:
    clip, decayed accumulator, top-32 per tile, sent part removed, mean over senders or sum / D, sign."""
    (p0, w0, grads, payload), (p1, _, _, _) = run_ranks(_worker_demo, 2, tmp_path, accumulate, average, clip)
    assert torch.equal(p0, p1), "replicas differ"
    expected = _demo_by_hand(w0, grads, LRS, 0.1, 0.5, clip, accumulate, average)
    # a sign flip of one coordinate moves it by 2 lr >= 0.004; fp32 against fp64 agrees far below that
    assert (p0.double() - expected).abs().max() < 1e-6
    assert payload == 2 * 32 * (4 + 2)  # two tiles, 32 values and 16-bit offsets each


def test_demo_chunks_one_dimensional_tensors_and_uses_the_largest_divisor():
    from qualitybench.demo import ChunkDCT, largest_divisor_at_most

    assert [largest_divisor_at_most(n, 64) for n in (128, 192, 100, 7)] == [64, 64, 50, 7]
    x = torch.randn(192)
    t = ChunkDCT(x.shape, 64)
    coef = t.encode(x)  # (3, 64)
    assert coef.shape == (3, 64)
    torch.testing.assert_close(t.decode(coef), x, rtol=0, atol=1e-5)
    from scipy.fft import dct

    torch.testing.assert_close(coef, torch.from_numpy(dct(x.view(3, 64).numpy(), norm="ortho", axis=1)),
                               rtol=0, atol=1e-5)
