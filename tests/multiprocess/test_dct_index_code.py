"""``scape.index_code "elias_fano"`` (basis "dct", per_rank and the shared mask) on 2 and 4 gloo ranks.

Each worker trains two copies of one model side by side, one sending int16 offsets and one Elias-Fano
coded offsets; the oracles are computed here: the coded payload decoded by a plain loop over its bits
(independently of ``scape_ds.exchange.index_code``) must give the int16 run's offsets, the two runs'
parameters must be the same bits after every step, and the offsets' bytes are counted by hand.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from scape_ds.optim import ScapeAdamS

from .harness import run_ranks
from .models import flat_params, loss_fn, make_batch, make_mlp
from .test_dct import SCAPE, RecordingCommunicator, _offsets_of

pytestmark = pytest.mark.timeout(300)

C = 256


def _ef_decode_by_loop(raw: bytes, chunk_size: int, kc: int) -> list[int]:
    """Elias-Fano, bit by bit: per tile kc low parts of l bits (least significant first), then a
    bitmap whose i-th set bit, at position p, gives the high part p - i; bytes most significant bit first."""
    low = 0
    while kc << (low + 1) <= chunk_size:
        low += 1
    upper = kc + ((chunk_size - 1) >> low) + 1
    per_tile = (kc * low + upper + 7) // 8
    assert len(raw) % per_tile == 0
    out = []
    for t in range(len(raw) // per_tile):
        bits = [(raw[t * per_tile + i // 8] >> (7 - i % 8)) & 1 for i in range(8 * per_tile)]
        lows = [sum(bits[i * low + j] << j for j in range(low)) for i in range(kc)]
        ones = [p for p in range(upper) if bits[kc * low + p]]
        assert len(ones) == kc, (t, len(ones))
        out += [((p - i) << low) | lows[i] for i, p in enumerate(ones)]
    return out


def _worker(rank, world_size, tmp_path, extra, steps):
    torch.manual_seed(0)
    plain_model = make_mlp(seed=3)
    coded_model = copy.deepcopy(plain_model)
    plain_comm, coded_comm = RecordingCommunicator(), RecordingCommunicator()
    scape = dict(SCAPE, **extra)
    if "tile_budget" in extra:  # it sets the sparsity itself
        del scape["sparsity"]
    plain = ScapeAdamS(plain_model.parameters(), lr=1e-2, weight_decay=0.1, comm=plain_comm, scape=scape)
    coded = ScapeAdamS(coded_model.parameters(), lr=1e-2, weight_decay=0.1, comm=coded_comm,
                       scape=dict(scape, index_code="elias_fano"))
    kc = coded.cfg.k_per_chunk  # per_rank: offsets a tile and rank; shared: the nominations (kc // D) or
    if coded.cfg.mask == "shared":  # the owner's choices (kc)
        kc = kc if coded.cfg.mask_source == "owner" else max(1, kc // world_size)
    unequal, offsets_differ, mismatches, stats = 0, 0, 0, []
    for step in range(steps):
        for model, opt, comm in ((plain_model, plain, plain_comm), (coded_model, coded, coded_comm)):
            comm.log.clear()
            opt.zero_grad()
            loss_fn(model, *make_batch(step, rank)).backward()
            opt.step()
        sent_plain = _offsets_of([inp for tag, inp, _ in plain_comm.log if tag == "index_ag"][0]).tolist()
        payload = [inp for tag, inp, _ in coded_comm.log if tag == "index_ag"][0]
        assert payload.dtype == torch.uint8
        offsets_differ += _ef_decode_by_loop(bytes(payload.tolist()), C, kc) != sent_plain
        unequal += not torch.equal(flat_params(plain_model), flat_params(coded_model))
        stats.append((dict(plain.comm_stats["by_tag"]), dict(coded.comm_stats["by_tag"])))
        params = flat_params(coded_model)
        every = [torch.empty_like(params) for _ in range(world_size)]
        dist.all_gather(every, params)
        mismatches += sum(not torch.equal(params, p) for p in every)
    n_chunks = coded._groups[0].tiles.numel // C  # the tiles whose offsets this rank sends (an owner: its own)
    if coded.cfg.mask_source == "owner":
        n_chunks //= world_size
    return dict(unequal=unequal, offsets_differ=offsets_differ, mismatches=mismatches, stats=stats, kc=kc,
                n_chunks=n_chunks)


@pytest.mark.parametrize("extra,world_size", [
    pytest.param({}, 2, id="fp32-2ranks"),
    pytest.param(dict(value_bits=8, dense_wire="bf16", tile_budget=64), 4, id="scale-4ranks"),
    pytest.param(dict(decode="senders", sparsity=0.99), 4, id="senders-kc2-4ranks"),
    pytest.param(dict(mask="shared", value_bits=4), 4, id="shared-q4-4ranks"),
    pytest.param(dict(mask="shared", mask_source="owner"), 2, id="shared-owner-2ranks")])
def test_elias_fano_offsets_are_lossless_and_cost_what_the_code_says(tmp_path, extra, world_size):
    results = run_ranks(_worker, world_size, tmp_path, extra, 4)
    D = world_size
    for r in results:
        assert r["offsets_differ"] == 0, "the code does not carry the int16 run's offsets"
        assert r["unequal"] == 0, "coded offsets changed the training"
        assert r["mismatches"] == 0, "replicas differ"
    r = results[0]
    kc, n_chunks = r["kc"], r["n_chunks"]
    low = max(b for b in range(17) if kc << b <= C)
    per_tile = (kc * low + kc + (C >> low) + 7) // 8  # C a power of two: ((C - 1) >> l) + 1 == C >> l
    assert per_tile < 2 * kc
    for plain, coded in r["stats"]:
        assert plain["index_ag"] == (D - 1) * n_chunks * kc * 2
        assert coded["index_ag"] == (D - 1) * n_chunks * per_tile, (coded, per_tile)
        assert {k: v for k, v in coded.items() if k != "index_ag"} == {k: v for k, v in plain.items()
                                                                      if k != "index_ag"}
