"""scape_ds.checkpoint.reshard: path A state re-sharded from D to D' data-parallel ranks, in one process.

Old states are real ``ScapeAdamS.state_dict()``s (each rank played by a SimulatedCommunicator, fp64
parameters, three param groups, one without sparse tensors), with every rank's master, momentum and
error feedback then overwritten by distinct random values so that nothing can pass by symmetry.
"""
import os

import pytest
import torch
from torch import nn

from scape_ds.checkpoint import check_manifest, convert_checkpoint, write_manifest
from scape_ds.checkpoint.convert import main
from scape_ds.checkpoint.files import saved_dp_size, saved_zero3_dp_size
from scape_ds.checkpoint.reshard import (
    load_resharded_zero3,
    read_scape_states,
    reshard_scape_state,
    reshard_scape_states,
    reshard_zero3_state,
    sum_in_rank_order,
    zero3_full_params,
    zero3_rank_partitions,
)
from scape_ds.comm.sim import SimulatedCommunicator
from scape_ds.exchange.layout import Zero3Layout
from scape_ds.exchange.masks import offsets_to_index
from scape_ds.exchange.pieces import piece_numel
from scape_ds.optim import ScapeAdamS

SCAPE = dict(sparsity=0.9, chunk_size=16, dense_numel_threshold=32, mask_refresh_interval=3)


def _model() -> nn.Module:
    torch.manual_seed(0)  # 3 groups: two sparse tensors + a bias; one sparse tensor (N=300, padded); dense only
    return nn.ModuleDict(dict(a=nn.Linear(24, 20), b=nn.Linear(20, 15, bias=False), c=nn.LayerNorm(7))).double()


def _optimizer(model, rank, world_size):
    groups = [dict(params=list(model["a"].parameters())), dict(params=[model["b"].weight]),
              dict(params=list(model["c"].parameters()), weight_decay=0.0)]
    return ScapeAdamS(groups, lr=1e-2, weight_decay=0.1, scape=SCAPE, comm=SimulatedCommunicator(world_size, rank))


def _old_states(world_size: int, steps: int = 2) -> list[dict]:
    """Every rank's state after ``steps`` steps (the last one sparse: decay debt < 1, a mask), with
    distinct random master, momentum and error feedback per rank (zero in the padding)."""
    states = []
    for rank in range(world_size):
        model = _model()
        opt = _optimizer(model, rank, world_size)
        for step in range(steps):
            for p in model.parameters():
                p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(step), dtype=p.dtype)
            opt.step()
        sd = opt.state_dict()
        g = torch.Generator().manual_seed(1000 + rank)
        for group in sd["scape"]["groups"]:
            if group["master"] is None:
                continue
            n, S = group["numel"], group["master"].numel()
            real = (torch.arange(S) + rank * S) < n  # this shard's elements that are not padding
            for key in ("master", "momentum"):
                group[key] = torch.randn(S, generator=g, dtype=torch.float64) * real
            group["error"] = torch.randn(group["padded_numel"], generator=g, dtype=torch.float64)
            group["error"][n:] = 0
        states.append(sd)
    return states


def _cat(states, g, key):
    return torch.cat([s["scape"]["groups"][g][key] for s in states])


@pytest.mark.parametrize("old,new", [(4, 2), (2, 4), (3, 5), (4, 1)])
def test_master_and_momentum_are_the_old_shards_concatenated(old, new):
    before = _old_states(old)
    for s in before:  # no decay owed: re-sharding only moves elements
        for group in s["scape"]["groups"]:
            group["decay_debt"] = 1.0
    after = reshard_scape_states(before, new)
    assert [s["scape"]["rank"] for s in after] == list(range(new))
    for g, saved in enumerate(before[0]["scape"]["groups"]):
        if saved["master"] is None:
            assert all(s["scape"]["groups"][g]["master"] is None for s in after)
            continue
        n = saved["numel"]
        sizes = {s["scape"]["groups"][g]["master"].numel() for s in after}
        assert len(sizes) == 1 and sizes.pop() % SCAPE["chunk_size"] == 0  # equal shards of whole chunks
        for key in ("master", "momentum"):
            flat_old, flat_new = _cat(before, g, key), _cat(after, g, key)
            assert flat_new.numel() == after[0]["scape"]["groups"][g]["padded_numel"] >= n
            assert torch.equal(flat_new[:n], flat_old[:n]), key
            assert not flat_new[n:].any(), f"{key}: the new padding is not zero"


