"""Elastic resume with ``scape.basis "dct"`` (path A, stage 0): a checkpoint saved on D = 2 ranks
loads on D' = 1 and D' = 4, and the error feedback's sum over the ranks is kept to the bit.

Two parts. In one process, :func:`reshard_scape_states` on real ``ScapeAdamS`` states (each rank played
by a ``SimulatedCommunicator``, every rank's error feedback and owner momentum then overwritten by
distinct random values, so nothing passes by symmetry): the new ranks' error feedback sums, in rank
order, to the old ranks' sum taken in rank order in fp64 and rounded once, each weight's coefficients
at the place they had (only the padding tiles after them move with D); the replicated momentum is old
rank 0's, the per-owner momentum of ``mask_source "momentum"`` re-cut, held masks dropped; the states
load on D' ranks and step. On gloo ranks, DeepSpeed engines with ds_configs/scape_dct.json's scape
block (and a shared-mask, owner-momentum, ``signum`` variant, and ds_configs/scape_dct_scale.json's
coded union) train 3 steps on 2 ranks and save; 1 rank and 4 ranks load it (4: in memory, and from
``python -m scape_ds.checkpoint convert``'s tag, bitwise the same), and train 2 more steps with the
replicas bitwise equal.

The tiny GPT with ``dense_numel_threshold`` 1024 has 17 tiles of 64 x 64 (the position embedding's
32 x 64 one padded inside its tile): 17, 18 and 20 tiles at D = 1, 2 and 4, so both loads move the
padding.
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from scape_ds.checkpoint.reshard import reshard_scape_states, sum_in_rank_order
from scape_ds.comm.sim import SimulatedCommunicator
from scape_ds.optim import ScapeAdamS

from .harness import run_ranks
from .test_deepspeed_engine import SEQ, _config, _engine, _params, _set_env

pytestmark = pytest.mark.timeout(600)

# ---------------------------------------------------------------- the pure function, in one process
SIM = dict(basis="dct", chunk_size=16, sparsity=0.75, dense_numel_threshold=32)  # 4 x 4 tiles, kc 4
MASKS = {
    "per_rank/sign": dict(mask="per_rank", dct_update="sign"),
    "per_rank/signum": dict(mask="per_rank", dct_update="signum"),
    "per_rank/sign/dense_bf16": dict(mask="per_rank", dct_update="sign", dense_wire="bf16"),
    "shared/union/hold2/adams": dict(mask="shared", mask_hold=2, dct_update="adams"),
    "shared/momentum/adams_coef": dict(mask="shared", mask_source="momentum", dct_update="adams_coef"),
}
TILES = {1: 13, 2: 14, 4: 16}  # 9 + 4 tiles of the two weights, padded to a multiple of D
FLAT = {1: 160, 2: 160, 4: 192}  # 90 + 64 = 154 elements, padded to a multiple of D C


def _sim_model() -> nn.Module:
    torch.manual_seed(0)  # weights (9, 10): 3 x 3 tiles, (4, 16): 1 x 4 tiles; a bias and a LayerNorm dense
    return nn.ModuleDict(dict(a=nn.Linear(10, 9), b=nn.Linear(16, 4, bias=False), c=nn.LayerNorm(7)))


def _sim_optimizer(model, rank: int, world_size: int, masks: dict) -> ScapeAdamS:
    groups = [dict(params=list(model["a"].parameters()) + [model["b"].weight]),
              dict(params=list(model["c"].parameters()), weight_decay=0.0)]
    return ScapeAdamS(groups, lr=1e-2, weight_decay=0.1, scape=dict(SIM, **masks),
                      comm=SimulatedCommunicator(world_size, rank))


def _sim_step(model, opt, step: int) -> None:
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step), dtype=p.dtype)
    opt.step()


def _sim_states(masks: dict, world_size: int = 2, steps: int = 3) -> list[dict]:
    """Every old rank's state after ``steps`` steps, its error feedback (and owner momentum) then made
    distinct per rank: random on the weights' tiles, zero on the padding tiles."""
    states = []
    for rank in range(world_size):
        model = _sim_model()
        opt = _sim_optimizer(model, rank, world_size, masks)
        for step in range(steps):
            _sim_step(model, opt, step)
        sd = opt.state_dict()
        g = torch.Generator().manual_seed(1000 + rank)
        group = sd["scape"]["groups"][0]
        used = group["coef_numel"]
        assert used == 13 * 16 and group["error"].numel() == TILES[world_size] * 16
        size = group["error"].numel()
        group["error"] = torch.randn(size, generator=g) * (torch.arange(size) < used)
        if group["coef_momentum"] is not None:
            S = group["coef_momentum"].numel()
            real = (torch.arange(S) + rank * S) < used
            group["coef_momentum"] = torch.randn(S, generator=g) * real
        states.append(sd)
    return states


