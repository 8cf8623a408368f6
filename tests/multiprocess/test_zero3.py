"""SCAPE under DeepSpeed ZeRO stage 3 (scape_ds/zero3.py) on gloo ranks."""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
import torch.distributed as dist

from .harness import run_ranks
from .models import loss_fn, make_batch, make_mlp

# DeepSpeed ZeRO-3 engines on 2 ranks: 57-87 s each measured at load ~20 (tests/README.md); 900 s
# leaves room on a busier machine and still ends a hang (scape_ds.spawn kills the ranks)
pytestmark = pytest.mark.timeout(900)

OPT = {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def _config(opt_type: str, sparsity: float | None = None, gas: int = 1, T: int = 4, exchange: str = "dense") -> dict:
    zero = {"stage": 3} if exchange == "sparse_replica" else {"stage": 3, "stage3_param_persistence_threshold": 0}
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
           "steps_per_print": 10**9, "zero_optimization": zero, "optimizer": {"type": opt_type, "params": OPT}}
    if sparsity is not None:
        cfg["scape"] = {"sparsity": sparsity, "mask_refresh_interval": T, "chunk_size": 256, "param_exchange": exchange}
    return cfg


def _gathered(engine) -> torch.Tensor:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    params = list(engine.module.parameters())
    # what forward would use; gathering (and then releasing) a resident replica would free it
    absent = [p for p in params if p.ds_status != ZeroParamStatus.AVAILABLE]
    with deepspeed.zero.GatheredParameters(absent):
        return torch.cat([p.detach().reshape(-1).clone() for p in params])


def _from_partitions(engine) -> torch.Tensor:
    """Every parameter rebuilt from the ZeRO-3 partitions (the truth a replica must equal)."""
    full = []
    for p in engine.module.parameters():
        pieces = [torch.empty_like(p.ds_tensor) for _ in range(dist.get_world_size())]
        dist.all_gather(pieces, p.ds_tensor)
        full.append(torch.cat([x.reshape(-1) for x in pieces])[: p.ds_numel])
    return torch.cat(full)


class _GatherCounter:
    """Counts DeepSpeed's all-gathers (ZeRO-3 parameter fetches) while it is on."""

    def __init__(self):
        from deepspeed.comm import comm

        self.cdb, self.calls, self.on = comm.cdb, 0, False
        for name in ("all_gather_into_tensor", "all_gather", "all_gather_coalesced"):
            if hasattr(self.cdb, name):
                setattr(self.cdb, name, self._counting(getattr(self.cdb, name)))

    def _counting(self, fn):
        def counted(*args, **kwargs):
            self.calls += self.on
            return fn(*args, **kwargs)
        return counted


def _equal_on_all_ranks(t: torch.Tensor) -> bool:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(out[0], o) for o in out)


def _worker(rank, world_size, tmp_path, opt_type, sparsity, steps, gas, exchange="dense", bf16=False, comm_dtype=None):
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import scape_ds

    model = make_mlp(seed=5, bias=True, norm=True)
    cfg = _config(opt_type, sparsity, gas, exchange=exchange)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if comm_dtype:
        cfg["communication_data_type"] = comm_dtype
    engine, *_ = scape_ds.initialize(model=model, config=cfg)
    counter = _GatherCounter()
    losses, unequal, stale, stats, fetches, dtypes = [], 0, 0, [], [], set()
    for step in range(steps):
        total = 0.0
        counter.calls, counter.on = 0, True  # forward and backward: ZeRO-3's parameter fetches
        for micro in range(gas):
            x, y = make_batch(step * gas + micro, rank)
            loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y) if bf16 else loss_fn(engine, x, y)
            engine.backward(loss)
            if micro == gas - 1:
                counter.on = False
            engine.step()
            total += float(loss)
        fetches.append(counter.calls)
        t = torch.tensor([total / gas], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t) / world_size)
        gathered = _gathered(engine)
        dtypes.add(str(gathered.dtype))
        unequal += not _equal_on_all_ranks(gathered)
        stale += not torch.equal(gathered, _from_partitions(engine))
        stats.append(dict(getattr(engine.optimizer, "comm_stats", {})))
    memory = None
    if hasattr(engine.optimizer, "synchronize"):
        engine.optimizer.synchronize()
        zopt = engine.optimizer
        sparse = [p for p in zopt.scape.params if p.ds_id not in zopt.scape.dense_ids]
        memory = dict(bytes=zopt.memory_bytes(), ef=4 * sum(world_size * zopt.scape.piece(p) for p in sparse),
                      partitions=4 * sum(zopt.scape.piece(p) for p in zopt.scape.params),
                      sparse_numel=sum(p.ds_numel for p in sparse), numel=sum(p.ds_numel for p in zopt.scape.params))
    return dict(losses=losses, unequal=unequal, stale=stale, stats=stats, memory=memory, fetches=fetches, dtypes=dtypes)


