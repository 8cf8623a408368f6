"""Elastic resume: re-shard per-rank optimizer state from D data-parallel ranks to D'.

The middle of :mod:`scape_ds.checkpoint`: pure functions over state dicts and layouts (no process
group; it imports the file format below it, never the engine or ZeRO-3: the loading engine's
layout comes in as a :class:`~scape_ds.exchange.layout.Zero3Layout`), used by
:func:`scape_ds.checkpoint.load_checkpoint` when the checkpoint was saved on another number of
data-parallel ranks, and (path A) by ``python -m scape_ds.checkpoint convert <dir> --to-dp N``.
docs/design.md, "Checkpoints", has the reasoning. Path B (ZeRO-3) is at the end of this module
(:func:`reshard_zero3_state`): each parameter is rebuilt from its D ZeRO-3 pieces and cut into D',
with the same treatment of decay debt, error feedback and masks as path A's. Path A, per param
group, from D old :meth:`ScapeAdamS.state_dict` states to new rank r':

1. Master weights and momentum: the old shards, concatenated in rank order, are the flat buffer
   (N_pad,) = (D S,); its first N elements are cut into the new layout (D' S', padded with zeros,
   S' = ceil(N / (D' C)) C) and r' keeps slice r'. Nothing is rounded: elements are only moved.
2. Lazy weight decay: the decay the coordinates outside the saved mask still owe (``decay_debt``)
   is applied to the concatenated master first, exactly as the old owners' next dense step would
   have (``settle_decay``), because the mask it refers to belongs to the old layout; the debt
   becomes 1.
3. Error feedback (one (N_pad,) buffer per old rank, the gradient each has not yet sent): their sum
   is kept whole on new rank 0 and every other new rank starts at zero. The sum is accumulated in
   rank order in fp64 (or wider) and stored once in the buffer's dtype. For fp64 buffers the new
   ranks' buffers therefore sum, in rank order, to the bits of the old ranks' sum in rank order
   (x + 0 = x); splitting it evenly would divide by D', which rounds unless D' is a power of two.
   For fp32 (bf16) buffers the stored sum is the fp64 sum rounded once. The next exchange divides
   the sum by D' where the old run would have divided it by D: the not-yet-sent gradient is kept
   in full and enters the first mean over the new ranks.
4. Masks are dropped (they index the old layout) and ``refresh_next`` is set: the first step after
   the load is a dense step that flushes the error feedback and chooses new masks.
5. Replicated state (dense-exchanged tensors' momenta, hyperparameters, step, config) is taken from
   old rank 0.

Basis "dct" (:func:`_reshard_dct_group`; docs/design.md, "Transform basis"): there is no sharded
master and the parameters are replicated (DeepSpeed's model file is the truth, as saved). The error
feedback is a (D S,) buffer of tile coefficients per old rank whose first ``coef_numel`` elements
are each weight's tiles at the same place whatever D (only the padding tiles after them depend on
D): their sum over the old ranks, in rank order in fp64, stored once in the buffer's dtype, goes to
new rank 0 element for element, zeros elsewhere, as in 3. The replicated momentum of ``dct_update``
"adams"/"signum" (flat parameter layout) or "adams_coef" (coefficients) comes from old rank 0,
re-padded. ``mask_source "momentum"``'s per-owner first moment ((S,) of the owner's tiles) is
re-cut like the master in 1 (the old shards concatenated are the whole buffer). Held shared masks
(``mask_hold``, ``mask_early``, ``mask_source "momentum"``) are dropped: their slots are laid out per
tile for D ranks (D (kc // D) per tile for the union) over the old tile count; the next step
chooses a fresh mask (``mask_source "momentum"``: a dense step, which sends the whole error
feedback, as after any load without a held mask). ``chunk_size`` (the tiles) cannot change.

Cost: the new rank holds every old rank's state at once while it converts (D times one rank's
state); loading reads every old rank's file.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from ..config import parse_scape_config
from ..exchange.core import settle_decay
from ..exchange.layout import Zero3Layout
from ..exchange.masks import offsets_to_index
from ..exchange.pieces import piece_numel
from .files import (
    ZERO_MODEL_FILE,
    ZERO_OPTIM_FILE,
    safe_load,
    saved_dp_size,
    saved_zero3_dp_size,
    scape_rank_files,
    zero3_files,
)

__all__ = ["reshard_scape_state", "reshard_scape_states", "read_scape_states", "load_resharded_state",
           "sum_in_rank_order", "zero3_full_params", "zero3_rank_partitions", "reshard_zero3_state",
           "load_resharded_zero3"]


def sum_in_rank_order(buffers: list[torch.Tensor]) -> torch.Tensor:
    """``((b0 + b1) + b2) + ...`` accumulated in fp64 (or wider): the sum that re-sharding keeps."""
    acc_dtype = torch.promote_types(buffers[0].dtype, torch.float64)
    total = buffers[0].to(acc_dtype, copy=True)
    for b in buffers[1:]:
        total += b.to(acc_dtype)
    return total


def reshard_scape_states(states: list[dict[str, Any]], world_size: int,
                         chunk_size: int | None = None) -> list[dict[str, Any]]:
    """Every new rank's state: ``[reshard_scape_state(states, r, world_size) for r in range(world_size)]``."""
    return [reshard_scape_state(states, r, world_size, chunk_size) for r in range(world_size)]


