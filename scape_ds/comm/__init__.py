"""Communication backends for SCAPE's exchange: one interface, a byte meter, the torch.distributed implementation.

``build_communicator(backend, group)`` picks one by the config's ``comm_backend``: ``"torch"``
(torch.distributed) or ``"mpi"`` (mpi4py, from the ``mpi`` extra; the job must be started by
``mpiexec`` so that MPI's world and torch.distributed's world are the same processes).
``SimulatedCommunicator`` plays one of D identical ranks in a single process (no process group),
metered the same way, for byte counts and single-process tests.
"""
from __future__ import annotations

from .base import Communicator, Work, all_gather_int16, all_gather_int16_async
from .hierarchy import build_communicator, build_dp_communicators
from .meter import ByteMeter, collective_bytes
from .mpi_comm import MPICommunicator, mpi_available
from .sim import SimulatedCommunicator
from .torch_comm import TorchCommunicator, collective_device

__all__ = ["Communicator", "Work", "ByteMeter", "collective_bytes", "TorchCommunicator", "MPICommunicator",
           "mpi_available", "build_communicator", "build_dp_communicators", "collective_device",
           "SimulatedCommunicator", "all_gather_int16", "all_gather_int16_async"]
