"""basis "dct" on 2-4 gloo ranks: replicas, error feedback in coefficients, density 0, resume, clipping.

The oracles are computed here, independently of ``exchange/coefficients.py``: the coefficients of each rank's
gradient by scipy-checked ``dct_matrix`` in fp64, what each rank sent read off its communicator, the
union of nominations by a plain loop, dense AdamS by ``AdamS`` on the all-reduced gradient.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from scape_ds.comm import TorchCommunicator
from scape_ds.exchange.basis import dct_matrix, to_coefficients
from scape_ds.kernels import torch_kernels
from scape_ds.optim import ScapeAdamS

from .harness import run_ranks
from .models import flat_params, loss_fn, make_batch, make_mlp
from .test_scape_engine import _worker_density_one

pytestmark = pytest.mark.timeout(300)

C = 256  # 16 x 16 tiles
SCAPE = dict(basis="dct", chunk_size=C, sparsity=0.9, dense_numel_threshold=1024)


class RecordingCommunicator(TorchCommunicator):
    """Keeps what this rank sent of the coefficient values and offsets, and the gathered offsets."""

    def __init__(self):
        super().__init__()
        self.log: list[tuple[str, torch.Tensor, torch.Tensor]] = []

    def all_gather(self, out, inp, tag):
        super().all_gather(out, inp, tag)
        if tag in ("grad_ag", "index_ag"):
            self.log.append((tag, inp.detach().clone(), out.detach().clone()))

    def all_to_all(self, out, inp, tag):
        super().all_to_all(out, inp, tag)
        self.log.append((tag, inp.detach().clone(), out.detach().clone()))

    def reduce_scatter(self, out, inp, tag):
        if tag == "grad_rs":
            self.log.append((tag, inp.detach().clone(), None))
        super().reduce_scatter(out, inp, tag)


def _sent_this_step(comm, mask, numel, world_size, k_per_chunk) -> torch.Tensor:
    """(numel,) fp64: the coefficients this rank sent in its last step, placed by their index."""
    sent = torch.zeros(numel, dtype=torch.float64)
    log = {tag: (inp, out) for tag, inp, out in comm.log}
    comm.log.clear()
    if mask == "per_rank":
        values = log["grad_ag"][0]
        offsets = _offsets_of(log["index_ag"][0])
        chunk = torch.arange(offsets.numel()) // k_per_chunk
        sent.index_add_(0, chunk * C + offsets, values.double())
        return sent
    values = log["grad_rs"][0]  # (n_chunks D K,) slot order: chunk, then rank, then nomination
    if mask == "shared/owner":  # (n_chunks kc,) the owners' choices, chunk-major, one per slot
        offsets = _offsets_of(log["index_ag"][1])
        chunk = torch.arange(offsets.numel()) // k_per_chunk
        assert all(len(set(offsets[chunk == c].tolist())) == k_per_chunk for c in range(numel // C))
        sent.index_add_(0, chunk * C + offsets, values.double())
        return sent
    noms = _offsets_of(log["index_ag"][1])  # (D n_chunks K,) rank-major
    K = max(1, k_per_chunk // world_size)
    n_chunks = numel // C
    noms = noms.view(world_size, n_chunks, K)
    slot = 0
    for c in range(n_chunks):
        seen = set()
        for r in range(world_size):
            for j in range(K):
                off = int(noms[r, c, j])
                if off in seen:
                    assert values[slot] == 0, "a repeated nomination must be sent as 0"
                else:
                    seen.add(off)
                    sent[c * C + off] += float(values[slot])
                slot += 1
    return sent


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _mask_settings(mask: str) -> dict:
    """``"shared/owner"``: the shared mask chosen by each tile's owner (``mask_source``)."""
    return dict(mask="shared", mask_source="owner") if mask == "shared/owner" else dict(mask=mask)


