"""Torch kernels (the oracle) against plain indexing, and the Triton kernels against the torch ones.

Triton runs here on CPU tensors under TRITON_INTERPRET=1 (set in tests/conftest.py), so sizes are
small; odd sizes (not multiples of the block or chunk) are included.
"""
from __future__ import annotations

import pytest
import torch

from scape_ds.exchange.masks import offsets_to_index, random_offsets, select_mask
from scape_ds.kernels import get_kernels
from scape_ds.kernels import torch_kernels as tk

HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, bias_correction=1 - 0.9**3)


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _random_index(n, k, seed=0):
    return torch.randperm(n, generator=_gen(seed))[:k].sort().values


# ---------------------------------------------------------------- torch kernels: semantics
def test_ef_accumulate_pack_conserves_and_rounds_into_error():
    n, k = 1000, 37
    error, grad = torch.randn(n, generator=_gen(1)), torch.randn(n, generator=_gen(2))
    index = _random_index(n, k)
    before = error + grad
    out = torch.empty(k, dtype=torch.bfloat16)
    tk.ef_accumulate_pack(error, grad, index, out)
    restored = error.clone()
    restored.index_add_(0, index, out.float())
    assert torch.equal(restored, before)  # everything sent plus the residual: exact
    assert (error[index].abs() > 0).any()  # bf16 rounding residual kept


def test_chunk_topk_picks_largest_magnitudes_ascending():
    C, kc = 64, 5
    scores = torch.randn(4 * C, generator=_gen(3))
    off = tk.chunk_topk(scores, C, kc)
    assert off.dtype == torch.int16 and off.numel() == 4 * kc
    for c in range(4):
        got = off[c * kc:(c + 1) * kc].long()
        assert torch.all(got[1:] > got[:-1])
        want = scores[c * C:(c + 1) * C].abs().topk(kc).indices.sort().values
        assert torch.equal(got, want)


