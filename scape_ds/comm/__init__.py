"""Communication backends for SCAPE's exchange: one interface, a byte meter, two implementations.

``build_communicator(backend, group)`` picks one by the config's ``comm_backend``; mpi4py is
imported only when ``"mpi"`` is asked for.
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
        from .mpi_comm import MPICommunicator  # imports mpi4py, with the install hint if missing

        return MPICommunicator(group, meter)
    raise ValueError(f"comm_backend must be 'torch' or 'mpi', got {backend!r}")