@pytest.mark.parametrize("old,new", [(4, 2), (2, 4), (3, 5), (5, 3)])
def test_error_feedback_sum_is_kept_to_the_bit(old, new):
    before = _old_states(old)
    after = reshard_scape_states(before, new)
    for g, saved in enumerate(before[0]["scape"]["groups"]):
        if saved["error"] is None:
            continue
        n = saved["numel"]
        old_sum = sum_in_rank_order([s["scape"]["groups"][g]["error"][:n] for s in before])
        errors = [s["scape"]["groups"][g]["error"] for s in after]
        assert all(e.dtype == torch.float64 and e.numel() == after[0]["scape"]["groups"][g]["padded_numel"]
                   for e in errors)
        assert torch.equal(sum_in_rank_order(errors)[:n], old_sum)  # bitwise, fp64
        assert torch.equal(errors[0][:n], old_sum) and not any(e.any() for e in errors[1:])
        assert not errors[0][n:].any()


def test_decay_debt_is_settled_outside_the_old_mask_and_masks_are_dropped():
    before = _old_states(2)
    group = before[0]["scape"]["groups"][0]
    debt = group["decay_debt"]
    assert 0 < debt < 1 and group["active_offsets"] is not None  # the last step was sparse
    after = reshard_scape_states(before, 3)
    kept = offsets_to_index(group["active_offsets"], SCAPE["chunk_size"], 2)  # kc = round(0.1 * 16) = 2
    flat_old, n = _cat(before, 0, "master"), group["numel"]
    expected = flat_old * debt
    expected[kept] = flat_old[kept]
    assert torch.equal(_cat(after, 0, "master")[:n], expected[:n])
    for s in after:
        sc = s["scape"]
        assert sc["refresh_next"] and sc["resharded_from"] == 2 and sc["step"] == before[0]["scape"]["step"]
        assert all(g["decay_debt"] == 1.0 and g["active_offsets"] is None for g in sc["groups"])
        assert torch.equal(sc["groups"][2]["dense_momenta"][0], before[0]["scape"]["groups"][2]["dense_momenta"][0])


def test_there_and_back_restores_the_shards():
    before = _old_states(4)
    for s in before:
        for group in s["scape"]["groups"]:
            group["decay_debt"] = 1.0
    back = reshard_scape_states(reshard_scape_states(before, 2), 4)
    for old, new in zip(before, back):
        for go, gn in zip(old["scape"]["groups"], new["scape"]["groups"]):
            for key in ("master", "momentum"):
                assert (go[key] is None and gn[key] is None) or torch.equal(go[key], gn[key])


def test_a_resharded_state_loads_and_the_next_step_is_a_dense_refresh():
    after = reshard_scape_state(_old_states(4), 1, 2)
    model = _model()
    opt = _optimizer(model, 1, 2)
    opt.load_state_dict(after)
    assert opt.step_count == after["scape"]["step"] and opt.mask_offsets() is None
    assert torch.equal(opt.state_dict()["scape"]["groups"][0]["master"], after["scape"]["groups"][0]["master"])
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    assert opt.comm_stats["dense_step"] and opt.mask_offsets() is not None
    assert not opt.state_dict()["scape"]["refresh_next"]


