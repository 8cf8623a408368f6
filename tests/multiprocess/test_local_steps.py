"""``scape.local_steps`` (H local steps, then the pseudo-gradient through the DCT exchange) on 2 and 4 gloo ranks.

Oracles computed here: at sparsity 0 (every coefficient sent, the error feedback emptied) the run is
DiLoCo, written out with torch.optim.AdamW on each rank, an all-reduce of theta_s - theta and the outer
Nesterov (or sign) step by hand; at 0.99 the error-feedback identity on the outer steps with Q Delta in
fp64 and what this rank sent read off its communicator; replicas; bytes; exact resume mid-period.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from scape_ds.exchange.basis import dct_matrix, to_coefficients
from scape_ds.exchange.quantize import decode_values
from scape_ds.kernels import torch_kernels
from scape_ds.optim import ScapeAdamS

from .harness import run_ranks
from .models import flat_params, loss_fn, make_batch, make_mlp
from .test_dct import RecordingCommunicator, _offsets_of
from .test_dct_index_code import _ef_decode_by_loop

pytestmark = pytest.mark.timeout(300)

C = 256
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
SCAPE = dict(basis="dct", chunk_size=C, dense_numel_threshold=1024, local_steps=3, outer_lr=0.7, outer_momentum=0.9)


def _backward(model, step, rank, dtype=torch.float32):
    x, y = (t.to(dtype) for t in make_batch(step, rank))
    loss_fn(model, x, y).backward()


def _lr_at(step: int) -> float:
    """The schedule of the DiLoCo comparison: the lr halves after step 4 (between outer steps)."""
    return HP["lr"] if step < 5 else HP["lr"] / 2


def _diloco_reference(rank, world_size, steps, H, outer):
    """DiLoCo by hand in fp64: AdamW on this rank's own batches; every H steps the mean of theta_s - theta
    by all-reduce, the outer step on theta_s, theta = theta_s."""
    model = make_mlp(seed=1).double()
    inner = torch.optim.AdamW(model.parameters(), **HP)
    synced = [p.detach().clone() for p in model.parameters()]
    momenta = [torch.zeros_like(s) for s in synced]
    out = []
    for step in range(steps):
        for g in inner.param_groups:
            g["lr"] = _lr_at(step)
        inner.zero_grad()
        _backward(model, step, rank, torch.float64)
        inner.step()
        if (step + 1) % H == 0:
            with torch.no_grad():
                for p, s, b in zip(model.parameters(), synced, momenta):
                    delta = s - p
                    dist.all_reduce(delta)
                    delta /= world_size
                    if outer in ("sign", "sign_lr"):  # sign_lr: 5 x the lr at this step
                        s -= (0.05 if outer == "sign" else 5 * _lr_at(step)) * torch.sign(delta)
                    else:
                        b.mul_(0.9).add_(delta)
                        s -= 0.7 * (delta + 0.9 * b)
                    p.copy_(s)
        out.append(flat_params(model))
    return out


def _worker_dense(rank, world_size, tmp_path, mask, outer):
    steps, H = 9, 3
    ref = _diloco_reference(rank, world_size, steps, H, outer)
    model = make_mlp(seed=1).double()
    scape = dict(SCAPE, sparsity=0.0, mask=mask, outer_update=outer,
                 outer_lr={"sign": 0.05, "sign_lr": 5.0}.get(outer, 0.7))
    opt = ScapeAdamS(model.parameters(), **HP, scape=scape)
    worst = 0.0
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = _lr_at(step)  # as a scheduler sets it
        opt.zero_grad()
        _backward(model, step, rank, torch.float64)
        opt.step()
        worst = max(worst, float((flat_params(model) - ref[step]).abs().max()))
    return worst


@pytest.mark.parametrize("mask,outer,world_size", [("per_rank", "nesterov", 2), ("shared", "nesterov", 4),
                                                   ("per_rank", "sign", 2), ("per_rank", "sign_lr", 2)])
def test_sparsity_zero_is_diloco(tmp_path, mask, outer, world_size):
    diffs = run_ranks(_worker_dense, world_size, tmp_path, mask, outer)
    # fp64: the transform's round trip and the summation order; a missed or doubled outer step, a wrong
    # mean or a lost dense tensor is off by an update (~1e-2)
    assert max(diffs) <= 1e-10, diffs


def _equal_on_every_rank(t: torch.Tensor) -> bool:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(out[0], o) for o in out)


def _run(model, opt, rank, start, stop):
    params = []
    for step in range(start, stop):
        opt.zero_grad()
        _backward(model, step, rank)
        opt.step()
        params.append(flat_params(model))
    return params


def _sparse_opt(model, extra, comm=None) -> ScapeAdamS:
    scape = dict(SCAPE, sparsity=0.99, ef_decay=0.999, clip_local=1.0, **extra)
    return ScapeAdamS(model.parameters(), **HP, comm=comm, scape=scape)


def _worker_sparse(rank, world_size, tmp_path, extra):
    steps, H, save_at = 9, 3, 4  # the save falls inside the second period
    value_bits, coded = extra.get("value_bits", 32), extra.get("index_code") == "elias_fano"
    model = make_mlp(seed=3)
    comm = RecordingCommunicator()
    opt = _sparse_opt(model, extra, comm)
    opt.memory_bytes()  # the flat buffers and the synchronized copy, before the first step
    gs, local, q, kc = opt._groups[0], opt._local, dct_matrix(16, torch.float64), opt.cfg.k_per_chunk
    captured = {}
    outer = local._outer

    def capturing_outer():  # Delta = theta_s - theta as the outer step starts (what enters the exchange)
        captured["delta"] = (local.synced[0].flat - gs.flat_param).double()
        captured["dense"] = torch.cat([(s - p.detach()).reshape(-1) for s, p in zip(local.synced[0].dense,
                                                                                  gs.dense_params)])
        captured["dense_kept"] = None if gs.dense_error is None else gs.dense_error.clone()
        outer()

    local._outer = capturing_outer
    sync_equal, local_differ, ef_worst, stats, params, dense_kept_right = True, False, 0.0, [], [], True
    for step in range(steps):
        before = opt.error_feedback().double().clone()
        opt.zero_grad()
        _backward(model, step, rank)
        opt.step()
        stats.append(dict(opt.comm_stats))
        params.append(flat_params(model))
        if (step + 1) % H:
            local_differ |= not _equal_on_every_rank(params[-1])
            assert not comm.log, "an inner step sent something"
            continue
        sync_equal &= _equal_on_every_rank(params[-1]) and torch.equal(local.synced[0].flat, gs.flat_param)
        log = {tag: (inp, out) for tag, inp, out in comm.log}
        comm.log.clear()
        offsets = (torch.tensor(_ef_decode_by_loop(bytes(log["index_ag"][0].tolist()), C, kc)) if coded
                   else _offsets_of(log["index_ag"][0]))
        index = torch.arange(offsets.numel()) // kc * C + offsets
        values = (log["grad_ag"][0] if value_bits == 32
                  else decode_values(log["grad_ag"][0], offsets.numel(), kc, value_bits))
        sent = torch.zeros(gs.tiles.numel, dtype=torch.float64).index_add_(0, index, values.double())
        q_delta = torch.zeros_like(sent)
        to_coefficients(gs.tiles, captured["delta"], q_delta, q, torch_kernels)  # fp64 oracle of Q Delta
        gap = sent + opt.error_feedback().double() - (0.999 * before + q_delta)
        ef_worst = max(ef_worst, float(gap.abs().max()) / max(float(q_delta.abs().max()), 1e-12))
        if extra.get("dense_wire") == "bf16":  # what rounding the dense Delta (+ what was kept) to bf16 lost
            carried = captured["dense"] + captured["dense_kept"]
            dense_kept_right &= torch.equal(gs.dense_error, carried - carried.bfloat16().float())
    # a save inside a period (after step 4 of H = 3): a fresh model and optimizer repeat steps 5..9 exactly
    model_a = make_mlp(seed=3)
    opt_a = _sparse_opt(model_a, extra)
    _run(model_a, opt_a, rank, 0, save_at)
    saved = (flat_params(model_a), opt_a.state_dict())
    model_b = make_mlp(seed=99)
    torch.nn.utils.vector_to_parameters(saved[0], model_b.parameters())
    opt_b = _sparse_opt(model_b, extra)
    opt_b.load_state_dict(saved[1])
    resumed = _run(model_b, opt_b, rank, save_at, steps)
    resume_equal = all(torch.equal(a, b) for a, b in zip(resumed, params[save_at:]))
    return dict(sync_equal=sync_equal, local_differ=local_differ, ef_worst=ef_worst, stats=stats,
                dense_kept_right=dense_kept_right,
                resume_equal=resume_equal, numel=gs.tiles.numel, kc=kc,
                dense=sum(p.numel() for p in gs.dense_params), n_pad=gs.layout.padded_numel, n=gs.layout.numel,
                memory=opt.memory_bytes())


@pytest.mark.parametrize("extra,world_size", [
    pytest.param({}, 2, id="fp32-2ranks"),
    pytest.param(dict(value_bits=8, dense_wire="bf16", index_code="elias_fano"), 4, id="q8-bf16-ef-4ranks")])
def test_sparse_outer_steps_replicas_error_feedback_bytes_resume(tmp_path, extra, world_size):
    results = run_ranks(_worker_sparse, world_size, tmp_path, extra)
    D, value_bits = world_size, extra.get("value_bits", 32)
    for r in results:
        assert r["dense_kept_right"], "the dense tensors' bf16 rounding is not what dense_error keeps"
        assert r["local_differ"], "inner steps must leave the ranks' local parameters apart"
        assert r["sync_equal"], "after an outer step every rank must hold the synchronized parameters"
        assert r["ef_worst"] <= 1e-5, r["ef_worst"]  # sent + kept == 0.999 kept + Q Delta, relative to Q Delta
        assert r["resume_equal"], "a resume inside a period differs"
        # theta_s and b (fp32: N_pad each, and the dense tensors'), AdamW's two moments of every parameter
        expected = 4 * 2 * (r["n_pad"] + r["dense"]) + 4 * 2 * (r["n"] + r["dense"])
        assert r["memory"]["rule_state"] == expected, r["memory"]
    r = results[0]
    k = r["numel"] // C * r["kc"]
    values = 4 * k if value_bits == 32 else k + 4 * (r["numel"] // C)
    dense_ar = 2 * (D - 1) * r["dense"] * (2 if extra.get("dense_wire") == "bf16" else 4) // D
    kc = r["kc"]
    assert kc == 3  # index_code "elias_fano": kc = 3 of 256, 6 low bits each and a bitmap of 3 + 256 / 64 bits
    offsets = (r["numel"] // C) * ((kc * 6 + kc + 4 + 7) // 8) if extra.get("index_code") else k * 2
    for step, s in enumerate(r["stats"], start=1):
        if step % 3:
            assert s["bytes_sent"] == 0 and s["bytes_dense"] > 0, s  # an inner step sends nothing
        else:
            want = {"grad_ag": (D - 1) * values, "index_ag": (D - 1) * offsets, "dense_ar": dense_ar}
            assert s["by_tag"] == want, s


def test_resume_with_other_local_settings_is_refused_before_anything_loads():
    from scape_ds.comm.sim import SimulatedCommunicator

    def opt_of(model, **kw):
        return ScapeAdamS(model.parameters(), **HP, comm=SimulatedCommunicator(1, 0),
                          scape=dict(SCAPE, sparsity=0.9, **kw))

    model = make_mlp(seed=2)
    opt = opt_of(model)
    opt.zero_grad()
    _backward(model, 0, 0)
    opt.step()
    saved = opt.state_dict()
    for kw, needle in ((dict(inner_optimizer="adams"), "scape.inner_optimizer 'adamw', this run has 'adams'"),
                       (dict(outer_update="sign", outer_lr=0.01), "saved with scape.outer_update 'nesterov'"),
                       (dict(local_steps=1), "saved with scape.local_steps 3, this run has 1")):
        other_model = make_mlp(seed=9)
        other = opt_of(other_model, **kw)
        before = flat_params(other_model)
        with pytest.raises(ValueError, match=needle):
            other.load_state_dict(saved)
        assert torch.equal(flat_params(other_model), before) and other.step_count == 0  # nothing half-loaded
