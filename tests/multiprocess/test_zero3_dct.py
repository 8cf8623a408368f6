"""basis "dct" under DeepSpeed ZeRO stage 3 (scape_ds/optim/stage3_dct.py) on gloo ranks.

The yardstick is stage 1's basis "dct" (``ScapeAdamS``) on the same model, data and config: the
exchange is the same code on the same tiles, so at sparsity 0 and at 0.99 the two must move the
parameters alike.
"""
from __future__ import annotations

import os

import pytest
import torch

from .harness import run_ranks
from .models import flat_params, loss_fn, make_batch, make_mlp
from .test_zero3 import _equal_on_all_ranks, _from_partitions, _GatherCounter, _gathered

# ZeRO-3 engines on 2-4 ranks, each 20-60 s on 2 busy cores
pytestmark = pytest.mark.timeout(900)

OPT = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
DCT = dict(basis="dct", chunk_size=256, ef_decay=0.999, clip_local=1.0)  # 16 x 16 tiles


def _config(stage: int, sparsity: float, gas: int = 1, exchange: str = "dense", clipping: float = 1.0,
            **scape) -> dict:
    """Stage 1 or 3, basis "dct" (``DCT`` updated by ``scape``), AdamS's hyperparameters ``OPT``."""
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": gas, "gradient_clipping": clipping,
           "steps_per_print": 10**9, "optimizer": {"type": "ScapeAdamS", "params": OPT},
           "scape": dict(DCT, **({} if "tile_budget" in scape else dict(sparsity=sparsity)), **scape)}
    if stage == 3:
        persistent = {} if exchange == "sparse_replica" else {"stage3_param_persistence_threshold": 0}
        cfg["zero_optimization"] = {"stage": 3, **persistent}
        cfg["scape"]["param_exchange"] = exchange
    else:
        cfg["zero_optimization"] = {"stage": 1}
    return cfg


def _setup(rank):
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _params(engine, stage: int) -> torch.Tensor:
    """Every parameter, flattened, as forward would use it (ZeRO-3: gathered)."""
    return _gathered(engine) if stage == 3 else flat_params(engine.module)


def _train(rank, stage, cfg, steps, model_kw, on_step=None):
    """``steps`` optimizer steps of ``cfg``; returns (parameters after every step, comm_stats, engine)."""
    import scape_ds

    gas, bf16 = cfg["gradient_accumulation_steps"], "bf16" in cfg
    engine, *_ = scape_ds.initialize(model=make_mlp(seed=5, **model_kw), config=cfg)
    after, stats = [], []
    for step in range(steps):
        for micro in range(gas):
            x, y = make_batch(step * gas + micro, rank)
            loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y) if bf16 else loss_fn(engine, x, y)
            engine.backward(loss)
            engine.step()
        after.append(_params(engine, stage))
        stats.append(dict(engine.optimizer.comm_stats))
        if on_step is not None:
            on_step(engine)
    engine.optimizer.synchronize()
    return after, stats, engine


# ---------------------------------------------------------------- (1) sparsity 0: ZeRO-3 == stage 1
def _worker_against_stage1(rank, world_size, tmp_path, steps, gas, model_kw, scape):
    _setup(rank)
    one, _, _ = _train(rank, 1, _config(1, 0.0, gas, **scape), steps, model_kw)
    three, _, engine = _train(rank, 3, _config(3, 0.0, gas, **scape), steps, model_kw)
    diffs = [float((a - b).abs().max()) for a, b in zip(one, three)]
    moved = float((three[-1] - one[0]).abs().max())
    clipped = getattr(engine.optimizer, "_global_grad_norm", None)
    return diffs, moved, type(engine.optimizer).__name__, None if clipped is None else float(clipped)


@pytest.mark.parametrize("world_size,gas,model_kw,scape", [
    (2, 2, dict(bias=False, norm=False), dict(dct_update="sign")),
    (2, 1, dict(bias=True, norm=True), dict(dct_update="sign")),
    (2, 1, dict(bias=True, norm=True), dict(dct_update="adams", mask="shared", clip_local=0.0, clipping=0.05)),
    (2, 1, dict(bias=True, norm=True), dict(dct_update="rms", clip_local=0.0, clipping=0.05)),
    (4, 1, dict(bias=False, norm=False), dict(dct_update="signum")),
], ids=["sign-gas2-weights", "sign-bias-norm", "adams-shared-clipped-bias-norm", "rms-clipped-bias-norm",
        "signum-4ranks"])