def test_bad_input_is_one_line():
    states = _old_states(2, steps=1)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="data-parallel size must be an integer >= 1"):
            reshard_scape_state(states, 0, bad)
    with pytest.raises(ValueError, match="new rank 2 is outside 0..1"):
        reshard_scape_state(states, 2, 2)
    with pytest.raises(ValueError, match="says it is rank 1 of 2"):
        reshard_scape_state(states[1:], 0, 2)
    states[1]["scape"]["step"] += 1
    with pytest.raises(ValueError, match=r"saved at different steps: \[1, 2\]"):
        reshard_scape_state(states, 0, 3)


def _write_checkpoint(tmp_path, states) -> str:
    ckpt = tmp_path / "ckpt"
    tag = ckpt / "global_step2"
    tag.mkdir(parents=True)
    for r, s in enumerate(states):
        torch.save(s, tag / f"scape_dp_rank_{r:05d}.pt")
    torch.save({"module": {"w": torch.ones(3)}}, tag / "mp_rank_00_model_states.pt")
    write_manifest(str(tag))
    (ckpt / "latest").write_text("global_step2")
    return str(ckpt)


def test_convert_writes_a_tag_for_the_new_size(tmp_path, capsys):
    states = _old_states(4, steps=1)
    ckpt = _write_checkpoint(tmp_path, states)
    assert main(["convert", ckpt, "--to-dp", "2", "--out", str(tmp_path / "out")]) == 0
    new_dir = capsys.readouterr().out.strip()
    assert new_dir == str(tmp_path / "out" / "global_step2_dp2")
    assert (tmp_path / "out" / "latest").read_text() == "global_step2_dp2"
    assert sorted(os.listdir(new_dir)) == ["manifest.json", "mp_rank_00_model_states.pt", "scape_dp_rank_00000.pt",
                                           "scape_dp_rank_00001.pt"]
    assert check_manifest(new_dir) == []  # a fresh manifest, not the original's
    converted = read_scape_states(new_dir)  # weights_only=True: the converted files hold no callables
    for got, want in zip(converted, reshard_scape_states(states, 2)):
        assert torch.equal(got["scape"]["groups"][1]["error"], want["scape"]["groups"][1]["error"])
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step2"  # the original is untouched
    assert saved_dp_size(os.path.join(ckpt, "global_step2")) == 4 and saved_dp_size(new_dir) == 2