@pytest.mark.parametrize("new", [1, 4])
@pytest.mark.parametrize("masks", list(MASKS), ids=list(MASKS))
def test_dct_state_resharded_keeps_the_error_feedback_sum_exactly(masks, new):
    before = _sim_states(MASKS[masks])
    after = reshard_scape_states(before, new)
    old_groups = [s["scape"]["groups"][0] for s in before]
    new_groups = [s["scape"]["groups"][0] for s in after]
    used = old_groups[0]["coef_numel"]
    # error feedback: the new ranks' sum (fp32, rank order) is the old ranks' fp64 rank-order sum rounded once
    old_sum = sum_in_rank_order([g["error"][:used] for g in old_groups]).to(torch.float32)
    assert old_sum.abs().max() > 0
    errors = [g["error"] for g in new_groups]
    assert all(e.dtype == torch.float32 and e.numel() == TILES[new] * 16 for e in errors)
    total = errors[0].clone()
    for e in errors[1:]:
        total += e
    assert torch.equal(total[:used], old_sum) and not total[used:].any()
    assert torch.equal(errors[0][:used], old_sum) and not any(e.any() for e in errors[1:])
    for s, g in zip(after, new_groups):
        sc = s["scape"]
        assert sc["resharded_from"] == 2 and sc["world_size"] == new and not sc["refresh_next"]
        assert g["held_mask"] is None and g["master"] is None and g["padded_numel"] == FLAT[new]
        assert g["coef_numel"] == used and sc["step"] == before[0]["scape"]["step"]
        assert torch.equal(sc["groups"][1]["dense_momenta"][0], before[0]["scape"]["groups"][1]["dense_momenta"][0])
    if MASKS[masks].get("dense_wire") == "bf16":  # the rounding every old rank kept, summed onto new rank 0
        for gi in (0, 1):
            kept = [s["scape"]["groups"][gi]["dense_error"] for s in before]
            assert kept[0].abs().max() > 0
            assert torch.equal(after[0]["scape"]["groups"][gi]["dense_error"], sum_in_rank_order(kept).float())
            assert not any(s["scape"]["groups"][gi]["dense_error"].any() for s in after[1:])
    if MASKS[masks].get("mask") == "shared":  # the held mask indexes 2 ranks' slots over 14 tiles: dropped
        assert old_groups[0]["held_mask"] is not None
    # the replicated momentum is old rank 0's, re-padded (flat layout, or coefficients for adams_coef)
    m_old = old_groups[0]["momentum"]
    if m_old is None:
        assert all(g["momentum"] is None for g in new_groups)
    else:
        n = used if MASKS[masks]["dct_update"] == "adams_coef" else old_groups[0]["numel"]
        assert m_old[:n].abs().max() > 0
        for g in new_groups:
            assert torch.equal(g["momentum"][:n], m_old[:n]) and not g["momentum"][n:].any()
    # mask_source "momentum": the owners' shards re-cut (the old shards concatenated, cut into D')
    if old_groups[0]["coef_momentum"] is not None:
        whole_old = torch.cat([g["coef_momentum"] for g in old_groups])
        whole_new = torch.cat([g["coef_momentum"] for g in new_groups])
        assert whole_new.numel() == TILES[new] * 16
        assert torch.equal(whole_new[:used], whole_old[:used]) and not whole_new[used:].any()
    # every new rank loads its state and steps
    for rank, state in enumerate(after):
        model = _sim_model()
        opt = _sim_optimizer(model, rank, new, MASKS[masks])
        opt.load_state_dict(state)
        assert torch.equal(opt.error_feedback(), errors[rank]) and opt.step_count == 3
        _sim_step(model, opt, 3)
        assert all(torch.isfinite(p).all() for p in model.parameters())


def test_dct_there_and_back_keeps_the_sum_and_the_owner_momentum():
    masks = MASKS["shared/momentum/adams_coef"]
    before = _sim_states(masks)
    back = reshard_scape_states(reshard_scape_states(before, 4), 2)
    used = before[0]["scape"]["groups"][0]["coef_numel"]
    old_sum = sum_in_rank_order([s["scape"]["groups"][0]["error"][:used] for s in before]).to(torch.float32)
    assert torch.equal(back[0]["scape"]["groups"][0]["error"][:used], old_sum)
    assert not back[1]["scape"]["groups"][0]["error"].any()
    for old, new in zip(before, back):
        assert torch.equal(old["scape"]["groups"][0]["coef_momentum"], new["scape"]["groups"][0]["coef_momentum"])


