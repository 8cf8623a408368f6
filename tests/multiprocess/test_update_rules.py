"""``scape.update_rule`` "catchup", "sign_drift" and "window_mean" on 2 gloo ranks: what each changes in
"lazy", replicas, error feedback, the sparsity-0 limit, memory and exact resume
(scape_ds/optim/update_rules.py)."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from scape_ds.exchange.masks import offsets_to_index
from scape_ds.optim import ScapeAdamS
from scape_ds.optim.memory import scape_stage01_bytes

from .harness import run_ranks
from .models import SentLedger, flat_params, loss_fn, make_batch, make_mlp
from .test_scape_engine import RecordingCommunicator, _gather, _worker_density_one

pytestmark = pytest.mark.timeout(300)

RULES = ["catchup", "sign_drift", "window_mean"]
HP = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
T = 5  # mask_refresh_interval of these tests: refreshes at steps 1, 6, 11, ...


def _scape(rule="lazy", **kw):
    return {**dict(update_rule=rule, sparsity=0.95, chunk_size=256, mask_refresh_interval=T,
                   dense_numel_threshold=1024, drift_steps=2, catchup_gain=0.5), **kw}


def _step(model, opt, step, rank, dtype=torch.float32):
    x, y = (t.to(dtype) for t in make_batch(step, rank))
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    opt.step()


def _mask_index(opt) -> torch.Tensor:
    return offsets_to_index(opt.mask_offsets(), 256, opt.cfg.k_per_chunk)  # (K,) int64 flat indices


# ---------------------------------------------------------------- what "catchup" adds at a refresh
def _worker_catchup_vs_lazy(rank, world_size, tmp_path):
    """A lazy and a catchup optimizer on identical copies: equal until the refresh at T+1, where they
    differ exactly by the catch-up step, and only outside the old mask (float64 reference)."""
    dtype = torch.float64
    models = [make_mlp(seed=5, bias=False, norm=False).to(dtype) for _ in range(2)]
    comm = RecordingCommunicator()
    lazy = ScapeAdamS(models[0].parameters(), **HP, scape=_scape("lazy"))
    catch = ScapeAdamS(models[1].parameters(), **HP, scape=_scape("catchup", catchup_beta=0.5), comm=comm)
    gain, beta, lr = 0.5, 0.5, HP["lr"]
    v = None
    result = {}
    for step in range(2 * T + 1):
        old_mask = _mask_index(catch) if step > 0 else None
        for m, o in zip(models, (lazy, catch)):
            _step(m, o, step, rank, dtype)
        diff = flat_params(models[1]) - flat_params(models[0])
        t = step + 1
        if not catch.schedule.is_dense(t):
            continue
        # the reduced mean a of this refresh, from what every rank sent
        sent = torch.stack(_gather(comm.sent_grads[-1]))  # (D, N_pad)
        a = sent.sum(0) / world_size
        w = torch.full_like(a, 1.0 if t == 1 else float(T))
        if old_mask is not None:
            w[old_mask] = 1.0
        v = (1 - beta) * a * a / w if v is None else beta * v + (1 - beta) * a * a / w
        n = (t - 1) // T + 1
        if t == 1:
            result["equal_at_1"] = bool(torch.equal(diff, torch.zeros_like(diff)))
        elif t == T + 1:
            step_ref = gain * lr * w.sqrt() * a / ((v / (1 - beta**n)).sqrt() + 1e-8)
            step_ref[old_mask] = 0.0
            numel = diff.numel()
            result["catchup_err"] = float((diff + step_ref[:numel]).abs().max())
            result["catchup_max"] = float(step_ref.abs().max())
            result["inside_mask_zero"] = bool(torch.count_nonzero(diff[old_mask[old_mask < numel]]) == 0)
            result["moved_outside"] = float((diff != 0).double().mean())
            break
    return result


def test_catchup_adds_the_window_step_outside_the_old_mask(tmp_path):
    for r in run_ranks(_worker_catchup_vs_lazy, 2, tmp_path):
        assert r["equal_at_1"], r  # the first refresh closes no window
        assert r["catchup_max"] > 1e-3, r  # a real step (lr 1e-2, w 5)
        assert r["catchup_err"] < 1e-12, r
        assert r["inside_mask_zero"], r
        assert r["moved_outside"] > 0.9, r


# ---------------------------------------------------------------- what "sign_drift" adds between refreshes
def _worker_sign_drift(rank, world_size, tmp_path, dtype):
    """After each refresh, K steps move every coordinate outside the mask by -lr*beta1/sqrt(beta2)*sign(m),
    m the owners' momentum after the refresh; later steps leave them alone (weight decay is lazy)."""
    model = make_mlp(seed=6, bias=False, norm=False).to(dtype)
    K = 2
    opt = ScapeAdamS(model.parameters(), **HP, scape=_scape("sign_drift", drift_steps=K))
    coef = HP["lr"] * HP["betas"][0] / math.sqrt(HP["betas"][1])
    sign = None
    worst, checked_drift, checked_still = 0.0, 0, 0
    for step in range(2 * T + 1):
        t = step + 1
        before = flat_params(model).double()
        _step(model, opt, step, rank, dtype)
        after = flat_params(model).double()
        n = after.numel()
        if opt.schedule.is_dense(t):
            momentum = torch.cat(_gather(opt._groups[0].momentum))  # (N_pad,) every owner's m
            sign = torch.where(momentum > 0, 1.0, -1.0).double()
            sign[n:] = 0.0
            sign[_mask_index(opt)] = 0.0  # the next mask takes AdamS steps
            continue
        outside = sign[:n] != 0
        expected = -coef * sign[:n] if t - 1 - ((t - 2) // T) * T <= K else torch.zeros(n, dtype=torch.float64)
        err = float(((after - before) - expected)[outside].abs().max())
        worst = max(worst, err)
        if t - 1 - ((t - 2) // T) * T <= K:
            checked_drift += 1
        else:
            checked_still += 1
    return worst, checked_drift, checked_still


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_sign_drift_moves_outside_the_mask_for_k_steps(tmp_path, dtype):
    for worst, drift, still in run_ranks(_worker_sign_drift, 2, tmp_path, dtype):
        assert drift == 4 and still == 4, (drift, still)  # steps 2-3, 7-8 drift; 4-5, 9-10 do not
        assert worst < (1e-12 if dtype == torch.float64 else 1e-6), worst  # fp32: rounding of p - coef*s


# ---------------------------------------------------------------- what "window_mean" changes at a refresh
def _worker_window_mean(rank, world_size, tmp_path):
    """At the refresh that closes a window, AdamS's momentum takes a / w outside the old mask (a at it)."""
    dtype = torch.float64
    model = make_mlp(seed=7, bias=False, norm=False).to(dtype)
    comm = RecordingCommunicator()
    opt = ScapeAdamS(model.parameters(), **HP, scape=_scape("window_mean"), comm=comm)
    beta1 = HP["betas"][0]
    worst, checked = 0.0, 0
    for step in range(2 * T + 1):
        t = step + 1
        old_mask = _mask_index(opt) if step > 0 else None
        m_prev = torch.cat(_gather(opt._groups[0].momentum.clone())) if step > 0 else None
        _step(model, opt, step, rank, dtype)
        if t != T + 1 and t != 2 * T + 1:
            continue
        a = torch.stack(_gather(comm.sent_grads[-1])).sum(0) / world_size  # (N_pad,) the reduced mean
        w = torch.full_like(a, float(T))
        w[old_mask] = 1.0
        want = beta1 * m_prev + (1 - beta1) * a / w
        got = torch.cat(_gather(opt._groups[0].momentum))
        worst = max(worst, float((got - want).abs().max()) / float(want.abs().max()))
        checked += 1
    return worst, checked


def test_window_mean_feeds_adams_the_mean_gradient_of_the_window(tmp_path):
    for worst, checked in run_ranks(_worker_window_mean, 2, tmp_path):
        assert checked == 2
        assert worst < 1e-12, worst


# ---------------------------------------------------------------- replicas, error feedback, memory
def _worker_replicas_and_ef(rank, world_size, tmp_path, rule, dtype):
    model = make_mlp(seed=3).to(dtype)
    comm = RecordingCommunicator()
    opt = ScapeAdamS(model.parameters(), **HP, scape=_scape(rule), comm=comm)
    mismatches = 0
    ledger = SentLedger()
    worst_ef = 0.0
    sparse = [p for p in model.parameters() if p.dim() > 1 and p.numel() >= 1024]
    for step in range(3 * T):
        dense = opt.schedule.is_dense(opt.step_count + 1)
        index = None if dense else _mask_index(opt)
        x, y = (t.to(dtype) for t in make_batch(step, rank))
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in sparse])
        opt.step()
        copies = _gather(flat_params(model))
        mismatches += sum(not torch.equal(copies[0], c) for c in copies)
        worst_ef = max(worst_ef, ledger.add(opt, comm.sent_grads[-1], grad, index))
    opt.synchronize()
    sc = opt.cfg
    want = scape_stage01_bytes(sum(p.numel() for p in sparse), world_size, sc.chunk_size, sc.k_per_chunk,
                               sparse[0].element_size(), 4, sc.compressor, sc.update_rule)
    return mismatches, worst_ef, opt.memory_bytes(), want


