"""``scape_ds.initialize`` parses the ``"scape"`` block once and hands the ScapeConfig on (issue 31).

On 2 gloo ranks, for path A (ZeRO stage 1, ``ScapeAdamS``) and path B (ZeRO-3, ``ScapeStage3``):
every binding of ``parse_scape_config`` in a loaded scape_ds module (``scape_ds.config``'s own, which
function-level imports read, and each module's ``from .config import parse_scape_config``) is
replaced by a counting wrapper before ``initialize``; after it and one training step the count is 1
and the optimizer's ``cfg`` is the object that one call returned.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

from .harness import run_ranks
from .models import make_batch, make_mlp

pytestmark = pytest.mark.timeout(300)


def _config(stage: int) -> dict:
    zero = {"stage": 3, "stage3_param_persistence_threshold": 0} if stage == 3 else {"stage": stage}
    return {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9, "zero_optimization": zero,
            "optimizer": {"type": "ScapeAdamS", "params": {"lr": 0.01}},
            "scape": {"sparsity": 0.9, "chunk_size": 16, "mask_refresh_interval": 3, "dense_numel_threshold": 64}}


def _count_parses() -> list:
    """Wrap every scape_ds binding of ``parse_scape_config``; returns the list each call appends its result to."""
    import scape_ds.checkpoint  # noqa: F401  (load what initialize may look the parser up in)
    import scape_ds.config
    import scape_ds.engine  # noqa: F401
    import scape_ds.zero3  # noqa: F401

    original = scape_ds.config.parse_scape_config
    results: list = []

    def counting(block):
        results.append(original(block))
        return results[-1]

    for name, module in list(sys.modules.items()):
        if (name == "scape_ds" or name.startswith("scape_ds.")) and getattr(module, "parse_scape_config", None) \
                is original:
            module.parse_scape_config = counting
    return results


def _worker(rank, world_size, tmp_path, stage):
    os.environ.setdefault("LOCAL_RANK", str(rank))
    import scape_ds

    parsed = _count_parses()
    engine, *_ = scape_ds.initialize(model=make_mlp(0, 16, 32, norm=False), config=_config(stage))
    x, y = make_batch(0, rank, 16, 4)
    engine.backward(torch.nn.functional.mse_loss(engine(x), y))
    engine.step()
    opt = engine.optimizer
    return len(parsed), type(opt).__name__, bool(parsed) and opt.cfg is parsed[0], opt.cfg.sparsity


@pytest.mark.parametrize("stage,optimizer", [(1, "ScapeAdamS"), (3, "ScapeStage3")])
def test_initialize_parses_the_scape_block_once(tmp_path, stage, optimizer):
    for calls, built, same, sparsity in run_ranks(_worker, 2, tmp_path, stage):
        assert (built, sparsity) == (optimizer, 0.9)
        assert calls == 1, f"parse_scape_config ran {calls} times during initialize and one step"
        assert same, "the optimizer's cfg is not the ScapeConfig initialize parsed"