def test_sparsity_zero_matches_stage1_dct(tmp_path, world_size, gas, model_kw, scape):
    results = run_ranks(_worker_against_stage1, world_size, tmp_path, 12, gas, model_kw, scape)
    for diffs, moved, cls, norm in results:
        assert cls == "ScapeStage3"
        assert moved > 0.05, moved
        assert max(diffs) == 0.0, diffs  # bitwise, after every step
    if "clipping" in scape:  # ZeRO-3's gradient_clipping acted (on the dense tensors; on u too for "adams")
        assert results[0][3] > 2 * scape["clipping"], results[0][3]


# ---------------------------------------------------------------- (2) sparsity 0.99: replicas bitwise
def _worker_sparse(rank, world_size, tmp_path, steps, exchange, bf16, scape):
    """Stage 1, then ZeRO-3 at 0.99: after every step the gathered parameters on every rank, the
    sparse_replica copy against the partitions, ZeRO-3's parameter fetches; the bytes and memory."""
    _setup(rank)
    one, one_stats, _ = ([], [], None) if bf16 else _train(rank, 1, _config(1, 0.99, **scape), steps, {})
    cfg = _config(3, 0.99, exchange=exchange, **scape)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    checks = dict(unequal=0, stale=0, fetches=[])
    counter = _GatherCounter()

    def on_step(engine):
        gathered = _gathered(engine)
        checks["unequal"] += not _equal_on_all_ranks(gathered)
        checks["stale"] += not torch.equal(gathered, _from_partitions(engine))
        checks["fetches"].append(counter.calls)
        counter.calls = 0

    counter.on = True
    three, three_stats, engine = _train(rank, 3, cfg, steps, {}, on_step)
    counter.on = False
    ex = engine.optimizer.scape
    diffs = [float((a - b).abs().max()) for a, b in zip(one, three)]
    return dict(checks, diffs=diffs, one_stats=one_stats, stats=three_stats, memory=engine.optimizer.memory_bytes(),
                dtype=str(three[-1].dtype), kc=engine.optimizer.cfg.k_per_chunk,
                coef=ex.coef_error.numel(), n_pad=ex.local_grads.numel())


@pytest.mark.parametrize("exchange,bf16,scape", [
    ("dense", False, {}), ("sparse_replica", False, dict(dct_update="rms")), ("dense", True, dict(mask="shared")),
    ("sparse_replica", False, dict(value_bits=8)), ("dense", False, dict(tile_budget=8)),
    ("dense", False, dict(tile_budget=8, index_code="elias_fano")),
    ("sparse_replica", False, dict(mask="shared", value_bits=8)),
], ids=["dense", "sparse_replica-rms", "dense-bf16-shared", "sparse_replica-8bit", "tile_budget-8",
        "tile_budget-8-elias_fano", "sparse_replica-shared-8bit"])
