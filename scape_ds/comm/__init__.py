"""Communication backends for SCAPE's exchange: one interface, a byte meter, the torch.distributed implementation.

``build_communicator(backend, group)`` picks one by the config's ``comm_backend``; the mpi4py
backend (issue 6) is not in this version: ``"mpi"`` is refused with a clear error.
"""
from __future__ import annotations

from .base import Communicator, Work
from .meter import ByteMeter, collective_bytes
from .torch_comm import TorchCommunicator

__all__ = ["Communicator", "Work", "ByteMeter", "collective_bytes", "TorchCommunicator", "build_communicator"]


def build_communicator(backend: str = "torch", group=None, meter: ByteMeter | None = None) -> Communicator:
    """Return the communicator for ``backend`` ("torch" | "mpi") over the data-parallel ``group``.

    For ``"mpi"``, ``group`` is the list of global ranks of the data-parallel group, a
    torch.distributed group (its ranks are used), or ``None`` for MPI's world.
    """
    if backend == "torch":
        return TorchCommunicator(group, meter)
    if backend == "mpi":
        raise ValueError("scape.comm_backend 'mpi' is not available in this version yet: use 'torch'")
    raise ValueError(f"comm_backend must be 'torch' or 'mpi', got {backend!r}")
