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


def test_dispatch():
    assert get_kernels("cpu", "auto") is tk
    assert get_kernels("cpu", "torch") is tk
    with pytest.raises(ValueError, match="kernels"):
        get_kernels("cpu", "fast")


# ---------------------------------------------------------------- Triton == torch
triton_kernels = pytest.importorskip("scape_ds.kernels.triton_kernels")


@pytest.mark.parametrize("n,k,wire", [(1000, 37, torch.float32), (4097, 1025, torch.bfloat16), (3, 1, torch.float32)])
def test_triton_ef_accumulate_pack(n, k, wire):
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
def test_triton_chunk_topk(C, kc, n_chunks):
    scores = torch.randn(n_chunks * C, generator=_gen(C + kc))
    assert torch.equal(triton_kernels.chunk_topk(scores, C, kc), tk.chunk_topk(scores, C, kc))


def test_triton_chunk_topk_ties_keep_lowest_offsets():
    scores = torch.zeros(64)
    scores[10] = 5.0
    got = triton_kernels.chunk_topk(scores, 64, 3)
    assert got.tolist() == [0, 1, 10]


@pytest.mark.parametrize("S,k", [(512, 40), (3000, 1025), (8, 1)])
def test_triton_masked_adams_update(S, k):
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
def test_triton_scatter_values(n, k):
    index = _random_index(n, k)
    values = torch.randn(k, generator=_gen(3))
    a, b = torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)
    tk.scatter_values(a, index, values)
    triton_kernels.scatter_values(b, index, values)
    assert torch.equal(a, b)


@pytest.mark.parametrize("C,kc,n_chunks", [(64, 9, 3), (256, 64, 2), (1024, 200, 1), (64, 3, 2)])
def test_triton_mask_encode_decode(C, kc, n_chunks):
    off = random_offsets(n_chunks, C, kc, _gen(12))
    enc = triton_kernels.encode_mask(off, C, kc)
    assert torch.equal(enc, tk.encode_mask(off, C, kc))
    assert torch.equal(triton_kernels.decode_mask(enc, C, kc), off)
