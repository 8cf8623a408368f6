"""Elastic resume on DeepSpeed engines (path A, stage 0, and path B, ZeRO-3): saved on 4 gloo ranks,
resumed on 2, saved again and resumed on 4; nothing is lost, and at sparsity 0 it equals dense AdamS
(under ZeRO-3: DeepSpeed's dense ZeRO-3 with AdamS) resumed the same way.

Six runs share the processes of each phase: on a small GPT at stage 0, SCAPE at sparsity 0.99, SCAPE
at sparsity 0 and dense AdamS; on a small MLP under ZeRO-3, the same three (SCAPE at sparsity 0 with
``param_exchange: "sparse_replica"``). Phase 0 (4 ranks) trains steps 1-3 and saves; phase 1 (2
ranks) loads that checkpoint (re-sharded in memory), trains steps 4-6 and saves; phase 2 (4 ranks)
loads it, the stage-0 0.99 run through ``python -m scape_ds.checkpoint convert``'s converted tag,
and trains steps 7-9.
``mask_refresh_interval`` 4: steps 1, 5, 9 are regular dense refreshes, so the dense steps 4 and 7
are the forced refreshes after the elastic loads. The ZeRO-3 runs load with ``load_checkpoint``,
which re-shards DeepSpeed's per-rank ZeRO-3 files in memory (there is no offline convert for them).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from .harness import run_ranks
from .test_deepspeed_engine import SEQ, _config, _engine, _params, _set_env

pytestmark = pytest.mark.timeout(600)

RUNS = ("scape99", "scape0", "dense")
PHASES = ((4, 0, 3), (2, 3, 6), (4, 6, 9))  # (ranks, first step done before, last step)
SCAPE = dict(chunk_size=256, mask_refresh_interval=4, dense_numel_threshold=1024)


def _run_config(name: str) -> dict:
    if name == "dense":
        return _config("dense_adams.json")
    return _config("scape_coordinate.json", sparsity=0.99 if name == "scape99" else 0.0, **SCAPE)


def _eval_loss(engine) -> float:
    """The loss of a fixed batch, the same on every rank (no step)."""
    from scape_ds.data import build_datasets, get_batch

    _, val = build_datasets()
    x, y = get_batch(val, 8, SEQ, 0)
    with torch.no_grad():
        return float(engine.module(x, y)[1])


def _train_steps(engine, data, start: int, stop: int):
    """Steps start+1..stop; returns the mean loss over ranks, whether each step was dense, and its lr."""
    from scape_ds.data import get_batch
    from scape_ds.engine import scape_optimizer

    losses, dense, lrs = [], [], []
    for step in range(start, stop):
        x, y = get_batch(data, 4, SEQ, step, dist.get_rank(), dist.get_world_size(), 0)
        _, loss = engine(x, y)
        engine.backward(loss)
        lrs.append(engine.get_lr()[0])  # this step's lr (the scheduler moves after the step)
        engine.step()
        total = torch.tensor([float(loss.detach())], dtype=torch.float64)
        dist.all_reduce(total)
        losses.append(float(total) / dist.get_world_size())
        opt = scape_optimizer(engine)
        dense.append(None if opt is None else opt.comm_stats["dense_step"])
    return losses, dense, lrs


def _worker(rank, world_size, tmp_path, phase, root):
    _set_env(rank)
    from scape_ds.checkpoint import load_checkpoint, save_checkpoint
    from scape_ds.data import build_datasets
    from scape_ds.engine import scape_optimizer

    train, _ = build_datasets()
    _, start, stop = PHASES[phase]
    out = {}
    for name in RUNS:
        engine = _engine(_run_config(name))
        ckpt = os.path.join(root, name)
        opt = scape_optimizer(engine)
        loaded = loaded_error = None
        if phase > 0:
            tag, client = load_checkpoint(engine, ckpt)
            assert client["step"] == start and engine.global_steps == start, (tag, client)
            loaded = (_eval_loss(engine), _params(engine))
            loaded_error = None if opt is None else opt.error_feedback().clone()
        losses, dense, lrs = _train_steps(engine, train, start, stop)
        error = None if opt is None else opt.error_feedback().clone()  # as saved below
        out[name] = dict(loaded=loaded, loaded_error=loaded_error, losses=losses, dense=dense, lrs=lrs,
                         saved=(_eval_loss(engine), _params(engine)), error=error)
        if phase < 2:
            save_checkpoint(engine, ckpt, stop, dict(step=stop))
    out.update(_zero3_runs(rank, root, phase))
    return out


Z3_RUNS = ("z3_99", "z3_0", "z3_dense")


def _zero3_config(name: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamS" if name == "z3_dense" else "ScapeAdamS",
                         "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}}}
    if name != "z3_dense":
        cfg["scape"] = {"sparsity": 0.99 if name == "z3_99" else 0.0, "chunk_size": 256, "mask_refresh_interval": 4}
    if name == "z3_0":  # the full replica on every rank (every parameter persistent) is rebuilt at the load too
        cfg["scape"]["param_exchange"] = "sparse_replica"
        cfg["zero_optimization"] = {"stage": 3}
    return cfg


def _zero3_runs(rank, root, phase) -> dict:
    """The ZeRO-3 runs of a phase: SCAPE 0.99, SCAPE 0 and DeepSpeed's dense ZeRO-3 with AdamS, each
    loading the previous phase's checkpoint (another data-parallel size: re-sharded on load)."""
    import scape_ds
    from scape_ds.checkpoint import load_checkpoint, save_checkpoint
    from scape_ds.zero3 import ScapeStage3

    from .models import loss_fn, make_batch, make_mlp
    from .test_zero3 import _gathered

    _, start, stop = PHASES[phase]
    x_eval, y_eval = make_batch(10**6, 0)
    out = {}
    for name in Z3_RUNS:
        engine, *_ = scape_ds.initialize(model=make_mlp(seed=5), config=_zero3_config(name))
        zopt = engine.optimizer
        scape = isinstance(zopt, ScapeStage3)

        def snapshot():
            with torch.no_grad():
                loss = float(loss_fn(engine, x_eval, y_eval))
            error = {i: e.clone() for i, e in zopt.scape.state_dict()["error"].items()} if scape else None
            return loss, _gathered(engine), error

        loaded = None
        if phase > 0:
            tag, client = load_checkpoint(engine, os.path.join(root, name))
            assert client["step"] == start and engine.global_steps == start, (tag, client)
            loaded = snapshot()
        losses, dense, lrs = [], [], []
        for step in range(start, stop):
            loss = loss_fn(engine, *make_batch(step, rank))
            engine.backward(loss)
            lrs.append(engine.get_lr()[0])
            engine.step()
            total = torch.tensor([float(loss.detach())], dtype=torch.float64)
            dist.all_reduce(total)
            losses.append(float(total) / dist.get_world_size())
            dense.append(zopt.comm_stats["dense_step"] if scape else None)
        out[name] = dict(loaded=loaded, losses=losses, dense=dense, lrs=lrs, saved=snapshot())
        if phase < 2:
            save_checkpoint(engine, os.path.join(root, name), stop, dict(step=stop))
        if scape:
            zopt.synchronize()
    if phase == 2:  # another model: refused on every rank, in one line, before any loading collective
        engine, *_ = scape_ds.initialize(model=make_mlp(seed=5, hidden=96), config=_zero3_config("z3_99"))
        try:
            load_checkpoint(engine, os.path.join(root, "z3_99"))
            out["z3_other_model"] = "loaded"
        except ValueError as e:
            out["z3_other_model"] = str(e)
    return out


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b))


