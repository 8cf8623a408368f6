"""A stage 1 checkpoint kept as a fixture loads into today's code with the state it was saved with.

``tests/fixtures/ckpt_stage1_dp2/`` was written by this module's ``__main__`` (2 gloo ranks, ZeRO
stage 1, ScapeAdamS at sparsity 0.75, saved after step 4 by ``scape_ds.checkpoint.save_checkpoint``)
before the checkpoint code became a package (issue 31); ``tests/fixtures/README.md`` says how. The
test loads it on 2 ranks and compares the engine's parameters and the optimizer's state, element
for element, with the tensors in the fixture's files, read directly with ``torch.load``.

Regenerate (only when the format changes on purpose)::

    python -m tests.multiprocess.test_checkpoint_format
"""
from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

from scape_ds.config import ScapeConfig

from .harness import run_ranks
from .models import make_batch, make_mlp

pytestmark = pytest.mark.timeout(300)

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "ckpt_stage1_dp2")
WIDTH, HIDDEN, STEPS = 8, 16, 4
CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_clipping": 1.0,
    "steps_per_print": 1000000,
    "zero_optimization": {"stage": 1},
    "optimizer": {"type": "ScapeAdamS", "params": {"lr": 0.01, "weight_decay": 0.1}},
    "scape": {"sparsity": 0.75, "chunk_size": 8, "mask_refresh_interval": 3, "dense_numel_threshold": 64},
}


def _engine():
    import scape_ds

    engine, *_ = scape_ds.initialize(model=make_mlp(0, WIDTH, HIDDEN, norm=False), config=CONFIG)
    return engine


def _worker_save(rank, world_size, tmp_path, save_dir):
    os.environ.setdefault("LOCAL_RANK", str(rank))
    from scape_ds.checkpoint import save_checkpoint

    engine = _engine()
    for step in range(STEPS):
        x, y = make_batch(step, rank, WIDTH, 4)
        engine.backward(torch.nn.functional.mse_loss(engine(x), y))
        engine.step()
    save_checkpoint(engine, save_dir, STEPS, dict(step=STEPS))


def _worker_load(rank, world_size, tmp_path, load_dir):
    os.environ.setdefault("LOCAL_RANK", str(rank))
    from scape_ds.checkpoint import load_checkpoint

    engine = _engine()
    tag, client = load_checkpoint(engine, load_dir)
    params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return tag, client, engine.global_steps, params, engine.optimizer.state_dict()


def _assert_same(a, b, where: str) -> None:
    """``a`` and ``b`` equal: tensors element for element (and dtype), containers key by key."""
    if torch.is_tensor(a):
        assert torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b))
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def test_stage1_fixture_loads_with_the_saved_state(tmp_path):
    load_dir = str(tmp_path / "ckpt")
    shutil.copytree(FIXTURE, load_dir)  # loading writes nothing, but keep the fixture out of reach
    tag_dir = os.path.join(load_dir, "global_step4")
    model = torch.load(os.path.join(tag_dir, "mp_rank_00_model_states.pt"), weights_only=True)["module"]
    results = run_ranks(_worker_load, 2, tmp_path / "ranks", load_dir)
    for rank, (tag, client, steps, params, opt_state) in enumerate(results):
        assert (tag, client["step"], steps) == ("global_step4", STEPS, STEPS)
        _assert_same(params, {n: t for n, t in model.items()}, f"rank {rank} parameters")
        saved = torch.load(os.path.join(tag_dir, f"scape_dp_rank_{rank:05d}.pt"), weights_only=True)
        assert saved["scape"]["step"] == STEPS and saved["scape"]["groups"][0]["active_offsets"] is not None
        # the scape block of the running config: fields added since the fixture was written hold their defaults
        config, saved_config = opt_state["scape"].pop("config"), saved["scape"].pop("config")
        added = {k: v for k, v in config.items() if k not in saved_config}
        assert added == {k: ScapeConfig.model_fields[k].default for k in added}, added
        _assert_same({k: config[k] for k in saved_config}, saved_config, f"rank {rank} config")
        # per param group: entries added since (basis "dct" state) are empty for this coordinate-basis run
        for group, saved_group in zip(opt_state["scape"]["groups"], saved["scape"]["groups"]):
            added = {k: group.pop(k) for k in list(group) if k not in saved_group}
            assert set(added) <= {"held_mask", "coef_momentum", "coef_numel", "dense_error"}, added
            assert all(v is None for v in added.values()), added
        # the optimizer's own entries added since (local_steps' state) are empty too
        added = {k: opt_state["scape"].pop(k) for k in list(opt_state["scape"]) if k not in saved["scape"]}
        assert set(added) <= {"local"} and all(v is None for v in added.values()), added
        _assert_same(opt_state, saved, f"rank {rank} optimizer state")


if __name__ == "__main__":  # writes the fixture (see the module docstring)
    out = sys.argv[1] if len(sys.argv) > 1 else FIXTURE
    shutil.rmtree(out, ignore_errors=True)
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_worker_save, 2, tmp, out)
    print(out)