def _worker_exchange(rank, world_size, tmp_path, steps, mask, update):
    model = make_mlp(seed=3)
    comm = RecordingCommunicator()
    opt = ScapeAdamS(model.parameters(), lr=1e-2, weight_decay=0.1, comm=comm,
                     scape=dict(SCAPE, **_mask_settings(mask), dct_update=update))
    sparse = [p for p in model.parameters() if p.dim() == 2]
    q = dct_matrix(16, torch.float64)
    produced = sent = None
    worst, mismatches, moved = 0.0, 0, []
    for step in range(steps):
        x, y = make_batch(step, rank)
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        before = flat_params(model)
        grads = torch.cat([p.grad.reshape(-1) for p in sparse]).double()
        opt.step()
        gs = opt._groups[0]
        if produced is None:
            produced = torch.zeros(gs.tiles.numel, dtype=torch.float64)
            sent = torch.zeros_like(produced)
        to_coefficients(gs.tiles, grads, produced, q, torch_kernels, decay=1.0)  # fp64 oracle of Q g
        sent += _sent_this_step(comm, mask, gs.tiles.numel, world_size, opt.cfg.k_per_chunk)
        worst = max(worst, float((sent + opt.error_feedback().double() - produced).abs().max()))
        after = flat_params(model)
        moved.append(float((after != before).double().mean()))
        mismatches += sum(not torch.equal(after, c) for c in _gather(after))
    return worst, mismatches, min(moved), float(produced.abs().max())


@pytest.mark.parametrize("mask,update,world_size", [("per_rank", "sign", 2), ("shared", "sign", 2),
                                                    ("per_rank", "adams", 4), ("shared", "adams", 4),
                                                    ("shared", "adams_coef", 2), ("shared/owner", "sign", 2),
                                                    ("shared/owner", "sign", 4), ("per_rank", "signum", 2),
                                                    ("shared", "rms", 2)])
def test_dct_replicas_equal_error_feedback_exact_every_parameter_moves(tmp_path, mask, update, world_size):
    results = run_ranks(_worker_exchange, world_size, tmp_path, 8, mask, update)
    for worst, mismatches, moved, scale in results:
        assert mismatches == 0, results  # every rank's parameters bitwise equal after every step
        assert worst <= 1e-6 * scale, results  # sent + kept == accumulated, to fp32 rounding of e
        assert moved > 0.95, results  # a sparse message in coefficients moves (nearly) every parameter


def _union_of(noms: torch.Tensor, world_size: int, n_chunks: int, K: int) -> list[list[int]]:
    """Each chunk's slots of the nominated union, rank-major nominations read by a plain loop: the
    in-chunk offset of every slot, -1 where it repeats an earlier slot's."""
    noms = noms.view(world_size, n_chunks, K)
    slots = []
    for c in range(n_chunks):
        seen, row = set(), []
        for r in range(world_size):
            for j in range(K):
                off = int(noms[r, c, j])
                row.append(-1 if off in seen else off)
                seen.add(off)
        slots.append(row)
    return slots


def _offsets_of(raw: torch.Tensor) -> torch.Tensor:
    """16-bit offsets as a communicator moved them (bytes) -> int64 in 0..C-1."""
    return raw.view(torch.int16).to(torch.int64) & 0xFFFF


def _logged_step(model, opt, comm, step, rank) -> tuple[torch.Tensor, dict]:
    """One training step: (numel,) fp64 coefficients Q g of this rank's sparse gradient (the oracle's
    own transform) and what the communicator logged, by tag."""
    sparse = [p for p in model.parameters() if p.dim() == 2]
    x, y = make_batch(step, rank)
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in sparse]).double()
    opt.step()
    tiles = opt._groups[0].tiles
    step_q = torch.zeros(tiles.numel, dtype=torch.float64)
    to_coefficients(tiles, grads, step_q, dct_matrix(16, torch.float64), torch_kernels, decay=1.0)
    log = {tag: (inp, out) for tag, inp, out in comm.log}
    comm.log.clear()
    return step_q, log


