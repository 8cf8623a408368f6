"""scape_ds.faults on 2 gloo ranks: every group gets --dist-timeout, and the store probe names the silent rank."""
from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from .harness import run_ranks

pytestmark = pytest.mark.timeout(120)


def _timeout(group) -> datetime.timedelta:
    return group._get_backend(torch.device("cpu")).options._timeout


def _worker(rank, world_size, tmp_path):
    from scape_ds.faults import bound_group_timeouts, probe_peers

    late = dist.new_group(list(range(world_size)))  # as DeepSpeed clones the world: gloo's 30 min default
    before = _timeout(late)
    assert bound_group_timeouts(7) == 2
    after = [_timeout(dist.group.WORLD), _timeout(late)]
    silent_first = probe_peers(rank, world_size, 1.0) if rank == 0 else None  # rank 1 does not answer yet
    dist.barrier()
    silent_all = probe_peers(rank, world_size, 1.0)  # both have posted now
    return before, after, silent_first, silent_all


def test_groups_get_the_timeout_and_the_probe_names_the_silent_rank(tmp_path):
    (b0, a0, first, all0), (_, a1, _, all1) = run_ranks(_worker, 2, tmp_path)
    assert b0 == datetime.timedelta(minutes=30)
    assert a0 == a1 == [datetime.timedelta(seconds=7)] * 2
    assert first == [1]
    assert all0 == all1 == []
