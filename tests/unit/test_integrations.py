"""scape_ds.enable()/disable(): which deepspeed.initialize calls reach scape_ds.initialize (no process group)."""
import json
import os
import sys
import types

import deepspeed
import pytest
import torch

import scape_ds
import scape_ds.engine
from scape_ds import integrations
from scape_ds.engine import auto_keys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCAPE_CFG = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "ScapeAdamS", "params": {"lr": 1e-3}},
             "scape": {"sparsity": 0.9}}


@pytest.fixture
def fake_deepspeed(monkeypatch):
    """deepspeed.initialize replaced by a recorder with DeepSpeed's signature; scape_ds.initialize
    by one that calls deepspeed.initialize, as the real one does. Undone after the test."""
    calls = []

    def ds_initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                      lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None,
                      collate_fn=None, config=None, mesh_param=None, config_params=None):
        calls.append(("deepspeed", dict(config=config, config_params=config_params, mpu=mpu,
                                        distributed_port=distributed_port)))
        return "engine", None, None, None

    def scape_initialize(**kwargs):
        calls.append(("scape", kwargs))
        return deepspeed.initialize(model=kwargs.get("model"), config={"inner": True})

    monkeypatch.setattr(deepspeed, "initialize", ds_initialize)
    monkeypatch.setattr(scape_ds.engine, "initialize", scape_initialize)
    yield calls, ds_initialize
    scape_ds.disable()


def test_enable_routes_scape_configs_and_passes_others_through(fake_deepspeed):
    calls, original = fake_deepspeed
    scape_ds.enable()
    scape_ds.enable()  # idempotent
    assert scape_ds.is_enabled() and deepspeed.initialize is integrations.routed_initialize

    assert deepspeed.initialize(model="m", config={"optimizer": {"type": "AdamW"}}) == ("engine", None, None, None)
    assert [c[0] for c in calls] == ["deepspeed"]

    calls.clear()
    deepspeed.initialize(model="m", config_params=SCAPE_CFG)  # accelerate passes config_params
    # one routed call; scape_ds.initialize's own deepspeed.initialize reaches DeepSpeed, not itself again
    assert [c[0] for c in calls] == ["scape", "deepspeed"]
    assert calls[0][1]["config_params"] == SCAPE_CFG and calls[1][1]["config"] == {"inner": True}

    scape_ds.disable()
    scape_ds.disable()  # idempotent
    assert not scape_ds.is_enabled() and deepspeed.initialize is original


@pytest.mark.parametrize("cfg,routed", [
    ({"scape": {}}, True),  # scape_ds.initialize then refuses the missing optimizer type, loudly
    ({"optimizer": {"type": "AdamS"}}, True),
    ({"optimizer": {"type": "ScapeAdamS"}}, True),
    ({"optimizer": {"type": "Adam"}}, False),
    ({}, False),
])
def test_wants_scape(cfg, routed, tmp_path):
    assert integrations.wants_scape(cfg) is routed
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert integrations.wants_scape(str(path)) is routed  # a JSON path
    assert integrations.wants_scape(None, types.SimpleNamespace(deepspeed_config=str(path))) is routed


def test_unreadable_config_goes_to_deepspeed(fake_deepspeed, tmp_path):
    calls, _ = fake_deepspeed
    scape_ds.enable()
    deepspeed.initialize(model="m", config=str(tmp_path / "missing.json"))
    assert [c[0] for c in calls] == ["deepspeed"]


def test_positional_arguments_keep_deepspeed_order(fake_deepspeed):
    calls, _ = fake_deepspeed
    scape_ds.enable()
    # deepspeed.initialize's 7th positional is distributed_port, scape_ds.initialize's is mpu
    deepspeed.initialize(None, "m", None, None, None, None, 1234, "the-mpu", None, None, SCAPE_CFG)
    kwargs = calls[0][1]
    assert calls[0][0] == "scape" and kwargs["distributed_port"] == 1234 and kwargs["mpu"] == "the-mpu"


def test_names_imported_before_enable_are_replaced_and_restored(fake_deepspeed):
    _, original = fake_deepspeed
    user = types.ModuleType("user_module_with_ds_init")
    user.ds_init = deepspeed.initialize  # `from deepspeed import initialize as ds_init`, before enable()
    sys.modules[user.__name__] = user
    try:
        scape_ds.enable()
        assert user.ds_init is integrations.routed_initialize
        scape_ds.disable()
        assert user.ds_init is original
    finally:
        del sys.modules[user.__name__]


def test_auto_values_left_are_one_error():
    with open(os.path.join(REPO, "ds_configs", "hf_scape.json")) as f:
        cfg = json.load(f)
    assert "optimizer.params.lr" in auto_keys(cfg) and "scheduler.params.total_num_steps" in auto_keys(cfg)
    with pytest.raises(ValueError, match=r'still "auto": .*optimizer\.params\.lr.*fill them in'):
        scape_ds.initialize(model=torch.nn.Linear(2, 2), config=cfg)


@pytest.mark.parametrize("name", ["hf_scape.json", "hf_scape_coordinate.json", "hf_scape_zero3.json"])
def test_hf_configs_are_valid_once_filled(name):
    """What HF fills (numbers for every "auto") leaves a config scape_ds accepts."""
    with open(os.path.join(REPO, "ds_configs", name)) as f:
        cfg = json.load(f)
    assert "train_batch_size" not in cfg  # DeepSpeed derives it; HF's CPU world size would be wrong
    assert "zero_optimization" in cfg  # accelerate requires the block
    scape_ds.parse_scape_config(cfg["scape"])
    assert set(cfg["optimizer"]["params"]) <= set(scape_ds.engine._ADAMS_PARAMS)
