"""Elastic resume: re-shard path A's per-rank SCAPE state from D data-parallel ranks to D'.

Pure functions over :meth:`ScapeAdamS.state_dict` dicts (no process group), used by
:func:`scape_ds.checkpoint.load_checkpoint` when the checkpoint was saved on another number of
data-parallel ranks, and by ``python -m scape_ds.checkpoint convert <dir> --to-dp N``.
docs/design.md, "Checkpoints", has the reasoning. Per param group, from D old states to new rank r':

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

Cost: the new rank holds every old rank's state at once while it converts (D times one rank's
state); loading reads every old rank's file.
"""
from __future__ import annotations

import os
import re
from typing import Any

import torch

from .config import parse_scape_config
from .exchange.core import settle_decay
from .exchange.masks import offsets_to_index

__all__ = ["reshard_scape_state", "reshard_scape_states", "scape_rank_files", "saved_dp_size",
           "read_scape_states", "load_resharded_state", "sum_in_rank_order", "check_zero3_dp_size"]

_RANK_FILE = re.compile(r"scape_dp_rank_(\d{5})(_global_rank_\d{5})?\.pt$")


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
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"the new data-parallel size must be an integer >= 1, got {world_size!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"new rank {rank} is outside 0..{world_size - 1}")
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
    groups = []
    for g, saved in enumerate(first["groups"]):
        per_rank = [sc["groups"][g] for sc in old]
        numel = saved["numel"]
        if any(p["numel"] != numel for p in per_rank):
            raise ValueError(f"param group {g}: the old ranks disagree on its number of elements")
        new = dict(decay_debt=1.0, active_offsets=None, numel=numel,
                   dense_momenta=[m.clone() for m in saved["dense_momenta"]])
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
    scape = dict(first, rank=rank, world_size=world_size, groups=groups, refresh_next=True,
                 resharded_from=len(old))
    return dict(param_groups=[dict(g) for g in states[0]["param_groups"]], scape=scape)


def _check_old_state(state: dict, rank: int, world_size: int) -> dict:
    if "scape" not in state:
        raise ValueError(f"old rank {rank}'s state is not a ScapeAdamS state dict (no 'scape' entry)")
    sc = state["scape"]
    if (sc["rank"], sc["world_size"]) != (rank, world_size):
        raise ValueError(f"old state {rank} of {world_size} says it is rank {sc['rank']} of {sc['world_size']}")
    return sc


def _repad(flat: torch.Tensor, numel: int, padded: int) -> torch.Tensor:
    """The first ``numel`` elements of ``flat`` followed by zeros up to ``padded``: (padded,)."""
    out = torch.zeros(padded, dtype=flat.dtype, device=flat.device)
    out[:numel] = flat[:numel]
    return out


# ---------------------------------------------------------------------- files
def scape_rank_files(tag_dir: str) -> dict[int, list[str]]:
    """Data-parallel rank -> the SCAPE state files saved for it in ``tag_dir`` (several with
    tensor or pipeline parallelism: one per model-parallel rank)."""
    found: dict[int, list[str]] = {}
    for name in sorted(os.listdir(tag_dir)):
        m = _RANK_FILE.match(name)
        if m:
            found.setdefault(int(m.group(1)), []).append(os.path.join(tag_dir, name))
    return found


def saved_dp_size(tag_dir: str) -> int | None:
    """The data-parallel size the SCAPE files in ``tag_dir`` were saved with (None: there are none).

    Raises:
        ValueError: the files of some data-parallel rank are missing.
    """
    files = scape_rank_files(tag_dir)
    if not files:
        return None
    size = max(files) + 1
    missing = [r for r in range(size) if r not in files]
    if missing:
        raise ValueError(f"{tag_dir} has SCAPE state for data-parallel ranks up to {size - 1} "
                         f"but none for rank(s) {missing}")
    return size


def read_scape_states(tag_dir: str) -> list[dict]:
    """Every old data-parallel rank's SCAPE state in ``tag_dir``, in rank order (read on the CPU).

    Raises:
        ValueError: no SCAPE files (ZeRO-3 or another optimizer), missing rank files, corrupt files,
            or tensor/pipeline-parallel files (elastic resume supports data parallelism only).
    """
    files = scape_rank_files(tag_dir)
    old_size = saved_dp_size(tag_dir)
    if old_size is None:
        if any(_ZERO_FILE.match(n) for n in os.listdir(tag_dir)):
            raise ValueError(f"{tag_dir} is a ZeRO-3 checkpoint: elastic resume is not supported under ZeRO-3 "
                             "(stage 0/1 only)")
        raise ValueError(f"{tag_dir} has no SCAPE state files (saved by another optimizer)")
    if any(len(paths) > 1 or "_global_rank_" in paths[0] for paths in files.values()):
        raise ValueError(f"{tag_dir} was saved with tensor or pipeline parallelism: elastic resume "
                         "supports data parallelism only")
    return [_load(files[r][0]) for r in range(old_size)]


def load_resharded_state(tag_dir: str, rank: int, world_size: int, chunk_size: int | None = None) -> dict:
    """Read every old rank's SCAPE file in ``tag_dir`` and return new rank ``rank``'s state.

    Raises:
        ValueError: as :func:`read_scape_states` and :func:`reshard_scape_state`.
    """
    return reshard_scape_state(read_scape_states(tag_dir), rank, world_size, chunk_size)


def _load(path: str) -> dict:
    from .checkpoint import safe_load  # checkpoint imports this module

    return safe_load(path)


_ZERO_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def check_zero3_dp_size(tag_dir: str, world_size: int) -> list[str]:
    """ZeRO-3 (path B) loads only on the data-parallel size that saved it: the problem, if any.

    Elastic resume re-shards path A's state only; ZeRO-3's fp32 partitions, momentum and SCAPE's
    per-parameter error feedback and masks live in DeepSpeed's per-rank optimizer files.
    """
    ranks = {int(m.group(1)) for n in os.listdir(tag_dir) if (m := _ZERO_FILE.match(n))}
    if ranks and len(ranks) != world_size:
        return [f"{os.path.basename(tag_dir)} was saved by ZeRO-3 on {len(ranks)} data-parallel ranks and this "
                f"run has {world_size}: elastic resume is not supported under ZeRO-3 (stage 0/1 only)"]
    return []
