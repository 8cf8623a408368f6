"""The DCT basis (``scape.basis = "dct"``): the transform against scipy, tiles, the union mask, config.

scipy.fft is the outside reference (scipy is a test dependency only). Triton runs on CPU tensors under
TRITON_INTERPRET=1 (tests/conftest.py).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.fft
import torch

from scape_ds.config import parse_scape_config
from scape_ds.exchange.basis import TileLayout, dct_matrix, from_coefficients, to_coefficients
from scape_ds.exchange.coefficients import union_slots
from scape_ds.exchange.index_code import decode_offsets, encode_offsets
from scape_ds.kernels import torch_kernels as tk


@pytest.mark.parametrize("n", [4, 16, 64])
def test_dct_matrix_is_scipys_orthonormal_dct2(n):
    q = dct_matrix(n, torch.float64)
    ref = scipy.fft.dct(np.eye(n), axis=0, norm="ortho")  # column i: the DCT of unit vector i
    assert np.abs(q.numpy() - ref).max() < 1e-12
    assert torch.allclose(q @ q.t(), torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("t", [16, 64])
def test_torch_dct_tiles_matches_scipy_dctn_and_round_trips(t):
    x = torch.randn(5, t, t, generator=torch.Generator().manual_seed(t))
    q = dct_matrix(t)
    y = tk.dct_tiles(x, q)
    ref = scipy.fft.dctn(x.double().numpy(), axes=(1, 2), norm="ortho")
    assert np.abs(y.double().numpy() - ref).max() < 1e-5  # fp32 matmuls against fp64 FFT
    assert torch.allclose(tk.dct_tiles(y, q, inverse=True), x, atol=1e-5, rtol=0)
    # orthonormal: the energy of every tile is kept
    assert torch.allclose(y.square().sum((1, 2)), x.square().sum((1, 2)), rtol=1e-5)


@pytest.mark.parametrize("t", [16, 32, 64])
def test_triton_dct_tiles_matches_torch(t):
    triton_kernels = pytest.importorskip("scape_ds.kernels.triton_kernels")
    x = torch.randn(3, t, t, generator=torch.Generator().manual_seed(7))
    q = dct_matrix(t)
    for inverse in (False, True):
        got = triton_kernels.dct_tiles(x, q, inverse=inverse)
        want = tk.dct_tiles(x, q, inverse=inverse)
        assert torch.allclose(got, want, atol=2e-6, rtol=0), (got - want).abs().max()


def test_tile_layout_pads_edges_and_never_crosses_a_shard():
    weights = [torch.zeros(100, 70), torch.zeros(32, 32), torch.zeros(8, 3, 5, 5)]  # conv: (8, 75)
    offsets = [0, 7000, 7000 + 1024]
    lay = TileLayout.build(weights, offsets, world_size=4, tile=16)
    assert lay.shapes == ((100, 70), (32, 32), (8, 75))
    assert lay.tile_grid == ((7, 5), (2, 2), (1, 5))
    assert lay.coef_offsets == (0, 35 * 256, 39 * 256)
    assert lay.numel % (4 * 256) == 0 and lay.numel >= 44 * 256  # 44 tiles padded to 44 (a multiple of 4)
    assert lay.shard_numel % lay.chunk_size == 0  # whole tiles per shard


def test_coefficients_round_trip_through_padded_tiles():
    gen = torch.Generator().manual_seed(3)
    weights = [torch.randn(100, 70, generator=gen), torch.randn(32, 48, generator=gen)]
    offsets = [0, 7000]
    flat = torch.cat([w.reshape(-1) for w in weights] + [torch.zeros(536)])  # (N_pad,)
    lay = TileLayout.build(weights, offsets, world_size=2, tile=16)
    q = dct_matrix(16, torch.float64)
    coef = torch.zeros(lay.numel, dtype=torch.float64)
    to_coefficients(lay, flat.double(), coef, q, tk)
    # each weight's tiles are scipy's dctn of the zero-padded weight, tile by tile
    padded = np.zeros((112, 80))
    padded[:100, :70] = weights[0].double().numpy()
    tile = padded[16:32, 32:48]
    grid_c = 5
    want = scipy.fft.dctn(tile, norm="ortho")
    got = coef[(1 * grid_c + 2) * 256 : (1 * grid_c + 2 + 1) * 256].view(16, 16).numpy()
    assert np.abs(got - want).max() < 1e-12
    out = torch.full_like(flat, float("nan"), dtype=torch.float64)
    from_coefficients(lay, coef, out, q, tk)
    assert torch.allclose(out[:7000 + 1536], flat[:7000 + 1536].double(), atol=1e-12, rtol=0)
    assert torch.isnan(out[7000 + 1536 :]).all()  # the flat padding is not written
    # accumulate: decay * e + Q g
    acc = coef.clone()
    to_coefficients(lay, flat.double(), acc, q, tk, decay=0.5)
    assert torch.allclose(acc, 1.5 * coef, atol=1e-12, rtol=0)


def test_union_slots_marks_repeats_once_per_chunk():
    # D = 2 ranks, 2 chunks of C = 8, K = 2 nominations each; rank-major (rank, chunk, K)
    nominated = torch.tensor([[[1, 5], [0, 7]],   # rank 0
                              [[5, 2], [7, 7]]],  # rank 1 (a repeat inside its own list too)
                             dtype=torch.int16).reshape(-1)
    index, repeated = union_slots(nominated, n_chunks=2, world_size=2, per_rank=2, chunk_size=8)
    assert index.tolist() == [[1, 5, 5, 2], [8, 15, 15, 15]]
    assert repeated.tolist() == [[False, False, True, False], [False, False, True, True]]


def test_config_dct_fields_and_refusals():
    cfg = parse_scape_config(dict(basis="dct", chunk_size=1024, mask="shared", clip_local=1.0, ef_decay=0.999))
    assert (cfg.tile_size, cfg.mask, cfg.dct_update) == (32, "shared", "sign")
    with pytest.raises(ValueError, match="power of 4"):
        parse_scape_config(dict(basis="dct", chunk_size=2048))
    assert parse_scape_config(dict(basis="dct", hierarchy="node", mask="shared")).hierarchy == "node"
    with pytest.raises(ValueError, match="mask_source 'momentum' is built for hierarchy 'flat'"):
        parse_scape_config(dict(basis="dct", hierarchy="node", mask="shared", mask_source="momentum"))
    with pytest.raises(ValueError, match="scape.overlap with basis 'dct' is built for: hierarchy 'node'"):
        parse_scape_config(dict(basis="dct", hierarchy="node", overlap=True))
    with pytest.raises(ValueError, match="update_rule 'catchup'"):
        parse_scape_config(dict(basis="dct", update_rule="catchup"))
    with pytest.raises(ValueError, match="scape.ef_decay: must be in"):
        parse_scape_config(dict(ef_decay=1.5))
    with pytest.raises(ValueError, match="scape.clip_local: must be >= 0"):
        parse_scape_config(dict(clip_local=-1.0))
    with pytest.raises(ValueError, match="scape.mask"):
        parse_scape_config(dict(mask="global"))
    assert parse_scape_config(dict(basis="dct", mask="shared", mask_source="owner")).mask_source == "owner"
    with pytest.raises(ValueError, match="mask_source 'owner' applies to the shared mask of basis 'dct'"):
        parse_scape_config(dict(basis="dct", mask_source="owner"))  # per_rank has no shared mask
    assert parse_scape_config(dict(basis="dct", mask="shared", mask_source="momentum")).mask_source == "momentum"
    with pytest.raises(ValueError, match="mask_source 'momentum' chooses each step's mask one step early"):
        parse_scape_config(dict(basis="dct", mask="shared", mask_source="momentum", mask_early=True))
    assert parse_scape_config(dict(basis="dct", dct_update="signum")).dct_update == "signum"
    held = parse_scape_config(dict(basis="dct", mask="shared", mask_hold=10, mask_early=True))
    assert (held.mask_hold, held.mask_early) == (10, True)
    with pytest.raises(ValueError, match="mask_hold 5 applies to the shared mask"):
        parse_scape_config(dict(basis="dct", mask_hold=5))
    with pytest.raises(ValueError, match="mask_early True applies to the shared mask"):
        parse_scape_config(dict(mask_early=True))
    with pytest.raises(ValueError, match="mask_hold must be >= 1"):
        parse_scape_config(dict(basis="dct", mask="shared", mask_hold=0))


def test_union_slots_with_one_nomination_per_rank_is_contiguous():
    nominated = torch.tensor([3, 4, 3, 5], dtype=torch.int16)  # D = 2, 2 chunks, K = 1
    index, repeated = union_slots(nominated, n_chunks=2, world_size=2, per_rank=1, chunk_size=8)
    assert index.view(-1).tolist() == [3, 3, 12, 13]
    assert repeated.view(-1).tolist() == [False, True, False, False]


@pytest.mark.parametrize("bits,qmax", [(8, 127), (4, 7)])
def test_coded_values_round_within_half_a_step_and_keep_zero_tiles(bits, qmax):
    from scape_ds.exchange.quantize import decode_values, encode_values, payload_numel

    torch.manual_seed(0)
    kc = 5
    values = torch.randn(3 * kc) * torch.tensor([1e-3, 1.0, 0.0]).repeat_interleave(kc)  # the last tile all 0
    payload = encode_values(values, kc, bits)
    assert payload.dtype == torch.uint8 and payload.numel() == payload_numel(values.numel(), kc, bits)
    assert payload.numel() == (15 if bits == 8 else 8) + 3 * 4  # codes (two nibbles a byte, padded), fp32 scales
    decoded = decode_values(payload, values.numel(), kc, bits)
    step = values.view(3, kc).abs().amax(dim=1) / qmax  # each tile's scale
    err = (values - decoded).view(3, kc).abs()
    assert bool((err <= step.unsqueeze(1) / 2 + 1e-12).all())
    assert decoded[2 * kc:].eq(0).all()
    # the largest value of a tile is sent exactly (its code is +-qmax)
    for t in range(2):
        i = int(values[t * kc:(t + 1) * kc].abs().argmax()) + t * kc
        assert torch.isclose(decoded[i], values[i], rtol=1e-6)


def test_value_bits_is_for_the_dct_exchange():
    assert parse_scape_config(dict(basis="dct", value_bits=8)).value_bits == 8
    with pytest.raises(ValueError, match="value_bits 8 codes the values of basis 'dct''s exchange: basis"):
        parse_scape_config(dict(value_bits=8))
    assert parse_scape_config(dict(basis="dct", mask="shared", value_bits=4)).value_bits == 4  # coded union
    with pytest.raises(ValueError, match="value_bits 4 codes the values of basis 'dct''s exchange: hierarchy 'node' "
                                         "\\(needs 'flat'\\)"):
        parse_scape_config(dict(basis="dct", mask="shared", value_bits=4, hierarchy="node"))
    with pytest.raises(ValueError, match="overlap True \\(needs False\\)"):
        parse_scape_config(dict(basis="dct", overlap=True, value_bits=8))
    with pytest.raises(ValueError, match="scape.value_bits"):
        parse_scape_config(dict(basis="dct", value_bits=12))
    assert parse_scape_config(dict(basis="dct", mask="shared", value_bits=16)).value_bits == 16
    with pytest.raises(ValueError, match="value_bits 16 sends the values of basis 'dct''s shared-mask exchange as "
                                         "bf16: mask 'per_rank' \\(needs 'shared'\\)"):
        parse_scape_config(dict(basis="dct", value_bits=16))
    with pytest.raises(ValueError, match="overlap True \\(needs False\\)"):
        parse_scape_config(dict(basis="dct", mask="shared", overlap=True, value_bits=16))


def test_index_code_is_for_the_dct_exchange():
    assert parse_scape_config(dict(basis="dct")).index_code == "int16"
    assert parse_scape_config(dict(basis="dct", index_code="elias_fano")).index_code == "elias_fano"
    with pytest.raises(ValueError, match="index_code 'elias_fano' codes the offsets of basis 'dct''s "
                                         "exchange: basis 'coordinate' \\(needs 'dct'\\)"):
        parse_scape_config(dict(index_code="elias_fano"))
    for source in ("union", "owner"):  # the shared mask's nominations, or its owners' choices
        assert parse_scape_config(dict(basis="dct", mask="shared", mask_source=source,
                                       index_code="elias_fano")).index_code == "elias_fano"
    with pytest.raises(ValueError, match="mask_source 'momentum' \\(needs 'union'\\)"):
        parse_scape_config(dict(basis="dct", mask="shared", mask_source="momentum", index_code="elias_fano"))
    with pytest.raises(ValueError, match="overlap True \\(needs False\\)"):
        parse_scape_config(dict(basis="dct", overlap=True, index_code="elias_fano"))
    with pytest.raises(ValueError, match="scape.index_code"):
        parse_scape_config(dict(basis="dct", index_code="varint"))


@pytest.mark.parametrize("chunk_size", [16, 256, 4096, 65536])
def test_elias_fano_offsets_round_trip_at_every_density(chunk_size):
    # random ascending sets, with the tile's first and last offsets (0 and C - 1, which is -1 as int16
    # at C = 65536) forced into some tiles; the code's length is the one Elias-Fano gives
    g = torch.Generator().manual_seed(chunk_size)
    kcs = sorted({1, 2, 3, chunk_size // 4 - 1, chunk_size // 4, chunk_size // 2, chunk_size // 2 + 1,
                  chunk_size - 1, chunk_size} - {0})
    if chunk_size == 65536:
        kcs = [1, 2, 41, 655, 16384]
    for kc in kcs:
        n_chunks = 5
        keys = torch.rand(n_chunks, chunk_size, generator=g)
        keys[0, 0] = keys[1, -1] = 2.0  # the largest key: always chosen
        x = keys.topk(kc, dim=1).indices.sort(dim=1).values  # (n_chunks, kc) ascending
        assert x[0, 0] == 0 and x[1, -1] == chunk_size - 1
        offsets = x.reshape(-1).to(torch.int32).to(torch.int16)
        code = encode_offsets(offsets, chunk_size, kc)
        low = max(b for b in range(17) if kc << b <= chunk_size)
        assert code.dtype == torch.uint8 and code.numel() == n_chunks * ((kc * low + kc + (chunk_size >> low) + 7) // 8)
        assert torch.equal(decode_offsets(code, chunk_size, kc), offsets), (chunk_size, kc)
        if kc <= chunk_size // 8:  # sparse tiles: under 2 + log2(C / kc) bits an offset, far below 16
            assert code.numel() * 8 <= n_chunks * kc * (2 + math.log2(chunk_size / kc)) + 8 * n_chunks
    with pytest.raises(ValueError, match="k_per_chunk must be in 1..16"):
        encode_offsets(torch.zeros(17, dtype=torch.int16), 16, 17)


def test_tile_budget_sets_the_per_rank_sparsity_by_d():
    cfg = parse_scape_config(dict(basis="dct", tile_budget=160))
    assert [cfg.for_ranks(D).k_per_chunk for D in (1, 2, 4, 8, 200)] == [160, 80, 40, 20, 1]
    assert parse_scape_config(dict(basis="dct")).for_ranks(8).k_per_chunk == 41  # without it: sparsity's kc
    with pytest.raises(ValueError, match="tile_budget 160 sets basis 'dct''s per-rank sparsity by the number of "
                                         "ranks: mask 'shared' \\(needs 'per_rank'\\)"):
        parse_scape_config(dict(basis="dct", mask="shared", tile_budget=160))
    with pytest.raises(ValueError, match="sparsity 0.99 \\(set by tile_budget // D: give one of the two\\)"):
        parse_scape_config(dict(basis="dct", sparsity=0.99, tile_budget=160))
    with pytest.raises(ValueError, match="scape.tile_budget must be >= 1"):
        parse_scape_config(dict(basis="dct", tile_budget=0))


def test_bf16_on_the_wire_is_refused_with_the_mpi_backend():
    for extra in (dict(mask="shared", value_bits=16), dict(dense_wire="bf16")):
        with pytest.raises(ValueError, match="comm_backend 'mpi' reduces fp32 and fp64 only"):
            parse_scape_config(dict(basis="dct", comm_backend="mpi", **extra))


def test_decode_senders_is_for_the_per_rank_dct_exchange():
    assert parse_scape_config(dict(basis="dct")).decode == "ranks"
    assert parse_scape_config(dict(basis="dct", decode="senders")).decode == "senders"
    with pytest.raises(ValueError, match="decode 'senders' averages basis 'dct''s per-rank messages over their "
                                         "senders: basis 'coordinate'"):
        parse_scape_config(dict(decode="senders"))
    with pytest.raises(ValueError, match="mask 'shared' \\(needs 'per_rank'\\)"):
        parse_scape_config(dict(basis="dct", mask="shared", decode="senders"))
    with pytest.raises(ValueError, match="overlap True \\(needs False\\)"):
        parse_scape_config(dict(basis="dct", overlap=True, decode="senders"))
    with pytest.raises(ValueError, match="scape.decode"):
        parse_scape_config(dict(basis="dct", decode="mean"))


def test_local_steps_settings_and_refusals():
    cfg = parse_scape_config(dict(basis="dct", local_steps=30))
    assert (cfg.local_steps, cfg.inner_optimizer, cfg.outer_update, cfg.outer_lr, cfg.outer_momentum) == (
        30, "adamw", "nesterov", 0.7, 0.9)
    with pytest.raises(ValueError, match="local_steps 30 exchanges pseudo-gradients through basis 'dct', built for: "
                                         "basis 'coordinate'"):
        parse_scape_config(dict(local_steps=30))
    with pytest.raises(ValueError, match="hierarchy 'node' \\(needs 'flat'\\)"):
        parse_scape_config(dict(basis="dct", local_steps=2, hierarchy="node"))
    with pytest.raises(ValueError, match="mask_hold 4 \\(needs 1\\)"):
        parse_scape_config(dict(basis="dct", local_steps=2, mask="shared", mask_hold=4))
    with pytest.raises(ValueError, match="scape.local_steps: must be an integer >= 1"):
        parse_scape_config(dict(basis="dct", local_steps=0))
    with pytest.raises(ValueError, match="scape.outer_momentum: must be in \\[0, 1\\)"):
        parse_scape_config(dict(basis="dct", local_steps=2, outer_momentum=1.0))
    with pytest.raises(ValueError, match="scape.outer_lr: must be > 0"):
        parse_scape_config(dict(basis="dct", local_steps=2, outer_lr=0.0))
    with pytest.raises(ValueError, match="outer_update 'sign' moves every synchronized parameter by outer_lr"):
        parse_scape_config(dict(basis="dct", local_steps=2, outer_update="sign"))  # 0.7 would be no step size
    with pytest.raises(ValueError, match="outer_update 'sign_lr' moves every synchronized parameter by outer_lr x"):
        parse_scape_config(dict(basis="dct", local_steps=30, outer_update="sign_lr"))
    assert parse_scape_config(dict(basis="dct", local_steps=30, outer_update="sign_lr", outer_lr=15)).outer_lr == 15
    assert parse_scape_config(dict(basis="dct", local_steps=2, outer_update="sign", outer_lr=0.03)).outer_lr == 0.03


def test_local_steps_refused_under_zero3():
    from scape_ds.zero3 import check_stage3_config

    with pytest.raises(ValueError, match="scape.local_steps 30 is not built for ZeRO stage 3"):
        check_stage3_config({"zero_optimization": {"stage": 3}}, parse_scape_config(dict(basis="dct", local_steps=30)))


def test_dense_wire_is_for_the_dct_basis_at_stage_0_1():
    from scape_ds.zero3 import check_stage3_config

    assert parse_scape_config(dict(basis="dct", dense_wire="bf16")).dense_wire == "bf16"
    with pytest.raises(ValueError, match="dense_wire 'bf16' is built for basis 'dct'"):
        parse_scape_config(dict(dense_wire="bf16"))
    with pytest.raises(ValueError, match="scape.dense_wire 'bf16' is not built for ZeRO stage 3"):
        check_stage3_config({"zero_optimization": {"stage": 3}},
                            parse_scape_config(dict(basis="dct", dense_wire="bf16")))
