"""Hierarchical SCAPE (scape.hierarchy "node") on 4 gloo ranks = 2 nodes x 2: exactness, replicas,
error feedback, resume, bytes and memory, all in one spawned world (docs/design.md, Hierarchical SCAPE)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from scape_ds.comm import build_dp_communicators, collective_bytes
from scape_ds.config import parse_scape_config
from scape_ds.optim import AdamS, ScapeAdamS

from .harness import run_ranks
from .models import flat_params, loss_fn, make_batch, make_mlp

pytestmark = pytest.mark.timeout(300)

G, M = 2, 2  # ranks per node, nodes
C = 256
HP = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def _scape(sparsity, hierarchy="node", G=G, **kw):
    block = dict(sparsity=sparsity, chunk_size=C, mask_refresh_interval=4, dense_numel_threshold=1024, **kw)
    if hierarchy == "node":
        block.update(hierarchy="node", intra_node_size=G)
    return parse_scape_config(block)


def _optimizer(model, cfg, **kw):
    comm, intra = build_dp_communicators(cfg)  # collective over the world: every rank builds every group
    return ScapeAdamS(model.parameters(), **HP, scape=cfg, comm=comm, intra_comm=intra, **kw)


def _backward(model, step, rank, micro=1, dtype=torch.float32):
    for m in range(micro):  # gradient accumulation: backward adds into the flat gradient buffer
        x, y = (t.to(dtype) for t in make_batch(step * micro + m, rank))
        (loss_fn(model, x, y) / micro).backward()


def _equal_on_every_rank(t: torch.Tensor) -> bool:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return all(torch.equal(out[0], o) for o in out)


def _dense_reference(rank, world_size, steps, max_grad_norm):
    """Dense data-parallel AdamS in fp64 with the same micro-batches and clipping."""
    model = make_mlp(seed=1).double()
    opt = AdamS(model.parameters(), **HP)
    out = []
    for step in range(steps):
        opt.zero_grad()
        _backward(model, step, rank, micro=2, dtype=torch.float64)
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        out.append(flat_params(model))
    return out


def _check_sparsity_zero(rank, world_size):
    """Sparsity 0, fp64, 2 micro-batches, clipping on: the same parameters as dense data-parallel AdamS."""
    steps, clip = 6, 0.05
    ref = _dense_reference(rank, world_size, steps, clip)
    model = make_mlp(seed=1).double()
    opt = _optimizer(model, _scape(0.0), max_grad_norm=clip)
    worst = 0.0
    for step in range(steps):
        opt.zero_grad()
        _backward(model, step, rank, micro=2, dtype=torch.float64)
        opt.step()
        worst = max(worst, float((flat_params(model) - ref[step]).abs().max()))
    assert opt.last_grad_norm is not None and opt.last_grad_norm > clip  # clipping was active
    return worst


def _check_g1_equals_flat(rank, world_size):
    """Hierarchy "node" with G = 1 (one rank per node) gives flat SCAPE's parameters bit for bit."""
    flat_model, node_model = make_mlp(seed=4), make_mlp(seed=4)
    flat = _optimizer(flat_model, _scape(0.99, hierarchy="flat"), max_grad_norm=1.0)
    node = _optimizer(node_model, _scape(0.99, G=1), max_grad_norm=1.0)
    equal = True
    for step in range(7):
        for model, opt in ((flat_model, flat), (node_model, node)):
            opt.zero_grad()
            _backward(model, step, rank)
            opt.step()
        equal &= torch.equal(flat_params(flat_model), flat_params(node_model))
        equal &= torch.equal(flat.error_feedback(), node.error_feedback())
    flat.synchronize()
    node.synchronize()
    return equal


