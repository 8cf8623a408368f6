"""scape_ds.initialize on DeepSpeed's engine, 2 gloo ranks: dense equivalence, exact resume, killed saves."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scape_ds.comm import collective_bytes

from .harness import run_ranks

pytestmark = pytest.mark.timeout(600)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SEQ = 32


def _config(name: str, **scape) -> dict:
    with open(os.path.join(REPO, "ds_configs", name)) as f:
        cfg = json.load(f)
    cfg["train_micro_batch_size_per_gpu"] = 4
    if scape:
        cfg["scape"].update(scape)
    return cfg


def _engine(cfg: dict):
    import scape_ds
    from scape_ds.models import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(seq_len=SEQ, n_layer=1, n_head=2, n_embd=64))
    engine, *_ = scape_ds.initialize(model=model, config=cfg)
    return engine


def _train(engine, data, start: int, stop: int) -> list[float]:
    from scape_ds.data import get_batch

    losses = []
    gas = engine.gradient_accumulation_steps()
    for step in range(start, stop):
        total = torch.zeros(1, dtype=torch.float64)
        for micro in range(gas):
            x, y = get_batch(data, 4, SEQ, step * gas + micro, dist.get_rank(), dist.get_world_size(), 0)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        dist.all_reduce(total)
        losses.append(float(total) / (gas * dist.get_world_size()))
    return losses


def _params(engine) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _set_env(rank):
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


# ---------------------------------------------------------------- sparsity 0 == dense AdamS
def _worker_dense_equivalence(rank, world_size, tmp_path, gas):
    _set_env(rank)
    from scape_ds.data import build_datasets

    train, _ = build_datasets()
    results = {}
    scape = _config("scape_coordinate.json", sparsity=0.0, chunk_size=256, dense_numel_threshold=1024)
    for name, cfg in (("scape", scape),
                      ("dense", _config("dense_adams.json"))):
        cfg["gradient_accumulation_steps"] = gas
        engine = _engine(cfg)
        results[name] = (_train(engine, train, 0, 10), _params(engine), engine.get_lr()[0])
    (ls, ps, lr_s), (ld, pd, lr_d) = results["scape"], results["dense"]
    loss_diff = max(abs(a - b) for a, b in zip(ls, ld))
    param_diff = max(float((a - b).abs().max()) for a, b in zip(ps, pd))
    return loss_diff, param_diff, lr_s, lr_d, ls


@pytest.mark.parametrize("gas", [1, 2])
def test_sparsity_zero_reproduces_dense_adams(tmp_path, gas):
    results = run_ranks(_worker_dense_equivalence, 2, tmp_path, gas)
    loss_diff, param_diff, lr_s, lr_d, losses = results[0]
    assert loss_diff <= 1e-5, (loss_diff, losses)
    assert param_diff <= 1e-5, param_diff
    assert lr_s == lr_d > 0  # DeepSpeed's scheduler drives both alike
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------- exact resume
def _worker_resume(rank, world_size, tmp_path, mode, ckpt):
    _set_env(rank)
    from scape_ds.checkpoint import load_checkpoint, save_checkpoint
    from scape_ds.data import build_datasets

    train, _ = build_datasets()
    engine = _engine(_config("scape_coordinate.json", sparsity=0.99, chunk_size=256, mask_refresh_interval=4,
                             dense_numel_threshold=1024))
    if mode == "straight":
        _train(engine, train, 0, 20)
    elif mode == "first_half":
        _train(engine, train, 0, 10)
        save_checkpoint(engine, ckpt, 10, dict(step=10))
    else:
        tag, client = load_checkpoint(engine, ckpt)
        assert tag == "global_step10" and client["step"] == 10 and engine.global_steps == 10
        _train(engine, train, 10, 20)
    opt = engine.optimizer
    return _params(engine), opt.error_feedback().clone(), opt.mask_offsets()


def test_resume_is_exact_at_sparsity_099(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    straight = run_ranks(_worker_resume, 2, tmp_path / "a", "straight", ckpt)
    run_ranks(_worker_resume, 2, tmp_path / "b", "first_half", ckpt)
    saved = sorted(os.listdir(os.path.join(ckpt, "global_step10")))
    assert saved[-2:] == ["scape_dp_rank_00000.pt", "scape_dp_rank_00001.pt"]
    resumed = run_ranks(_worker_resume, 2, tmp_path / "c", "second_half", ckpt)  # new processes, new group
    for (pa, ea, ma), (pb, eb, mb) in zip(straight, resumed):
        assert all(torch.equal(a, b) for a, b in zip(pa, pb)), "parameters differ after resume"
        assert torch.equal(ea, eb), "error feedback differs after resume"
        assert torch.equal(ma, mb), "mask differs after resume"


# ---------------------------------------------------------------- resume with other SCAPE settings (issue 35)
_SAVED = dict(sparsity=0.99, chunk_size=256, mask_refresh_interval=4, dense_numel_threshold=1024)


def _scape_totals(engine) -> tuple[torch.Tensor, torch.Tensor]:
    """The first N elements of the error-feedback sum over ranks (fp64) and of the flat momentum
    (every rank's shard, gathered), for the first param group."""
    opt = engine.optimizer
    sc = opt.state_dict()["scape"]["groups"][0]
    n, world = sc["numel"], dist.get_world_size()
    error = sc["error"].double()
    dist.all_reduce(error)
    shards = [torch.empty_like(sc["momentum"]) for _ in range(world)]
    dist.all_gather(shards, sc["momentum"])
    return error[:n], torch.cat(shards)[:n]


def _worker_changed_settings(rank, world_size, tmp_path, ckpt, phase):
    _set_env(rank)
    from scape_ds.checkpoint import estimate_checkpoint_bytes, load_checkpoint, save_checkpoint
    from scape_ds.data import build_datasets

    train, _ = build_datasets()
    if phase == "save":
        engine = _engine(_config("scape_coordinate.json", **_SAVED))
        _train(engine, train, 0, 3)  # steps 2 and 3 are sparse: error feedback held back
        error, momentum = _scape_totals(engine)
        save_checkpoint(engine, ckpt, 3, dict(step=3))
        tag_dir = os.path.join(ckpt, "global_step3")
        size = sum(os.path.getsize(os.path.join(tag_dir, n)) for n in os.listdir(tag_dir))
        return _params(engine), error, momentum, size, estimate_checkpoint_bytes(engine)
    out = {}
    for name, changed in [("sparsity", dict(sparsity=0.9)),
                          ("all three", dict(sparsity=0.9, chunk_size=128, mask_refresh_interval=6))]:
        engine = _engine(_config("scape_coordinate.json", **{**_SAVED, **changed}))
        tag, client = load_checkpoint(engine, ckpt)
        loaded = (_params(engine), *_scape_totals(engine), engine.optimizer.mask_offsets())
        losses = _train(engine, train, 3, 7)  # the first step is a dense refresh with new masks
        kc = engine.optimizer.cfg.k_per_chunk
        out[name] = (tag, client["step"], loaded, losses, engine.optimizer.mask_offsets().numel() % kc == 0)
    dense = _engine(_config("dense_adamw.json"))
    try:
        load_checkpoint(dense, ckpt)
        out["adamw"] = "loaded"
    except ValueError as e:
        out["adamw"] = str(e)
    return out


def _worker_scale_config(rank, world_size, tmp_path):
    _set_env(rank)
    from scape_ds.data import build_datasets

    train, _ = build_datasets()
    engine = _engine(_config("scape_dct_scale.json", chunk_size=256, dense_numel_threshold=1024))
    losses = _train(engine, train, 0, 6)
    opt = engine.optimizer
    params = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    every = [torch.empty_like(params) for _ in range(world_size)]
    dist.all_gather(every, params)
    return dict(kc=opt.cfg.k_per_chunk, losses=losses, equal=all(torch.equal(params, p) for p in every),
                by_tag=dict(opt.comm_stats["by_tag"]), n_chunks=opt._groups[0].tiles.numel // 256,
                n_dense=sum(p.numel() for gs in opt._groups for p in gs.dense_params))


@pytest.mark.parametrize("world_size", [2, 4])
def test_scale_config_as_shipped_sends_a_coded_union_whatever_d(tmp_path, world_size):
    # ds_configs/scape_dct_scale.json: the shared mask at 0.94 (here kc = round(0.06 x 256) = 15 of each
    # 16 x 16 tile), each rank nominating K = kc // D in Elias-Fano code (K l low bits and a bitmap of K + 256 /
    # 2^l bits a tile, l = floor(log2(256 / K))); the D K slots of each owner's tiles go as 4-bit codes and one
    # fp32 scale a tile, once to the owner (all-to-all) and once as its coded sums (all-gather); bf16 dense
    results = run_ranks(_worker_scale_config, world_size, tmp_path)
    D, K = world_size, 15 // world_size
    for r in results:
        assert r["kc"] == 15 and r["equal"], (r["kc"], r["equal"])
        assert r["losses"][-1] < r["losses"][0]
    r = results[0]
    n_chunks = r["n_chunks"]
    assert n_chunks % D == 0
    low = {7: 5, 3: 6}[K]  # floor(log2(256 / K))
    payload = (n_chunks * K + 1) // 2 + 4 * (n_chunks // D)  # one owner's n_chunks / D tiles of D K slots
    assert r["by_tag"] == {"index_ag": (D - 1) * n_chunks * ((K * low + K + 256 // 2**low + 7) // 8),
                           "grad_a2a": (D - 1) * payload, "grad_ag": (D - 1) * payload,
                           "dense_ar": collective_bytes("all_reduce", r["n_dense"] * 2, D)}, r["by_tag"]


def _worker_local_steps_size(rank, world_size, tmp_path, ckpt):
    _set_env(rank)
    from scape_ds.checkpoint import estimate_checkpoint_bytes, save_checkpoint
    from scape_ds.data import build_datasets

    train, _ = build_datasets()
    engine = _engine(_config("scape_local.json", chunk_size=256, dense_numel_threshold=1024))
    before = estimate_checkpoint_bytes(engine)  # as scape_ds.train's free-disk check asks: before any step
    _train(engine, train, 0, 4)  # mid-period (H = 30): the local state differs by rank
    save_checkpoint(engine, ckpt, 4, dict(step=4))
    tag_dir = os.path.join(ckpt, "global_step4")
    size = sum(os.path.getsize(os.path.join(tag_dir, n)) for n in os.listdir(tag_dir))
    return size, before, estimate_checkpoint_bytes(engine)


def test_checkpoint_size_estimate_counts_the_local_steps_state(tmp_path):
    # the synchronized copy, outer momentum, AdamW's two moments and each rank's local parameters
    # are saved per rank: an estimate without them was under half the files' size
    (size, before, estimate), _ = run_ranks(_worker_local_steps_size, 2, tmp_path, str(tmp_path / "ckpt"))
    assert before == estimate, (before, estimate)
    assert 0.8 * size <= estimate <= 1.25 * size, (size, estimate)


def test_resume_with_other_sparsity_chunk_size_and_interval_keeps_the_state(tmp_path):
    """Saved at 0.99 (C=256, T=4), resumed at 0.9 (and C=128, T=6): the weights, the momentum and
    the error-feedback sum are carried over, the masks are chosen afresh by a dense refresh, and
    training goes on; an AdamW config refuses the SCAPE checkpoint in one line."""
    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(_worker_changed_settings, 2, tmp_path / "a", ckpt, "save")
    params, error, momentum, size, estimate = saved[0]
    assert error.abs().sum() > 0  # there is unsent gradient to lose
    assert 0.8 * size <= estimate <= 1.25 * size, (size, estimate)
    resumed = run_ranks(_worker_changed_settings, 2, tmp_path / "b", ckpt, "load")
    for out in resumed:
        for name in ("sparsity", "all three"):
            tag, step, (p, e, m, mask), losses, whole_chunks = out[name]
            assert (tag, step) == ("global_step3", 3), name
            # the weights: the saved ones, with the weight decay owed outside the old mask settled
            # (lazy decay: at most lr * weight_decay * 3 steps, relative)
            assert all(torch.allclose(a, b, rtol=2e-3, atol=0) for a, b in zip(p, params)), f"{name}: weights differ"
            assert torch.equal(m, momentum), f"{name}: momentum differs"
            # kept whole on rank 0, summed in fp64 and stored in fp32 once
            assert torch.allclose(e, error, rtol=1e-6, atol=1e-9), f"{name}: error feedback lost"
            assert mask is None and whole_chunks, name  # no saved mask kept; new masks after the refresh
            assert all(x == x and x < 10 for x in losses), (name, losses)  # finite, still learning
        assert "saved by ScapeAdamS" in out["adamw"] and "\n" not in out["adamw"], out["adamw"]
    assert resumed[0]["adamw"] == resumed[1]["adamw"]


# ---------------------------------------------------------------- DeepSpeed's own save/load (the HF Trainer's)
def _same(a, b) -> bool:
    """Nested state dicts equal, tensors bitwise."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _worker_engine_methods(rank, world_size, tmp_path, ckpt):
    import inspect

    _set_env(rank)
    from scape_ds.data import build_datasets

    train, _ = build_datasets()
    engine = _small_engine()
    _train(engine, train, 0, 3)
    signature = inspect.signature(engine.save_checkpoint).parameters  # the Trainer looks for exclude_frozen_parameters
    engine.save_checkpoint(ckpt)  # as the Trainer's save_strategy calls it: DeepSpeed's default tag
    saved = engine.optimizer.state_dict(), _params(engine)
    fresh = _small_engine()
    path, _ = fresh.load_checkpoint(ckpt, load_optimizer_states=True, load_lr_scheduler_states=True)  # the resume
    same = _same(saved, (fresh.optimizer.state_dict(), _params(fresh))) and fresh.global_steps == 3
    # DeepSpeed's own loader gives every rank the one optimizer state in its model file (rank 0's)
    try:
        inspect.unwrap(fresh.load_checkpoint)(ckpt, load_optimizer_states=True)
        message = None
    except ValueError as e:
        message = str(e)
    # a checkpoint saved before issue 36 (DeepSpeed's files alone; each rank a copy of its own): refused
    old = os.path.join(str(tmp_path), f"old{rank}")
    os.makedirs(os.path.join(old, "global_step3"))
    shutil.copy(os.path.join(ckpt, "global_step3", "mp_rank_00_model_states.pt"), os.path.join(old, "global_step3"))
    shutil.copy(os.path.join(ckpt, "latest"), old)
    try:
        fresh.load_checkpoint(old)
        old_refused = None
    except ValueError as e:
        old_refused = str(e)
    engine._config.use_node_local_storage = True  # a folder per node: refused when saving, on every rank
    try:
        engine.save_checkpoint(ckpt, tag="local")
        refused = None
    except ValueError as e:
        refused = str(e)
    return "exclude_frozen_parameters" in signature, path, same, message, refused, old_refused


def test_deepspeeds_own_save_and_load_hold_every_ranks_state(tmp_path):
    """Issue 36: engine.save_checkpoint / load_checkpoint, which the HF Trainer calls, at stage 0/1."""
    ckpt = str(tmp_path / "ckpt")
    results = run_ranks(_worker_engine_methods, 2, tmp_path, ckpt)
    tag_dir = os.path.join(ckpt, "global_step3")
    assert {"scape_dp_rank_00000.pt", "scape_dp_rank_00001.pt", "manifest.json"} <= set(os.listdir(tag_dir))
    assert open(os.path.join(ckpt, "latest")).read() == "global_step3"
    for rank, (signature, path, same, message, refused, old_refused) in enumerate(results):
        assert signature and path == tag_dir
        assert "has no manifest.json" in old_refused and "\n" not in old_refused, old_refused
        assert same, f"rank {rank}: state after load_checkpoint differs from the saved one"
        assert "use_node_local_storage" in refused and "\n" not in refused, refused
        assert not os.path.exists(os.path.join(ckpt, "local"))
    assert results[0][3] is None  # rank 0's own state
    assert "rank 0/2 cannot load on rank 1/2: the data-parallel size is the same, but this is rank 0's shard " \
           "and rank 1 needs its own" in results[1][3], results[1][3]


# ---------------------------------------------------------------- a save killed half way
def _small_engine():
    cfg = _config("scape_coordinate.json", chunk_size=256, mask_refresh_interval=4, dense_numel_threshold=1024)
    return _engine(cfg)


def _trained_and_saved(rank, ckpt, steps):
    """A small SCAPE engine trained ``steps`` steps and saved as global_step<steps>; (engine, data)."""
    _set_env(rank)
    from scape_ds.checkpoint import save_checkpoint
    from scape_ds.data import build_datasets

    train, _ = build_datasets()
    engine = _small_engine()
    _train(engine, train, 0, steps)
    save_checkpoint(engine, ckpt, steps, dict(step=steps))
    return engine, train


def _worker_killed_save(rank, world_size, tmp_path, ckpt):
    from scape_ds.checkpoint import save_checkpoint

    engine, train = _trained_and_saved(rank, ckpt, 3)
    torch.save(_params(engine), os.path.join(str(tmp_path), f"params_{rank}.pt"))
    _train(engine, train, 3, 5)
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):  # the process dies half way through writing a file
        real_save(obj, f, *args, **kwargs)
        if isinstance(f, (str, os.PathLike)):
            size = os.path.getsize(f)
            with open(f, "r+b") as fh:
                fh.truncate(size // 2)
        os._exit(17)

    torch.save = dying_save
    save_checkpoint(engine, ckpt, 5, dict(step=5))


def _worker_load_after_kill(rank, world_size, tmp_path, ckpt, saved_dir):
    _set_env(rank)
    from scape_ds.checkpoint import load_checkpoint

    engine = _small_engine()
    tag, client = load_checkpoint(engine, ckpt)
    saved = torch.load(os.path.join(saved_dir, f"params_{rank}.pt"))
    return tag, client["step"], all(torch.equal(a, b) for a, b in zip(_params(engine), saved))


def test_killed_save_leaves_previous_checkpoint_loadable(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    with pytest.raises(mp.ProcessExitedException):
        run_ranks(_worker_killed_save, 2, tmp_path / "a", ckpt)
    assert os.path.isdir(os.path.join(ckpt, "global_step5"))  # the half-written one is there...
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read() == "global_step3"  # ...but latest still names the complete one
    results = run_ranks(_worker_load_after_kill, 2, tmp_path / "b", ckpt, str(tmp_path / "a"))
    assert results == [("global_step3", 3, True)] * 2


class _RunsCode:
    """Unpickling this calls os.system: what a checkpoint from an untrusted source could hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _worker_damaged_checkpoints(rank, world_size, tmp_path, ckpt):
    """Save once, then load after each damage (done by rank 0 between barriers): every rank must
    refuse with the same one-line ValueError naming the file; finally the repaired tag loads."""
    from scape_ds.checkpoint import load_checkpoint, write_manifest

    engine, _ = _trained_and_saved(rank, ckpt, 2)
    tag = os.path.join(ckpt, "global_step2")
    victims = dict(altered=os.path.join(tag, "scape_dp_rank_00001.pt"),
                   code=os.path.join(tag, "mp_rank_00_model_states.pt"))
    originals = {}
    for name, path in victims.items():
        with open(path, "rb") as f:
            originals[name] = f.read()
    marker = os.path.join(str(tmp_path), "code_ran")

    def damage(name):
        path = victims[name]
        if name == "altered":  # one byte flipped, size unchanged: only the hash sees it
            data = bytearray(originals[name])
            data[len(data) // 2] ^= 0xFF
            with open(path, "wb") as f:
                f.write(bytes(data))
        else:  # a model file with a pickled callable, and a manifest rewritten to match it
            state = torch.load(path, weights_only=True)
            state["payload"] = _RunsCode(marker)
            torch.save(state, path)
            write_manifest(tag, collective=False)  # rank 0 alone hashes every file

    answers = {}
    for name in victims:
        if rank == 0:
            damage(name)
        dist.barrier()
        try:
            load_checkpoint(engine, ckpt)
            answers[name] = "loaded"
        except ValueError as e:
            answers[name] = str(e)
        dist.barrier()
        if rank == 0:
            with open(victims[name], "wb") as f:
                f.write(originals[name])
    if rank == 0:
        write_manifest(tag, collective=False)
    dist.barrier()
    tag_name, client = load_checkpoint(engine, ckpt)
    return answers, victims, os.path.exists(marker), (tag_name, client["step"])


def test_altered_or_code_holding_files_are_refused_on_every_rank(tmp_path):
    results = run_ranks(_worker_damaged_checkpoints, 2, tmp_path, str(tmp_path / "ckpt"))
    for answers, victims, code_ran, repaired in results:
        assert not code_ran and repaired == ("global_step2", 2)
        assert victims["altered"] in answers["altered"] and "altered" in answers["altered"], answers
        assert victims["code"] in answers["code"] and "not plain data" in answers["code"], answers
        assert "system" in answers["code"] and all("\n" not in a for a in answers.values()), answers
    assert results[0][0] == results[1][0]  # the same line on every rank


def _worker_disk_full(rank, world_size, tmp_path, ckpt):
    from scape_ds.checkpoint import CheckpointSaveError, load_checkpoint, save_checkpoint

    engine, train = _trained_and_saved(rank, ckpt, 2)
    saved = _params(engine)
    free = os.statvfs(ckpt).f_bavail * os.statvfs(ckpt).f_frsize
    with open(os.path.join(ckpt, "filler"), "wb") as f:  # leave 64 KiB: less than one tag needs
        f.write(b"\0" * (free - (64 << 10)))
    _train(engine, train, 2, 4)
    try:
        save_checkpoint(engine, ckpt, 4, dict(step=4))
        error = None
    except CheckpointSaveError as e:
        error = str(e)
    leftovers = os.listdir(os.path.join(ckpt, "global_step4")) if os.path.isdir(os.path.join(ckpt, "global_step4")) \
        else []  # the partial tag folder is removed
    engine = _small_engine()
    tag, client = load_checkpoint(engine, ckpt)
    return error, leftovers, tag, client["step"], all(torch.equal(a, b) for a, b in zip(_params(engine), saved))


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root)")
def test_disk_full_during_save_is_one_line_and_keeps_previous(tmp_path):
    import subprocess

    ckpt = tmp_path / "small"
    ckpt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(ckpt)], check=True)
    try:
        ((error, leftovers, tag, step, same),) = run_ranks(_worker_disk_full, 1, tmp_path, str(ckpt))
    finally:
        subprocess.run(["umount", "-l", str(ckpt)], check=False)
    assert error is not None and "saving global_step4" in error and "\n" not in error, error
    assert "latest still names global_step2" in error and "the partial global_step4 was removed" in error, error
    assert leftovers == [] and (tag, step, same) == ("global_step2", 2, True)


def _worker_no_shm_build(rank, world_size, tmp_path):
    _set_env(rank)
    extensions = os.path.join(str(tmp_path), "extensions")
    os.environ["TORCH_EXTENSIONS_DIR"] = extensions  # empty: any JIT build would land here
    import deepspeed.comm

    engine = _small_engine()
    engine.step()
    built = sorted(os.listdir(extensions)) if os.path.isdir(extensions) else []
    return deepspeed.comm.comm.cdb.shm_comm_op is None, built


def test_cpu_engine_skips_deepspeeds_unused_shm_op_build(tmp_path):
    """scape_ds.initialize on CPU keeps DeepSpeed from JIT-compiling its inference-only shm op."""
    assert run_ranks(_worker_no_shm_build, 1, tmp_path) == [(True, [])]


# ---------------------------------------------------------------- refused combinations
@pytest.mark.parametrize("edit,message", [
    (lambda c: c.update(zero_optimization={"stage": 2}), "ZeRO stage 2"),
    (lambda c: c.update(zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}}), "offload_param"),
    (lambda c: c.update(zero_optimization={"stage": 3, "reduce_scatter": False}), "reduce_scatter false"),
    (lambda c: c.update(zero_optimization={"stage": 3, "zero_quantized_gradients": True}), "zero_quantized_gradients"),
    (lambda c: c.update(zero_optimization={"stage": 3, "zero_hpz_partition_size": 2}), "zero_hpz_partition_size"),
    (lambda c: c.update(bf16={"enabled": True}), "bf16"),  # path A; bf16 runs under ZeRO-3
    (lambda c: c.update(zero_optimization={"stage": 3}, fp16={"enabled": True}), "fp16"),
    (lambda c: c.update(zero_optimization={"stage": 1, "offload_optimizer": {"device": "cpu"}}), "offload_optimizer"),
    (lambda c: c.update(fp16={"enabled": True}), "fp16"),
    (lambda c: c["scape"].update(sparsityy=0.5), "scape.sparsityy: unknown field"),
    (lambda c: c["optimizer"]["params"].update(momentum=0.9), "unknown ['momentum']"),
    (lambda c: c["optimizer"].update(type="AdamW"), "'scape' block but optimizer.type is 'AdamW'"),
    (lambda c: c.update(zero_optimization={"stage": 3}) or c["scape"].update(overlap=True),
     "scape.overlap under ZeRO stage 3 overlaps param_exchange 'sparse_replica''s all-gather"),
    (lambda c: c["scape"].update(overlap=True, basis="dct", mask="shared"),
     "scape.overlap with basis 'dct' is built for: mask 'shared' (needs one of per_rank)"),
    (lambda c: c["scape"].update(overlap=True, basis="dct") or c.update(gradient_clipping=1.0),
     "scape.overlap with basis 'dct' needs gradient_clipping 0 (got 1;"),
    (lambda c: c["scape"].update(overlap=True, clip_local=1.0), "clip_local 1.0 (needs 0.0): clip_local scales"),
    (lambda c: c["scape"].update(overlap=True, bucket_mb=0), "scape.bucket_mb: must be > 0"),
])
def test_unsupported_combinations_fail_at_initialize(edit, message):
    import scape_ds

    cfg = _config("scape_coordinate.json")
    edit(cfg)
    with pytest.raises(ValueError, match=None) as err:
        scape_ds.initialize(model=torch.nn.Linear(4, 4), config=cfg)
    assert message in str(err.value), str(err.value)
