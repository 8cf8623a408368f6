"""The parts of the exchange both SCAPE optimizers share (docs/design.md section 1).

:class:`~scape_ds.optim.ScapeAdamS` (path A) and the ZeRO-3 ``ScapeStage3`` (path B) differ in
what they pack and where their state lives; they run the same schedule and bookkeeping:

- :class:`MaskSchedule`: which steps refresh the mask and which exchange densely;
- :class:`PendingMasks`: the asynchronous all-gather of a new mask, waited for by the next step;
- :class:`ValuesInFlight`: ``scape.overlap``'s new values per bucket, waited for by the next forward;
- :func:`settle_decay` / :func:`owe_decay`: lazy weight decay of the coordinates outside the mask;
- :func:`step_comm_stats`: the per-step ``comm_stats`` dict;
- :func:`check_same_layout`: a checkpoint loads only on the rank and world size that saved it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

__all__ = ["MaskSchedule", "PendingMasks", "ValuesInFlight", "is_refresh_step", "settle_decay", "owe_decay",
           "step_comm_stats", "check_same_layout"]


def is_refresh_step(t: int, interval: int) -> bool:
    """Whether step ``t`` (1-based) chooses the next mask: the first step and every ``interval`` after."""
    return t == 1 or (t - 1) % interval == 0


@dataclass(frozen=True)
class MaskSchedule:
    """Refresh and dense-step decisions of a run.

    Attributes:
        interval: T, ``mask_refresh_interval``: steps 1, T+1, 2T+1, ... choose the next mask.
        dense_refresh: refresh steps exchange densely (flushing every residual).
        always_dense: every step is dense (``compressor="dense"``, or no mask to apply).
    """

    interval: int
    dense_refresh: bool
    always_dense: bool = False

    def is_refresh(self, t: int) -> bool:
        """Whether step ``t`` (1-based) selects the next mask (used from step ``t + 1`` on)."""
        return is_refresh_step(t, self.interval)

    def is_dense(self, t: int) -> bool:
        """Whether step ``t`` (1-based) exchanges everything: the first step (no mask yet), and each
        refresh step under ``dense_refresh``."""
        return self.always_dense or t == 1 or (self.dense_refresh and self.is_refresh(t))


class PendingMasks:
    """At most one asynchronous mask all-gather in flight, decoded when it is waited for.

    The masks of a refresh step travel while the next forward and backward run; the next exchange
    calls :meth:`wait` first. Costs the gathered buffer (world_size times the local mask) until then.
    """

    def __init__(self):
        self._pending: tuple[Any, torch.Tensor, Callable[[torch.Tensor], None]] | None = None

    @property
    def in_flight(self) -> bool:
        return self._pending is not None

    def start(self, comm, local: torch.Tensor, decode: Callable[[torch.Tensor], None], tag: str = "mask_ag") -> None:
        """All-gather ``local`` (this rank's encoded mask) over ``comm`` without waiting; ``decode``
        gets the (world_size * local.numel(),) rank-major result when :meth:`wait` is called."""
        assert self._pending is None, "wait for the masks in flight before starting new ones"
        out = torch.empty(local.numel() * comm.world_size, dtype=local.dtype, device=local.device)
        self._pending = (comm.all_gather_async(out, local, tag), out, decode)

    def wait(self) -> None:
        """Wait for the all-gather in flight, if any, and decode it."""
        if self._pending is None:
            return
        work, out, decode = self._pending
        work.wait()
        self._pending = None
        decode(out)

    def drop(self) -> None:
        """Forget the all-gather in flight (a loaded checkpoint brings its own masks)."""
        self._pending = None


class ValuesInFlight:
    """``scape.overlap``: new parameter values on the wire, one collective per bucket, each written in
    when it is waited for: by the forward of a module holding its parameters (:meth:`hook`), or by
    :meth:`wait` (a step, a save, ``synchronize()``). Path A's broadcasts and the ZeRO-3 replica's
    all-gathers both use it."""

    def __init__(self):
        self._pending: dict[int, tuple[Any, Callable[[], None] | None]] = {}  # bucket -> (work, write-in)

    def __len__(self) -> int:
        return len(self._pending)

    def start(self, bucket: int, work, finish: Callable[[], None] | None = None) -> None:
        """``bucket``'s collective ``work`` is in flight; ``finish()`` writes its values in after it."""
        self._pending[bucket] = (work, finish)

    def wait(self, buckets: Iterable[int] | None = None) -> None:
        """Wait for ``buckets`` (default: every one in flight) and write their values in."""
        for b in list(self._pending) if buckets is None else buckets:
            pending = self._pending.pop(b, None)
            if pending is not None:
                work, finish = pending
                work.wait()
                if finish is not None:
                    finish()

    def hook(self, model: torch.nn.Module, buckets_of: dict[int, Iterable[int]]) -> tuple[list, bool]:
        """Put a forward pre-hook on every module of ``model`` that holds a parameter of ``buckets_of``
        (``id(p)`` -> the buckets ``p`` overlaps), waiting for those buckets, and state_dict /
        load_state_dict pre-hooks on ``model`` waiting for all (its own save or load reads or
        overwrites the parameters). Returns the hooks' handles and whether any module was hooked."""
        handles = []
        for module in model.modules():
            mine = sorted({b for p in module.parameters(recurse=False) for b in buckets_of.get(id(p), ())})
            if mine:
                handles.append(module.register_forward_pre_hook(lambda m, args, mine=mine: self.wait(mine)))
        hooked = bool(handles)
        handles.append(model.register_state_dict_pre_hook(lambda *args, **kw: self.wait()))
        handles.append(model.register_load_state_dict_pre_hook(lambda *args, **kw: self.wait()))
        return handles, hooked


def settle_decay(flat: torch.Tensor, debt: float, kept: torch.Tensor | None) -> float:
    """Apply the weight decay owed outside the last mask; returns the debt left (1.0).

    On a sparse step AdamS runs only at the mask, so the coordinates outside it miss their decay
    ``(1 - lr * weight_decay)``; the product of what they missed (``debt``) is applied at the next
    dense step, to every coordinate of ``flat`` but those at ``kept`` (the mask they were updated at).
    """
    if kept is not None and debt != 1.0:
        values = flat[kept]
        flat.mul_(debt)
        flat[kept] = values
    return 1.0


def owe_decay(debt: float, lr: float, weight_decay: float) -> float:
    """The decay debt after one more sparse step."""
    return debt * (1.0 - lr * weight_decay)


def step_comm_stats(meter, step: int, dense_step: bool, intra_meter=None) -> dict[str, Any]:
    """This step's ``comm_stats`` from ``meter`` and, under hierarchy "node", the node group's
    ``intra_meter`` (their per-step counters are reset).

    Keys: ``step``, ``dense_step``; ``bytes_inter`` (what ``meter``'s communicator sent: every byte of
    a flat run, which does not know the topology) and ``bytes_intra`` (the node group's, 0 when
    flat), both without ``init``; ``bytes_dense_inter`` and ``bytes_dense_intra``, what the dense
    exchange it replaces sends on each (recorded by the optimizer with ``meter.record_dense``);
    ``bytes_sent`` and ``bytes_dense``, their sums; ``by_tag`` and ``by_tag_intra``.
    """
    by_tag, dense_inter = meter.step_bytes()
    by_tag_intra, dense_intra = intra_meter.step_bytes() if intra_meter is not None else ({}, 0)
    inter, intra = sum(by_tag.values()), sum(by_tag_intra.values())
    return dict(step=step, dense_step=dense_step, bytes_sent=inter + intra, bytes_dense=dense_inter + dense_intra,
                bytes_inter=inter, bytes_intra=intra, bytes_dense_inter=dense_inter, bytes_dense_intra=dense_intra,
                by_tag=by_tag, by_tag_intra=by_tag_intra)


def check_same_layout(saved_rank: int, saved_world_size: int, rank: int, world_size: int, what: str) -> None:
    """Refuse a sharded state saved on another data-parallel rank or world size.

    Raises:
        ValueError: naming both layouts and what differs: the world size (resume on the saved size,
            or re-shard), or, at the same size, the rank (the checkpoint holds another rank's shard
            where this rank needs its own: one state for every rank, such as DeepSpeed's stage-0
            optimizer entry, which data-parallel rank 0 alone writes).
    """
    if (saved_rank, saved_world_size) == (rank, world_size):
        return
    head = f"{what} state of rank {saved_rank}/{saved_world_size} cannot load on rank {rank}/{world_size}"
    if saved_world_size != world_size:
        raise ValueError(f"{head}: resume with the same data-parallel size ({saved_world_size}), or load the "
                         f"checkpoint with scape_ds.checkpoint.load_checkpoint, which re-shards it")
    raise ValueError(f"{head}: the data-parallel size is the same, but this is rank {saved_rank}'s shard and rank "
                     f"{rank} needs its own; the checkpoint holds one rank's state where each rank's own file is "
                     f"needed (save through scape_ds.initialize's engine or scape_ds.checkpoint, which write one "
                     f"per rank)")