def _node_sum_of_slice(grad: torch.Tensor, rank: int) -> torch.Tensor:
    """The node sum of this rank's slice of the flat gradient (N_pad,) -> (N_pad/G,), from every rank's."""
    every = [torch.empty_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(every, grad)
    node, local = divmod(rank, G)
    total = sum(every[node * G + i] for i in range(G))
    n = grad.numel() // G
    return total[local * n:(local + 1) * n].double()


def _check_sparse(rank, world_size, tmp_path):
    """Sparsity 0.99: replicas, error feedback of node sums, bytes against flat, memory, exact resume."""
    steps, save_at = 10, 5
    model, flat_model = make_mlp(seed=3, bias=False, norm=False), make_mlp(seed=3, bias=False, norm=False)
    opt = _optimizer(model, _scape(0.99))
    flat = _optimizer(flat_model, _scape(0.99, hierarchy="flat"))
    opt.memory_bytes()  # builds the flat buffers now, so the first backward lands in flat_grad
    sent_packets = []
    rs = opt.comm.reduce_scatter

    def recording_rs(out, inp, tag):  # what this rank sends across nodes
        if tag == "grad_rs":
            sent_packets.append(inp.detach().clone())
        rs(out, inp, tag)

    opt.comm.reduce_scatter = recording_rs
    accumulated = sent = None
    ef_worst, replicas_equal, stats, flat_stats, saved, params = 0.0, True, [], [], None, []
    for step in range(steps):
        for m, o in ((model, opt), (flat_model, flat)):
            o.zero_grad()
            _backward(m, step, rank)
        node_grad = _node_sum_of_slice(opt._groups[0].flat_grad, rank)  # (N_pad/G,)
        dense = opt.schedule.is_dense(opt.step_count + 1)
        opt.step()
        flat.step()
        stats.append(dict(opt.comm_stats))
        flat_stats.append(dict(flat.comm_stats))
        gs = opt._groups[0]
        if accumulated is None:
            accumulated = torch.zeros_like(node_grad)
            sent = torch.zeros_like(node_grad)
        accumulated += node_grad
        packet = sent_packets[-1].double()
        if dense:
            sent += packet
        else:
            sent.index_add_(0, gs.active_index, packet)
            assert torch.count_nonzero(opt.error_feedback()[gs.active_index]) == 0
        ef_worst = max(ef_worst, float((sent + opt.error_feedback().double() - accumulated).abs().max()))
        replicas_equal &= _equal_on_every_rank(flat_params(model))
        params.append(flat_params(model))
        if step + 1 == save_at:
            saved = (flat_params(model), opt.state_dict())
    opt.synchronize()
    flat.synchronize()
    memory = opt.memory_bytes()
    n_pad = opt._groups[0].layout.padded_numel

    # exact resume: a new model and optimizer from the state after step save_at repeat the rest bit for bit
    resumed = make_mlp(seed=99, bias=False, norm=False)
    torch.nn.utils.vector_to_parameters(saved[0], resumed.parameters())
    opt2 = _optimizer(resumed, _scape(0.99))
    opt2.load_state_dict(saved[1])
    resume_equal = True
    for step in range(save_at, steps):
        opt2.zero_grad()
        _backward(resumed, step, rank)
        opt2.step()
        resume_equal &= torch.equal(flat_params(resumed), params[step])
    opt2.synchronize()
    return dict(ef_worst=ef_worst, replicas_equal=replicas_equal, resume_equal=resume_equal, stats=stats,
                flat_stats=flat_stats, memory=memory, n_pad=n_pad, ef_numel=opt.error_feedback().numel(),
                k=opt._groups[0].active_local.numel())


def _check_split_of_tp_groups(rank, world_size):
    """Two data-parallel groups {0, 2} and {1, 3} (as under TP2), nodes from LOCAL_WORLD_SIZE = 2 (global
    ranks {0, 1} and {2, 3}): each group splits into one rank per node, two nodes; a step keeps replicas."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    cfg = parse_scape_config(dict(sparsity=0.99, chunk_size=C, dense_numel_threshold=1024, hierarchy="node"))
    comm, intra = build_dp_communicators(cfg, groups[rank % 2])
    model = make_mlp(seed=5)
    opt = ScapeAdamS(model.parameters(), **HP, scape=cfg, comm=comm, intra_comm=intra)
    for step in range(3):
        opt.zero_grad()
        _backward(model, step, rank)
        opt.step()
    opt.synchronize()
    return (comm.world_size, intra.world_size, comm.rank), flat_params(model)


def _worker(rank, world_size, tmp_path):
    split, params = _check_split_of_tp_groups(rank, world_size)
    return dict(zero=_check_sparsity_zero(rank, world_size), g1=_check_g1_equals_flat(rank, world_size),
                sparse=_check_sparse(rank, world_size, tmp_path), split=split, split_params=params)


def test_hierarchical_scape_two_nodes_of_two(tmp_path):
    results = run_ranks(_worker, G * M, tmp_path)
    assert max(r["zero"] for r in results) <= 1e-12, [r["zero"] for r in results]  # fp64: exact but rounding
    assert all(r["g1"] for r in results), "hierarchy 'node' with G=1 differs from flat SCAPE"
    # TP-like data-parallel groups {0, 2}, {1, 3}: nodes of one rank each, node 0 then node 1
    assert [r["split"] for r in results] == [(2, 1, 0), (2, 1, 0), (2, 1, 1), (2, 1, 1)]
    assert torch.equal(results[0]["split_params"], results[2]["split_params"])
    assert torch.equal(results[1]["split_params"], results[3]["split_params"])
    for r in results:
        s = r["sparse"]
        assert s["replicas_equal"], "replicas differ after a step"
        assert s["ef_worst"] < 1e-5, s["ef_worst"]  # sent + residual == node sums accumulated (fp32 rounding)
        assert s["resume_equal"], "resumed run differs"
        # error feedback: N_pad / G elements of fp32 per rank
        assert s["ef_numel"] == s["n_pad"] // G
        assert s["memory"]["error_feedback"] == s["n_pad"] // G * 4
        assert s["memory"]["grads"] == s["n_pad"] * 4 + s["n_pad"] // G * 4  # + the node sum of the slice
    s = results[0]["sparse"]
    k, b, D, S = s["k"], 4, G * M, s["n_pad"] // (G * M)
    kc = _scape(0.99).k_per_chunk
    for step, (h, f) in enumerate(zip(s["stats"], s["flat_stats"])):
        assert f["bytes_intra"] == 0 and f["bytes_inter"] == f["bytes_sent"]  # flat: every byte counts as inter
        assert h["bytes_sent"] == h["bytes_inter"] + h["bytes_intra"]
        # inside the node, every step: a dense reduce-scatter of the gradient (N_pad,)
        rs_intra = collective_bytes("reduce_scatter", s["n_pad"] * b, G)
        if h["dense_step"]:
            assert h["by_tag_intra"]["grad_rs"] == rs_intra
            assert h["by_tag"]["grad_rs"] == collective_bytes("reduce_scatter", M * S * b, M)
            continue
        assert h["by_tag"] == {"grad_rs": (M - 1) * k * b, "param_ag": (M - 1) * k * b}
        assert f["by_tag"] == {"grad_rs": (D - 1) * k * b, "param_ag": (D - 1) * k * b}
        intra = {"grad_rs": rs_intra, "param_ag": (G - 1) * M * k * b}
        if s["stats"][step - 1]["dense_step"]:  # the slices' new masks, gathered in the node when first used
            intra["mask_ag"] = (G - 1) * M * (S // C) * kc * 2  # 16-bit offsets: smaller than a bitmask here
        assert h["by_tag_intra"] == intra
        # the packed volume handed to the cross-node collectives is exactly 1/G of flat's (M k vs D k
        # values); per rank the ring sends (M-1)/M of it against flat's (D-1)/D
        assert h["bytes_inter"] * M / (M - 1) * G == f["bytes_inter"] * D / (D - 1)
        assert h["bytes_inter"] <= f["bytes_inter"] / G
    assert [h["dense_step"] for h in s["stats"]] == [True, False, False, False, True] + [False] * 3 + [True, False]