# ---------------------------------------------------------------- DeepSpeed engines on gloo ranks
RUNS = {  # name: (ds_configs/ file, changes to its scape block)
    "per_rank": ("scape_dct.json", dict(dense_numel_threshold=1024)),
    "momentum": ("scape_dct.json", dict(dense_numel_threshold=1024, mask="shared", mask_source="momentum",
                                        dct_update="signum")),
    # the coded union as shipped: 4-bit values summed at each tile's owner, Elias-Fano nominations, bf16 dense
    "scale": ("scape_dct_scale.json", dict(dense_numel_threshold=1024)),
}
SAVED_AT = 3
MORE = 2  # steps after each load


def _steps(engine, data, start: int, stop: int) -> list[float]:
    from scape_ds.data import get_batch

    losses = []
    for step in range(start, stop):
        x, y = get_batch(data, 4, SEQ, step, dist.get_rank(), dist.get_world_size(), 0)
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        total = torch.tensor([float(loss.detach())], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
    return losses


def _state(opt) -> dict:
    group = opt.state_dict()["scape"]["groups"][0]
    return {k: group[k] for k in ("error", "momentum", "coef_momentum", "coef_numel", "numel")}


def _worker(rank, world_size, tmp_path, root, converted):
    _set_env(rank)
    from scape_ds.checkpoint import load_checkpoint, save_checkpoint
    from scape_ds.data import build_datasets
    from scape_ds.engine import scape_optimizer

    train, _ = build_datasets()
    out = {}
    for name, (file, scape) in RUNS.items():
        engine = _engine(_config(file, **scape))
        opt = scape_optimizer(engine)
        ckpt = os.path.join(root, name)
        if world_size == 2:  # the run that saves
            losses = _steps(engine, train, 0, SAVED_AT)
            out[name] = dict(losses=losses, params=_params(engine), state=_state(opt))
            save_checkpoint(engine, ckpt, SAVED_AT, dict(step=SAVED_AT))
            continue
        tag, client = load_checkpoint(engine, ckpt)
        assert client["step"] == SAVED_AT and engine.global_steps == SAVED_AT and opt.step_count == SAVED_AT, tag
        loaded = dict(params=_params(engine), state=_state(opt))
        if converted is not None:  # the same checkpoint through the offline converter's tag
            other = _engine(_config(file, **scape))
            load_checkpoint(other, os.path.join(converted, name))
            loaded["converted"] = dict(params=_params(other), state=_state(scape_optimizer(other)))
        losses = _steps(engine, train, SAVED_AT, SAVED_AT + 1)
        flushed = not opt.error_feedback().any()  # mask_source "momentum": the first step is dense
        losses += _steps(engine, train, SAVED_AT + 1, SAVED_AT + MORE)
        out[name] = dict(loaded=loaded, losses=losses, flushed=flushed, after=_params(engine))
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _same_state(a: dict, b: dict) -> bool:
    return all((a[k] is None and b[k] is None) or (torch.is_tensor(a[k]) and torch.equal(a[k], b[k])) or a[k] == b[k]
               for k in a)


def _check_load(saved: list[dict], resumed: list[dict], name: str, new: int) -> None:
    old = [r[name] for r in saved]
    used, numel = old[0]["state"]["coef_numel"], old[0]["state"]["numel"]
    assert used == 17 * 4096 and all(r["state"]["error"].numel() == 18 * 4096 for r in old)
    runs = [r[name] for r in resumed]
    for r in runs:  # every new rank starts from the saved parameters (replicated: one copy)
        assert _equal(r["loaded"]["params"], old[0]["params"]), (name, new)
        assert r["loaded"]["state"]["error"].numel() == {1: 17, 4: 20}[new] * 4096
        if "converted" in r["loaded"]:  # the offline converter gives the same state and parameters
            assert _equal(r["loaded"]["converted"]["params"], r["loaded"]["params"])
            assert _same_state(r["loaded"]["converted"]["state"], r["loaded"]["state"]), name
    # the error feedback's sum over the old ranks (fp64, rank order, rounded once) on new rank 0
    old_sum = sum_in_rank_order([r["state"]["error"][:used] for r in old]).to(torch.float32)
    assert old_sum.abs().max() > 0
    errors = [r["loaded"]["state"]["error"] for r in runs]
    total = errors[0].clone()
    for e in errors[1:]:
        total += e
    assert torch.equal(total[:used], old_sum) and not total[used:].any()
    assert not any(e.any() for e in errors[1:])
    # replicated momentum (signum: flat layout) from old rank 0; the owners' momentum re-cut
    if old[0]["state"]["momentum"] is not None:
        for r in runs:
            m = r["loaded"]["state"]["momentum"]
            assert torch.equal(m[:numel], old[0]["state"]["momentum"][:numel]) and not m[numel:].any()
    if old[0]["state"]["coef_momentum"] is not None:
        whole_old = torch.cat([r["state"]["coef_momentum"] for r in old])
        whole_new = torch.cat([r["loaded"]["state"]["coef_momentum"] for r in runs])
        assert whole_old.abs().max() > 0 and torch.equal(whole_new[:used], whole_old[:used])
        assert all(r["flushed"] for r in runs)  # the held mask was dropped: the first step sent everything
    # training goes on, the replicas bitwise equal
    assert all(_equal(r["after"], runs[0]["after"]) for r in runs)
    assert not _equal(runs[0]["after"], old[0]["params"])
    assert all(r["losses"] == runs[0]["losses"] for r in runs)
    assert len(runs[0]["losses"]) == MORE and all(math.isfinite(x) for x in runs[0]["losses"]), runs[0]["losses"]


def test_dct_elastic_resume_2_to_1_and_2_to_4(tmp_path):
    from scape_ds.checkpoint import convert_checkpoint

    root = str(tmp_path / "ckpt")
    saved = run_ranks(_worker, 2, tmp_path / "d2", root, None)
    converted = str(tmp_path / "converted")
    for name in RUNS:
        convert_checkpoint(os.path.join(root, name), 4, os.path.join(converted, name))
    for new, conv in ((1, None), (4, converted)):
        resumed = run_ranks(_worker, new, tmp_path / f"d{new}", root, conv)
        for name in RUNS:
            _check_load(saved, resumed, name, new)
            assert all(math.isfinite(x) for x in saved[0][name]["losses"])


# ---------------------------------------------------------------- ZeRO-3 (Stage3DctExchange): 2 -> 1 and 2 -> 4
Z3 = {"z3dct": dict(), "z3dct_replica": dict(param_exchange="sparse_replica")}


def _z3_config(scape: dict) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "ScapeAdamS", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8,
                                                         "weight_decay": 0.1}},
           "scape": dict(basis="dct", chunk_size=256, sparsity=0.9, dense_numel_threshold=1024, clip_local=1.0,
                         ef_decay=0.999, **scape)}
    if scape.get("param_exchange") == "sparse_replica":
        cfg["zero_optimization"] = {"stage": 3}  # every parameter persistent: the copies stay resident
    return cfg


