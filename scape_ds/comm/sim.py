"""A communicator for one process that plays rank ``rank`` of ``world_size`` identical ranks.

No data moves and no process group is needed: every "other rank" is taken to hold the same tensor
as this one, so a sum over ranks is ``world_size`` times the local tensor and an all-gather repeats
it. Every collective is metered exactly as :class:`TorchCommunicator` and :class:`MPICommunicator`
meter theirs (:func:`collective_bytes`), so byte counts of a real optimizer on real shapes can be
taken in one process (``bench/bytes.py``) and single-process tests can run the exchange code.
Values are those of D identical ranks, so they are right for replicated tensors (sums, norms), not
for sharded state: an all-gather of this rank's shard fills every segment with it. Use it for byte
counts and for code paths, not to check a sharded optimizer's numbers.
"""
from __future__ import annotations

import torch

from .meter import ByteMeter, collective_bytes

__all__ = ["SimulatedCommunicator"]


class _Done:
    """The handle of a collective that has already completed."""

    def wait(self) -> None:
        return None


class SimulatedCommunicator:
    """Rank ``rank`` of ``world_size`` identical ranks: collectives computed locally, bytes metered.

    Args:
        world_size: the number of ranks simulated (D).
        rank: the rank this process plays (its segment in reduce-scatter; broadcast counts at root 0).
        meter: byte meter to add to (a new one if omitted).

    Raises:
        ValueError: ``world_size`` < 1 or ``rank`` outside ``[0, world_size)``.
    """

    def __init__(self, world_size: int, rank: int = 0, meter: ByteMeter | None = None):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        self.world_size, self.rank = world_size, rank
        self.meter = meter if meter is not None else ByteMeter()
        self.device = torch.device("cpu")

    def _count(self, kind: str, t: torch.Tensor, tag: str) -> None:
        self.meter.record(tag, collective_bytes(kind, t.numel() * t.element_size(), self.world_size, self.rank == 0))

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> None:
        self.all_gather_async(out, inp, tag)

    def all_gather_async(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> _Done:
        self._count("all_gather", inp, tag)
        # (D, n): every rank's part is ours; inp may be our own block of out (an in-place all-gather)
        out.view(self.world_size, -1).copy_(inp.view(1, -1).clone())
        return _Done()

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> None:
        self._count("reduce_scatter", inp, tag)
        out.copy_(inp.view(self.world_size, -1)[self.rank]).mul_(self.world_size)  # (n,) D equal terms

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> None:
        self._count("all_to_all", inp, tag)
        out.view(self.world_size, -1).copy_(inp.view(self.world_size, -1)[self.rank].clone())  # D equal parts

    def all_reduce(self, tensor: torch.Tensor, tag: str) -> None:
        self._count("all_reduce", tensor, tag)
        tensor.mul_(self.world_size)

    def broadcast(self, tensor: torch.Tensor, src: int, tag: str) -> None:
        self._count("broadcast", tensor, tag)

    def reduce_async(self, tensor: torch.Tensor, dst: int, tag: str) -> _Done:
        self.meter.record(tag, collective_bytes("reduce", tensor.numel() * tensor.element_size(), self.world_size,
                                                self.rank == dst))
        tensor.mul_(self.world_size)  # D equal terms (on the root; elsewhere the result is undefined)
        return _Done()

    def broadcast_async(self, tensor: torch.Tensor, src: int, tag: str) -> _Done:
        self.meter.record(tag, collective_bytes("broadcast_all", tensor.numel() * tensor.element_size(),
                                                self.world_size, self.rank == src))
        return _Done()

    def barrier(self) -> None:
        return None
