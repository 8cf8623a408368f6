"""Megatron-core tensor/pipeline parallel groups with SCAPE on the data-parallel group (gloo ranks, DeepSpeed
engines)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from .harness import run_ranks

# 2- and 4-rank DeepSpeed engines: up to 292 s measured for one test (tests/README.md); 900 s leaves
# room on a busier machine and still ends a hang (scape_ds.spawn kills the ranks)
pytestmark = pytest.mark.timeout(900)

SEQ, VOCAB, MICRO = 16, 64, 2
CFG = dict(vocab_size=VOCAB, seq_len=SEQ, n_layer=2, n_head=4, n_embd=64)


def _ds_config(sparsity: float, gas: int = 1, clip: float = 0.5) -> dict:
    return {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
        "steps_per_print": 10_000, "wall_clock_breakdown": False,
        "optimizer": {"type": "ScapeAdamS", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scape": {"sparsity": sparsity, "chunk_size": 256, "mask_refresh_interval": 5, "dense_numel_threshold": 1024},
        "pipeline": {"pipe_partitioned": False, "grad_partitioned": False},
    }


def _batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sequences (t, t+1, ...) mod VOCAB from random starts: learnable in a few steps."""
    g = torch.Generator().manual_seed(step * 1009 + dp_rank)
    start = torch.randint(0, VOCAB, (MICRO, 1), generator=g)
    seq = (start + torch.arange(SEQ + 1)) % VOCAB  # (B, T+1)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _set_env(rank):
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def _gathered_equal(t: torch.Tensor, group) -> bool:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, t.contiguous(), group=group)
    return all(torch.equal(out[0], o) for o in out)