def _z3_worker(rank, world_size, tmp_path, root):
    _set_env(rank)
    import scape_ds
    from scape_ds.checkpoint import load_checkpoint, save_checkpoint

    from .models import loss_fn, make_batch, make_mlp
    from .test_zero3 import _gathered

    out = {}
    for name, scape in Z3.items():
        engine, *_ = scape_ds.initialize(model=make_mlp(seed=5), config=_z3_config(scape))
        ex = engine.optimizer.scape
        ckpt = os.path.join(root, name)
        start = 0
        if world_size != 2:
            load_checkpoint(engine, ckpt)
            start = SAVED_AT
            loaded = dict(params=_gathered(engine), error=ex.coef_error.clone(), used=ex.tiles.tiles_numel)
        losses = []
        for step in range(start, start + (SAVED_AT if world_size == 2 else MORE)):
            loss = loss_fn(engine, *make_batch(step, rank))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        if world_size == 2:
            out[name] = dict(params=_gathered(engine), error=ex.coef_error.clone(), used=ex.tiles.tiles_numel)
            save_checkpoint(engine, ckpt, SAVED_AT, dict(step=SAVED_AT))
        else:
            out[name] = dict(loaded=loaded, losses=losses, after=_gathered(engine))
        engine.optimizer.synchronize()
    return out


def test_dct_elastic_resume_under_zero3_2_to_1_and_2_to_4(tmp_path):
    root = str(tmp_path / "ckpt")
    saved = run_ranks(_z3_worker, 2, tmp_path / "d2", root)
    for new in (1, 4):
        resumed = run_ranks(_z3_worker, new, tmp_path / f"d{new}", root)
        for name in Z3:
            old, runs = [r[name] for r in saved], [r[name] for r in resumed]
            used = old[0]["used"]
            assert all(r["loaded"]["used"] == used for r in runs)  # the tiles lie where they lay
            for r in runs:  # every new rank starts from the saved parameters (gathered from the partitions)
                assert torch.equal(r["loaded"]["params"], old[0]["params"]), (name, new)
            # the error feedback's sum over the old ranks (fp64, rank order, rounded once) on new rank 0
            old_sum = sum_in_rank_order([r["error"][:used] for r in old]).to(torch.float32)
            assert old_sum.abs().max() > 0
            errors = [r["loaded"]["error"] for r in runs]
            assert torch.equal(errors[0][:used], old_sum) and not errors[0][used:].any(), (name, new)
            assert not any(e.any() for e in errors[1:])
            # training goes on, the ranks' gathered parameters alike
            assert all(torch.equal(r["after"], runs[0]["after"]) for r in runs)
            assert not torch.equal(runs[0]["after"], old[0]["params"])
            assert all(math.isfinite(x) for r in runs for x in r["losses"])
