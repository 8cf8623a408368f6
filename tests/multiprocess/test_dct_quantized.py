"""``scape.value_bits`` 8 and 4 (basis "dct", per_rank and the shared mask) and 16 (shared) on 2-8 gloo ranks.

The oracles are computed here: Q g in fp64 (``_logged_step``), and what each rank sent decoded from the
bytes its communicator moved by a plain loop over the payload (codes, then little-endian fp32 scales),
independently of ``scape_ds.exchange.quantize``; the bytes of each collective counted by hand.
"""
from __future__ import annotations

import struct

import pytest
import torch
import torch.distributed as dist

from scape_ds.comm import collective_bytes
from scape_ds.optim import ScapeAdamS

from .harness import run_ranks
from .models import flat_params, make_mlp
from .test_dct import SCAPE, RecordingCommunicator, _logged_step, _offsets_of, _sent_this_step

pytestmark = pytest.mark.timeout(300)

C = 256


def _decode_by_loop(payload: torch.Tensor, n: int, kc: int, bits: int) -> list[float]:
    """The n values a payload carries: code - (qmax + 1), times its tile's fp32 scale."""
    raw = bytes(payload.tolist())
    qmax = 127 if bits == 8 else 7
    n_codes = n if bits == 8 else (n + 1) // 2
    if bits == 8:
        codes = list(raw[:n_codes])
    else:
        codes = [nib for b in raw[:n_codes] for nib in (b & 0xF, b >> 4)][:n]
    n_tiles = n // kc
    scales = struct.unpack(f"<{n_tiles}f", raw[n_codes : n_codes + 4 * n_tiles])
    return [(codes[i] - (qmax + 1)) * scales[i // kc] for i in range(n)]


def _worker(rank, world_size, tmp_path, bits, steps):
    model = make_mlp(seed=3)
    comm = RecordingCommunicator()
    opt = ScapeAdamS(model.parameters(), lr=1e-2, weight_decay=0.1, comm=comm, scape=dict(SCAPE, value_bits=bits))
    kc = opt.cfg.k_per_chunk
    produced = sent = None
    worst, mismatches, stats, coded_worst = 0.0, 0, [], 0.0
    for step in range(steps):
        step_q, log = _logged_step(model, opt, comm, step, rank)
        if produced is None:
            produced, sent = torch.zeros_like(step_q), torch.zeros_like(step_q)
        produced += step_q
        payload, offsets = log["grad_ag"][0], _offsets_of(log["index_ag"][0])
        values = torch.tensor(_decode_by_loop(payload, offsets.numel(), kc, bits), dtype=torch.float64)
        chunk = torch.arange(offsets.numel()) // kc
        sent.index_add_(0, chunk * C + offsets, values)
        worst = max(worst, float((sent + opt.error_feedback().double() - produced).abs().max()))
        # what the coding lost stays at the sent positions: at most half a step of each tile's scale
        kept = opt.error_feedback().double()[chunk * C + offsets].view(-1, kc)
        scale = values.view(-1, kc).abs().amax(dim=1, keepdim=True) / (127 if bits == 8 else 7)
        coded_worst = max(coded_worst, float((kept.abs() - scale / 2).max() / scale.max()))
        stats.append(dict(opt.comm_stats))
        params = flat_params(model)
        every = [torch.empty_like(params) for _ in range(world_size)]
        dist.all_gather(every, params)
        mismatches += sum(not torch.equal(params, p) for p in every)
    gs = opt._groups[0]
    return dict(worst=worst, mismatches=mismatches, stats=stats, coded_worst=coded_worst, kc=kc,
                numel=gs.tiles.numel, dense=sum(p.numel() for p in gs.dense_params), scale=float(produced.abs().max()))


@pytest.mark.parametrize("bits,world_size", [(8, 2), (4, 2), (8, 4), (4, 8)])
def test_coded_values_replicas_error_feedback_and_bytes(tmp_path, bits, world_size):
    results = run_ranks(_worker, world_size, tmp_path, bits, 6)
    for r in results:
        assert r["mismatches"] == 0, "replicas differ"
        # sent (as decoded by the loop) + kept == accumulated: nothing the coding rounded away is lost
        assert r["worst"] <= 1e-6 * r["scale"], (r["worst"], r["scale"])
        assert r["coded_worst"] <= 1e-6, r["coded_worst"]  # |v - q s| <= s / 2 at every sent value
    r, D = results[0], world_size
    k = r["numel"] // C * r["kc"]  # this rank's sent coefficients, whole tiles
    payload = (k if bits == 8 else (k + 1) // 2) + 4 * (r["numel"] // C)
    for s in r["stats"]:
        assert s["by_tag"] == {"grad_ag": (D - 1) * payload, "index_ag": (D - 1) * k * 2,
                               "dense_ar": collective_bytes("all_reduce", r["dense"] * 4, D)}, s["by_tag"]


def _worker_dense_wire(rank, world_size, tmp_path, steps):
    from .models import loss_fn, make_batch

    model = make_mlp(seed=3)
    opt = ScapeAdamS(model.parameters(), lr=1e-2, weight_decay=0.1, scape=dict(SCAPE, dense_wire="bf16"))
    sent = produced = None
    worst, mismatches, stats = 0.0, 0, []
    wire = opt.comm.all_reduce

    def recording(tensor, tag):  # the bf16 values this rank puts on the wire for the dense tensors
        if tag == "dense_ar":
            recording.sent = tensor.detach().double().clone()
        wire(tensor, tag)

    opt.comm.all_reduce = recording
    for step in range(steps):
        opt.zero_grad()
        loss_fn(model, *make_batch(step, rank)).backward()
        grads = torch.cat([p.grad.reshape(-1).double() for p in model.parameters() if p.dim() == 1])
        opt.step()
        gs = opt._groups[0]
        assert recording.sent.numel() == gs.dense_error.numel()
        produced = grads if produced is None else produced + grads
        sent = recording.sent if sent is None else sent + recording.sent
        worst = max(worst, float((sent + gs.dense_error.double() - produced).abs().max() / produced.abs().max()))
        stats.append(dict(opt.comm_stats))
        params = flat_params(model)
        every = [torch.empty_like(params) for _ in range(world_size)]
        dist.all_gather(every, params)
        mismatches += sum(not torch.equal(params, p) for p in every)
    return dict(worst=worst, mismatches=mismatches, stats=stats, dense=gs.dense_error.numel(),
                memory=opt.memory_bytes())


def test_dense_wire_bf16_keeps_its_rounding_and_halves_the_dense_bytes(tmp_path):
    D = 2
    results = run_ranks(_worker_dense_wire, D, tmp_path, 5)
    for r in results:
        assert r["mismatches"] == 0, "replicas differ"
        # sent (bf16 values) + kept (fp32) == every local gradient produced: nothing the rounding lost is lost
        assert r["worst"] <= 1e-6, r["worst"]
    r = results[0]
    for s in r["stats"]:
        assert s["by_tag"]["dense_ar"] == collective_bytes("all_reduce", r["dense"] * 2, D), s["by_tag"]
    assert r["memory"]["error_feedback"] >= r["dense"] * 4


def _worker_fp64(rank, world_size, tmp_path, bits):
    from .models import loss_fn, make_batch

    model = make_mlp(seed=3).double()
    opt = ScapeAdamS(model.parameters(), lr=1e-2, weight_decay=0.1, scape=dict(SCAPE, value_bits=bits))
    for step in range(3):
        opt.zero_grad()
        loss_fn(model, *(t.double() for t in make_batch(step, rank))).backward()
        opt.step()
    params = flat_params(model)
    every = [torch.empty_like(params) for _ in range(world_size)]
    dist.all_gather(every, params)
    return all(torch.equal(params, p) for p in every) and params.dtype == torch.float64


def test_coded_values_with_fp64_parameters(tmp_path):
    assert run_ranks(_worker_fp64, 2, tmp_path, 8) == [True, True]


def _step_and_grads(model, opt, sparse, step, rank) -> torch.Tensor:
    """One optimizer step on this rank's batch; the gradient of the ``sparse`` weights it took, (N,) fp64."""
    from .models import loss_fn, make_batch

    opt.zero_grad()
    loss_fn(model, *make_batch(step, rank)).backward()
    grads = torch.cat([p.grad.reshape(-1) for p in sparse]).double()
    opt.step()
    return grads


def _differing_replicas(model, world_size) -> int:
    """How many ranks' parameters differ from this rank's."""
    params = flat_params(model)
    every = [torch.empty_like(params) for _ in range(world_size)]
    dist.all_gather(every, params)
    return sum(not torch.equal(params, p) for p in every)


def _worker_shared_bf16(rank, world_size, tmp_path, steps):
    from scape_ds.exchange.basis import dct_matrix, to_coefficients
    from scape_ds.kernels import torch_kernels

    model = make_mlp(seed=3)
    comm = RecordingCommunicator()
    opt = ScapeAdamS(model.parameters(), lr=1e-2, weight_decay=0.1, comm=comm,
                     scape=dict(SCAPE, mask="shared", value_bits=16))
    sparse = [p for p in model.parameters() if p.dim() == 2]
    produced = sent = None
    worst, mismatches, stats, wire_dtypes = 0.0, 0, [], set()
    for step in range(steps):
        grads = _step_and_grads(model, opt, sparse, step, rank)
        gs = opt._groups[0]
        if produced is None:
            produced, sent = torch.zeros(gs.tiles.numel, dtype=torch.float64), torch.zeros(gs.tiles.numel,
                                                                                           dtype=torch.float64)
        to_coefficients(gs.tiles, grads, produced, dct_matrix(16, torch.float64), torch_kernels, decay=1.0)
        wire_dtypes |= {inp.dtype for tag, inp, _ in comm.log if tag == "grad_rs"}
        sent += _sent_this_step(comm, "shared", gs.tiles.numel, world_size, opt.cfg.k_per_chunk)  # the bf16 values
        worst = max(worst, float((sent + opt.error_feedback().double() - produced).abs().max()))
        stats.append(dict(opt.comm_stats))
        mismatches += _differing_replicas(model, world_size)
    return dict(worst=worst, mismatches=mismatches, stats=stats, wire=wire_dtypes, kc=opt.cfg.k_per_chunk,
                numel=gs.tiles.numel, dense=sum(p.numel() for p in gs.dense_params), scale=float(produced.abs().max()))


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_shared_mask_bf16_values_keep_their_rounding_and_cost_six_bytes_a_slot(tmp_path, world_size):
    results = run_ranks(_worker_shared_bf16, world_size, tmp_path, 6)
    for r in results:
        assert r["mismatches"] == 0, "replicas differ"
        assert r["wire"] == {torch.bfloat16}, r["wire"]
        # sent (the bf16 values this rank put on the wire) + kept == accumulated: its rounding is kept
        assert r["worst"] <= 1e-6 * r["scale"], (r["worst"], r["scale"])
    r, D = results[0], world_size
    n_chunks, K = r["numel"] // C, max(1, r["kc"] // world_size)
    slots = n_chunks * D * K
    for s in r["stats"]:
        assert s["by_tag"] == {"index_ag": (D - 1) * n_chunks * K * 2,  # 2 B per slot, each way
                               "grad_rs": (D - 1) * slots * 2 // D, "grad_ag": (D - 1) * slots // D * 2,
                               "dense_ar": collective_bytes("all_reduce", r["dense"] * 4, D)}, s["by_tag"]


def _worker_shared_coded(rank, world_size, tmp_path, bits, steps):
    from scape_ds.exchange.basis import dct_matrix, to_coefficients
    from scape_ds.kernels import torch_kernels

    model = make_mlp(seed=3)
    comm = RecordingCommunicator()
    opt = ScapeAdamS(model.parameters(), lr=1e-2, weight_decay=0.1, comm=comm,
                     scape=dict(SCAPE, mask="shared", value_bits=bits))
    sparse = [p for p in model.parameters() if p.dim() == 2]
    D, K = world_size, max(1, opt.cfg.k_per_chunk // world_size)
    produced = applied = None
    worst, mismatches, stats = 0.0, 0, []
    for step in range(steps):
        grads = _step_and_grads(model, opt, sparse, step, rank)
        gs = opt._groups[0]
        n_chunks = gs.tiles.numel // C
        if produced is None:
            produced = torch.zeros(gs.tiles.numel, dtype=torch.float64)
            applied = torch.zeros(gs.tiles.numel, dtype=torch.float64)
        to_coefficients(gs.tiles, grads, produced, dct_matrix(16, torch.float64), torch_kernels, decay=1.0)
        log = {tag: (inp, out) for tag, inp, out in comm.log}
        comm.log.clear()
        # the slots: chunk, then rank, then nomination; the sums: every owner's block of tiles decoded by a loop
        noms = _offsets_of(log["index_ag"][1]).view(D, n_chunks, K)
        every = log["grad_ag"][1].view(D, -1)  # (D, L) each owner's coded sums
        per_owner = n_chunks // D * D * K
        sums = [v for part in every for v in _decode_by_loop(part, per_owner, D * K, bits)]
        for c in range(n_chunks):
            for j in range(D * K):
                applied[c * C + int(noms[j // K, c, j % K])] += sums[c * D * K + j]  # a repeated slot: 0
        # over the ranks together, accumulated - kept == what every rank applied, the sums' codes included
        moved = produced - opt.error_feedback().double()
        dist.all_reduce(moved)
        worst = max(worst, float((moved - applied).abs().max()))
        stats.append(dict(opt.comm_stats))
        mismatches += _differing_replicas(model, world_size)
    return dict(worst=worst, mismatches=mismatches, stats=stats, K=K, n_chunks=n_chunks,
                dense=sum(p.numel() for p in gs.dense_params), scale=float(produced.abs().max()))


@pytest.mark.parametrize("bits,world_size", [(8, 2), (4, 4), (8, 8)])
def test_shared_mask_coded_values_lose_nothing_over_the_ranks(tmp_path, bits, world_size):
    results = run_ranks(_worker_shared_coded, world_size, tmp_path, bits, 5)
    for r in results:
        assert r["mismatches"] == 0, "replicas differ"
        # what the ranks' codes and the owners' codes of the sums lost is all in the error feedback
        assert r["worst"] <= 1e-5 * r["scale"], (r["worst"], r["scale"])
    r, D = results[0], world_size
    n = r["n_chunks"] // D * D * r["K"]  # the values of one owner's block of tiles
    payload = (n if bits == 8 else (n + 1) // 2) + 4 * (r["n_chunks"] // D)  # codes, then one fp32 scale a tile
    for s in r["stats"]:
        assert s["by_tag"] == {"index_ag": (D - 1) * r["n_chunks"] * r["K"] * 2,
                               "grad_a2a": (D - 1) * payload, "grad_ag": (D - 1) * payload,
                               "dense_ar": collective_bytes("all_reduce", r["dense"] * 4, D)}, s["by_tag"]


def _worker_coded_resume(rank, world_size, tmp_path, extra):
    import copy

    from .models import loss_fn, make_batch

    def train(model, opt, start, steps):
        for step in range(start, start + steps):
            opt.zero_grad()
            loss_fn(model, *make_batch(step, rank)).backward()
            opt.step()

    scape = dict(SCAPE, **extra)
    model = make_mlp(seed=4)
    opt = ScapeAdamS(model.parameters(), lr=1e-2, weight_decay=0.1, scape=scape)
    train(model, opt, 0, 3)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    train(model, opt, 3, 3)
    again = make_mlp(seed=99)
    again.load_state_dict(saved_model)
    opt2 = ScapeAdamS(again.parameters(), lr=1e-2, weight_decay=0.1, scape=scape)
    opt2.load_state_dict(saved_opt)
    train(again, opt2, 3, 3)
    return torch.equal(flat_params(model), flat_params(again))


@pytest.mark.parametrize("extra,world_size", [
    pytest.param(dict(value_bits=8, dense_wire="bf16"), 8, id="q8-bf16-8ranks"),
    pytest.param(dict(mask="shared", value_bits=16, dense_wire="bf16"), 8, id="shared-bf16-8ranks"),
    pytest.param(dict(value_bits=8, dense_wire="bf16"), 4, id="q8-bf16-4ranks"),
    pytest.param(dict(mask="shared", value_bits=4), 4, id="shared-q4-4ranks"),
    pytest.param(dict(decode="senders"), 4, id="senders-4ranks")])
def test_coded_exchanges_resume_exactly(tmp_path, extra, world_size):
    # what the coding kept (error feedback, dense_error) is all a resume needs: bit for bit
    assert run_ranks(_worker_coded_resume, world_size, tmp_path, extra) == [True] * world_size


def _worker_budget(rank, world_size, tmp_path, budget):
    from scape_ds.config import parse_scape_config

    from .models import loss_fn, make_batch

    model = make_mlp(seed=3)
    opt = ScapeAdamS(model.parameters(), lr=1e-2, scape=dict(basis="dct", chunk_size=C, dense_numel_threshold=1024,
                                                           tile_budget=budget))
    opt.zero_grad()
    loss_fn(model, *make_batch(0, rank)).backward()
    opt.step()
    saved = opt.state_dict()["scape"]["config"]
    return dict(kc=opt.cfg.k_per_chunk, by_tag=dict(opt.comm_stats["by_tag"]), n_chunks=opt._groups[0].tiles.numel // C,
                reparsed_sparsity=parse_scape_config(saved).sparsity, sparsity=opt.cfg.sparsity)


@pytest.mark.parametrize("world_size", [2, 4])
def test_tile_budget_sends_budget_over_d_per_rank(tmp_path, world_size):
    # 64 coefficients per 16 x 16 tile in all: 32 per rank at D = 2, 16 at D = 4, so the all-gathers'
    # bytes per rank, (D - 1) k 6, stay within (D - 1) / D of each other
    r = run_ranks(_worker_budget, world_size, tmp_path, 64)[0]
    D, kc = world_size, 64 // world_size
    assert r["kc"] == kc
    assert r["by_tag"]["grad_ag"] == (D - 1) * r["n_chunks"] * kc * 4
    assert r["by_tag"]["index_ag"] == (D - 1) * r["n_chunks"] * kc * 2
    assert r["reparsed_sparsity"] == r["sparsity"]  # the checkpoint's config says what ran, and parses