def test_masked_adams_update_touches_only_the_mask():
    S, k = 512, 40
    p, m = torch.randn(S, generator=_gen(4)), torch.randn(S, generator=_gen(5))
    p0, m0 = p.clone(), m.clone()
    index = _random_index(S, k, 6)
    g = torch.randn(k, generator=_gen(7))
    out = torch.empty(k)
    tk.masked_adams_update(p, m, index, g, out, **HYPER)
    outside = torch.ones(S, dtype=torch.bool)
    outside[index] = False
    assert torch.equal(p[outside], p0[outside]) and torch.equal(m[outside], m0[outside])
    assert torch.equal(out, p[index])
    c = HYPER["bias_correction"]
    want_m = 0.9 * m0[index] + 0.1 * g
    denom = torch.sqrt(0.95 * (m0[index] / c) ** 2 + 0.05 * g**2) + 1e-8
    want_p = p0[index] * (1 - 1e-3) - 1e-2 * (want_m / c) / denom
    torch.testing.assert_close(p[index], want_p, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("C,kc", [(64, 1), (64, 3), (64, 40), (256, 64), (4096, 41), (65536, 655)])
def test_mask_encode_decode_round_trip_and_size(C, kc):
    n_chunks = 3
    off = random_offsets(n_chunks, C, kc, _gen(8))
    enc = tk.encode_mask(off, C, kc)
    assert enc.dtype == torch.uint8
    assert enc.numel() == n_chunks * min(C // 8, 2 * kc)  # the smaller encoding
    assert torch.equal(tk.decode_mask(enc, C, kc), off)


def test_decode_rejects_corrupt_bitmask():
    C, kc = 64, 40
    enc = tk.encode_mask(random_offsets(2, C, kc, _gen(9)), C, kc)
    enc[0] ^= 1
    with pytest.raises(RuntimeError, match="corrupt mask"):
        tk.decode_mask(enc, C, kc)


def test_offsets_to_index_and_exploration():
    C, kc = 32, 4
    off = torch.tensor([0, 5, 6, 31, 1, 2, 3, 4], dtype=torch.int16)
    assert offsets_to_index(off, C, kc).tolist() == [0, 5, 6, 31, 33, 34, 35, 36]
    scores = torch.randn(4 * C, generator=_gen(10))
    mixed = select_mask(scores, C, 8, tk, exploration=0.5, generator=_gen(11))
    idx = offsets_to_index(mixed, C, 8).view(4, 8)
    assert all(len(set(row.tolist())) == 8 for row in idx)  # distinct, ascending
    assert torch.all(idx[:, 1:] > idx[:, :-1])


def test_dense_adams_update_equals_adams_bitwise():
    from scape_ds.optim.adams import adams

    S = tk.BLOCK_NUMEL + 1000  # more than one block, and a partial one
    p, m, g = (torch.randn(S, generator=_gen(i)) for i in (20, 21, 22))
    p1, m1 = p.clone(), m.clone()
    tk.dense_adams_update(p1, m1, g, grad_scale=1.0, **HYPER)
    p2, m2 = p.clone(), m.clone()
    adams([p2], [g], [m2], step=3, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, bias_correction=True)
    assert torch.equal(p1, p2) and torch.equal(m1, m2)
    # grad_scale folds the mean's 1/D and the clipping factor; out gets the new values rounded
    p3, m3, out = p.clone(), m.clone(), torch.empty(S, dtype=torch.bfloat16)
    tk.dense_adams_update(p3, m3, (4 * g).bfloat16(), out, grad_scale=0.25, **HYPER)
    p4, m4 = p.clone(), m.clone()
    adams([p4], [(4 * g).bfloat16().float() * 0.25], [m4], step=3, lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8,
          weight_decay=0.1, bias_correction=True)
    assert torch.equal(p3, p4) and torch.equal(m3, m4) and torch.equal(out, p3.bfloat16())


def test_chunk_topk_in_blocks_equals_one_topk():
    C, kc = 64, 5
    n_chunks = 2 * (tk.BLOCK_NUMEL // C) + 7  # two full blocks of chunks and a partial one
    scores = torch.randn(n_chunks * C, generator=_gen(23))
    want = scores.abs().view(-1, C).topk(kc, dim=1, sorted=False).indices.sort(dim=1).values.reshape(-1)
    assert torch.equal(tk.chunk_topk(scores, C, kc).long(), want)
    assert torch.equal(tk.chunk_topk(scores[: 3 * C], C, C).long(), torch.arange(C).repeat(3))


def test_chunk_topk_largest_chunk_reads_offsets_as_uint16():
    C, kc = 65536, 655
    scores = torch.randn(2 * C, generator=_gen(24))
    off = tk.chunk_topk(scores, C, kc)
    idx = offsets_to_index(off, C, kc)
    want = torch.cat([scores[c * C:(c + 1) * C].abs().topk(kc).indices.sort().values + c * C for c in range(2)])
    assert torch.equal(idx, want) and int(idx.max()) >= 32768  # offsets above int16's range survive


def test_dispatch():
    assert get_kernels("cpu", "auto") is tk
    assert get_kernels("cpu", "torch") is tk
    with pytest.raises(ValueError, match="kernels"):
        get_kernels("cpu", "fast")


# ---------------------------------------------------------------- Triton == torch
@pytest.fixture(scope="module")
def triton_kernels():
    """The Triton kernels; only the tests that take this skip without triton (the torch ones above run)."""
    return pytest.importorskip("scape_ds.kernels.triton_kernels", exc_type=ImportError)  # its own ImportError


@pytest.mark.parametrize("n,k,wire", [(1000, 37, torch.float32), (4097, 1025, torch.bfloat16), (3, 1, torch.float32)])
def test_triton_ef_accumulate_pack(triton_kernels, n, k, wire):
    error, grad = torch.randn(n, generator=_gen(1)), torch.randn(n, generator=_gen(2))
    index = _random_index(n, k)
    outs = []
    for kern in (tk, triton_kernels):
        e = error.clone()
        out = torch.empty(k, dtype=wire)
        kern.ef_accumulate_pack(e, grad, index, out)
        outs.append((e, out))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


@pytest.mark.parametrize("C,kc,n_chunks", [(64, 1, 3), (64, 7, 5), (256, 3, 2), (1024, 10, 3), (64, 64, 2)])
def test_triton_chunk_topk(triton_kernels, C, kc, n_chunks):
    scores = torch.randn(n_chunks * C, generator=_gen(C + kc))
    assert torch.equal(triton_kernels.chunk_topk(scores, C, kc), tk.chunk_topk(scores, C, kc))


def test_triton_chunk_topk_ties_keep_lowest_offsets(triton_kernels):
    scores = torch.zeros(64)
    scores[10] = 5.0
    got = triton_kernels.chunk_topk(scores, 64, 3)
    assert got.tolist() == [0, 1, 10]


@pytest.mark.parametrize("S,k", [(512, 40), (3000, 1025), (8, 1)])
def test_triton_masked_adams_update(triton_kernels, S, k):
    p, m = torch.randn(S, generator=_gen(4)), torch.randn(S, generator=_gen(5))
    index = _random_index(S, k, 6)
    g = torch.randn(k, generator=_gen(7))
    res = []
    for kern in (tk, triton_kernels):
        pp, mm, out = p.clone(), m.clone(), torch.empty(k)
        kern.masked_adams_update(pp, mm, index, g, out, **HYPER)
        res.append((pp, mm, out))
    for a, b in zip(res[0], res[1]):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("n,k", [(100, 7), (5000, 1500)])
def test_triton_scatter_values(triton_kernels, n, k):
    index = _random_index(n, k)
    values = torch.randn(k, generator=_gen(3))
    a, b = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    tk.scatter_values(a, index, values)
    triton_kernels.scatter_values(b, index, values)
    assert torch.equal(a, b)


@pytest.mark.parametrize("C,kc,n_chunks", [(64, 9, 3), (256, 64, 2), (1024, 200, 1), (64, 3, 2)])
def test_triton_mask_encode_decode(triton_kernels, C, kc, n_chunks):
    off = random_offsets(n_chunks, C, kc, _gen(12))
    enc = triton_kernels.encode_mask(off, C, kc)
    assert torch.equal(enc, tk.encode_mask(off, C, kc))
    assert torch.equal(triton_kernels.decode_mask(enc, C, kc), off)


def test_triton_chunk_topk_radix_bytes_equals_bitwise_with_ties_and_nan(triton_kernels):
    # values from a small set (many ties at the threshold), zeros, inf and NaN
    C = 256
    base = torch.randint(0, 6, (4 * C,), generator=_gen(25)).float() * 0.5
    base[::37] = float("nan")
    base[5] = float("inf")
    base[C : 2 * C] = 0.0  # a chunk of equal keys: the lowest offsets are kept
    for kc in (1, 3, 40, 200, 256):
        got = triton_kernels.chunk_topk(base, C, kc)
        assert torch.equal(got, triton_kernels.chunk_topk_bitwise(base, C, kc)), kc
        assert torch.equal(got[kc : 2 * kc].long(), torch.arange(kc)), kc


def test_triton_chunk_topk_above_max_chunk_uses_torch_with_one_warning(triton_kernels):
    import warnings

    C, kc = 2 * triton_kernels.MAX_TRITON_CHUNK, 10
    scores = torch.randn(2 * C, generator=_gen(26))
    triton_kernels._WARNED_BIG_CHUNK = False
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = triton_kernels.chunk_topk(scores, C, kc)
        triton_kernels.chunk_topk(scores, C, kc)
    assert torch.equal(got, tk.chunk_topk(scores, C, kc))
    assert len([w for w in caught if "chunk_size" in str(w.message)]) == 1
    kc = C // 4  # a bitmask mask of a chunk this large decodes in torch too
    off = random_offsets(2, C, kc, _gen(27))
    enc = triton_kernels.encode_mask(off, C, kc)
    assert torch.equal(enc, tk.encode_mask(off, C, kc)) and torch.equal(triton_kernels.decode_mask(enc, C, kc), off)


@pytest.mark.parametrize("S,grad_dtype,out_dtype,scale", [(3000, torch.float32, None, 1.0),
                                                          (1025, torch.bfloat16, torch.bfloat16, 0.5),
                                                          (8, torch.float32, torch.float32, 0.25)])
def test_triton_dense_adams_update(triton_kernels, S, grad_dtype, out_dtype, scale):
    p, m = torch.randn(S, generator=_gen(28)), torch.randn(S, generator=_gen(29))
    g = torch.randn(S, generator=_gen(30)).to(grad_dtype)
    res = []
    for kern in (tk, triton_kernels):
        pp, mm = p.clone(), m.clone()
        out = None if out_dtype is None else torch.empty(S, dtype=out_dtype)
        kern.dense_adams_update(pp, mm, g, out, grad_scale=scale, **HYPER)
        res.append((pp, mm, out))
    for a, b in zip(res[0][:2], res[1][:2]):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    if out_dtype is not None:
        assert torch.equal(res[1][2], res[1][0].to(out_dtype))  # rounded to nearest-even, as torch


def test_triton_ef_accumulate_pack_bf16_error_buffer(triton_kernels):
    n, k = 1000, 37
    error, grad = torch.randn(n, generator=_gen(31)).bfloat16(), torch.randn(n, generator=_gen(32))
    index = _random_index(n, k)
    outs = []
    for kern in (tk, triton_kernels):
        e, out = error.clone(), torch.empty(k)
        kern.ef_accumulate_pack(e, grad, index, out)
        outs.append((e, out))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert torch.count_nonzero(outs[0][0][index]) == 0  # fp32 wire: a bf16 value is sent exactly