def _worker_held_mask(rank, world_size, tmp_path, steps, hold, early):
    """mask "shared" with ``mask_hold``/``mask_early``: which steps gather offsets, which slots every
    step sends, from which error feedback they were chosen, and sent + kept == accumulated."""
    model = make_mlp(seed=3)
    comm = RecordingCommunicator()
    opt = ScapeAdamS(model.parameters(), lr=1e-2, weight_decay=0.1, comm=comm,
                     scape=dict(SCAPE, mask="shared", mask_hold=hold, mask_early=early))
    produced = sent = kept = slots = upcoming = None
    chose_at, worst, mismatches, wrong_source = [], 0.0, 0, 0
    for step in range(1, steps + 1):
        step_q, log = _logged_step(model, opt, comm, step, rank)
        n_chunks = step_q.numel() // C
        if produced is None:
            produced, sent, kept = (torch.zeros_like(step_q) for _ in range(3))
        before_send = kept + step_q  # this rank's e before the send (ef_decay 1)
        produced += step_q
        K = max(1, opt.cfg.k_per_chunk // world_size)
        if "index_ag" in log:
            chose_at.append(step)
            mine = _offsets_of(log["index_ag"][0]).view(n_chunks, K)
            for c in range(n_chunks):  # chosen from this step's e before its send: the top K of each chunk
                tile = before_send[c * C : (c + 1) * C].abs()
                inside = tile[mine[c]].min()
                outside = tile.clone().index_fill_(0, mine[c], 0.0).max()
                wrong_source += int(inside < outside - 1e-6 * float(tile.max()))
            fresh = _union_of(_offsets_of(log["index_ag"][1]), world_size, n_chunks, K)
            if early and step > 1:
                upcoming = fresh  # serves from the next step on
            else:
                slots = upcoming = fresh
        values = log["grad_rs"][0].double().view(n_chunks, world_size * K)
        for c, row in enumerate(slots):
            for j, off in enumerate(row):
                if off >= 0:
                    sent[c * C + off] += float(values[c, j])
                else:
                    assert values[c, j] == 0, "a repeated nomination must be sent as 0"
        if early:
            slots = upcoming
        kept = opt.error_feedback().double().clone()
        worst = max(worst, float((sent + kept - produced).abs().max()))
        after = flat_params(model)
        mismatches += sum(not torch.equal(after, c) for c in _gather(after))
    return chose_at, worst / float(produced.abs().max()), mismatches, wrong_source


@pytest.mark.parametrize("hold,early,world_size,want", [(3, False, 2, [1, 4, 7]), (1, True, 2, list(range(1, 9))),
                                                         (3, True, 4, [1, 3, 6]), (1, False, 2, list(range(1, 9)))])
def test_dct_shared_mask_held_or_chosen_early(tmp_path, hold, early, world_size, want):
    # chosen at step 1 for steps 1..T, then (mask_early) on the last step of each mask from that step's
    # e before its send, or (held) on the first step it serves; with early and T = 1 the mask of step 2
    # is step 1's own (the same e), so step 1 gathers once
    results = run_ranks(_worker_held_mask, world_size, tmp_path, 8, hold, early)
    for chose_at, worst, mismatches, wrong_source in results:
        assert chose_at == want, results
        assert mismatches == 0, results  # replicas bitwise equal after every step
        assert worst <= 1e-6, results  # sent + kept == accumulated, to fp32 rounding of e
        assert wrong_source == 0, results  # every nomination is a top K of that step's e before its send


def _worker_momentum_mask(rank, world_size, tmp_path, steps, refresh):
    """mask_source "momentum": dense steps at 1 and every ``refresh``; on the others the slots the owners
    chose after the step before, from a first moment of the mean coefficients that this test keeps
    itself (lazy: where they were sent; everywhere on dense steps)."""
    model = make_mlp(seed=3)
    comm = RecordingCommunicator()
    beta1 = 0.9
    opt = ScapeAdamS(model.parameters(), lr=1e-2, betas=(beta1, 0.95), weight_decay=0.1, comm=comm,
                     scape=dict(SCAPE, mask="shared", mask_source="momentum", mask_refresh_interval=refresh))
    produced = sent = m = chosen = None
    dense_at, worst, mismatches, wrong_choice = [], 0.0, 0, 0
    kc = opt.cfg.k_per_chunk
    for step in range(1, steps + 1):
        step_q, log = _logged_step(model, opt, comm, step, rank)
        n_chunks = step_q.numel() // C
        if produced is None:
            produced, sent, m = (torch.zeros_like(step_q) for _ in range(3))
        produced += step_q
        values = log["grad_rs"][0].double()
        mine = torch.zeros_like(produced)  # what this rank sent this step, by coefficient
        if values.numel() == produced.numel():  # a dense step: every coefficient
            dense_at.append(step)
            mine += values
            where = torch.ones_like(produced, dtype=torch.bool)
        else:
            mine.index_add_(0, chosen, values)
            where = torch.zeros_like(produced, dtype=torch.bool).index_fill_(0, chosen, True)
        sent += mine
        mean = torch.stack(_gather(mine)).sum(0) / world_size
        m = torch.where(where, beta1 * m + (1 - beta1) * mean, m)
        offsets = _offsets_of(log["index_ag"][1])  # the next step's mask, every owner's choice, chunk-major
        chosen = torch.arange(n_chunks).repeat_interleave(kc) * C + offsets
        for c in range(n_chunks):  # each owner's top kc of |m| in each of its tiles
            tile = m[c * C : (c + 1) * C].abs()
            pick = offsets[c * kc : (c + 1) * kc]
            outside = tile.clone().index_fill_(0, pick, 0.0).max()
            wrong_choice += int(tile[pick].min() < outside - 1e-6 * float(tile.max()))
        kept = opt.error_feedback().double().clone()
        worst = max(worst, float((sent + kept - produced).abs().max()))
        after = flat_params(model)
        mismatches += sum(not torch.equal(after, c) for c in _gather(after))
    return dense_at, worst / float(produced.abs().max()), mismatches, wrong_choice


@pytest.mark.parametrize("world_size", [2, 4])
def test_dct_shared_mask_from_the_owners_momentum(tmp_path, world_size):
    results = run_ranks(_worker_momentum_mask, world_size, tmp_path, 9, 4)
    for dense_at, worst, mismatches, wrong_choice in results:
        assert dense_at == [1, 5, 9], results  # the first step and each refresh after it ((t - 1) % 4 == 0)
        assert mismatches == 0, results
        assert worst <= 1e-6, results  # sent + kept == accumulated
        assert wrong_choice == 0, results  # each mask is the owners' top kc of the first moment


def _worker_held_resume(rank, world_size, tmp_path, extra):
    hp = dict(lr=1e-2, weight_decay=0.1)
    settings = dict(SCAPE, mask="shared", **extra)
    model = make_mlp(seed=4)
    opt = ScapeAdamS(model.parameters(), **hp, scape=settings)
    _train(model, opt, rank, 4, 0)  # the saved state holds the mask of steps 4..6 (chosen at step 3), 2 uses left
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train(model, opt, rank, 5, 4)
    straight = flat_params(model)
    again = make_mlp(seed=99)
    again.load_state_dict(saved_model)
    opt2 = ScapeAdamS(again.parameters(), **hp, scape=settings)
    opt2.load_state_dict(saved_opt)
    _train(again, opt2, rank, 5, 4)
    return torch.equal(straight, flat_params(again)), saved_opt["scape"]["groups"][0]["held_mask"] is not None


@pytest.mark.parametrize("extra", [dict(mask_hold=3, mask_early=True),
                                   dict(mask_source="momentum", mask_refresh_interval=3)], ids=["held", "momentum"])
def test_dct_held_mask_resume_is_exact(tmp_path, extra):
    # the mask kept for the next steps (and mask_source "momentum"'s first moment) are in the state
    assert run_ranks(_worker_held_resume, 2, tmp_path, extra) == [(True, True)] * 2


@pytest.mark.parametrize("mask,world_size", [("per_rank", 2), ("shared", 2), ("shared", 4)])
def test_dct_density_one_adams_is_dense_adams(tmp_path, mask, world_size):
    extra = dict(basis="dct", mask=mask, dct_update="adams")
    diffs = run_ranks(_worker_density_one, world_size, tmp_path, 12, torch.float64, extra)
    # fp64: the transform's round trip and, on 4 ranks, another summation order (7e-12 after 12 steps);
    # a wrong exchange is off by the size of an update (~1e-2)
    assert max(diffs) <= 1e-10, diffs


def _step_fp64(model, opt, step, rank) -> tuple[torch.Tensor, torch.Tensor]:
    """One fp64 training step of ``model`` by ``opt`` on this rank's batch; returns the batch."""
    x, y = (t.double() for t in make_batch(step, rank))
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    opt.step()
    return x, y


def _worker_real_space_density_one(rank, world_size, tmp_path, steps, update):
    """dct_update "signum" or "rms" at sparsity 0, fp64, no tensor outside the transform: the rule on
    the mean gradient, written out here: signum m = 0.9 m + 0.1 g_mean, p = (1 - lr wd) p - lr sign(m);
    rms p = (1 - lr wd) p - lr g_mean / rms(g_mean), the RMS over each tensor."""
    model = make_mlp(seed=6, bias=False, norm=False).double()
    ref = [p.detach().clone() for p in model.parameters()]
    lr, wd, beta1 = 1e-2, 0.1, 0.9
    opt = ScapeAdamS(model.parameters(), lr=lr, betas=(beta1, 0.95), weight_decay=wd,
                     scape=dict(SCAPE, sparsity=0.0, dct_update=update))
    moments = [torch.zeros_like(p) for p in ref]
    worst = 0.0
    for step in range(steps):
        x, y = _step_fp64(model, opt, step, rank)
        probe = make_mlp(seed=6, bias=False, norm=False).double()
        with torch.no_grad():
            for q, r in zip(probe.parameters(), ref):
                q.copy_(r)
        loss_fn(probe, x, y).backward()  # the reference's own gradient at its own parameters
        for r, m, q in zip(ref, moments, probe.parameters()):
            mean = q.grad.clone()
            dist.all_reduce(mean)
            mean /= world_size
            if update == "signum":
                m.mul_(beta1).add_(mean, alpha=1 - beta1)
                r.mul_(1 - lr * wd).add_(torch.sign(m), alpha=-lr)
            else:
                r.mul_(1 - lr * wd).add_(mean / mean.square().mean().sqrt(), alpha=-lr)
        for p, r in zip(model.parameters(), ref):
            worst = max(worst, float((p.detach() - r).abs().max()))
    return worst


@pytest.mark.parametrize("update,world_size", [("signum", 2), ("signum", 4), ("rms", 2)])
def test_dct_real_space_updates_at_density_one(tmp_path, update, world_size):
    # every coefficient sent: the decoded mean is the mean gradient up to the transform's fp64 round trip
    # (1e-16), far from flipping a sign; a wrong momentum, sign or norm moves a coordinate by ~lr = 1e-2
    diffs = run_ranks(_worker_real_space_density_one, world_size, tmp_path, 10, update)
    assert max(diffs) <= 1e-12, diffs


def _train(model, opt, rank, steps, start):
    for step in range(start, start + steps):
        x, y = make_batch(step, rank)
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()


def _worker_resume(rank, world_size, tmp_path, changed):
    hp = dict(lr=1e-2, weight_decay=0.1)
    model = make_mlp(seed=4)
    opt = ScapeAdamS(model.parameters(), **hp, scape=dict(SCAPE, dct_update="adams", clip_local=0.5))
    _train(model, opt, rank, 4, 0)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    _train(model, opt, rank, 4, 4)
    straight = flat_params(model)
    again = make_mlp(seed=99)
    again.load_state_dict(saved_model)
    opt2 = ScapeAdamS(again.parameters(), **hp, scape=dict(SCAPE, dct_update="adams", clip_local=0.5, **changed))
    opt2.load_state_dict(saved_opt)
    carried = torch.equal(opt2.error_feedback(), saved_opt["scape"]["groups"][0]["error"])
    _train(again, opt2, rank, 4, 4)
    resumed = flat_params(again)
    return torch.equal(straight, resumed), carried, bool(torch.isfinite(resumed).all())


def test_dct_resume_is_exact(tmp_path):
    results = run_ranks(_worker_resume, 2, tmp_path, {})
    assert all(same and carried for same, carried, _ in results), results


def test_dct_resume_with_other_sparsity_and_mask_trains_on(tmp_path):
    results = run_ranks(_worker_resume, 2, tmp_path, dict(sparsity=0.99, mask="shared"))
    assert all(carried and finite and not same for same, carried, finite in results), results


def _worker_refuses_other_basis(rank, world_size, tmp_path):
    model = make_mlp(seed=4)
    opt = ScapeAdamS(model.parameters(), scape=dict(SCAPE))
    _train(model, opt, rank, 1, 0)
    other = ScapeAdamS(model.parameters(), scape=dict(SCAPE, basis="coordinate"))
    with pytest.raises(ValueError, match="saved with scape.basis 'dct', this run has 'coordinate'"):
        other.load_state_dict(opt.state_dict())
    return True


def test_dct_checkpoint_refused_by_coordinate_basis(tmp_path):
    assert run_ranks(_worker_refuses_other_basis, 2, tmp_path) == [True, True]


def _worker_clip_local(rank, world_size, tmp_path, clip):
    model = make_mlp(seed=5)
    comm = RecordingCommunicator()
    opt = ScapeAdamS(model.parameters(), lr=1e-2, comm=comm, scape=dict(SCAPE, sparsity=0.0, clip_local=clip))
    x, y = make_batch(0, rank)
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    norm = float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in model.parameters()])))
    opt.step()
    sent = comm.log[0][1]  # sparsity 0, per_rank: every coefficient of this rank's sparse gradient
    return norm, float(torch.linalg.vector_norm(sent.double()))


