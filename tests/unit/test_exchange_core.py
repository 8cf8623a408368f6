"""The exchange parts both SCAPE optimizers share (scape_ds/exchange/core.py, refused.py), in one process."""
from __future__ import annotations

import pytest
import torch

from scape_ds.comm import ByteMeter
from scape_ds.exchange.core import (
    MaskSchedule,
    PendingMasks,
    check_same_layout,
    owe_decay,
    settle_decay,
    step_comm_stats,
)
from scape_ds.exchange.refused import refusal_message, refused_settings


@pytest.mark.parametrize("dense_refresh,always_dense,dense_steps", [
    (True, False, [1, 5, 9]),
    (False, False, [1]),
    (False, True, list(range(1, 11))),
])
def test_mask_schedule_refreshes_every_T_steps_and_is_dense_where_configured(dense_refresh, always_dense, dense_steps):
    schedule = MaskSchedule(4, dense_refresh, always_dense)
    assert [t for t in range(1, 11) if schedule.is_refresh(t)] == [1, 5, 9]
    assert [t for t in range(1, 11) if schedule.is_dense(t)] == dense_steps
    assert [t for t in range(1, 5) if MaskSchedule(1, True).is_refresh(t)] == [1, 2, 3, 4]


class _LateWork:
    """An all-gather that completes only when waited for."""

    def __init__(self, out, inp, world_size):
        self.out, self.inp, self.world_size, self.waited = out, inp, world_size, False

    def wait(self):
        self.out.view(self.world_size, -1).copy_(self.inp.view(1, -1))
        self.waited = True


class _AsyncComm:
    world_size = 3

    def __init__(self):
        self.works = []

    def all_gather_async(self, out, inp, tag):
        assert tag == "mask_ag"
        self.works.append(_LateWork(out, inp, self.world_size))
        return self.works[-1]


def test_pending_masks_decode_once_after_the_all_gather_completes():
    comm, decoded = _AsyncComm(), []
    pending = PendingMasks()
    pending.wait()  # nothing in flight: a no-op
    pending.start(comm, torch.tensor([1, 2], dtype=torch.int32), lambda out: decoded.append(out.clone()))
    assert pending.in_flight and decoded == []
    with pytest.raises(AssertionError):
        pending.start(comm, torch.tensor([3, 4], dtype=torch.int32), decoded.append)
    pending.wait()
    pending.wait()
    assert comm.works[0].waited and len(decoded) == 1 and decoded[0].tolist() == [1, 2] * 3
    pending.start(comm, torch.tensor([5], dtype=torch.int32), decoded.append)
    pending.drop()  # a loaded checkpoint brings its own masks
    assert not pending.in_flight and len(decoded) == 1


def test_lazy_decay_settles_what_two_sparse_steps_owe_outside_the_mask():
    flat = torch.arange(1.0, 9.0)
    kept = torch.tensor([1, 6])
    debt = owe_decay(owe_decay(1.0, 0.1, 0.5), 0.1, 0.5)
    assert debt == pytest.approx(0.95**2)
    want = flat * debt
    want[kept] = flat[kept]
    assert settle_decay(flat, debt, kept) == 1.0
    assert torch.equal(flat, want)
    before = flat.clone()
    assert settle_decay(flat, debt, None) == 1.0 and torch.equal(flat, before)  # no mask yet: nothing owed


def test_step_comm_stats_reads_and_resets_the_meter():
    meter = ByteMeter()
    meter.record("grad_rs", 100)
    meter.record("mask_ag", 7)
    meter.record("init", 1000)
    meter.record_dense(400)
    stats = step_comm_stats(meter, 3, False)
    assert stats == {"step": 3, "dense_step": False, "bytes_sent": 107, "bytes_dense": 400,
                     "bytes_inter": 107, "bytes_intra": 0, "bytes_dense_inter": 400, "bytes_dense_intra": 0,
                     "by_tag": {"grad_rs": 100, "mask_ag": 7}, "by_tag_intra": {}}
    assert step_comm_stats(meter, 4, True)["bytes_sent"] == 0
    # hierarchy "node": the node group's meter is the intra-node traffic
    intra = ByteMeter()
    meter.record("grad_rs", 10)
    meter.record_dense(40)
    intra.record("grad_rs", 300)
    intra.record("init", 5)
    intra.record_dense(600)
    stats = step_comm_stats(meter, 5, False, intra)
    assert (stats["bytes_inter"], stats["bytes_intra"], stats["bytes_sent"]) == (10, 300, 310)
    assert (stats["bytes_dense_inter"], stats["bytes_dense_intra"], stats["bytes_dense"]) == (40, 600, 640)
    assert stats["by_tag_intra"] == {"grad_rs": 300}


def test_state_loads_only_on_the_rank_and_world_size_that_saved_it():
    check_same_layout(1, 4, 1, 4, "X")
    with pytest.raises(ValueError, match="X state of rank 1/4 cannot load on rank 1/2: resume with the same"):
        check_same_layout(1, 4, 1, 2, "X")
    with pytest.raises(ValueError, match="rank 0/2 cannot load on rank 1/2: the data-parallel size is the same, "
                                         "but this is rank 0's shard and rank 1 needs its own") as e:
        check_same_layout(0, 2, 1, 2, "X")
    assert "resume with the same data-parallel size" not in str(e.value)  # the size is the same: not the advice


@pytest.mark.parametrize("cfg,refused_at_1,refused_at_3", [
    ({}, [], []),
    ({"bf16": {"enabled": True}}, ["bf16"], []),
    ({"bfloat16": {"enabled": True}}, ["bf16"], []),
    ({"fp16": {"enabled": True}}, ["fp16"], ["fp16"]),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": "none"}},
     ["zero_optimization.offload_optimizer"], ["zero_optimization.offload_optimizer"]),
    ({"zero_optimization": {"reduce_scatter": False, "zero_hpz_partition_size": 2}, "prescale_gradients": True},
     [], ["zero_optimization.reduce_scatter false", "zero_optimization.zero_hpz_partition_size > 1",
          "prescale_gradients"]),
])
def test_refused_settings_depend_on_the_stage(cfg, refused_at_1, refused_at_3):
    assert [r.setting for r in refused_settings(cfg, 1)] == refused_at_1
    assert [r.setting for r in refused_settings(cfg, 0)] == refused_at_1
    assert [r.setting for r in refused_settings(cfg, 3)] == refused_at_3
    for stage in (1, 3):
        refused = refused_settings(cfg, stage)
        if refused:
            message = refusal_message(refused, stage)
            assert "\n" not in message and f"ZeRO stage {stage}" in message
            assert all(r.setting in message and r.why in message for r in refused)