def _worker_all(rank, world_size, tmp_path, steps, gas):
    """DeepSpeed's dense ZeRO-3 with AdamS, then the SCAPE stage 3 at sparsity 0 in both modes, in one process."""
    return [_worker(rank, world_size, tmp_path, "AdamS", None, steps, gas)] + \
        [_worker(rank, world_size, tmp_path, "ScapeAdamS", 0.0, steps, gas, exchange)
         for exchange in ("dense", "sparse_replica")]


@pytest.mark.parametrize("gas", [1, 2])
def test_sparsity_zero_reproduces_deepspeed_dense_zero3(tmp_path, gas):
    dense, scape, replica = run_ranks(_worker_all, 2, tmp_path, 20, gas)[0]
    d = dense["losses"]
    assert d[-1] < d[0]
    for run in (scape, replica):
        assert max(abs(a - b) for a, b in zip(d, run["losses"])) < 1e-5, (d, run["losses"])


@pytest.mark.parametrize("exchange", ["dense", "sparse_replica"])
def test_sparse_099_replicas_equal_and_bytes_cut(tmp_path, exchange):
    results = run_ranks(_worker, 2, tmp_path, "ScapeAdamS", 0.99, 12, 1, exchange)
    losses = results[0]["losses"]
    assert losses[-1] < losses[0], losses
    assert all(r["unequal"] == 0 and r["stale"] == 0 for r in results), [(r["unequal"], r["stale"]) for r in results]
    m = results[0]["memory"]
    memory, n_params = m["bytes"], m["numel"]
    # a full fp32 gradient-size buffer per rank for the sparse-exchanged tensors (the dense ones have none)
    assert memory["error_feedback"] == m["ef"] >= 4 * m["sparse_numel"] and m["sparse_numel"] < n_params
    assert memory["fp32_partitions"] == memory["momentum"] == m["partitions"]  # ZeRO-3 holds 1/D of everything
    dense_share = 1 - m["sparse_numel"] / n_params  # biases and the LayerNorm: reduced whole every step
    sparse = [s for s in results[0]["stats"] if not s["dense_step"]]
    assert len(sparse) >= 8
    fetches = results[0]["fetches"]
    if exchange == "dense":
        assert memory["replica"] == 0
        assert all(f > 0 for f in fetches), fetches  # ZeRO-3 gathers parameters in forward and backward
        for s in sparse:  # masks included, against ZeRO-3's dense reduce-scatter
            assert (s["by_tag"].get("grad_rs", 0) + s["by_tag"].get("mask_ag", 0)) * 30 <= s["bytes_dense"], s
            assert s["by_tag"]["dense_rs"] == round(dense_share * s["bytes_dense"])  # whole, fp32 as ZeRO-3's
    else:
        assert memory["replica"] == 4 * n_params  # a full fp32 copy of every parameter
        assert fetches[1:] == [0] * (len(fetches) - 1), fetches  # the replica: no fetch after the first forward
        first = results[0]["stats"][0]  # a dense step sends exactly dense ZeRO-3's RS + AG (plus the first masks)
        by_tag = first["by_tag"]
        assert first["dense_step"]
        assert by_tag["grad_rs"] + by_tag["dense_rs"] + by_tag["param_ag"] == first["bytes_dense"]
        for s in sparse:  # everything sent (masks, gradients, parameters) against dense ZeRO-3's RS + AG; the
            assert s["bytes_sent"] <= (0.03 + dense_share) * s["bytes_dense"], s  # dense tensors' share goes whole
            assert s["by_tag"]["param_ag"] > 0


