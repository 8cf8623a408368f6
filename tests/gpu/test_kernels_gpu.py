"""Triton kernels against the torch oracle on CUDA, at real sizes, for every allowed chunk size.

Chunk sizes 8..65536 (every power of two ``scape.chunk_size`` allows), kept-per-chunk counts from 1 to
C, fp32 and bf16 where a kernel takes either. Chunks above ``MAX_TRITON_CHUNK`` go to the torch
top-k on CUDA (one warning); that fallback is checked too. torch.topk and the Triton radix select
break ties among equal magnitudes differently (Triton: lowest offsets), so top-k is compared as the
multiset of kept magnitudes per chunk, which is the same for any correct top-k, and exactly where
the test data has no ties.
"""
from __future__ import annotations

import time

import pytest
import torch

from scape_ds.exchange.masks import offsets_to_index, random_offsets
from scape_ds.kernels import torch_kernels as tk

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

if torch.cuda.is_available():
    from scape_ds.kernels import triton_kernels as trk

CHUNKS = [1 << b for b in range(3, 17)]  # 8 .. 65536: every chunk_size the config allows
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, bias_correction=1 - 0.9**3)
DEV = "cuda"


def _gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def _kcs(C):
    return sorted({1, max(1, round(0.01 * C)), max(1, round(0.1 * C)), C // 2 or 1, C})


@pytest.mark.parametrize("C", CHUNKS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_topk_every_chunk_size(C, dtype):
    S = max(C, 1 << 22)  # 4M elements (one chunk of 65536 at least)
    scores = torch.randn(S, device=DEV, generator=_gen(C)).to(dtype)
    t0 = time.perf_counter()
    for kc in _kcs(C):
        got = trk.chunk_topk(scores, C, kc)
        want = tk.chunk_topk(scores, C, kc)
        assert got.shape == want.shape and got.dtype == torch.int16
        g = (got.long() & 0xFFFF).view(-1, kc)
        assert torch.all(g[:, 1:] > g[:, :-1]), "offsets ascending and distinct in each chunk"
        mags = scores.float().abs().view(-1, C)
        kept = mags.gather(1, g).sort(dim=1).values
        ref = mags.gather(1, (want.long() & 0xFFFF).view(-1, kc)).sort(dim=1).values
        assert torch.equal(kept, ref), f"C={C} kc={kc}: different magnitudes kept"
    torch.cuda.synchronize()
    assert time.perf_counter() - t0 < 120, "compiling and running every kc took over 2 minutes"


def test_chunk_topk_ties_keep_lowest_offsets_on_gpu():
    scores = torch.zeros(4096 * 3, device=DEV)
    scores[10] = 5.0
    got = trk.chunk_topk(scores, 4096, 41).view(3, 41).long()
    assert got[0].tolist() == sorted([10] + list(range(40)))
    assert got[1].tolist() == list(range(41))


@pytest.mark.parametrize("C", [4096, 16384])
def test_radix_byte_select_equals_first_version(C):
    scores = torch.randn(C * 64, device=DEV, generator=_gen(1))
    scores[::7] = 0.0  # many ties
    kc = round(0.01 * C)
    assert torch.equal(trk.chunk_topk(scores, C, kc), trk.chunk_topk_bitwise(scores, C, kc))


@pytest.mark.parametrize("C", CHUNKS)
def test_mask_encode_decode_every_chunk_size(C):
    n_chunks = max(1, (1 << 20) // C)
    for kc in _kcs(C):
        off = random_offsets(n_chunks, C, kc, torch.Generator().manual_seed(C + kc)).to(DEV)
        enc = trk.encode_mask(off, C, kc)
        assert torch.equal(enc, tk.encode_mask(off, C, kc)), (C, kc)
        assert torch.equal(trk.decode_mask(enc, C, kc), off), (C, kc)


@pytest.mark.parametrize("err_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("wire", [torch.float32, torch.bfloat16])
def test_ef_accumulate_pack(err_dtype, grad_dtype, wire):
    n = (1 << 24) + 13
    k = n // 100
    error = torch.randn(n, device=DEV, generator=_gen(2)).to(err_dtype)
    grad = torch.randn(n, device=DEV, generator=_gen(3)).to(grad_dtype)
    index = torch.randperm(n, device=DEV, generator=_gen(4))[:k].sort().values
    res = []
    for kern in (tk, trk):
        e, out = error.clone(), torch.empty(k, dtype=wire, device=DEV)
        kern.ef_accumulate_pack(e, grad, index, out)
        res.append((e, out))
    assert torch.equal(res[0][0], res[1][0]) and torch.equal(res[0][1], res[1][1])


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_masked_adams_update(grad_dtype, out_dtype):
    S = 1 << 22
    k = S // 100
    p, m = torch.randn(S, device=DEV, generator=_gen(5)), torch.randn(S, device=DEV, generator=_gen(6))
    index = torch.randperm(S, device=DEV, generator=_gen(7))[:k].sort().values
    g = torch.randn(k, device=DEV, generator=_gen(8)).to(grad_dtype)
    res = []
    for kern in (tk, trk):
        pp, mm, out = p.clone(), m.clone(), torch.empty(k, dtype=out_dtype, device=DEV)
        kern.masked_adams_update(pp, mm, index, g, out, **HYPER)
        res.append((pp, mm, out))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(res[0][1], res[1][1], rtol=2e-6, atol=1e-6)
    assert torch.equal(res[1][2], res[1][0][index].to(out_dtype))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.bfloat16])
def test_dense_adams_update(grad_dtype, out_dtype):
    S = (1 << 24) + 7
    p, m = torch.randn(S, device=DEV, generator=_gen(9)), torch.randn(S, device=DEV, generator=_gen(10))
    g = torch.randn(S, device=DEV, generator=_gen(11)).to(grad_dtype)
    res = []
    for kern in (tk, trk):
        pp, mm = p.clone(), m.clone()
        out = None if out_dtype is None else torch.empty(S, dtype=out_dtype, device=DEV)
        kern.dense_adams_update(pp, mm, g, out, grad_scale=0.5, **HYPER)
        res.append((pp, mm, out))
    torch.testing.assert_close(res[0][0], res[1][0], rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(res[0][1], res[1][1], rtol=2e-6, atol=1e-6)
    if out_dtype is not None:
        assert torch.equal(res[1][2], res[1][0].to(out_dtype))


@pytest.mark.parametrize("dst_dtype", [torch.float32, torch.bfloat16])
def test_scatter_values(dst_dtype):
    n = (1 << 24) + 3
    k = n // 100
    index = torch.randperm(n, device=DEV, generator=_gen(12))[:k].sort().values
    values = torch.randn(k, device=DEV, generator=_gen(13))
    a, b = torch.zeros(n, dtype=dst_dtype, device=DEV), torch.zeros(n, dtype=dst_dtype, device=DEV)
    tk.scatter_values(a, index, values)
    trk.scatter_values(b, index, values)
    assert torch.equal(a, b)


def test_offsets_to_index_on_gpu_for_the_largest_chunk():
    C, kc = 65536, 655
    scores = torch.randn(2 * C, device=DEV, generator=_gen(14))
    idx = offsets_to_index(trk.chunk_topk(scores, C, kc), C, kc)
    want = torch.cat([scores[c * C:(c + 1) * C].abs().topk(kc).indices.sort().values + c * C for c in range(2)])
    assert torch.equal(idx, want)


@pytest.mark.parametrize("C", [256, 4096, 65536])
def test_elias_fano_offsets_on_gpu_match_the_cpu_code(C):
    # the offsets' code on CUDA tensors (no host sync in it): the same bytes as on the CPU, and back
    from scape_ds.exchange.index_code import decode_offsets, encode_offsets

    for kc in _kcs(C):
        scores = torch.randn(max(8, (1 << 22) // C), C, generator=_gen(C + kc), device=DEV)  # 4M, 1024 tiles of 4096
        offsets = tk.chunk_topk(scores.reshape(-1), C, kc)  # (n_chunks kc,) int16, ascending per tile
        code = encode_offsets(offsets, C, kc)
        assert code.is_cuda and torch.equal(code.cpu(), encode_offsets(offsets.cpu(), C, kc)), (C, kc)
        assert torch.equal(decode_offsets(code, C, kc), offsets), (C, kc)