def _worker_train(rank, world_size, tmp_path, tp, pp, sparsity, steps, gas=1, dropout=0.0, overlap=False,
                  scape_extra=None, clip=0.5, sync_every=1):
    """Train the Megatron GPT (flat for pp == 1 unless forced, PipelineModule otherwise); return per-step losses
    and how many steps broke replica equality (DP replicas, checked every ``sync_every``-th step: with
    ``scape.local_steps`` H the replicas are equal only after each outer step; TP-replicated parameters)."""
    _set_env(rank)
    import scape_ds
    from scape_ds.megatron import MegatronGPT, build_pipeline_gpt, init_model_parallel, model_parallel_seed
    from scape_ds.models import GPTConfig

    mpu = init_model_parallel(tp, abs(pp))
    cfg = GPTConfig(**CFG, dropout=dropout)
    dp_rank, dp_group = mpu.get_data_parallel_rank(), mpu.get_data_parallel_group()
    tp_group = mpu.get_tensor_model_parallel_group()
    config = _ds_config(sparsity, gas, clip)
    config["scape"].update(overlap=overlap, bucket_mb=4 * 256 * 4 / 2**20)  # scape.overlap: many buckets
    config["scape"].update(scape_extra or {})
    if pp > 0:  # flat model
        torch.manual_seed(0)
        model = MegatronGPT(cfg)
        model_parallel_seed(0)
        engine, *_ = scape_ds.initialize(model=model, config=config, mpu=mpu)
    else:  # -pp: a DeepSpeed PipelineModule with |pp| stages
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        topo = PipeModelDataParallelTopology(num_pp=-pp, num_mp=tp, num_dp=world_size // (tp * -pp))
        model = build_pipeline_gpt(cfg, topo, seed=0)
        model_parallel_seed(0)
        engine, *_ = scape_ds.initialize(model=model, config=config)
    losses, dp_breaks, tp_breaks = [], 0, 0
    in_backward = []  # scape.overlap: buckets each overlapped param group started in backward, per step
    for step in range(steps):
        if pp > 0:
            total = torch.zeros(1, dtype=torch.float64)
            for micro in range(gas):
                x, y = _batch(step * gas + micro, dp_rank)
                _, loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                total += float(loss.detach())
            dist.all_reduce(total, group=dp_group)
            losses.append(float(total) / (gas * dist.get_world_size(dp_group)))
        else:
            batches = iter([_batch(step * gas + micro, dp_rank) for micro in range(gas)])
            losses.append(float(engine.train_batch(data_iter=batches)))  # mean over DP and micro-batches
        if overlap:
            # coordinate basis: buckets started in backward; basis dct: buckets waiting for the next forward
            in_backward.append([o.started_in_backward if hasattr(o, "started_in_backward") else len(o._in_flight)
                                for o in engine.optimizer._overlaps()])
            engine.optimizer.synchronize()  # read outside a forward: wait for the new values
        params = [p.detach().reshape(-1) for p in engine.module.parameters()]
        if (step + 1) % sync_every == 0:
            dp_breaks += not _gathered_equal(torch.cat(params), dp_group)
        replicated = [p.detach().reshape(-1) for p in engine.module.parameters()
                      if not getattr(p, "tensor_model_parallel", False)]
        if replicated:
            tp_breaks += not _gathered_equal(torch.cat(replicated), tp_group)
    engine.optimizer.synchronize()
    if pp < 0 and -pp > 1:  # the tied embedding: its copies on the first and last stage stay equal
        for comm in engine.module.tied_comms.values():
            for name in comm["weight_attr"]:
                w = engine.module._recursive_getattr(comm["module"], name).detach().reshape(-1)
                tp_breaks += not _gathered_equal(w, comm["group"])
    if overlap:
        return losses, dp_breaks, tp_breaks, in_backward
    return losses, dp_breaks, tp_breaks


@pytest.mark.parametrize("gas", [1, 2])
def test_tp2_reproduces_tp1_at_sparsity_zero(tmp_path, gas):
    ref = run_ranks(_worker_train, 2, tmp_path / "tp1", 1, 1, 0.0, 10, gas)
    tp2 = run_ranks(_worker_train, 4, tmp_path / "tp2", 2, 1, 0.0, 10, gas)
    ref_losses, tp2_losses = ref[0][0], tp2[0][0]
    assert ref_losses[-1] < ref_losses[0]
    assert max(abs(a - b) for a, b in zip(ref_losses, tp2_losses)) < 1e-4, (ref_losses, tp2_losses)
    assert all(r[1] == 0 and r[2] == 0 for r in tp2), tp2


def test_pp2_reproduces_pp1_at_sparsity_zero(tmp_path):
    ref = run_ranks(_worker_train, 2, tmp_path / "pp1", 1, -1, 0.0, 10, 2)
    pp2 = run_ranks(_worker_train, 4, tmp_path / "pp2", 1, -2, 0.0, 10, 2)
    ref_losses, pp2_losses = ref[0][0], pp2[0][0]
    assert ref_losses[-1] < ref_losses[0]
    assert max(abs(a - b) for a, b in zip(ref_losses, pp2_losses)) < 1e-4, (ref_losses, pp2_losses)


@pytest.mark.parametrize("tp,pp,dropout", [(2, 1, 0.0), (1, -2, 0.0), (2, 1, 0.1)],
                         ids=["tp2xdp2", "pp2xdp2", "tp2xdp2-dropout"])
def test_sparse_099_trains_with_equal_replicas(tmp_path, tp, pp, dropout):
    # with dropout, TP-replicated parameters stay equal only if the replicated activations draw the
    # same dropout masks on every TP rank (the default RNG, same seed) and the heads their own
    results = run_ranks(_worker_train, 4, tmp_path, tp, pp, 0.99, 30, 1, dropout)
    losses = results[0][0]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"losses first 5 {first:.3f} last 5 {last:.3f}")
    assert last < first - 0.3, losses  # ln(64) = 4.16 at the start
    assert all(dp == 0 for _, dp, _ in results), [r[1:] for r in results]
    assert all(tpb == 0 for _, _, tpb in results), [r[1:] for r in results]