def test_clip_local_scales_each_ranks_gradient_before_error_feedback(tmp_path):
    for norm, sent in run_ranks(_worker_clip_local, 2, tmp_path, 1e-3):
        assert norm > 1e-2  # the clip acts
        assert 0.5e-3 < sent <= 1e-3 * (1 + 1e-5)  # the sparse part of a gradient clipped to 1e-3 in total


def _worker_bytes(rank, world_size, tmp_path, mask):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256, bias=False) for _ in range(3)])
    opt = ScapeAdamS(model.parameters(), lr=1e-3, scape=dict(basis="dct", **_mask_settings(mask), sparsity=0.99))
    stats = []
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 256)).square().mean().backward()
        opt.step()
        stats.append(dict(opt.comm_stats))
    return stats


@pytest.mark.parametrize("mask", ["per_rank", "shared", "shared/owner"])
def test_dct_byte_meter_counts_exactly(tmp_path, mask):
    # written out by hand: 2 ranks, three 256 x 256 weights = 48 tiles of 64 x 64, kc = round(0.01 * 4096) = 41;
    # dense yardstick: reduce-scatter of 196608 fp32 (half of it leaves each rank) + all-gather of 98304
    dense = 196608 * 4 // 2 + 98304 * 4
    if mask == "per_rank":  # all-gather of 48 * 41 values (4 bytes) and 48 * 41 offsets (2 bytes)
        want = {"grad_ag": 48 * 41 * 4, "index_ag": 48 * 41 * 2}
    elif mask == "shared":  # 20 nominations per tile and rank; 40 slots per tile reduce-scattered, 20 per rank
        want = {"index_ag": 48 * 20 * 2, "grad_rs": 48 * 40 * 4 // 2, "grad_ag": 48 * 20 * 4}  # all-gathered
    else:  # each owner's 24 tiles x 41 offsets all-gathered; 48 x 41 values reduce-scattered, 24 x 41 all-gathered
        want = {"index_ag": 24 * 41 * 2, "grad_rs": 48 * 41 * 4 // 2, "grad_ag": 24 * 41 * 4}
    for s in run_ranks(_worker_bytes, 2, tmp_path, mask)[0]:
        assert s["by_tag"] == want
        assert s["bytes_dense"] == dense == 786432
        # 1.5015%, 1.25% and 1.25%: 1.5 rho (per_rank) and 1.25 rho (shared), rho = 41 / 4096 here
        assert s["bytes_sent"] / s["bytes_dense"] <= (0.0151 if mask == "per_rank" else 0.01252)


def _tile_dct(w: torch.Tensor, t: int, inverse: bool = False) -> torch.Tensor:
    """scipy's orthonormal 2-D DCT-II (or its inverse) of every t x t tile of a matrix: the oracle."""
    import scipy.fft

    r, c = w.shape
    blocks = w.detach().numpy().reshape(r // t, t, c // t, t)
    fn = scipy.fft.idctn if inverse else scipy.fft.dctn
    return torch.from_numpy(fn(blocks, axes=(1, 3), norm="ortho").reshape(r, c).copy())


def _worker_adams_coef(rank, world_size, tmp_path, steps):
    from scape_ds.optim import AdamS

    hp = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    model = make_mlp(seed=6).double()
    opt = ScapeAdamS(model.parameters(), **hp, scape=dict(SCAPE, sparsity=0.0, dct_update="adams_coef"))
    ref = make_mlp(seed=6).double()  # real-space weights of the reference; its matrices step as theta
    mats = [p for p in ref.parameters() if p.dim() == 2]
    theta = [torch.nn.Parameter(_tile_dct(p, 16)) for p in mats]  # the rotated weights
    ref_opt = AdamS(theta + [p for p in ref.parameters() if p.dim() < 2], **hp)
    worst = 0.0
    for step in range(steps):
        x, y = _step_fp64(model, opt, step, rank)
        ref.zero_grad()  # its matrices are not in ref_opt (theta is)
        loss_fn(ref, x, y).backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
        for th, p in zip(theta, mats):  # rotate the gradient, step in coefficients, rotate back
            th.grad = _tile_dct(p.grad, 16)
        ref_opt.step()
        with torch.no_grad():
            for th, p in zip(theta, mats):
                p.copy_(_tile_dct(th, 16, inverse=True))
        worst = max(worst, float((flat_params(model) - flat_params(ref)).abs().max()))
    return worst


def test_dct_density_one_adams_on_coefficients_is_dense_adams_on_rotated_parameters(tmp_path):
    diffs = run_ranks(_worker_adams_coef, 2, tmp_path, 10)
    assert max(diffs) <= 1e-10, diffs  # fp64 round trips; a wrong rotation or update is off by ~1e-2
