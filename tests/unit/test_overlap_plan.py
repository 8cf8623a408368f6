"""scape.overlap without a process group: the bucket plan, the byte counts of its collectives, the config."""
from __future__ import annotations

import pytest
import torch

from scape_ds.comm import SimulatedCommunicator, collective_bytes
from scape_ds.config import parse_scape_config
from scape_ds.exchange.basis import TileLayout
from scape_ds.exchange.layout import FlatLayout
from scape_ds.optim.dct_overlap import plan_dct_buckets
from scape_ds.optim.overlap import plan_buckets


@pytest.mark.parametrize("world_size,bucket_numel", [(1, 10_000), (2, 3 * 256), (4, 1000), (4, 10**9)])
def test_buckets_cover_the_buffer_once_inside_shards_in_backward_order(world_size, bucket_numel):
    shapes = [(96, 64), (64,), (128, 96), (50, 7)]
    layout = FlatLayout.build([torch.empty(s) for s in shapes], world_size, 256)
    buckets = plan_buckets(layout, bucket_numel)
    covered = torch.zeros(layout.padded_numel, dtype=torch.int32)
    per = max(256, bucket_numel // 256 * 256)
    for b in buckets:
        assert b.lo % 256 == 0 and b.hi % 256 == 0 and 0 < b.hi - b.lo <= per
        shard = layout.shard_slice(b.owner)
        assert shard.start <= b.lo < b.hi <= shard.stop  # never across an owner's shard
        covered[b.lo : b.hi] += 1
        want = [i for i, (o, n) in enumerate(zip(layout.offsets, layout.numels)) if o < b.hi and o + n > b.lo]
        assert list(b.params) == want
    assert bool((covered == 1).all())
    assert [b.hi for b in buckets] == sorted((b.hi for b in buckets), reverse=True)  # the end of the buffer first


def test_packed_slice_holds_the_buckets_chunks():
    layout = FlatLayout.build([torch.empty(64, 64)], 2, 256)
    b = plan_buckets(layout, 512)[0]  # the last two chunks
    assert (b.lo, b.hi) == (3584, 4096) and b.packed(256, 3) == slice(42, 48)


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_reduces_and_broadcasts_count_what_the_reduce_scatter_and_all_gather_count(world_size):
    k = 1000 * 4  # bytes of one owner's part
    for rank in range(world_size):
        reduces = sum(collective_bytes("reduce", k, world_size, owner == rank) for owner in range(world_size))
        broadcasts = sum(collective_bytes("broadcast_all", k, world_size, owner == rank) for owner in range(world_size))
        assert reduces == collective_bytes("reduce_scatter", world_size * k, world_size)
        assert broadcasts == collective_bytes("all_gather", k, world_size)


def test_simulated_communicator_reduce_and_broadcast():
    comm = SimulatedCommunicator(4, rank=1)
    t = torch.ones(10)
    comm.reduce_async(t, 1, "grad_rs").wait()
    assert torch.equal(t, torch.full((10,), 4.0))
    comm.broadcast_async(t, 1, "param_ag").wait()
    assert comm.meter.total == {"grad_rs": 0, "param_ag": 3 * 40}


@pytest.mark.parametrize("edit,message", [
    (dict(basis="dct", mask="shared"), "basis 'dct' is built for: mask 'shared' (needs one of per_rank)"),
    (dict(basis="dct", dct_update="adams"), "dct_update 'adams' (needs one of sign, rms, signum)"),
    (dict(hierarchy="node"), "hierarchy 'node' (needs 'flat')"),
    (dict(update_rule="catchup"), "update_rule 'catchup' (needs 'lazy')"),
    (dict(clip_local=1.0), "clip_local 1.0 (needs 0.0)"),
    (dict(bucket_mb=-1.0), "scape.bucket_mb: must be > 0"),
    (dict(buckets_in_flight=-1), "scape.buckets_in_flight: must be >= 0"),
])
def test_overlap_refuses_what_it_is_not_built_for(edit, message):
    with pytest.raises(ValueError) as err:
        parse_scape_config(dict(overlap=True, **edit))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_overlap_off_by_default_with_ddp_sized_buckets():
    cfg = parse_scape_config({})
    assert cfg.overlap is False and cfg.bucket_mb == 25.0 and cfg.buckets_in_flight == 8


@pytest.mark.parametrize("world_size,bucket_numel", [(1, 10**9), (2, 6144), (4, 1), (2, 20000)])
def test_dct_buckets_are_runs_of_whole_weights_covering_both_buffers_once(world_size, bucket_numel):
    shapes = [(96, 64), (128, 96), (50, 7), (64, 64)]  # 6144, 12288, 350 (one padded tile), 4096 elements
    tensors = [torch.empty(s) for s in shapes]
    layout = FlatLayout.build(tensors, world_size, 1024)
    tiles = TileLayout.build(tensors, layout.offsets, world_size, 32)
    buckets = plan_dct_buckets(tiles, layout.numels, layout.padded_numel, bucket_numel)
    flat, coef = torch.zeros(layout.padded_numel, dtype=torch.int32), torch.zeros(tiles.numel, dtype=torch.int32)
    weights = []
    for b in buckets:
        weights += list(b.weights)
        assert b.lo == layout.offsets[b.weights[0]] and b.coef_lo == tiles.coef_offsets[b.weights[0]]
        size = sum(layout.numels[w] for w in b.weights)
        assert size <= bucket_numel or len(b.weights) == 1, (b, bucket_numel)  # a larger weight alone
        flat[b.lo : b.hi] += 1
        coef[b.coef_lo : b.coef_hi] += 1
    assert weights == list(range(len(shapes)))  # forward order, each weight once
    assert bool((flat == 1).all()) and bool((coef == 1).all())
    assert len(buckets) == {10**9: 1, 6144: 3, 1: 4, 20000: 2}[bucket_numel]
