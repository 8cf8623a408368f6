"""Single-process parts of the ZeRO-3 path: Stage3AdamS's masked and lazy-decay steps, the config refusals,
the packing and replica-position arithmetic of the exchange (D ranks simulated in one process)."""
from __future__ import annotations

import copy

import pytest
import torch

from scape_ds.config import parse_scape_config
from scape_ds.exchange.pieces import (
    flat_indices,
    k_per_piece,
    pack_for_reduce_scatter,
    piece_numel,
    real_numel,
    replica_positions,
    split_rank_major,
    unpack_pieces,
)
from scape_ds.optim.adams import adams
from scape_ds.zero3 import Stage3AdamS, check_deepspeed_internals, check_stage3_config, replica_zero_config

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def test_masked_steps_touch_only_the_mask_and_decay_is_settled_at_the_dense_step():
    torch.manual_seed(0)
    flat = torch.randn(64, requires_grad=True)
    opt = Stage3AdamS([flat], **HP)
    ref_p, ref_m = flat.detach().clone(), torch.zeros(64)
    index = torch.tensor([3, 10, 40])
    grads = [torch.randn(64) for _ in range(4)]
    for t, g in enumerate(grads, start=1):
        sparse = t in (2, 3)
        opt.active = {id(flat): index} if sparse else {}
        flat.grad = g.clone()
        before = flat.detach().clone()
        opt.step()
        if sparse:
            outside = torch.ones(64, dtype=torch.bool)
            outside[index] = False
            assert torch.equal(flat.detach()[outside], before[outside])  # untouched until the dense step
            sub_p, sub_m = ref_p[index].clone(), ref_m[index].clone()
            adams([sub_p], [g[index]], [sub_m], step=t, bias_correction=True, lr=HP["lr"], beta1=0.9, beta2=0.95,
                  eps=HP["eps"], weight_decay=HP["weight_decay"])
            ref_p[index], ref_m[index] = sub_p, sub_m
        else:
            if t == 4:  # two sparse steps of weight decay owed outside the mask
                keep = ref_p[index].clone()
                ref_p.mul_((1 - HP["lr"] * HP["weight_decay"]) ** 2)
                ref_p[index] = keep
            adams([ref_p], [g], [ref_m], step=t, bias_correction=True, lr=HP["lr"], beta1=0.9, beta2=0.95,
                  eps=HP["eps"], weight_decay=HP["weight_decay"])
        torch.testing.assert_close(flat.detach(), ref_p, rtol=1e-6, atol=1e-7)


def test_a_loaded_state_keeps_the_last_mask_an_index_and_the_dense_step_after_it_matches():
    """torch's load_state_dict casts state tensors to the parameter's dtype; ``last_index`` stays
    int64, so the dense step after a resume (a refresh) settles the decay exactly as without one."""
    torch.manual_seed(0)
    flats = [torch.randn(64, requires_grad=True) for _ in range(2)]
    opt = Stage3AdamS(flats, **HP)
    grads = [torch.randn(64) for _ in range(2)]
    for f, g in zip(flats, grads):
        f.grad = g.clone()
    opt.active = {id(f): torch.tensor([3, 10, 40]) + i for i, f in enumerate(flats)}
    opt.step()  # sparse: owes decay outside the mask
    saved = copy.deepcopy(opt.state_dict())  # as read from a file: no tensor shared with opt
    copies = [f.detach().clone().requires_grad_() for f in flats]
    again = Stage3AdamS(copies, **HP)
    again.load_state_dict(saved)
    assert [again.state[c]["last_index"].dtype for c in copies] == [torch.int64] * 2
    assert torch.equal(again.state[copies[1]]["last_index"], torch.tensor([4, 11, 41]))
    for o, ps in ((opt, flats), (again, copies)):
        for p, g in zip(ps, grads):
            p.grad = g.clone()
        o.active = {}
        o.step()  # dense: settles the decay with last_index
    assert all(torch.equal(a.detach(), b.detach()) for a, b in zip(flats, copies))