def _worker_ef(rank, world_size, tmp_path, steps, gas):
    """Every local gradient = what the reduce-scatter delivered (times D) + what error feedback holds."""
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import scape_ds

    model = make_mlp(seed=5, bias=True, norm=True)
    cfg = _config("ScapeAdamS", 0.95, gas, T=3)
    cfg["gradient_clipping"] = 0.0  # the flat gradient the optimizer sees is then exactly what was delivered
    engine, *_ = scape_ds.initialize(model=model, config=cfg)
    zopt = engine.optimizer
    D = dist.get_world_size()
    params = zopt.scape.params
    local = {p.ds_id: torch.zeros(D * zopt.scape.piece(p), dtype=torch.float64) for p in params}
    delivered = {id(f): torch.zeros(f.numel(), dtype=torch.float64) for f in zopt.fp32_partitioned_groups_flat}
    reduce = zopt._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads

    def recording_reduce(ps, dtype):
        for p in ps:
            local[p.ds_id][: p.ds_numel] += p.grad.reshape(-1).double()
        return reduce(ps, dtype)

    zopt._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads = recording_reduce
    inner_step = zopt.optimizer.step

    def recording_step(closure=None):
        for group in zopt.optimizer.param_groups:
            for f in group["params"]:
                delivered[id(f)] += f.grad.double()
        return inner_step(closure)

    zopt.optimizer.step = recording_step
    for step in range(steps):
        for micro in range(gas):
            x, y = make_batch(step * gas + micro, rank)
            engine.backward(loss_fn(engine, x, y))
            engine.step()
    zopt.synchronize()
    worst = 0.0
    for flat, offset, p in zopt._positions():
        P = zopt.scape.piece(p)
        mine = delivered[id(flat)][offset: offset + P]  # (P,) mean delivered at this rank's piece
        pieces = [torch.empty_like(mine) for _ in range(D)]
        dist.all_gather(pieces, mine)
        sent_total = torch.cat(pieces) * D  # (D*P,) sum over ranks of everything sent
        total_local = local[p.ds_id].clone()
        total_error = zopt.error.get(p.ds_id, torch.zeros_like(total_local)).double()  # dense tensors keep none
        dist.all_reduce(total_local)
        dist.all_reduce(total_error)
        worst = max(worst, float((sent_total + total_error - total_local)[: p.ds_numel].abs().max()))
    return worst, sum(not s for s in [zopt.scape.is_dense(t) for t in range(1, steps + 1)])


def test_error_feedback_conserves_everything_under_zero3(tmp_path):
    results = run_ranks(_worker_ef, 2, tmp_path, 10, 2)  # with gradient accumulation: E grows every micro-step
    assert all(sparse_steps >= 5 for _, sparse_steps in results)
    assert max(w for w, _ in results) < 1e-5, results


def _worker_resume(rank, world_size, tmp_path, exchange):
    """8 steps straight == 4 steps, save, a new engine loads, 4 more (sparsity 0.99, gas 2)."""
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import scape_ds
    from scape_ds.checkpoint import load_checkpoint, save_checkpoint

    def engine_():
        engine, *_ = scape_ds.initialize(model=make_mlp(seed=5), config=_config("ScapeAdamS", 0.99, 2, T=3,
                                                                                   exchange=exchange))
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
    first.optimizer.synchronize()
    resumed = engine_()
    tag, client = load_checkpoint(resumed, ckpt)
    part += train(resumed, client["step"], 8)
    resumed.optimizer.synchronize()
    straight.optimizer.synchronize()
    return ref == part, torch.equal(ref_params, _gathered(resumed)), tag