DCT = dict(basis="dct", chunk_size=256, clip_local=0.0)  # 16 x 16 tiles over each rank's own weight shards


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, -2)], ids=["tp2", "pp2"])
def test_dct_under_model_parallelism_reproduces_one_rank_per_replica(tmp_path, tp, pp):
    # basis "dct" at sparsity 0 with dct_update "adams" is dense AdamS whatever the tiles, so TP 2 x DP 2
    # (tiles over each TP shard) and PP 2 x DP 2 (tiles per stage) train as TP 1 / PP 1 x DP 2 does
    dct = dict(DCT, dct_update="adams")
    gas = 1 if pp > 0 else 2
    ref = run_ranks(_worker_train, 2, tmp_path / "ref", 1, pp // abs(pp), 0.0, 10, gas, 0.0, False, dct)
    split = run_ranks(_worker_train, 4, tmp_path / "split", tp, pp, 0.0, 10, gas, 0.0, False, dct)
    ref_losses, losses = ref[0][0], split[0][0]
    assert ref_losses[-1] < ref_losses[0]
    assert max(abs(a - b) for a, b in zip(ref_losses, losses)) < 1e-4, (ref_losses, losses)
    assert all(r[1] == 0 and r[2] == 0 for r in split), split


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, -2)], ids=["tp2xdp2", "pp2xdp2"])
def test_dct_099_under_model_parallelism_trains_with_equal_replicas(tmp_path, tp, pp):
    # ds_configs/scape_dct.json's exchange (per-rank masks, sign, clip_local 1) on 4 ranks: the local
    # clip sums the norm over the model-parallel group; DP replicas, TP-replicated parameters and the
    # tied embedding's two stage copies stay bitwise equal
    dct = dict(DCT, dct_update="sign", clip_local=1.0, ef_decay=0.999)
    results = run_ranks(_worker_train, 4, tmp_path, tp, pp, 0.99, 30, 1, 0.0, False, dct)
    losses = results[0][0]
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.3, losses
    assert all(dp == 0 and tpb == 0 for _, dp, tpb in results), [r[1:] for r in results]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, -2)], ids=["tp2", "pp2"])
def test_local_steps_under_model_parallelism_reproduce_one_rank_per_replica(tmp_path, tp, pp):
    # scape.local_steps 3 at sparsity 0: inner AdamW steps clipped on each replica's own norm (summed
    # over its TP / PP ranks), every third step the pseudo-gradient's exchange and the outer Nesterov
    # step; TP 2 x DP 2 and PP 2 x DP 2 train as TP 1 / PP 1 x DP 2 does, and the DP replicas are
    # bitwise equal after every outer step
    local = dict(DCT, local_steps=3)
    gas = 1 if pp > 0 else 2
    ref = run_ranks(_worker_train, 2, tmp_path / "ref", 1, pp // abs(pp), 0.0, 9, gas, 0.0, False, local, 0.5, 1)
    split = run_ranks(_worker_train, 4, tmp_path / "split", tp, pp, 0.0, 9, gas, 0.0, False, local, 0.5, 3)
    ref_losses, losses = ref[0][0], split[0][0]
    assert ref_losses[-1] < ref_losses[0]
    assert max(abs(a - b) for a, b in zip(ref_losses, losses)) < 1e-4, (ref_losses, losses)
    # checked every step, the replicas differ after the 6 inner-only steps and agree after the 3 outer
    assert all(r[1] == 6 and r[2] == 0 for r in ref), [r[1:] for r in ref]
    assert all(r[1] == 0 and r[2] == 0 for r in split), [r[1:] for r in split]


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, -2)], ids=["tp2xdp2", "pp2xdp2"])
def test_dct_overlap_under_model_parallelism_equals_the_non_overlapped_run(tmp_path, tp, pp):
    # ds_configs/scape_dct_overlap.json's exchange on 4 ranks: each weight's update waits for its
    # module's forward (a pipeline stage's own modules; the tied embedding's group updates in step());
    # the same losses as without overlap, replicas and the tied copies bitwise equal
    dct = dict(DCT, dct_update="sign", clip_local=1.0, ef_decay=0.999)
    plain = run_ranks(_worker_train, 4, tmp_path / "plain", tp, pp, 0.99, 8, 1, 0.0, False, dct, 0.0)
    overlapped = run_ranks(_worker_train, 4, tmp_path / "overlap", tp, pp, 0.99, 8, 1, 0.0, True, dct, 0.0)
    assert [r[0] for r in overlapped] == [r[0] for r in plain], (plain[0][0], overlapped[0][0])
    assert all(dp == 0 and tpb == 0 for _, dp, tpb, _ in overlapped), [r[1:3] for r in overlapped]
    # every rank has an overlapped group, and after every step each has buckets waiting for the forward
    pending = [r[3] for r in overlapped]
    assert all(groups and all(n > 0 for n in groups) for steps in pending for groups in steps), pending