@pytest.mark.parametrize("edit,message", [
    (dict(zero_optimization={"stage": 3, "reduce_scatter": False}), "reduce_scatter false"),
    (dict(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"}}), "offload_optimizer"),
    (dict(zero_optimization={"stage": 3}, gradient_predivide_factor=2.0), "gradient_predivide_factor"),
    (dict(zero_optimization={"stage": 3}, scape={"hierarchy": "node"}), "hierarchy 'node' is not built for ZeRO"),
    (dict(zero_optimization={"stage": 3}, scape={"update_rule": "catchup"}),
     "update_rule 'catchup' is not built for ZeRO stage 3"),
    (dict(zero_optimization={"stage": 3}, scape={"reselect_interval": 50}),
     "reselect_interval is not built for ZeRO stage 3"),
    (dict(zero_optimization={"stage": 3}, scape={"basis": "dct", "dct_update": "adams_coef"}),
     "dct_update 'adams_coef' is not built for ZeRO stage 3"),
    (dict(zero_optimization={"stage": 3}, scape={"clip_local": 1.0}), "clip_local is not built for the coordinate"),
    (dict(zero_optimization={"stage": 3}, scape={"compressor": "topk"}), "runs compressor 'scape' over comm_backend"),
    (dict(zero_optimization={"stage": 3}, scape={"error_feedback_dtype": "bf16"}),
     "error_feedback_dtype 'bf16' is for ZeRO stage 0/1"),
])
def test_stage3_refusals(edit, message):
    with pytest.raises(ValueError, match=message):
        check_stage3_config(edit, parse_scape_config(edit.get("scape")))


def test_installed_deepspeed_has_the_private_names():
    check_deepspeed_internals()  # raises naming the DeepSpeed version if they moved


def test_sparse_replica_makes_every_parameter_persistent_and_refuses_a_threshold():
    zero = replica_zero_config({"stage": 3})
    assert zero["stage3_param_persistence_threshold"] == zero["stage3_model_persistence_threshold"] > 2**62
    with pytest.raises(ValueError, match="stage3_param_persistence_threshold = 0 .*sparse_replica"):
        replica_zero_config({"stage": 3, "stage3_param_persistence_threshold": 0})


# ---------------------------------------------------------------- stage-3 index arithmetic, D ranks in one process
def _reduce_scatter(packed_per_rank: list[torch.Tensor], world_size: int) -> list[torch.Tensor]:
    """What a sum reduce-scatter delivers to each rank: row r of the sum of every rank's buffer."""
    total = torch.stack(packed_per_rank).sum(0).view(world_size, -1)
    return [total[r] for r in range(world_size)]


@pytest.mark.parametrize("numel,world_size", [(10, 4), (5, 4), (12, 3), (1, 2), (4097, 8)])
def test_pieces_cover_the_parameter_and_only_the_last_ones_are_padded(numel, world_size):
    P = piece_numel(numel, world_size)
    real = [real_numel(numel, P, r) for r in range(world_size)]
    assert P * world_size >= numel > (P - 1) * world_size  # P = ceil(numel / D)
    assert sum(real) == numel and real == sorted(real, reverse=True)  # full pieces, then the padded ones
    assert sum(0 < n < P for n in real) <= 1
    assert 1 <= k_per_piece(P, 0.99) <= P and k_per_piece(P, 0.0) == P and k_per_piece(P, 0.999999) == 1


@pytest.mark.parametrize("dense", [True, False])
def test_rank_major_pack_delivers_each_rank_the_sum_at_its_piece_and_keeps_the_rest(dense):
    torch.manual_seed(0)
    D, numels, k = 3, [10, 7], 2
    pieces = [piece_numel(n, D) for n in numels]  # [4, 3]
    masks = [torch.rand(D, P).argsort(dim=1)[:, :k].sort(dim=1).values for P in pieces]  # (D, k) each, all ranks alike
    before, packed, widths = [], [], None
    for _ in range(D):  # every rank: error feedback E + g, one (D*P,) buffer per parameter
        errs = [torch.zeros(D * P, dtype=torch.float64) for P in pieces]
        for e, n in zip(errs, numels):
            e[:n] = torch.randn(n, dtype=torch.float64)
        accs = [e.view(D, P) for e, P in zip(errs, pieces)]
        before.append([a.clone() for a in accs])
        buf, widths = pack_for_reduce_scatter(accs, None if dense else masks)
        assert buf.numel() == D * sum(widths) and widths == (pieces if dense else [k, k])
        # nothing is lost: what was packed plus what stays in E is what E held
        rows = split_rank_major(buf, widths, D)
        sent = [row if dense else torch.zeros_like(a).scatter(1, m, row) for row, a, m in zip(rows, accs, masks)]
        for s, a, b, m in zip(sent, accs, before[-1], masks):
            assert torch.equal(s + a, b)
            assert (a == 0).all() if dense else (a.gather(1, m) == 0).all()
        packed.append(buf)
    for r, row in enumerate(_reduce_scatter(packed, D)):
        parts = unpack_pieces(row, widths, pieces, None if dense else [m[r] for m in masks])
        for i, (part, P) in enumerate(zip(parts, pieces)):
            want = torch.stack([b[i][r] for b in before]).sum(0)  # (P,) every rank's piece r
            if not dense:
                keep = torch.zeros(P, dtype=torch.bool)
                keep[masks[i][r]] = True
                want = torch.where(keep, want, torch.zeros_like(want))
            torch.testing.assert_close(part, want, rtol=0, atol=1e-12)
            assert part.narrow(0, 0, real_numel(numels[i], P, r)).numel() == min(P, max(0, numels[i] - r * P))


def test_replica_positions_place_every_rank_mask_in_the_full_tensor_and_drop_padding():
    D, numel = 4, 10
    P = piece_numel(numel, D)  # 3: rank 3 owns 9..11, of which only 9 is real
    mask = torch.tensor([[0, 2], [1, 2], [0, 1], [0, 1]])  # rank 3: positions 9 and 10 (padding)
    pos, valid = replica_positions(mask, P, numel)
    want = [r * P + int(m) for r in range(D) for m in mask[r] if r * P + int(m) < numel]
    assert pos.tolist() == want == [0, 2, 4, 5, 6, 7, 9]
    assert valid.tolist() == [True] * 7 + [False]
    # patching a replica with the all-gathered values at the masks == rebuilding it from the pieces
    new = torch.arange(D * P, dtype=torch.float32) + 100.0  # (D*P,) every rank's updated piece, padded
    local = [new.view(D, P)[r][mask[r]] for r in range(D)]  # what rank r sends: (k,)
    gathered = split_rank_major(torch.cat(local), [mask.shape[1]], D)[0]  # (D, k)
    replica = torch.zeros(numel)
    replica[pos] = gathered.reshape(-1)[valid]
    ref = torch.zeros(numel)
    for r in range(D):
        for m in mask[r].tolist():
            if r * P + m < numel:
                ref[r * P + m] = new[r * P + m]
    assert torch.equal(replica, ref)


def test_flat_indices_offset_each_mask_row_into_its_partition_in_order():
    rows = [torch.tensor([0, 3]), torch.tensor([1]), torch.tensor([2, 4])]
    index = flat_indices([("a", 0, rows[0]), ("b", 0, rows[1]), ("a", 5, rows[2])])
    assert index["a"].tolist() == [0, 3, 7, 9] and index["b"].tolist() == [1]


def test_split_rank_major_returns_row_r_from_rank_r():
    D, widths = 3, [2, 1, 3]
    local = [torch.arange(sum(widths)) + 10 * r for r in range(D)]  # rank r's parts, concatenated
    parts = split_rank_major(torch.cat(local), widths, D)  # as an all-gather delivers them
    starts = [0, 2, 3]
    for i, (p, w, s) in enumerate(zip(parts, widths, starts)):
        assert p.shape == (D, w)
        for r in range(D):
            assert torch.equal(p[r], local[r][s: s + w])


# ---------------------------------------------------------------- Stage3Exchange without DeepSpeed or a process group
class _LoopbackComm:
    """World size 1: every collective hands the input back, bytes metered."""

    world_size, rank = 1, 0

    def __init__(self):
        from scape_ds.comm import ByteMeter

        self.meter = ByteMeter()

    def _done(self, out, inp, tag):
        self.meter.record(tag, inp.numel() * inp.element_size())
        out.copy_(inp)
        return self

    def wait(self):
        return None

    def reduce_scatter(self, out, inp, tag):
        self._done(out, inp, tag)

    def all_gather(self, out, inp, tag):
        self._done(out, inp, tag)

    def all_gather_async(self, out, inp, tag):
        return self._done(out, inp, tag)


def _zero3_param(ds_id: int, shape) -> torch.nn.Parameter:
    """A parameter carrying the ZeRO-3 attributes Stage3Exchange reads (one rank: its piece is all of it)."""
    p = torch.nn.Parameter(torch.randn(shape))
    p.ds_id, p.ds_numel, p.ds_shape, p.ds_persist = ds_id, p.numel(), p.shape, True
    p.ds_tensor = p.detach().reshape(-1).clone()
    p.partition_numel = lambda n=p.numel(): n
    return p


def test_stage3_exchange_keeps_what_it_did_not_send_and_resumes_from_its_state():
    from scape_ds.config import parse_scape_config
    from scape_ds.exchange.stage3 import Stage3Exchange

    torch.manual_seed(0)
    cfg = parse_scape_config({"sparsity": 0.75, "mask_refresh_interval": 2, "dense_numel_threshold": 0})
    params = [_zero3_param(7, (4, 5)), _zero3_param(3, (2, 4))]
    ex = Stage3Exchange(cfg, _LoopbackComm(), params, True, torch.float32)
    assert [p.ds_id for p in ex.params] == [3, 7] and [ex.k(p) for p in ex.params] == [2, 5]
    total = {p.ds_id: torch.zeros(p.numel()) for p in params}  # every gradient so far
    delivered = {p.ds_id: torch.zeros(p.numel()) for p in params}
    flat = torch.zeros(8 + 20)  # one flat fp32 partition: ds_id 3 at offset 0, ds_id 7 at offset 8
    momentum = torch.randn(28)
    positions = [(flat, 0, ex.params[0]), (flat, 8, ex.params[1])]
    for t in range(1, 4):
        assert ex.begin_step() == (t != 2)  # step 1 dense (no mask yet), 2 sparse, 3 a dense refresh
        for p in params:
            p.grad = torch.randn(p.shape)
            total[p.ds_id] += p.grad.reshape(-1)
        for p, part in zip(ex.params, ex.reduce_scatter_grads(ex.params, torch.float32)):
            delivered[p.ds_id] += part
            if t == 2:  # zero outside this rank's mask
                outside = torch.ones(p.numel(), dtype=torch.bool)
                outside[ex.masks[p.ds_id][0]] = False
                assert (part[outside] == 0).all() and (ex.error[p.ds_id][~outside] == 0).all()
        for p in params:  # sent + kept == every gradient
            torch.testing.assert_close(delivered[p.ds_id] + ex.error[p.ds_id], total[p.ds_id])
        if t == 2:
            index = ex.flat_indices(positions)[id(flat)]
            assert index.tolist() == ex.masks[3][0].tolist() + (ex.masks[7][0] + 8).tolist()
        ex.end_step((momentum, offset, p) for _, offset, p in positions)
        assert ex.comm_stats["step"] == t and ex.comm_stats["dense_step"] == (t != 2)
        assert ex.comm_stats["by_tag"]["grad_rs"] == 4 * (28 if t != 2 else 7)  # fp32: everything, or the k values
        assert ("mask_ag" in ex.comm_stats["by_tag"]) == (t != 2)  # refresh steps send the next masks
    ex.pending.wait()
    assert ex.masks[7][0].tolist() == momentum[8:].abs().topk(5).indices.sort().values.tolist()
    saved = ex.state_dict()
    again = Stage3Exchange(cfg, _LoopbackComm(), [_zero3_param(11, (4, 5)), _zero3_param(10, (2, 4))], True,
                           torch.float32)
    again.check_loadable(saved)
    again.load_state_dict(saved, torch.device("cpu"))
    assert again.step == 3 and torch.equal(again.masks[11], ex.masks[7]) and torch.equal(again.error[10], ex.error[3])
    with pytest.raises(ValueError, match="SCAPE ZeRO-3 state of rank 0/2 cannot load on rank 0/1"):
        again.check_loadable(dict(saved, world_size=2))
    with pytest.raises(ValueError, match="no SCAPE ZeRO-3 state"):
        again.check_loadable(None)


def test_stage3_state_saved_at_another_sparsity_drops_its_masks_and_keeps_the_error():
    """Issue 35 item 5 under ZeRO-3: masks of another k are dropped; the next step is dense and
    chooses masks of the new k; the error feedback is kept as saved."""
    from scape_ds.config import parse_scape_config
    from scape_ds.exchange.stage3 import Stage3Exchange

    torch.manual_seed(0)
    params = [_zero3_param(1, (4, 10))]
    ex = Stage3Exchange(parse_scape_config({"sparsity": 0.9, "mask_refresh_interval": 4, "dense_numel_threshold": 0}),
                        _LoopbackComm(), params, True, torch.float32)
    momentum = torch.randn(40)
    for _ in range(2):  # a dense first step that chooses masks, then a sparse one that keeps error
        ex.begin_step()
        params[0].grad = torch.randn(4, 10)
        ex.reduce_scatter_grads(ex.params, torch.float32)
        ex.end_step([(momentum, 0, ex.params[0])])
    ex.pending.wait()
    saved = ex.state_dict()
    assert saved["masks"][0].shape == (1, 4) and saved["error"][0].abs().sum() > 0
    cfg = parse_scape_config({"sparsity": 0.5, "mask_refresh_interval": 6, "dense_numel_threshold": 0})
    again = Stage3Exchange(cfg, _LoopbackComm(), [_zero3_param(5, (4, 10))], True, torch.float32)
    kept = saved["error"][0].clone()  # loading on the CPU shares the tensor, which the dense step flushes
    again.load_state_dict(saved, torch.device("cpu"))
    assert again.masks == {} and again.refresh_next and torch.equal(again.error[5], kept)
    assert again.begin_step()  # dense: sends the kept error
    again.params[0].grad = torch.zeros(4, 10)
    (sent,) = again.reduce_scatter_grads(again.params, torch.float32)
    torch.testing.assert_close(sent, kept)
    again.end_step([(momentum, 0, again.params[0])])
    again.pending.wait()
    assert again.masks[5].shape == (1, 20)


def test_stage3_small_and_1d_tensors_go_whole_every_step_without_error_feedback():
    """config.py's dense_numel_threshold under ZeRO-3: 1-D tensors and tensors under the threshold are
    reduce-scattered whole (tag dense_rs) on sparse steps too, keep no error feedback and no mask, and
    the optimizer's sparse-step index covers their whole piece."""
    from scape_ds.config import parse_scape_config
    from scape_ds.exchange.stage3 import Stage3Exchange

    torch.manual_seed(0)
    cfg = parse_scape_config({"sparsity": 0.75, "mask_refresh_interval": 3, "dense_numel_threshold": 16})
    weight, bias, small = _zero3_param(1, (4, 5)), _zero3_param(2, (5,)), _zero3_param(3, (2, 3))
    ex = Stage3Exchange(cfg, _LoopbackComm(), [weight, bias, small], True, torch.float32)
    assert ex.dense_ids == {2, 3} and [ex.k(p) for p in ex.params] == [5, 5, 6]
    flat = torch.zeros(20 + 5 + 6)  # one flat fp32 partition: weight, bias, small
    positions = [(flat, 0, weight), (flat, 20, bias), (flat, 25, small)]
    for t in range(1, 4):
        dense = ex.begin_step()
        assert dense == (t == 1)
        for p in ex.params:
            p.grad = torch.randn(p.shape)
        parts = ex.reduce_scatter_grads(ex.params, torch.float32)
        for p, part in zip(ex.params[1:], parts[1:]):  # the mean (one rank: the gradient itself), whole
            assert torch.equal(part, p.grad.reshape(-1))
        assert set(ex.error) == {1} and set(ex.masks) <= {1}
        if not dense:
            index = ex.flat_indices(positions)[id(flat)]
            assert index.tolist() == ex.masks[1][0].tolist() + list(range(20, 31))
        ex.end_step((torch.randn(31), offset, p) for _, offset, p in positions)
        by_tag = ex.comm_stats["by_tag"]
        assert by_tag["dense_rs"] == 4 * 11 and by_tag["grad_rs"] == 4 * (20 if dense else 5), by_tag
        ex.pending.wait()
    saved = ex.state_dict()
    assert list(saved["error"]) == [0] and list(saved["masks"]) == [0]


def test_stage3_all_dense_model_never_chooses_masks():
    from scape_ds.config import parse_scape_config
    from scape_ds.exchange.stage3 import Stage3Exchange

    p = _zero3_param(4, (6,))
    ex = Stage3Exchange(parse_scape_config({"sparsity": 0.99, "mask_refresh_interval": 2}), _LoopbackComm(), [p],
                        True, torch.float32)
    for _ in range(3):
        assert ex.begin_step()  # no mask ever: every step dense
        p.grad = torch.randn(6)
        ex.reduce_scatter_grads([p], torch.float32)
        ex.end_step([(torch.randn(6), 0, p)])
    assert ex.masks == {} and ex.error == {} and ex.comm_stats["by_tag"] == {"dense_rs": 24}