@pytest.mark.parametrize("rule,dtype", [("catchup", torch.float32), ("sign_drift", torch.float32),
                                        ("sign_drift", torch.bfloat16), ("window_mean", torch.float32)])
def test_replicas_bitwise_equal_and_error_feedback_loses_nothing(tmp_path, rule, dtype):
    for mismatches, worst_ef, memory, want in run_ranks(_worker_replicas_and_ef, 2, tmp_path, rule, dtype):
        # the rule's buffers as scape_ds.optim.memory counts them (v: 4 bytes per owned coordinate; signs:
        # 1 byte per coordinate); params/grads/momentum also hold the dense-exchanged tensors, not counted there
        for key in ("rule_state", "error_feedback", "masks", "master"):
            assert memory[key] == want[key], (key, memory, want)
        assert (want["rule_state"] > 0) == (rule != "window_mean"), want
        assert mismatches == 0
        # error feedback carries raw gradients under both rules: sent + residual = every local gradient
        assert worst_ef < (1e-5 if dtype == torch.float32 else 0.05), worst_ef  # bf16: wire rounding residual


# ---------------------------------------------------------------- the sparsity-0 limit
@pytest.mark.parametrize("rule", RULES)
def test_sparsity_zero_is_dense_adams(tmp_path, rule):
    """At sparsity 0 the mask holds every coordinate: nothing is outside it to catch up or drift."""
    extra = dict(update_rule=rule, drift_steps=2, catchup_gain=0.5)
    assert max(run_ranks(_worker_density_one, 2, tmp_path, 3 * T, torch.float64, extra)) < 1e-12