@pytest.mark.parametrize("exchange", ["dense", "sparse_replica"])
def test_exact_resume_under_zero3(tmp_path, exchange):
    results = run_ranks(_worker_resume, 2, tmp_path, exchange)
    assert results == [(True, True, "global_step4")] * 2, results


def _worker_bf16(rank, world_size, tmp_path):
    """bf16: DeepSpeed's dense ZeRO-3 (fp32 reduce) against SCAPE at sparsity 0 in both modes, then
    SCAPE 0.99 sparse_replica with bf16 communication (DeepSpeed's default under bf16)."""
    runs = [("AdamS", None, "dense", "fp32"), ("ScapeAdamS", 0.0, "dense", "fp32"),
            ("ScapeAdamS", 0.0, "sparse_replica", "fp32"), ("ScapeAdamS", 0.99, "sparse_replica", None)]
    return [_worker(rank, world_size, tmp_path, opt_type, sparsity, 12, 1, exchange, bf16=True, comm_dtype=comm_dtype)
            for opt_type, sparsity, exchange, comm_dtype in runs]


def test_bf16_under_zero3(tmp_path):
    results = run_ranks(_worker_bf16, 2, tmp_path)
    dense, s0, s0_replica, s99 = results[0]
    for rank_runs in results:  # bf16 replicas equal on every rank and to the partitions, after every step
        for run in rank_runs:
            assert run["dtypes"] == {"torch.bfloat16"} and run["unequal"] == run["stale"] == 0, run["dtypes"]
    assert dense["losses"][-1] < dense["losses"][0]
    for run in (s0, s0_replica):  # same bf16 compute, both reduce in fp32
        assert max(abs(a - b) for a, b in zip(dense["losses"], run["losses"])) < 1e-5, (dense["losses"], run["losses"])
    assert sum(s99["losses"][-3:]) < sum(s99["losses"][:3]), s99["losses"]
    sparse = [s for s in s99["stats"] if not s["dense_step"]]
    assert len(sparse) >= 8
    m = s99["memory"]
    dense_share = 1 - m["sparse_numel"] / m["numel"]
    for s in sparse:  # fp32 values in the reduce-scatters, bf16 in the all-gather, vs dense bf16 RS + AG: the
        assert s["bytes_sent"] <= (0.03 + 1.5 * dense_share) * s["bytes_dense"], s  # dense tensors 1.5x their share


def _worker_foreign(rank, world_size, tmp_path):
    """The class swapped in under DeepSpeed's own optimizer (as tests/deepspeed_upstream does): exact
    at sparsity 0, refused above it."""
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    from scape_ds.config import parse_scape_config
    from scape_ds.engine import _stage3_class_swapped, skip_unused_cpu_ops
    from scape_ds.zero3 import scape_stage3_class

    skip_unused_cpu_ops()  # deepspeed.initialize directly: as scape_ds.initialize would
    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 1.0, "steps_per_print": 10**9,
           "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}}}

    def losses(sparsity):
        swap = _stage3_class_swapped(scape_stage3_class(parse_scape_config({"sparsity": sparsity}))) \
            if sparsity is not None else contextlib.nullcontext()
        with swap:
            model = make_mlp(seed=5, bias=True, norm=True)
            engine, *_ = deepspeed.initialize(model=model, config=cfg, model_parameters=model.parameters())
        out = []
        for step in range(8):
            x, y = make_batch(step, rank)
            loss = loss_fn(engine, x, y)
            engine.backward(loss)
            engine.step()
            out.append(float(loss))
        return out, type(engine.optimizer).__name__

    dense, scape = losses(None), losses(0.0)
    try:
        losses(0.5)
        refused = ""
    except ValueError as err:
        refused = str(err)
    return dense, scape, refused