def test_sparse_replicas_bitwise_equal_and_match_stage1(tmp_path, exchange, bf16, scape):
    results = run_ranks(_worker_sparse, 2, tmp_path, 10, exchange, bf16, scape)
    for r in results:
        assert r["unequal"] == 0 and r["stale"] == 0, r  # every step: all ranks alike, copies == partitions
        assert r["dtype"] == ("torch.bfloat16" if bf16 else "torch.float32")
        if not bf16:
            assert max(r["diffs"]) == 0.0, r["diffs"]  # the same exchange and update as stage 1, bitwise
            if exchange == "sparse_replica":
                assert r["fetches"][1:] == [0] * (len(r["fetches"]) - 1), r["fetches"]  # the copy: no fetch
            else:
                assert all(f > 0 for f in r["fetches"]), r["fetches"]  # ZeRO-3's own all-gathers
        # by hand: two 128 x 64 weights (64 tiles of 16 x 16, coefficients 16384 = N_pad), four dense
        # tensors (pieces of 64, 64, 64, 32 on 2 ranks) accumulated whole, fp32
        m = r["memory"]
        assert r["coef"] == r["n_pad"] == 16384
        assert m["error_feedback"] == 4 * 16384 and m["local_grads"] == 4 * 16384 + 4 * 2 * 224, m
        assert m["replica"] == (4 * 16832 if exchange == "sparse_replica" else 0), m
        assert m["masks"] == 0, m  # mask "shared" with a fresh mask every step keeps none
        # (3) bytes per step, by hand (D = 2, kc = round(0.01 * 256) = 3 of each tile's 256 coefficients;
        # tile_budget 8: 8 // D = 4, set by the number of ranks under ZeRO-3 and stage 1 alike)
        kc = scape["tile_budget"] // 2 if "tile_budget" in scape else 3
        assert r["kc"] == kc  # what the engine's optimizer reports is what its exchange runs
        if scape.get("mask") == "shared" and scape.get("value_bits") == 8:  # 2 slots a tile; each owner's 32
            # tiles: 64 one-byte codes and 32 fp32 scales, to the other rank in the all-to-all and again summed
            exchange_bytes = {"index_ag": 64 * 1 * 2, "grad_a2a": 64 + 32 * 4, "grad_ag": 64 + 32 * 4}
        elif scape.get("mask") == "shared":  # K = kc // D = 1 nomination per tile and rank
            exchange_bytes = {"index_ag": 64 * 1 * 2, "grad_rs": 64 * 2 * 4 // 2, "grad_ag": 64 * 1 * 4}
        elif scape.get("value_bits") == 8:  # per_rank, each value one byte plus one fp32 scale per tile
            exchange_bytes = {"grad_ag": 64 * 3 * 1 + 64 * 4, "index_ag": 64 * 3 * 2}
        elif scape.get("index_code") == "elias_fano":  # kc = 4 of 256: 6 low bits each and a bitmap of
            exchange_bytes = {"grad_ag": 64 * kc * 4, "index_ag": 64 * 4}  # 4 + 256 / 64 bits: 4 bytes a tile
        else:  # per_rank: every rank's 64 x kc values (fp32) and in-tile offsets (int16) all-gathered
            exchange_bytes = {"grad_ag": 64 * kc * 4, "index_ag": 64 * kc * 2}
        # the dense tensors' 448 fp32 gradients: stage 1 all-reduces them, ZeRO-3 reduce-scatters their
        # 2 x 224 padded pieces (half the bytes) and, under sparse_replica, all-gathers their new values
        zero3_extra = {"dense_rs": 224 * 4} | ({"param_ag": 224 * 4} if exchange == "sparse_replica" else {})
        # dense ZeRO-3's yardstick: the reduce-scatter of every parameter's 2 pieces (sum P = 8416, in its
        # communication dtype: bf16 under bf16; SCAPE sends fp32) and, under sparse_replica, the all-gather
        yardstick = 8416 * (2 if bf16 else 4) * (2 if exchange == "sparse_replica" else 1)
        for s in r["stats"][1:]:  # the first step also gathers the copies whole (sparse_replica)
            assert s["by_tag"] == exchange_bytes | zero3_extra, s
            assert s["bytes_dense"] == yardstick, s
        for s in r["one_stats"][1:]:
            assert s["by_tag"] == exchange_bytes | {"dense_ar": 2 * 448 * 4 // 2}, s


# ---------------------------------------------------------------- (4) exact resume on the same D
def _worker_resume(rank, world_size, tmp_path, exchange, scape):
    """8 steps straight == 4 steps, save, a new engine loads, 4 more (sparsity 0.99, gas 2); then a
    coordinate-basis engine refuses the checkpoint."""
    _setup(rank)
    import scape_ds
    from scape_ds.checkpoint import load_checkpoint, save_checkpoint

    cfg = _config(3, 0.99, 2, exchange, **scape)

    def engine_(config=cfg):
        engine, *_ = scape_ds.initialize(model=make_mlp(seed=5), config=config)
        return engine

    def train(engine, start, stop):
        losses = []
        for step in range(start, stop):
            for micro in range(2):
                x, y = make_batch(step * 2 + micro, rank)
                loss = loss_fn(engine, x, y)
                engine.backward(loss)
                engine.step()
                losses.append(float(loss))
        return losses

    straight = engine_()
    ref = train(straight, 0, 8)
    ref_params = _gathered(straight)
    first = engine_()
    part = train(first, 0, 4)
    ckpt = os.path.join(tmp_path, "ckpt")
    save_checkpoint(first, ckpt, 4, dict(step=4))
    saved = first.optimizer.scape.state_dict()
    resumed = engine_()
    tag, client = load_checkpoint(resumed, ckpt)
    part += train(resumed, client["step"], 8)
    same_state = torch.equal(resumed.optimizer.scape.coef_error, straight.optimizer.scape.coef_error)
    coordinate = _config(3, 0.99, 2, exchange)
    coordinate["scape"] = dict(sparsity=0.99, chunk_size=256, param_exchange=exchange)
    try:
        load_checkpoint(engine_(coordinate), ckpt)
        refused = ""
    except ValueError as e:
        refused = str(e)
    return (ref == part, torch.equal(ref_params, _gathered(resumed)), same_state, tag, refused,
            saved["dct"]["local_grads"] is None, saved["dct"]["held_mask"] is not None)


def _worker_elastic(rank, world_size, tmp_path, exchange, scape):
    """The 2-rank checkpoint of :func:`_worker_resume` loaded on ``world_size`` ranks: refused."""
    _setup(rank)
    import scape_ds
    from scape_ds.checkpoint import load_checkpoint

    engine, *_ = scape_ds.initialize(model=make_mlp(seed=5), config=_config(3, 0.99, 2, exchange, **scape))
    with pytest.raises(ValueError) as err:
        load_checkpoint(engine, os.path.join(tmp_path, "ckpt"))
    return str(err.value)


@pytest.mark.parametrize("exchange,scape", [
    ("dense", dict(mask="shared", mask_source="momentum", mask_refresh_interval=3, dct_update="signum")),
    ("sparse_replica", {}),
], ids=["dense-momentum-mask-signum", "sparse_replica-sign"])
def test_exact_resume_under_zero3_dct(tmp_path, exchange, scape):
    results = run_ranks(_worker_resume, 2, tmp_path, exchange, scape)
    for same_losses, same_params, same_state, tag, refused, emptied, held in results:
        assert same_losses and same_params and same_state and tag == "global_step4", results
        assert emptied  # the local gradient accumulators are empty between steps: not saved
        assert held == (scape.get("mask_source") == "momentum")  # the next step's mask travels in the state
        assert "saved with scape.basis 'dct', this run has 'coordinate'" in refused, refused
    if exchange == "dense":
        for message in run_ranks(_worker_elastic, 1, tmp_path, exchange, scape):  # one line, naming the basis
            assert "scape.basis 'dct'" in message and "elastic" in message and "\n" not in message, message


# ---------------------------------------------------------------- (5) what ZeRO-3 refuses, in one line
@pytest.mark.parametrize("scape,bf16,match", [
    (dict(basis="dct"), False, None),  # runs: the refusal of basis "dct" under ZeRO-3 is gone
    (dict(basis="dct", mask="shared", mask_source="momentum", dct_update="adams", param_exchange="dense"), True, None),
    (dict(basis="dct", dct_update="adams_coef"), False, "scape.dct_update 'adams_coef' is not built for ZeRO stage 3"),
    (dict(basis="dct", overlap=True, param_exchange="sparse_replica"), False,
     "scape.overlap with basis 'dct' is not built for ZeRO stage 3"),
    (dict(basis="dct", dct_update="signum", param_exchange="sparse_replica"), False,
     "'sparse_replica' with basis 'dct' moves every rank's full copy"),
    (dict(basis="dct", param_exchange="sparse_replica"), True, "'sparse_replica' with basis 'dct' runs in fp32 only"),
    (dict(clip_local=1.0), False, "scape.clip_local is not built for the coordinate basis under ZeRO stage 3"),
])
def test_stage3_dct_settings_run_or_are_refused_in_one_line(scape, bf16, match):
    from scape_ds.config import parse_scape_config
    from scape_ds.zero3 import check_stage3_config

    cfg = {"zero_optimization": {"stage": 3}, "bf16": {"enabled": bf16}}
    if match is None:
        check_stage3_config(cfg, parse_scape_config(scape))
        return
    with pytest.raises(ValueError, match=match) as err:
        check_stage3_config(cfg, parse_scape_config(scape))
    assert "\n" not in str(err.value)
