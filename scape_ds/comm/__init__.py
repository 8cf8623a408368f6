"""Communication backends for SCAPE's exchange: one interface, a byte meter, the torch.distributed implementation.

``build_communicator(backend, group)`` picks one by the config's ``comm_backend``: ``"torch"``
(torch.distributed) or ``"mpi"`` (mpi4py, from the ``mpi`` extra; the job must be started by
``mpiexec`` so that MPI's world and torch.distributed's world are the same processes).
``SimulatedCommunicator`` plays one of D identical ranks in a single process (no process group),
metered the same way, for byte counts and single-process tests.
"""
from __future__ import annotations

from .base import Communicator, Work
from .hierarchy import build_dp_communicators
from .meter import ByteMeter, collective_bytes
from .mpi_comm import MPICommunicator, mpi_available
from .sim import SimulatedCommunicator
from .torch_comm import TorchCommunicator, collective_device

__all__ = ["Communicator", "Work", "ByteMeter", "collective_bytes", "TorchCommunicator", "MPICommunicator",
           "mpi_available", "build_communicator", "build_dp_communicators", "collective_device",
           "SimulatedCommunicator"]


def build_communicator(backend: str = "torch", group=None, meter: ByteMeter | None = None) -> Communicator:
    """Return the communicator for ``backend`` ("torch" | "mpi") over the data-parallel ``group``.

    For ``"mpi"``, ``group`` is the list of global ranks of the data-parallel group, a
    torch.distributed group (its ranks are used), or ``None`` for MPI's world.
    """
    if backend == "torch":
        return TorchCommunicator(group, meter)
    if backend == "mpi":
        return MPICommunicator(_group_ranks(group), meter)
    raise ValueError(f"comm_backend must be 'torch' or 'mpi', got {backend!r}")


def _group_ranks(group) -> list[int] | None:
    """Global ranks of ``group`` (a list, a torch.distributed group, or None for the world), checked
    against MPI's world when torch.distributed is also running."""
    reason = mpi_available()
    if reason:
        raise ImportError(reason)
    import torch.distributed as dist
    from mpi4py import MPI

    mpi_rank, mpi_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) != (mpi_rank, mpi_size):
        raise ValueError(
            f"comm_backend 'mpi': torch.distributed rank {dist.get_rank()} of {dist.get_world_size()} is MPI rank "
            f"{mpi_rank} of {mpi_size}; start the job with mpiexec (mpiexec -n N python launch/pretrain.py ...)")
    if group is None or isinstance(group, (list, tuple)):
        return None if group is None else list(group)
    return list(dist.get_process_group_ranks(group))