def _worker_module_only_load(rank, world_size, tmp_path):
    """PP 2 x DP 2 with basis dct and overlap: a module-only load (DeepSpeed loads a PipelineModule
    layer by layer, past the model's own load_state_dict hook) while updates are in flight must leave
    the loaded weights, not the updates, in the model."""
    _set_env(rank)
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    import scape_ds
    from scape_ds.megatron import build_pipeline_gpt, init_model_parallel, model_parallel_seed
    from scape_ds.models import GPTConfig

    mpu = init_model_parallel(1, 2)
    config = _ds_config(0.99, 1, 0.0)
    config["scape"].update(DCT, dct_update="sign", clip_local=1.0, ef_decay=0.999, overlap=True,
                           bucket_mb=4 * 256 * 4 / 2**20)
    model = build_pipeline_gpt(GPTConfig(**CFG), PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2), seed=0)
    model_parallel_seed(0)
    engine, *_ = scape_ds.initialize(model=model, config=config)
    dp_rank = mpu.get_data_parallel_rank()
    for step in range(3):
        engine.train_batch(data_iter=iter([_batch(step, dp_rank)]))
        if step == 1:
            engine.save_checkpoint(os.path.join(tmp_path, "ckpt"))  # waits for what is in flight
            saved = [p.detach().clone() for p in engine.module.parameters()]
    pending = sum(len(o._in_flight) for o in engine.optimizer._overlaps())  # step 3's, waiting for a forward
    engine.load_checkpoint(os.path.join(tmp_path, "ckpt"), load_module_only=True)
    engine.optimizer.synchronize()
    return pending, all(torch.equal(a, p.detach()) for a, p in zip(saved, engine.module.parameters()))


def test_module_only_load_drops_no_update_onto_the_loaded_weights(tmp_path):
    for pending, restored in run_ranks(_worker_module_only_load, 4, tmp_path):
        assert pending > 0 and restored, (pending, restored)


def test_overlap_under_tp2_equals_the_non_overlapped_run(tmp_path):
    # scape.overlap with tensor parallelism (TP 2 x DP 2, GAS 2): the data-parallel buckets go out during
    # backward while the TP all-reduces run; the norm still spans the TP group. DP = 2: the same bits
    plain = run_ranks(_worker_train, 4, tmp_path / "plain", 2, 1, 0.99, 8, 2)
    overlapped = run_ranks(_worker_train, 4, tmp_path / "overlap", 2, 1, 0.99, 8, 2, 0.0, True)
    assert [r[0] for r in overlapped] == [r[0] for r in plain], (plain[0][0], overlapped[0][0])
    assert all(dp == 0 and tpb == 0 for _, dp, tpb, _ in overlapped), [r[1:3] for r in overlapped]


def test_overlap_under_pp2_equals_the_non_overlapped_run(tmp_path):
    # scape.overlap with DeepSpeed's PipelineModule (PP 2 x DP 2, GAS 2): the buckets go out during the
    # last BackwardPass of each train_batch (counted; the engine's own boundary is true only after
    # backward), the tied embedding's group, summed across the stages by ReduceTiedGrads, in step()
    plain = run_ranks(_worker_train, 4, tmp_path / "plain", 1, -2, 0.99, 8, 2)
    overlapped = run_ranks(_worker_train, 4, tmp_path / "overlap", 1, -2, 0.99, 8, 2, 0.0, True)
    assert [r[0] for r in overlapped] == [r[0] for r in plain], (plain[0][0], overlapped[0][0])
    assert all(dp == 0 and tpb == 0 for _, dp, tpb, _ in overlapped), [r[1:3] for r in overlapped]
    for _, _, _, in_backward in overlapped:  # every stage has an overlapped group whose buckets left in backward
        assert in_backward[0] and all(n > 0 for step in in_backward[1:] for n in step), in_backward


def _worker_overlap_own_pipeline(rank, world_size, tmp_path):
    _set_env(rank)
    import scape_ds
    from scape_ds.megatron import MegatronGPT, init_model_parallel
    from scape_ds.models import GPTConfig

    mpu = init_model_parallel(1, 2)  # two pipeline stages of a schedule the user runs: not a PipelineModule
    config = _ds_config(0.99)
    config["scape"]["overlap"] = True
    with pytest.raises(ValueError, match="scape.overlap with pipeline stages is built for DeepSpeed's PipelineModule"):
        scape_ds.initialize(model=MegatronGPT(GPTConfig(**CFG)), config=config, mpu=mpu)
    return True


def test_overlap_refuses_pipeline_stages_without_a_pipeline_module(tmp_path):
    assert run_ranks(_worker_overlap_own_pipeline, 2, tmp_path) == [True, True]