def _owed_decay(run: dict, weight_decay: float = 0.1) -> float:
    """The decay owed outside the last mask at the save: prod(1 - lr_t wd) over the sparse steps
    after the last dense one, from the run's recorded steps and lrs (not from the code under test)."""
    debt = 1.0
    for dense, lr in zip(run["dense"], run["lrs"]):
        debt = 1.0 if dense else debt * (1.0 - lr * weight_decay)
    return debt


def _check_decay_settled(loaded: list[torch.Tensor], saved: list[torch.Tensor], debt: float) -> None:
    """A load settles the owed decay: each coordinate is either exactly as saved (kept by the last
    mask, or a dense parameter) or ``saved * debt`` (fp32 rounding), and most are the latter (the
    mask keeps 1%). Unsettled, every coordinate equals the saved one and this fails."""
    assert debt < 1.0 - 1e-5, debt  # a sparse step came after the last dense one: decay is owed
    exact = settled = 0
    for a, b in zip(loaded, saved):
        a, b = a.double().flatten(), b.double().flatten()
        nonzero = b != 0
        assert torch.equal(a[~nonzero], b[~nonzero])
        ratio = a[nonzero] / b[nonzero]
        is_exact, is_settled = ratio == 1.0, (ratio - debt).abs() <= 1e-6
        assert (is_exact | is_settled).all(), ratio[~(is_exact | is_settled)][:5]
        exact, settled = exact + int(is_exact.sum()), settled + int(is_settled.sum())
    assert settled >= 0.5 * (exact + settled), (exact, settled, debt)