# ---------------------------------------------------------------- exact resume
def _worker_resume(rank, world_size, tmp_path, rule, steps, extra=None):
    extra = extra or {}
    model = make_mlp(seed=4)
    opt = ScapeAdamS(model.parameters(), **HP, scape=_scape(rule, sparsity=0.99, **extra))
    for step in range(steps):
        _step(model, opt, step, rank)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    for step in range(steps, 2 * steps):
        _step(model, opt, step, rank)
    straight = (flat_params(model), opt.error_feedback().clone(), opt.mask_offsets())
    model2 = make_mlp(seed=99)  # other initial values: everything comes from the checkpoint
    model2.load_state_dict(saved_model)
    opt2 = ScapeAdamS(model2.parameters(), **HP, scape=_scape(rule, sparsity=0.99, **extra))
    opt2.load_state_dict(saved_opt)
    for step in range(steps, 2 * steps):
        _step(model2, opt2, step, rank)
    resumed = (flat_params(model2), opt2.error_feedback().clone(), opt2.mask_offsets())
    lazy = ScapeAdamS(make_mlp(seed=4).parameters(), **HP, scape=_scape("lazy", sparsity=0.99))
    try:
        lazy.load_state_dict(saved_opt)
        refused = ""
    except ValueError as err:
        refused = str(err)
    for o in (opt, opt2, lazy):
        o.synchronize()
    return [torch.equal(a, b) for a, b in zip(straight, resumed)], refused


@pytest.mark.parametrize("rule,steps", [("catchup", 7), ("sign_drift", 7), ("sign_drift", 6), ("window_mean", 7)])
def test_resume_is_exact(tmp_path, rule, steps):
    """7: saved inside a sparse stretch after a refresh window closed; 6: saved on a refresh step,
    so the resumed run starts inside the drift."""
    for equal, refused in run_ranks(_worker_resume, 2, tmp_path, rule, steps):
        assert equal == [True, True, True], equal  # parameters, error feedback, mask
        assert refused == (f"checkpoint was saved with scape.update_rule {rule!r}, this run has 'lazy': "
                           f"their optimizer states differ; resume with {rule!r}"), refused


# ---------------------------------------------------------------- reselect_interval (masks re-chosen between refreshes)
RESELECT = dict(update_rule="lazy", reselect_interval=2)


