"""The communication interface SCAPE's exchange runs on.

A :class:`Communicator` is bound to one data-parallel group. All collectives are over 1-D
contiguous tensors (packed values, encoded masks), sums for reductions, and every call adds the
bytes this rank sends to ``meter`` under a tag. Every tensor handed to a collective lives on
``device`` (NCCL takes CUDA tensors only; gloo and MPI's host staging take CPU tensors).
Implementations: ``TorchCommunicator`` (torch.distributed: gloo on CPU, NCCL on GPU) and
``MPICommunicator`` (mpi4py).
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .meter import ByteMeter

__all__ = ["Communicator", "Work", "all_gather_int16", "all_gather_int16_async"]


@runtime_checkable
class Work(Protocol):
    """Handle of an asynchronous collective."""

    def wait(self) -> None: ...


@runtime_checkable
class Communicator(Protocol):
    """Collectives over one data-parallel group, with a byte meter."""

    rank: int
    world_size: int
    meter: ByteMeter
    device: torch.device  # where scalars, norms and staging buffers for its collectives are allocated

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> None:
        """``out`` (D*n,) = concatenation of every rank's ``inp`` (n,)."""

    def all_gather_async(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> Work:
        """Like :meth:`all_gather`, returning a handle; ``out`` is valid after ``wait()``."""

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> None:
        """``out`` (n,) = sum over ranks of segment ``rank`` of ``inp`` (D*n,)."""

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> None:
        """``out`` (D*n,): segment r is segment ``rank`` of rank r's ``inp`` (D*n,) (no reduction)."""

    def all_reduce(self, tensor: torch.Tensor, tag: str) -> None:
        """In-place sum over ranks; every rank ends with the same bits."""

    def broadcast(self, tensor: torch.Tensor, src: int, tag: str) -> None:
        """In-place copy of group rank ``src``'s ``tensor`` to every rank."""

    def reduce_async(self, tensor: torch.Tensor, dst: int, tag: str) -> Work:
        """Sum of every rank's ``tensor`` into group rank ``dst``'s, in place, without waiting; the
        other ranks' ``tensor`` is undefined afterwards (a backend may use it as scratch)."""

    def broadcast_async(self, tensor: torch.Tensor, src: int, tag: str) -> Work:
        """Like :meth:`broadcast`, returning a handle; ``tensor`` is valid after ``wait()``. Counted as
        ``broadcast_all`` (what every receiver gets), not as a one-off broadcast."""

    def barrier(self) -> None:
        """Block until every rank arrives."""


def _int16_as_bytes(comm: Communicator, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """16-bit values travel as their bytes (gloo has no int16): the (2 D n,) uint8 output of their
    all-gather and the (2 n,) uint8 view of ``values`` to send."""
    out = torch.empty(comm.world_size * values.numel() * 2, dtype=torch.uint8, device=values.device)
    return out, values.contiguous().view(torch.uint8)


def all_gather_int16(comm: Communicator, values: torch.Tensor, tag: str) -> torch.Tensor:
    """All-gather (n,) int16 ``values`` (e.g. in-tile offsets) over ``comm``: (D n,) int16, rank-major."""
    out, send = _int16_as_bytes(comm, values)
    comm.all_gather(out, send, tag)
    return out.view(torch.int16)


def all_gather_int16_async(comm: Communicator, values: torch.Tensor, tag: str) -> tuple[torch.Tensor, Work]:
    """:func:`all_gather_int16`, asynchronously: the (D n,) int16 output, valid once the returned
    handle is waited for, and the handle."""
    out, send = _int16_as_bytes(comm, values)
    return out.view(torch.int16), comm.all_gather_async(out, send, tag)