def test_elastic_resume_4_to_2_to_4(tmp_path):
    from scape_ds.checkpoint import convert_checkpoint
    from scape_ds.checkpoint.reshard import sum_in_rank_order

    root = str(tmp_path / "ckpt")
    phases = []
    for phase, (ranks, _, _) in enumerate(PHASES):
        if phase == 2:  # the 0.99 run resumes on 4 ranks from the offline-converted tag
            convert_checkpoint(os.path.join(root, "scape99"), 4)
        phases.append(run_ranks(_worker, ranks, tmp_path / f"p{phase}", phase, root))

    for phase in (1, 2):
        before, after = phases[phase - 1], phases[phase]
        for name in RUNS:
            saved_loss, saved_params = before[0][name]["saved"]
            for r in after:  # every new rank resumes from the saved model, the replicas alike
                loaded_loss, loaded_params = r[name]["loaded"]
                if name == "scape99":  # the decay owed outside the old mask was settled at the load
                    assert abs(loaded_loss - saved_loss) < 1e-4, (phase, loaded_loss, saved_loss)
                    _check_decay_settled(loaded_params, saved_params, _owed_decay(before[0][name]))
                else:
                    assert loaded_loss == saved_loss and _max_diff(loaded_params, saved_params) == 0.0, (phase, name)
                assert _max_diff(r[name]["loaded"][1], after[0][name]["loaded"][1]) == 0.0
                assert _max_diff(r[name]["saved"][1], after[0][name]["saved"][1]) == 0.0  # replicas equal
        # the error feedback not yet sent, summed over the old ranks, is on new rank 0 (rounded once
        # to fp32), zero elsewhere; the padding of both layouts holds none
        old_sum = sum_in_rank_order([r["scape99"]["error"] for r in before])
        n = min(old_sum.numel(), after[0]["scape99"]["loaded_error"].numel())
        assert old_sum.abs().max() > 0 and not old_sum[n:].any()
        new_errors = [r["scape99"]["loaded_error"] for r in after]
        assert new_errors[0].dtype == torch.float32 and not new_errors[0][n:].any()
        assert torch.equal(new_errors[0][:n], old_sum[:n].float())
        assert not any(e.any() for e in new_errors[1:])
        # the first step after each load is a forced dense refresh (steps 4 and 7 are not refreshes)
        assert [r["scape99"]["dense"] for r in after] == [[True, True, False] if phase == 1 else [True, False, True]] \
            * len(after)

    losses = {name: [loss for p in phases for loss in p[0][name]["losses"]] for name in RUNS}
    for name in RUNS:
        assert losses[name][-1] < losses[name][0] - 0.05, (name, losses[name])  # training continued
    # sparsity 0 resumed elastically equals dense AdamS resumed the same way
    assert max(abs(a - b) for a, b in zip(losses["scape0"], losses["dense"])) <= 1e-5, losses
    assert _max_diff(phases[2][0]["scape0"]["saved"][1], phases[2][0]["dense"]["saved"][1]) <= 1e-5
    _check_zero3(phases)