# ---------------------------------------------------------------- the mpu adapter under DeepSpeed's own engine
def _worker_mpu(rank, world_size, tmp_path):
    _set_env(rank)
    import scape_ds
    from scape_ds.megatron import MegatronGPT, init_model_parallel, model_parallel_seed
    from scape_ds.models import GPTConfig

    mpu = init_model_parallel(2, 1)
    answers = dict(
        mp=(mpu.get_model_parallel_rank(), mpu.get_model_parallel_world_size(),
            dist.get_process_group_ranks(mpu.get_model_parallel_group())),
        tp=(mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_world_size(),
            mpu.get_tensor_model_parallel_src_rank()),
        dp=(mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size(), mpu.get_data_parallel_group_ranks(),
            dist.get_process_group_ranks(mpu.get_data_parallel_group())),
        pp=(mpu.get_pipeline_model_parallel_rank(), mpu.get_pipeline_model_parallel_world_size(),
            dist.get_process_group_ranks(mpu.get_pipe_parallel_group()),
            dist.get_process_group_ranks(mpu.get_norm_group())),
    )
    from scape_ds.megatron import get_rng_tracker

    model_parallel_seed(0)
    with get_rng_tracker().fork():
        sharded_draw = torch.rand(8)  # the tensor-parallel stream: one per TP rank
    replicated_draw = torch.rand(8)  # the default stream: the same on every TP rank
    tp_group = mpu.get_tensor_model_parallel_group()
    answers["rng"] = (_gathered_equal(sharded_draw, tp_group), _gathered_equal(replicated_draw, tp_group))
    torch.manual_seed(0)
    model = MegatronGPT(GPTConfig(**CFG))
    model_parallel_seed(0)
    cfg = _ds_config(0.0)
    cfg.pop("scape")
    # DeepSpeed's own engine, all-reduce and clipping; torch's AdamW, not the fused op it would JIT-build here
    cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 3e-3, "torch_adam": True}}
    engine, *_ = scape_ds.initialize(model=model, config=cfg, mpu=mpu)
    losses = []
    for step in range(4):
        x, y = _batch(step, mpu.get_data_parallel_rank())
        _, loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    params = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    dp_equal = _gathered_equal(params, mpu.get_data_parallel_group())
    engine.save_checkpoint(os.path.join(tmp_path, "ckpt"), tag="t")
    return answers, losses, dp_equal


def test_mpu_adapter_answers_deepspeed_engine(tmp_path):
    results = run_ranks(_worker_mpu, 4, tmp_path)
    for rank, (answers, losses, dp_equal) in enumerate(results):
        tp_rank, dp_rank = rank % 2, rank // 2
        assert answers["mp"] == (tp_rank, 2, [rank - tp_rank, rank - tp_rank + 1])
        assert answers["tp"] == (tp_rank, 2, rank - tp_rank)
        assert answers["dp"] == (dp_rank, 2, [tp_rank, tp_rank + 2], [tp_rank, tp_rank + 2])
        assert answers["pp"] == (0, 1, [rank], [rank - tp_rank, rank - tp_rank + 1])
        assert answers["rng"] == (False, True)
        assert dp_equal and losses[-1] < losses[0]
    assert results[0][1] == results[1][1]  # TP ranks of one replica compute the same loss
    names = sorted(os.listdir(tmp_path / "ckpt" / "t"))
    assert "mp_rank_00_model_states.pt" in names and "mp_rank_01_model_states.pt" in names, names


# ---------------------------------------------------------------- topology errors
@pytest.mark.parametrize("world,tp,pp,stage,message", [
    (6, 4, 1, 0, "not divisible by tensor-model-parallel-size 4"),
    (4, 1, 3, 0, "not divisible"),
    (4, 2, 2, 3, "ZeRO stage 0 or 1 only"),
    (4, 0, 1, 0, "must be an int >= 1"),
])
def test_bad_topology_is_refused(world, tp, pp, stage, message):
    from scape_ds.megatron import check_topology

    with pytest.raises(ValueError, match=message):
        check_topology(world, tp, pp, stage)


def test_good_topology_gives_data_parallel_size():
    from scape_ds.megatron import check_topology

    assert check_topology(8, 2, 2, 1) == 2 and check_topology(4, 1, 1, 3) == 4