def test_convert_refuses_bad_input_in_one_line(tmp_path, capsys):
    ckpt = _write_checkpoint(tmp_path, _old_states(2, steps=1))
    assert main(["convert", ckpt, "--to-dp", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "scape_ds.checkpoint convert: --to-dp must be an integer >= 1, got 0"
    os.remove(os.path.join(ckpt, "global_step2", "scape_dp_rank_00000.pt"))
    with pytest.raises(ValueError, match="scape_dp_rank_00000.pt is missing"):  # against the manifest
        convert_checkpoint(ckpt, 3)
    write_manifest(os.path.join(ckpt, "global_step2"))  # as if saved without rank 0's file
    with pytest.raises(ValueError, match=r"none for rank\(s\) \[0\]"):
        convert_checkpoint(ckpt, 3)
    assert main(["convert", ckpt, "--to-dp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "none for rank(s) [0]" in err
    assert not os.path.exists(os.path.join(ckpt, "global_step2_dp3"))  # nothing half-written


def test_convert_refuses_zero3_checkpoints_in_one_line(tmp_path):
    tag = tmp_path / "global_step3"
    tag.mkdir()
    for r in range(4):
        (tag / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    write_manifest(str(tag))
    assert saved_zero3_dp_size(str(tag)) == 4 and saved_dp_size(str(tag)) is None
    (tmp_path / "latest").write_text("global_step3")
    with pytest.raises(ValueError, match="is a ZeRO-3 checkpoint: convert re-shards stage 0/1 checkpoints only"):
        convert_checkpoint(str(tmp_path), 2)
    os.remove(tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    with pytest.raises(ValueError, match=r"files for data-parallel ranks up to 3 but none for rank\(s\) \[1\]"):
        saved_zero3_dp_size(str(tag))


# ---------------------------------------------------------------------- ZeRO-3 (path B)
# A layout with odd sizes (padding on the last ranks), one parameter of one element, two param groups
# and three sub-groups; ds_id order differs from the flat order.
Z3 = Zero3Layout(numels=(7, 300, 1, 64, 33), sub_groups=(2, 1, 2), param_group_of=(0, 0, 1), ds_order=(2, 0, 1, 4, 3))


def _full(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g, dtype=torch.float64) for n in Z3.numels]


def _z3_states(world_size: int, scape: bool = True, debt: float = 1.0) -> tuple[list[dict], dict]:
    """Old ranks' ZeRO-3 optimizer states (fp64) cut from known full tensors; returns (states, truth)."""
    truth = dict(master=_full(1), momentum=_full(2))
    states = []
    for r in range(world_size):
        flats = zero3_rank_partitions(truth["master"], Z3.sub_groups, r, world_size)
        moms = zero3_rank_partitions(truth["momentum"], Z3.sub_groups, r, world_size)
        state = {i: dict(momentum=m, step=5, decay_debt=debt) for i, m in enumerate(moms)}
        if debt != 1.0:
            for i, f in enumerate(flats):
                state[i]["last_index"] = torch.arange(0, f.numel(), 3)
        sd = dict(zero_stage=3, loss_scaler=None, dynamic_loss_scale=False, overflow=False, partition_count=world_size,
                  fp32_flat_groups=flats, optimizer_state_dict=dict(
                      state=state, param_groups=[dict(lr=1e-2, params=[0, 1]), dict(lr=1e-2, params=[2])]))
        if scape:
            g = torch.Generator().manual_seed(100 + r)
            error = {}
            for i, f in enumerate(Z3.ds_order):
                n = Z3.numels[f]
                P = piece_numel(n, world_size)
                error[i] = torch.zeros(world_size * P, dtype=torch.float64)
                error[i][:n] = torch.randn(n, generator=g, dtype=torch.float64)
            sd["scape"] = dict(step=5, rank=r, world_size=world_size, refresh_next=False, error=error,
                               masks={0: torch.zeros(world_size, 1, dtype=torch.long)})
        states.append(sd)
    return states, truth


def test_zero3_layout_is_the_one_zero_to_fp32_reads():
    """DeepSpeed's own reader of ZeRO-3 files rebuilds the same full tensors from our partitions."""
    from collections import OrderedDict
    from types import SimpleNamespace

    from deepspeed.utils.zero_to_fp32 import _zero3_merge_trainable_params, to_torch_tensor

    full = _full(1)
    for D in (1, 2, 3, 4):
        flats = [zero3_rank_partitions(full, Z3.sub_groups, r, D) for r in range(D)]
        shapes = [OrderedDict((f"p{i}", torch.Size([Z3.numels[i]])) for i in range(0, 2)),
                  OrderedDict([("p2", torch.Size([1]))]),
                  OrderedDict((f"p{i}", torch.Size([Z3.numels[i]])) for i in range(3, 5))]
        theirs = {}
        _zero3_merge_trainable_params(theirs, D, flats, [SimpleNamespace(param_shapes=shapes)])
        theirs = to_torch_tensor(theirs)
        ours = zero3_full_params([torch.cat(f) for f in flats], Z3.numels)
        for i, t in enumerate(full):
            assert torch.equal(theirs[f"p{i}"], t) and torch.equal(ours[i], t)
        for r in range(D):  # ZeRO-3's pieces: ceil(numel / D) each, zero padding on the last ranks
            assert [f.numel() for f in flats[r]] == [sum(piece_numel(Z3.numels[i], D) for i in ids)
                                                    for ids in ((0, 1), (2,), (3, 4))]


@pytest.mark.parametrize("old,new", [(4, 2), (2, 4), (3, 5), (4, 1)])
def test_zero3_master_and_momentum_are_rebuilt_exactly(old, new):
    states, truth = _z3_states(old)
    after = [reshard_zero3_state(states, Z3, r, new) for r in range(new)]
    master = zero3_full_params([torch.cat(s["fp32_flat_groups"]) for s in after], Z3.numels)
    for r, s in enumerate(after):
        assert s["partition_count"] == new and [g["params"] for g in s["optimizer_state_dict"]["param_groups"]] \
            == [[0, 1], [2]]
        assert all(st["step"] == 5 and st["decay_debt"] == 1.0 and "last_index" not in st
                   for st in s["optimizer_state_dict"]["state"].values())
        for f, st in zip(s["fp32_flat_groups"], s["optimizer_state_dict"]["state"].values()):
            assert f.dtype == st["momentum"].dtype == torch.float64 and f.numel() == st["momentum"].numel()
    momentum = zero3_full_params([torch.cat([st["momentum"] for st in s["optimizer_state_dict"]["state"].values()])
                                  for s in after], Z3.numels)
    for key, rebuilt in (("master", master), ("momentum", momentum)):
        assert all(torch.equal(a, b) for a, b in zip(rebuilt, truth[key])), key
    for r in range(new):  # the padding of the new layout is zero
        cut = zero3_rank_partitions(truth["master"], Z3.sub_groups, r, new)
        assert all(torch.equal(a, b) for a, b in zip(after[r]["fp32_flat_groups"], cut))


@pytest.mark.parametrize("old,new", [(4, 2), (2, 4), (3, 5), (5, 3)])
def test_zero3_error_feedback_sum_is_kept_to_the_bit(old, new):
    states, _ = _z3_states(old)
    after = [reshard_zero3_state(states, Z3, r, new)["scape"] for r in range(new)]
    for i, f in enumerate(Z3.ds_order):
        n = Z3.numels[f]
        old_sum = sum_in_rank_order([s["scape"]["error"][i][:n] for s in states])
        errors = [s["error"][i] for s in after]
        assert all(e.dtype == torch.float64 and e.numel() == new * piece_numel(n, new) for e in errors)
        assert torch.equal(sum_in_rank_order(errors)[:n], old_sum)  # bitwise, fp64
        assert torch.equal(errors[0][:n], old_sum) and not errors[0][n:].any()
        assert not any(e.any() for e in errors[1:])
    for r, sc in enumerate(after):  # masks index the old pieces: dropped; the next step is a dense refresh
        assert (sc["rank"], sc["world_size"], sc["step"], sc["masks"], sc["refresh_next"], sc["resharded_from"]) \
            == (r, new, 5, {}, True, old)


def test_zero3_decay_owed_outside_the_last_mask_is_settled():
    debt = 0.99
    states, truth = _z3_states(2, debt=debt)
    expected = []
    for r, s in enumerate(states):
        flats = []
        for f, st in zip(s["fp32_flat_groups"], s["optimizer_state_dict"]["state"].values()):
            want = f * debt
            want[st["last_index"]] = f[st["last_index"]]
            flats.append(want)
        expected.append(torch.cat(flats))
    after = [reshard_zero3_state(states, Z3, r, 3) for r in range(3)]
    got = zero3_full_params([torch.cat(s["fp32_flat_groups"]) for s in after], Z3.numels)
    assert all(torch.equal(a, b) for a, b in zip(got, zero3_full_params(expected, Z3.numels)))
    assert all(st["decay_debt"] == 1.0 for s in after for st in s["optimizer_state_dict"]["state"].values())
    assert all(torch.equal(f, s) for f, s in zip(states[0]["fp32_flat_groups"], _z3_states(2, debt=debt)[0][0][
        "fp32_flat_groups"]))  # the old states are not modified


def test_zero3_state_of_deepspeeds_own_optimizer_is_resharded():
    """Dense ZeRO-3 (DeepSpeed's optimizer, any per-element state, no SCAPE entry)."""
    states, truth = _z3_states(4, scape=False)
    for s in states:
        for st in s["optimizer_state_dict"]["state"].values():
            st["exp_avg_sq"] = st["momentum"] * 2
    after = [reshard_zero3_state(states, Z3, r, 2) for r in range(2)]
    assert "scape" not in after[0]
    sq = zero3_full_params([torch.cat([st["exp_avg_sq"] for st in s["optimizer_state_dict"]["state"].values()])
                            for s in after], Z3.numels)
    assert all(torch.equal(a, 2 * b) for a, b in zip(sq, truth["momentum"]))


def test_zero3_bad_input_is_one_line():
    states, _ = _z3_states(2)
    with pytest.raises(ValueError, match="new rank 2 is outside 0..1"):
        reshard_zero3_state(states, Z3, 2, 2)
    with pytest.raises(ValueError, match="says it is rank 1 of 2"):
        reshard_zero3_state(states[1:], Z3, 0, 2)
    other = Zero3Layout(numels=(7, 300, 1, 64, 36), sub_groups=Z3.sub_groups, param_group_of=Z3.param_group_of,
                        ds_order=Z3.ds_order)
    with pytest.raises(ValueError, match="old rank 0's ZeRO-3 partitions hold 204 elements; the model's 5 "
                                         "parameters need 205 per rank at 2 ranks"):
        reshard_zero3_state(states, other, 0, 3)
    del states[1]["scape"]
    with pytest.raises(ValueError, match="some old ranks have SCAPE state and some none"):
        reshard_zero3_state(states, Z3, 0, 3)
    states, _ = _z3_states(2)
    states[1]["scape"]["step"] = 6
    with pytest.raises(ValueError, match=r"saved at different steps: \[5, 6\]"):
        reshard_zero3_state(states, Z3, 0, 3)
    states, _ = _z3_states(2)
    states[1]["optimizer_state_dict"]["state"][2]["step"] = 4
    with pytest.raises(ValueError, match="old rank 1's optimizer state differs from old rank 0's"):
        reshard_zero3_state(states, Z3, 0, 3)


def _write_zero3_tag(tmp_path, states, prefix="") -> str:
    from collections import OrderedDict

    tag = tmp_path / "global_step5"
    tag.mkdir()
    for r, s in enumerate(states):
        torch.save(dict(optimizer_state_dict=s), tag / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")
        shapes = [OrderedDict((f"p{i}", torch.Size([Z3.numels[i]])) for i in ids) for ids in ((0, 1), (2,), (3, 4))]
        torch.save(dict(module={}, param_shapes=shapes, global_steps=5, frozen_param_fragments=None),
                   tag / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    return str(tag)


def test_zero3_files_are_read_with_the_model_states_of_rank_0(tmp_path):
    states, _ = _z3_states(2)
    tag = _write_zero3_tag(tmp_path, states, prefix="bf16_")  # DeepSpeed's name for bf16 runs
    assert saved_zero3_dp_size(tag) == 2
    state, model = load_resharded_zero3(tag, Z3, 1, 3)
    want = reshard_zero3_state(states, Z3, 1, 3)
    assert model["global_steps"] == 5 and state["scape"]["rank"] == 1
    assert all(torch.equal(a, b) for a, b in zip(state["fp32_flat_groups"], want["fp32_flat_groups"]))
    other = Zero3Layout(numels=(7, 300, 1, 64, 36), sub_groups=Z3.sub_groups, param_group_of=Z3.param_group_of,
                        ds_order=Z3.ds_order)
    with pytest.raises(ValueError, match=r"global_step5 holds 5 parameters of 405 elements, this model 5 of 408"):
        load_resharded_zero3(tag, other, 0, 3)
    path = os.path.join(tag, "zero_pp_rank_0_mp_rank_00_model_states.pt")
    model["frozen_param_fragments"] = {"w": torch.ones(2)}
    torch.save(model, path)
    with pytest.raises(ValueError, match="has frozen parameters: elastic ZeRO-3 resume supports trainable"):
        load_resharded_zero3(tag, Z3, 0, 3)
    os.remove(path)
    with pytest.raises(ValueError, match="has no zero_pp_rank_0_mp_rank_00_model_states.pt"):
        load_resharded_zero3(tag, Z3, 0, 3)
    (tmp_path / "global_step5" / "zero_pp_rank_0_mp_rank_01_optim_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="saved with tensor or pipeline parallelism"):
        saved_zero3_dp_size(tag)


def test_hierarchical_states_are_refused_in_one_line():
    states = _old_states(2, steps=1)
    for st in states:
        st["scape"]["node_size"] = 2
    with pytest.raises(ValueError, match="saved with scape.hierarchy 'node' \\(2 ranks per node\\)"):
        reshard_scape_state(states, 0, 1)


def test_update_rule_states_are_refused_in_one_line():
    states = _old_states(2, steps=1)
    for st in states:
        st["scape"]["config"]["update_rule"] = "sign_drift"
    with pytest.raises(ValueError, match="saved with scape.update_rule 'sign_drift': elastic resume re-shards"):
        reshard_scape_state(states, 0, 1)
    for st in states:
        st["scape"]["config"].update(update_rule="lazy", reselect_interval=50)
    with pytest.raises(ValueError, match="saved with scape.reselect_interval 50: elastic resume re-shards"):
        reshard_scape_state(states, 0, 1)


def test_dct_basis_states_without_a_tile_count_or_at_another_chunk_size_are_refused_in_one_line():
    # basis "dct" is re-sharded (tests/multiprocess/test_elastic_dct.py); what it cannot carry is one line
    states = _old_states(2, steps=1)
    for st in states:
        st["scape"]["config"]["basis"] = "dct"
    with pytest.raises(ValueError, match="param group 0 was saved with scape.basis 'dct' by a version that did not "
                                         r"record its tiles' coefficient count \(coef_numel\)"):
        reshard_scape_state(states, 0, 1)
    with pytest.raises(ValueError, match="saved with scape.basis 'dct' and scape.chunk_size 16, this run has "
                                         "chunk_size 64: its error feedback is in the coefficients of those tiles"):
        reshard_scape_state(states, 0, 1, chunk_size=64)


def test_zero3_dct_error_feedback_is_summed_onto_new_rank_0_and_a_mid_accumulation_save_is_refused():
    states, _ = _z3_states(2)
    errors = [torch.randn(64, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    for st, e in zip(states, errors):
        st["scape"].update(basis="dct", config=dict(basis="dct"),
                           dct=dict(error=e, held_mask=None, coef_momentum=None, local_grads=None, dense_grads=None))
    new = [reshard_zero3_state(states, Z3, r, 3)["scape"] for r in range(3)]
    total = (errors[0].double() + errors[1].double()).float()  # in rank order, fp64, rounded once
    assert torch.equal(new[0]["dct"]["error"], total)
    assert not new[1]["dct"]["error"].any() and not new[2]["dct"]["error"].any()
    assert [(n["rank"], n["world_size"], n["resharded_from"]) for n in new] == [(0, 3, 2), (1, 3, 2), (2, 3, 2)]
    assert all(n["dct"]["held_mask"] is None for n in new)
    states[1]["scape"]["dct"]["local_grads"] = torch.ones(8)
    with pytest.raises(ValueError, match="old rank 1 was saved under ZeRO-3 with scape.basis 'dct' between the "
                                         "micro-steps of a gradient accumulation"):
        reshard_zero3_state(states, Z3, 0, 1)