def _check_zero3(phases):
    """ZeRO-3: every run resumes from the model it saved (SCAPE 0.99: with the decay owed outside the
    last mask settled), replicas equal, the error feedback sum kept, and at sparsity 0 the same run
    as DeepSpeed's dense ZeRO-3 with AdamS resumed the same way."""
    from scape_ds.checkpoint.reshard import sum_in_rank_order

    for phase in (1, 2):
        before, after = phases[phase - 1], phases[phase]
        for name in Z3_RUNS:
            saved_loss, saved_params, saved_error = before[0][name]["saved"]
            for r in after:
                loaded_loss, loaded_params, _ = r[name]["loaded"]
                if name == "z3_99":  # the decay owed outside the last mask, settled at the load
                    assert abs(loaded_loss - saved_loss) < 1e-2, (phase, loaded_loss, saved_loss)
                    debt = _owed_decay(before[0][name])
                    # lr wd = 1e-3; phase 0 saved after sparse steps 2 and 3, phase 1 after sparse step 6
                    assert debt == pytest.approx((1 - 1e-3) ** (2 if phase == 1 else 1), rel=1e-12)
                    _check_decay_settled([loaded_params], [saved_params], debt)
                else:
                    assert loaded_loss == saved_loss and torch.equal(loaded_params, saved_params), (phase, name)
                assert torch.equal(r[name]["loaded"][1], after[0][name]["loaded"][1])  # replicas equal
                assert torch.equal(r[name]["saved"][1], after[0][name]["saved"][1])
        # error feedback: the old ranks' sum (fp64, rank order), rounded once to fp32, on new rank 0
        for name in ("z3_99", "z3_0"):
            new_errors = [r[name]["loaded"][2] for r in after]
            old_errors = [r[name]["saved"][2] for r in before]
            assert sorted(new_errors[0]) == sorted(old_errors[0]) != []
            nonzero = 0
            for i in old_errors[0]:
                n = min(old_errors[0][i].numel(), new_errors[0][i].numel())  # numel <= both padded sizes
                old_sum = sum_in_rank_order([e[i] for e in old_errors])
                assert not old_sum[n:].any() and not new_errors[0][i][n:].any()
                assert new_errors[0][i].dtype == torch.float32
                assert torch.equal(new_errors[0][i][:n], old_sum[:n].float())
                assert not any(e[i].any() for e in new_errors[1:])
                nonzero += bool(old_sum.any())
            assert nonzero > 0 if name == "z3_99" else nonzero == 0  # sparsity 0: every step flushes it
        # the first step after each load is a forced dense refresh that chooses masks (step 4 is not a
        # refresh; step 8 after the forced step 7 is sparse)
        assert [r["z3_99"]["dense"] for r in after] == [[True, True, False] if phase == 1 else [True, False, True]] \
            * len(after)
    refused = {r["z3_other_model"] for r in phases[2]}
    assert len(refused) == 1 and "\n" not in (line := refused.pop()), refused
    assert "global_step6 holds 6 parameters of 16832 elements, this model 6 of 12640 (or in another order)" in line
    losses = {name: [loss for p in phases for loss in p[0][name]["losses"]] for name in Z3_RUNS}
    for name in Z3_RUNS:
        assert losses[name][-1] < losses[name][0] - 0.05, (name, losses[name])  # training continued
    # sparsity 0 resumed elastically equals dense ZeRO-3 with AdamS resumed the same way
    assert max(abs(a - b) for a, b in zip(losses["z3_0"], losses["z3_dense"])) <= 1e-5, losses
    assert float((phases[2][0]["z3_0"]["saved"][1] - phases[2][0]["z3_dense"]["saved"][1]).abs().max()) <= 1e-5