def reshard_scape_state(states: list[dict[str, Any]], rank: int, world_size: int,
                        chunk_size: int | None = None) -> dict[str, Any]:
    """The state of new data-parallel rank ``rank`` of ``world_size``, from old ranks' states.

    Args:
        states: the old ranks' ``ScapeAdamS.state_dict()``, one per old rank, in rank order.
        rank: the new data-parallel rank.
        world_size: D', the new data-parallel size.
        chunk_size: C of the new layout (default: the saved config's).

    Returns:
        A state dict that ``ScapeAdamS.load_state_dict`` loads on rank ``rank`` of ``world_size``.

    Raises:
        ValueError: a bad world size or rank, or old states that do not belong together.
    """
    _check_new_rank(rank, world_size)
    if not states:
        raise ValueError("no old states to re-shard")
    old = [_check_old_state(s, i, len(states)) for i, s in enumerate(states)]
    first = old[0]
    if any(len(sc["groups"]) != len(first["groups"]) for sc in old):
        raise ValueError("the old ranks disagree on the number of param groups")
    if any(sc["step"] != first["step"] for sc in old):
        raise ValueError(f"the old ranks were saved at different steps: {[sc['step'] for sc in old]}")
    cfg = parse_scape_config(first["config"])
    C = cfg.chunk_size if chunk_size is None else chunk_size
    if cfg.basis == "dct" and C != cfg.chunk_size:
        raise ValueError(f"the checkpoint was saved with scape.basis 'dct' and scape.chunk_size {cfg.chunk_size}, "
                         f"this run has chunk_size {C}: its error feedback is in the coefficients of those tiles "
                         f"(resume with chunk_size {cfg.chunk_size})")
    groups = []
    for g, saved in enumerate(first["groups"]):
        per_rank = [sc["groups"][g] for sc in old]
        numel = saved["numel"]
        if any(p["numel"] != numel for p in per_rank):
            raise ValueError(f"param group {g}: the old ranks disagree on its number of elements")
        new = dict(decay_debt=1.0, active_offsets=None, numel=numel,
                   dense_momenta=[m.clone() for m in saved["dense_momenta"]])
        if cfg.basis == "dct":
            groups.append(_reshard_dct_group(per_rank, new, cfg.dct_update, g, rank, world_size, C))
            continue
        if saved["master"] is None:
            new.update(master=None, momentum=None, error=None, padded_numel=saved["padded_numel"])
            groups.append(new)
            continue
        quantum = world_size * C
        padded = max(quantum, -(-numel // quantum) * quantum)
        shard = slice(rank * (padded // world_size), (rank + 1) * (padded // world_size))
        master = torch.cat([p["master"] for p in per_rank])  # (D S,) fp32 the old flat master, a copy
        if saved["active_offsets"] is not None:  # settle the decay owed outside the old mask
            kept = offsets_to_index(saved["active_offsets"].cpu(), cfg.chunk_size, cfg.k_per_chunk)
            settle_decay(master, saved["decay_debt"], kept)
        new["master"] = _repad(master, numel, padded)[shard].clone()  # (S',) fp32
        new["momentum"] = _repad(torch.cat([p["momentum"] for p in per_rank]), numel, padded)[shard].clone()  # (S',)
        if saved["error"] is None:
            new["error"] = None
        elif rank == 0:
            total = sum_in_rank_order([p["error"][:numel] for p in per_rank])
            new["error"] = _repad(total.to(saved["error"].dtype), numel, padded)  # (D' S',)
        else:
            new["error"] = torch.zeros(padded, dtype=saved["error"].dtype)  # (D' S',)
        new["padded_numel"] = padded
        groups.append(new)
    # basis "dct" has no forced refresh (its step ignores refresh_next; a dropped held mask of
    # mask_source "momentum" makes its next step dense by itself)
    scape = dict(first, rank=rank, world_size=world_size, groups=groups, refresh_next=cfg.basis != "dct",
                 resharded_from=len(old))
    return dict(param_groups=[dict(g) for g in states[0]["param_groups"]], scape=scape)


def _reshard_dct_group(per_rank: list[dict], new: dict, dct_update: str, g: int, rank: int, world_size: int,
                       C: int) -> dict:
    """Basis "dct": param group ``g`` of new rank ``rank`` (module docstring) from the old ranks'
    groups ``per_rank``; ``new`` holds what every basis shares (numel, dense momenta)."""
    saved, numel = per_rank[0], new["numel"]
    quantum = world_size * C
    padded = max(quantum, -(-numel // quantum) * quantum)  # N_pad': FlatLayout at D'
    new.update(master=None, padded_numel=padded, coef_numel=saved.get("coef_numel"), held_mask=None,
               coef_momentum=None, dense_error=None)
    if saved.get("dense_error") is not None:  # dense_wire "bf16": the rounding every old rank kept, on new rank 0
        total = sum_in_rank_order([p["dense_error"] for p in per_rank]).to(saved["dense_error"].dtype)
        new["dense_error"] = total if rank == 0 else torch.zeros_like(total)
    if saved["error"] is None:  # no sparse tensors in this group
        new.update(momentum=None, error=None)
        return new
    used = saved.get("coef_numel")
    if used is None:
        raise ValueError(f"param group {g} was saved with scape.basis 'dct' by a version that did not record its "
                         "tiles' coefficient count (coef_numel): resume on the same world size")
    if any(p["error"].numel() < used for p in per_rank):
        raise ValueError(f"param group {g}: an old rank's error feedback is shorter than its tiles' "
                         f"{used} coefficients")
    coef_padded = max(quantum, -(-used // quantum) * quantum)  # TileLayout.numel at D'
    dtype = saved["error"].dtype
    if rank == 0:  # the not-yet-sent coefficients of every old rank, summed once, whole on new rank 0
        new["error"] = _repad(sum_in_rank_order([p["error"][:used] for p in per_rank]).to(dtype), used, coef_padded)
    else:
        new["error"] = torch.zeros(coef_padded, dtype=dtype)
    # the replicated momentum (the same on every old rank): "adams"/"signum" in the flat parameter
    # layout (N_pad,), "adams_coef" in coefficients; "sign"/"rms" keep none
    m = saved["momentum"]
    new["momentum"] = None if m is None else (_repad(m, used, coef_padded) if dct_update == "adams_coef"
                                              else _repad(m, numel, padded))
    if saved.get("coef_momentum") is not None:  # mask_source "momentum": each owner's (S,) of its tiles
        shard = coef_padded // world_size
        whole = torch.cat([p["coef_momentum"] for p in per_rank])  # (D S,) the old owners' shards in order
        new["coef_momentum"] = _repad(whole, used, coef_padded)[rank * shard:(rank + 1) * shard].clone()
    return new


def _check_old_state(state: dict, rank: int, world_size: int) -> dict:
    if "scape" not in state:
        raise ValueError(f"old rank {rank}'s state is not a ScapeAdamS state dict (no 'scape' entry)")
    return _check_old_scape(state["scape"], rank, world_size)


def _check_old_scape(sc: dict, rank: int, world_size: int) -> dict:
    if sc.get("node_size", 1) > 1:
        raise ValueError(f"old rank {rank} was saved with scape.hierarchy 'node' ({sc['node_size']} ranks per node): "
                         "elastic resume supports flat data parallelism only")
    config = sc.get("config", {})
    rule = config.get("update_rule", "lazy")
    if rule != "lazy":
        raise ValueError(f"old rank {rank} was saved with scape.update_rule {rule!r}: elastic resume re-shards "
                         "the 'lazy' state only (resume on the same world size)")
    if config.get("reselect_interval", 0):
        raise ValueError(f"old rank {rank} was saved with scape.reselect_interval "
                         f"{config['reselect_interval']}: elastic resume re-shards the state of "
                         "reselect_interval 0 only (resume on the same world size)")
    if (sc["rank"], sc["world_size"]) != (rank, world_size):
        raise ValueError(f"old state {rank} of {world_size} says it is rank {sc['rank']} of {sc['world_size']}")
    return sc


def _repad(flat: torch.Tensor, numel: int, padded: int) -> torch.Tensor:
    """The first ``numel`` elements of ``flat`` followed by zeros up to ``padded``: (padded,)."""
    out = torch.zeros(padded, dtype=flat.dtype, device=flat.device)
    out[:numel] = flat[:numel]
    return out


def read_scape_states(tag_dir: str) -> list[dict]:
    """Every old data-parallel rank's SCAPE state in ``tag_dir``, in rank order (read on the CPU).

    Raises:
        ValueError: no SCAPE files (ZeRO-3 or another optimizer), missing rank files, corrupt files,
            or tensor/pipeline-parallel files (elastic resume supports data parallelism only).
    """
    files = scape_rank_files(tag_dir)
    old_size = saved_dp_size(tag_dir)
    if old_size is None:
        if any(ZERO_OPTIM_FILE.match(n) for n in os.listdir(tag_dir)):
            raise ValueError(f"{tag_dir} is a ZeRO-3 checkpoint: convert re-shards stage 0/1 checkpoints only "
                             "(a ZeRO-3 checkpoint is re-sharded when it is loaded on the new number of ranks)")
        raise ValueError(f"{tag_dir} has no SCAPE state files (saved by another optimizer)")
    if any(len(paths) > 1 or "_global_rank_" in paths[0] for paths in files.values()):
        raise ValueError(f"{tag_dir} was saved with tensor or pipeline parallelism: elastic resume "
                         "supports data parallelism only")
    return [safe_load(files[r][0]) for r in range(old_size)]


def load_resharded_state(tag_dir: str, rank: int, world_size: int, chunk_size: int | None = None) -> dict:
    """Read every old rank's SCAPE file in ``tag_dir`` and return new rank ``rank``'s state.

    Raises:
        ValueError: as :func:`read_scape_states` and :func:`reshard_scape_state`.
    """
    return reshard_scape_state(read_scape_states(tag_dir), rank, world_size, chunk_size)


# ---------------------------------------------------------------------- ZeRO-3 (path B)
def zero3_full_params(flats: list[torch.Tensor], numels: list[int] | tuple[int, ...]) -> list[torch.Tensor]:
    """Every parameter's full flat value from the old ranks' ZeRO-3 partitions.

    ZeRO-3 cuts parameter ``p`` into ``D`` pieces of ``P = ceil(numel / D)`` elements (the last
    padded with zeros); rank ``r`` holds piece ``r`` of every parameter, concatenated in flat order
    (its sub-groups' fp32 partitions one after the other), as DeepSpeed's zero_to_fp32.py reads them.

    Args:
        flats: per old rank (D of them, in rank order), its (sum_p P_p,) partitions concatenated.
        numels: every parameter's number of elements, in flat order.

    Returns:
        Per parameter its (numel,) value (new tensors).

    Raises:
        ValueError: a rank's partitions do not hold the pieces of these parameters at D ranks.
    """
    D = len(flats)
    pieces = [piece_numel(n, D) for n in numels]
    for r, flat in enumerate(flats):
        if flat.numel() != sum(pieces):
            raise ValueError(f"old rank {r}'s ZeRO-3 partitions hold {flat.numel()} elements; the model's "
                             f"{len(numels)} parameters need {sum(pieces)} per rank at {D} ranks")
    per_rank = [torch.split(flat, pieces) for flat in flats]  # [rank][param] (P,)
    return [torch.cat([per_rank[r][i] for r in range(D)])[:n].clone() for i, n in enumerate(numels)]


def zero3_rank_partitions(full: list[torch.Tensor], sub_groups: tuple[int, ...] | list[int], rank: int,
                          world_size: int) -> list[torch.Tensor]:
    """Rank ``rank``'s ZeRO-3 partition of every sub-group at ``world_size`` ranks: per sub-group
    the concatenation of its parameters' pieces ``rank`` (zero padding past ``numel``)."""
    out, i = [], 0
    for count in sub_groups:
        parts = []
        for t in full[i:i + count]:
            P = piece_numel(t.numel(), world_size)
            parts.append(_repad(t, t.numel(), world_size * P)[rank * P:(rank + 1) * P])
        out.append(torch.cat(parts) if parts else torch.zeros(0))
        i += count
    return out


def reshard_zero3_state(states: list[dict[str, Any]], layout: Zero3Layout, rank: int,
                        world_size: int) -> dict[str, Any]:
    """New data-parallel rank ``rank``'s ZeRO-3 optimizer state, from the old ranks' states.

    Args:
        states: the old ranks' ZeRO-3 optimizer ``state_dict()`` (the ``optimizer_state_dict`` entry
            of DeepSpeed's ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``), one per old rank, in
            order: ``ScapeStage3``'s (with ``"scape"``) or DeepSpeed's own ZeRO-3 optimizer's.
        layout: the loading engine's layout.
        rank, world_size: the new data-parallel rank and size D'.

    Returns:
        A state dict that the ZeRO-3 optimizer's ``load_state_dict`` loads on rank ``rank`` of
        ``world_size``: the fp32 partitions and every per-element optimizer state (Stage3AdamS's
        ``momentum``, Adam's ``exp_avg``...) cut from the full tensors, the decay Stage3AdamS owed
        outside its last mask settled first (debt 1); with SCAPE, the error feedback summed in rank
        order in fp64 and kept whole on new rank 0 (zeros elsewhere), no masks, ``refresh_next`` set.

    Raises:
        ValueError: a bad world size or rank, or old states that do not belong together or to this model.
    """
    _check_new_rank(rank, world_size)
    if not states:
        raise ValueError("no old ZeRO-3 states to re-shard")
    old = [_check_old_zero3_state(s, i, len(states)) for i, s in enumerate(states)]
    if any(sc is None for sc in old) != all(sc is None for sc in old):
        raise ValueError("some old ranks have SCAPE state and some none")
    if old[0] is not None and any(sc["step"] != old[0]["step"] for sc in old):
        raise ValueError(f"the old ranks were saved at different steps: {[sc['step'] for sc in old]}")
    masters, per_element, scalars = [], {}, None
    for r, s in enumerate(states):
        inner = s["optimizer_state_dict"]
        flats = [f.clone() for f in s["fp32_flat_groups"]]
        ids = [i for g in inner["param_groups"] for i in g["params"]]  # the sub-groups, in order
        if len(ids) != len(flats):
            raise ValueError(f"old rank {r}: {len(flats)} fp32 partitions but {len(ids)} optimizer parameters")
        flat_states = [inner["state"].get(i, {}) for i in ids]
        for flat, st in zip(flats, flat_states):  # the decay owed outside the last mask, as the next dense step
            settle_decay(flat, st.get("decay_debt", 1.0), st.get("last_index"))
        masters.append(torch.cat(flats))
        for flat, st in zip(flats, flat_states):
            keys = sorted(k for k, v in st.items() if torch.is_tensor(v) and v.numel() == flat.numel() > 0
                          and k != "last_index")
            rest = {k: v for k, v in st.items() if k not in keys and k != "last_index"}
            rest = dict(rest, decay_debt=1.0) if "decay_debt" in rest else rest
            if scalars is None:
                scalars, names = rest, keys
            elif keys != names or not _same(rest, scalars):
                raise ValueError(f"old rank {r}'s optimizer state differs from old rank 0's in kind or step")
            for k in keys:
                per_element.setdefault(k, [[] for _ in states])[r].append(st[k])
    full = zero3_full_params(masters, layout.numels)
    new_state: dict = {}
    if scalars or per_element:
        new_state = {i: dict(scalars) for i in range(len(layout.sub_groups))}
    for k, per_rank in per_element.items():
        values = zero3_full_params([torch.cat(parts) for parts in per_rank], layout.numels)
        for i, part in enumerate(zero3_rank_partitions(values, layout.sub_groups, rank, world_size)):
            new_state[i][k] = part
    saved_groups = states[0]["optimizer_state_dict"]["param_groups"]
    groups = [dict(g, params=[i for i, pg in enumerate(layout.param_group_of) if pg == gi])
              for gi, g in enumerate(saved_groups)]
    new = dict(states[0], partition_count=world_size,
               fp32_flat_groups=zero3_rank_partitions(full, layout.sub_groups, rank, world_size),
               optimizer_state_dict=dict(state=new_state, param_groups=groups))
    if old[0] is not None and old[0].get("basis") == "dct":
        new["scape"] = dict(old[0], rank=rank, world_size=world_size, resharded_from=len(states),
                            dct=_zero3_dct_state(old, rank))
    elif old[0] is not None:
        new["scape"] = dict(old[0], rank=rank, world_size=world_size, error=_zero3_error(old, layout, rank, world_size),
                            masks={}, refresh_next=True, resharded_from=len(states))
    return new


def _zero3_dct_state(old: list[dict], rank: int) -> dict:
    """Basis "dct" under ZeRO-3 (``Stage3DctExchange``): the error feedback in coefficients is the old
    ranks' sum, in rank order in fp64, whole on new rank 0 and zeros elsewhere, at the old length (the
    loader keeps its own tiles' prefix: the tiles lie where they lay, only the padding tiles' count
    depends on D); no kept mask or owner momentum (``mask_source "momentum"``'s next step is then
    dense), no accumulators (saved after a step)."""
    errors = [sc["dct"]["error"] for sc in old]
    if any(e.numel() != errors[0].numel() for e in errors):
        raise ValueError("the old ranks' dct error feedback differ in length")
    total = sum_in_rank_order(errors).to(errors[0].dtype)
    return dict(error=total if rank == 0 else torch.zeros_like(total), held_mask=None, coef_momentum=None,
                local_grads=None, dense_grads=None)


def _same(a: dict, b: dict) -> bool:
    """The same keys and values (tensors compared elementwise)."""
    return a.keys() == b.keys() and all(
        torch.equal(v, b[k]) if torch.is_tensor(v) and torch.is_tensor(b[k]) else v == b[k] for k, v in a.items())


def _zero3_error(old: list[dict], layout: Zero3Layout, rank: int, world_size: int) -> dict[int, torch.Tensor]:
    """SCAPE's error feedback (key: place in ds_id order) of new rank ``rank``: the old ranks' sum,
    in rank order in fp64, stored once in the buffer's dtype on rank 0; zeros elsewhere."""
    keys = sorted(old[0]["error"])
    if any(sorted(sc["error"]) != keys for sc in old):
        raise ValueError("the old ranks hold error feedback for different parameters")
    out = {}
    for i in keys:
        if i >= len(layout.ds_order):
            raise ValueError(f"the checkpoint has error feedback for parameter {i}; the model has "
                             f"{len(layout.ds_order)} parameters")
        n = layout.numels[layout.ds_order[i]]
        padded = world_size * piece_numel(n, world_size)
        dtype = old[0]["error"][i].dtype
        if rank == 0:
            out[i] = _repad(sum_in_rank_order([sc["error"][i][:n] for sc in old]).to(dtype), n, padded)
        else:
            out[i] = torch.zeros(padded, dtype=dtype)
    return out


def _check_old_zero3_state(state: dict, rank: int, world_size: int) -> dict | None:
    """The old rank's SCAPE state (None: saved by DeepSpeed's own ZeRO-3 optimizer)."""
    if not isinstance(state, dict) or "fp32_flat_groups" not in state or "optimizer_state_dict" not in state:
        raise ValueError(f"old rank {rank}'s optimizer state is not a ZeRO-3 state")
    if state.get("ds_zero_partition_groups") is not None:
        raise ValueError("elastic ZeRO-3 resume does not support AutoEP partition groups")
    if "scape" not in state:
        return None
    sc = state["scape"]
    if sc.get("basis") == "dct" and (sc["dct"].get("local_grads") is not None or sc["dct"].get("dense_grads")):
        raise ValueError(f"old rank {rank} was saved under ZeRO-3 with scape.basis 'dct' between the micro-steps of "
                         "a gradient accumulation: elastic resume needs a checkpoint saved after an optimizer step")
    return _check_old_scape(sc, rank, world_size)


def _check_new_rank(rank: int, world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"the new data-parallel size must be an integer >= 1, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"new rank {rank} is outside 0..{world_size - 1}")


def load_resharded_zero3(tag_dir: str, layout: Zero3Layout, rank: int, world_size: int) -> tuple[dict, dict]:
    """Read every old rank's ZeRO-3 optimizer file and old rank 0's model-states file in ``tag_dir``;
    returns ``(new rank's optimizer state, rank 0's model states)``.

    Raises:
        ValueError: as :func:`~scape_ds.checkpoint.files.saved_zero3_dp_size` and :func:`reshard_zero3_state`, a missing
            model-states file, parameters other than the model's, or frozen parameters (not supported).
    """
    old_size = saved_zero3_dp_size(tag_dir)
    if old_size is None:
        raise ValueError(f"{tag_dir} has no ZeRO-3 optimizer files")
    model_path = os.path.join(tag_dir, ZERO_MODEL_FILE)
    if not os.path.isfile(model_path):
        raise ValueError(f"{tag_dir} has no {ZERO_MODEL_FILE}")
    model = safe_load(model_path)
    if model.get("frozen_param_fragments"):
        raise ValueError(f"{tag_dir} has frozen parameters: elastic ZeRO-3 resume supports trainable parameters only")
    saved = [int(shape.numel()) for group in model.get("param_shapes") or [] for shape in group.values()]
    if saved != list(layout.numels):
        raise ValueError(f"{tag_dir} holds {len(saved)} parameters of {sum(saved)} elements, this model "
                         f"{len(layout.numels)} of {sum(layout.numels)} (or in another order)")
    files = zero3_files(tag_dir)
    states = [safe_load(files[r])["optimizer_state_dict"] for r in range(old_size)]
    return reshard_zero3_state(states, layout, rank, world_size), model