def _worker_reselect_masks(rank, world_size, tmp_path):
    """Every R steps between refreshes each owner re-chooses its mask from |beta1 m + (1 - beta1) e| on its
    shard; the next step uses it on every rank; replicas stay equal and nothing sent is lost."""
    model = make_mlp(seed=8)
    comm = RecordingCommunicator()
    opt = ScapeAdamS(model.parameters(), **HP, scape=_scape(**RESELECT), comm=comm)
    sparse = [p for p in model.parameters() if p.dim() > 1 and p.numel() >= 1024]
    ledger, worst_ef, mismatches, reselections, masks = SentLedger(), 0.0, 0, 0, set()
    for step in range(2 * T + 1):
        dense = opt.schedule.is_dense(opt.step_count + 1)
        index = None if dense else _mask_index(opt)
        if index is not None:
            masks.add(tuple(index.tolist()))
        x, y = make_batch(step, rank)
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        grad = torch.cat([p.grad.reshape(-1) for p in sparse])
        opt.step()
        t = opt.step_count
        worst_ef = max(worst_ef, ledger.add(opt, comm.sent_grads[-1], grad, index))
        copies = _gather(flat_params(model))
        mismatches += sum(not torch.equal(copies[0], c) for c in copies)
        if not dense and (t - 1) % T % 2 == 0 and t % T != 0:  # reselection (not before a refresh): from |e|
            shard = opt._groups[0].layout.shard_slice(rank)
            b1 = HP["betas"][0]
            score = opt._groups[0].momentum * b1 + opt.error_feedback()[shard] * (1 - b1)
            want = opt._kernels.chunk_topk(score, 256, opt.cfg.k_per_chunk)
            assert torch.equal(opt.last_selected_offsets, want), t
            k = want.numel()
            assert torch.equal(opt.mask_offsets()[rank * k:(rank + 1) * k], want)  # used from the next step
            reselections += 1
    opt.synchronize()
    return mismatches, worst_ef, reselections, len(masks)


def test_reselect_chooses_from_momentum_and_the_owners_residual(tmp_path):
    for mismatches, worst_ef, reselections, masks in run_ranks(_worker_reselect_masks, 2, tmp_path):
        assert mismatches == 0 and worst_ef < 1e-5, (mismatches, worst_ef)
        assert reselections == 2, reselections  # steps 3 and 8 (refreshes at 1, 6, 11; 5 and 10 precede one)
        assert masks == 4, masks  # chosen at steps 1, 3, 6, 8


def _worker_reselect_decay(rank, world_size, tmp_path):
    """With zero gradients only weight decay acts: a coordinate at the mask has had every step's decay,
    one outside it the decay up to its last update, and after a refresh every coordinate has all of it."""
    dtype = torch.float64
    model = make_mlp(seed=9, bias=False, norm=False).to(dtype)
    opt = ScapeAdamS(model.parameters(), **HP, scape=_scape(**RESELECT))
    p0 = flat_params(model)
    lam = 1.0 - HP["lr"] * HP["weight_decay"]
    worst = 0.0
    for step in range(2 * T + 1):
        opt.zero_grad()
        (0.0 * sum(p.sum() for p in model.parameters())).backward()
        dense = opt.schedule.is_dense(opt.step_count + 1)
        index = None if dense else _mask_index(opt)
        opt.step()
        p = flat_params(model)
        if dense:
            worst = max(worst, float((p - p0 * lam**opt.step_count).abs().max()))
        else:
            n = p.numel()
            inside = index[index < n]
            worst = max(worst, float((p[inside] - p0[inside] * lam**opt.step_count).abs().max()))
    opt.synchronize()
    return worst


def test_reselect_pays_each_coordinates_weight_decay_exactly(tmp_path):
    assert max(run_ranks(_worker_reselect_decay, 2, tmp_path)) < 1e-14


def test_reselect_at_sparsity_zero_is_dense_adams(tmp_path):
    extra = dict(reselect_interval=2)
    assert max(run_ranks(_worker_density_one, 2, tmp_path, 3 * T, torch.float64, extra)) < 1e-12


def test_reselect_resume_is_exact(tmp_path):
    for equal, refused in run_ranks(_worker_resume, 2, tmp_path, "lazy", 8, dict(reselect_interval=2)):
        assert equal == [True, True, True], equal
        assert refused.startswith("checkpoint was saved with scape.reselect_interval 2, this run has 0"), refused