def test_installed_under_deepspeeds_own_optimizer(tmp_path):
    (dense, dense_cls), (scape, scape_cls), refused = run_ranks(_worker_foreign, 2, tmp_path)[0]
    assert dense_cls == "DeepSpeedZeroOptimizer_Stage3" and scape_cls == "ScapeStage3"
    assert max(abs(a - b) for a, b in zip(dense, scape)) < 1e-6, (dense, scape)
    assert "Stage3AdamS at sparsity > 0" in refused, refused


def _worker_small(rank, world_size, tmp_path, exchange):
    """Sparsity 0.99: the biases and the LayerNorm (dense_numel_threshold) against one AdamS step on the
    mean of every rank's gradient, after every step (sparse steps included)."""
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import scape_ds
    from scape_ds.optim.adams import adams

    cfg = _config("ScapeAdamS", 0.99, 1, T=4, exchange=exchange)
    cfg["gradient_clipping"] = 0.0  # the update is then AdamS on the mean gradient itself
    engine, *_ = scape_ds.initialize(model=make_mlp(seed=5, bias=True, norm=True), config=cfg)
    zopt = engine.optimizer
    ex = zopt.scape
    names = {p.ds_id: n for n, p in engine.module.named_parameters()}
    small = [p for p in ex.params if p.ds_id in ex.dense_ids]
    mean_grad = {}
    reduce = zopt._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads

    def recording_reduce(ps, dtype):
        for p in ps:
            if p.ds_id in ex.dense_ids:
                g = p.grad.reshape(-1).double()  # (numel,) this rank's gradient
                dist.all_reduce(g)
                mean_grad[p.ds_id] = (g / world_size).float()
        return reduce(ps, dtype)

    zopt._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads = recording_reduce
    ref = {p.ds_id: _gathered_one(p) for p in small}  # (numel,) fp32 each
    momenta = {i: torch.zeros_like(v) for i, v in ref.items()}
    worst, unequal, sparse_steps, stats = 0.0, 0, 0, []
    for step in range(10):
        x, y = make_batch(step, rank)
        engine.backward(loss_fn(engine, x, y))
        engine.step()
        sparse_steps += not ex.step_dense
        for i in ref:
            adams([ref[i]], [mean_grad[i]], [momenta[i]], step=step + 1, bias_correction=True, lr=OPT["lr"],
                  beta1=0.9, beta2=0.95, eps=OPT["eps"], weight_decay=OPT["weight_decay"])
        for p in small:
            got = _gathered_one(p)
            worst = max(worst, float((got - ref[p.ds_id]).abs().max()))
            unequal += not _equal_on_all_ranks(got)
        stats.append(dict(zopt.comm_stats))
    zopt.synchronize()
    small_bytes = 4 * (world_size - 1) * sum(ex.piece(p) for p in small)  # ring RS of D whole pieces, fp32
    return dict(worst=worst, unequal=unequal, sparse_steps=sparse_steps, small_bytes=small_bytes, stats=stats,
                names=sorted(names[p.ds_id] for p in small), error=sorted(ex.error), dense_ids=sorted(ex.dense_ids))


def _gathered_one(p) -> torch.Tensor:
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    absent = [p] if p.ds_status != ZeroParamStatus.AVAILABLE else []  # a resident replica stays (see _gathered)
    with deepspeed.zero.GatheredParameters(absent):
        return p.detach().reshape(-1).float().clone()


@pytest.mark.parametrize("exchange", ["dense", "sparse_replica"])
def test_small_tensors_get_the_dense_mean_update_under_zero3(tmp_path, exchange):
    results = run_ranks(_worker_small, 2, tmp_path, exchange)
    for r in results:
        assert r["names"] == ["0.bias", "1.bias", "1.weight", "3.bias"], r["names"]  # biases and the LayerNorm
        assert r["sparse_steps"] >= 6 and r["unequal"] == 0
        assert r["worst"] < 1e-6, r["worst"]  # AdamS on the mean gradient, to fp32 rounding
        assert not set(r["error"]) & set(r["dense_ids"])  # no error feedback for them
        for s in r["stats"]:  # their bytes: a dense reduce-scatter every step, sparse steps included
            assert s["by_tag"]["dense_rs"] == r["small_bytes"], s
