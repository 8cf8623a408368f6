"""mpi4py implementation of the Communicator: SCAPE's exchange over MPI, next to torch.distributed.

The data-parallel group becomes an MPI sub-communicator (``MPI.COMM_WORLD`` for the whole world,
or ``Create_group`` over the group's global ranks, which only the members call). Buffers are
torch CPU tensors handed to MPI through the buffer protocol (no copy). GPU tensors are staged
through host memory unless the MPI library reports CUDA support (``MPI.Query_cuda_support()``),
in which case MPI reads device memory directly. The byte meter counts exactly what the torch
backend counts for the same call.

MPI's non-blocking all-gather (used for the masks, one step ahead) progresses inside MPI calls;
MPICH progresses it in a background thread with ``MPIR_CVAR_ASYNC_PROGRESS=1``.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .meter import ByteMeter, collective_bytes

__all__ = ["MPICommunicator", "mpi_available"]

# torch dtype -> the dtype MPI moves (reductions need a real MPI type; bit-copies can reinterpret)
_REDUCIBLE = {torch.float32, torch.float64, torch.int32, torch.int64, torch.int16, torch.uint8, torch.int8}


def mpi_available() -> str | None:
    """``None`` if mpi4py and an MPI library load, else the reason they do not."""
    try:
        from mpi4py import MPI  # noqa: F401
    except Exception as e:  # ImportError, or a missing libmpi (RuntimeError/OSError)
        return f"mpi4py with an MPI library is needed for comm_backend 'mpi' (pip install 'scape_ds[mpi]'): {e}"
    return None


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A same-size view MPI can copy (bf16/fp16 as int16); reductions never go through this."""
    return t.view(torch.int16) if t.dtype in (torch.bfloat16, torch.float16) else t


def _is_own_slice(inp: torch.Tensor, out: torch.Tensor, rank: int) -> bool:
    """Whether ``inp`` is the block of ``out`` that ``rank`` contributes to an all-gather into ``out``."""
    return (inp.device == out.device and inp.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()
            and inp.data_ptr() == out.data_ptr() + rank * inp.numel() * inp.element_size())


class _Request:
    """An in-flight MPI request plus what must happen when it completes (copy back to the GPU)."""

    def __init__(self, req, keep: tuple, finish=None):
        self._req, self._keep, self._finish = req, keep, finish

    def wait(self) -> None:
        if self._req is not None:
            self._req.Wait()
            self._req = None
            if self._finish is not None:
                self._finish()
            self._keep = ()


class MPICommunicator:
    """Collectives over an MPI communicator, metered like :class:`TorchCommunicator`.

    Args:
        ranks: global ranks (in ``MPI.COMM_WORLD``) of the data-parallel group, in group order;
            ``None`` for the whole world. Every member must construct it (collective).
        meter: byte meter to add to (a new one if omitted).
        cuda_aware: hand device pointers to MPI; default: what ``MPI.Query_cuda_support()`` says.
    """

    def __init__(self, ranks: Sequence[int] | None = None, meter: ByteMeter | None = None,
                 cuda_aware: bool | None = None):
        reason = mpi_available()
        if reason:
            raise ImportError(reason)
        from mpi4py import MPI

        self._MPI = MPI
        world = MPI.COMM_WORLD
        if ranks is None or list(ranks) == list(range(world.Get_size())):
            self.comm = world.Dup()
        else:
            ranks = [int(r) for r in ranks]
            if world.Get_rank() not in ranks:
                raise ValueError(f"MPI rank {world.Get_rank()} is not in the data-parallel group {ranks}")
            self.comm = world.Create_group(world.Get_group().Incl(ranks))
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self.meter = meter if meter is not None else ByteMeter()
        if cuda_aware is None:
            query = getattr(MPI, "Query_cuda_support", None)
            cuda_aware = bool(query()) if query is not None else False
        self.cuda_aware = cuda_aware
        # scalars are allocated on the host; device buffers are staged (or read directly when CUDA-aware)
        self.device = torch.device("cpu")

    # -- buffers -------------------------------------------------------------------------------
    def _host(self, t: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """(tensor MPI may touch, whether it is a staging copy of a device tensor)."""
        if not t.is_contiguous():
            raise ValueError("MPICommunicator needs contiguous tensors")
        if t.device.type == "cpu" or self.cuda_aware:
            return t, False
        return t.detach().to("cpu"), True

    def _ready(self, t: torch.Tensor) -> None:
        """A device tensor MPI reads directly (CUDA-aware) must be written by then: MPI does not wait
        for the kernels queued on the stream (the pack of a bucket, just before its reduce)."""
        if t.device.type == "cuda" and self.cuda_aware:
            torch.cuda.current_stream(t.device).synchronize()

    def _buf(self, t: torch.Tensor, reduce: bool = False):
        if reduce:
            if t.dtype not in _REDUCIBLE:
                raise TypeError(f"MPICommunicator reduces {sorted(map(str, _REDUCIBLE))}, not {t.dtype}")
            return t.detach().numpy() if t.device.type == "cpu" else t.detach()
        b = _bits(t).detach()
        return b.numpy() if b.device.type == "cpu" else b

    @staticmethod
    def _nbytes(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    # -- collectives ---------------------------------------------------------------------------
    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> None:
        self.all_gather_async(out, inp, tag).wait()

    def all_gather_async(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> _Request:
        assert out.numel() == inp.numel() * self.world_size, (out.shape, inp.shape)
        self.meter.record(tag, collective_bytes("all_gather", self._nbytes(inp), self.world_size))
        self._ready(inp)
        h_out, staged = self._host(out)
        if _is_own_slice(inp, out, self.rank):
            # in place (SCAPE's dense step): this rank's part already sits in ``out``; MPI forbids
            # aliased send and receive buffers, so say IN_PLACE
            h_in, send = None, self._MPI.IN_PLACE
        else:
            h_in, _ = self._host(inp)
            send = self._buf(h_in)
        req = self.comm.Iallgather(send, self._buf(h_out))
        finish = (lambda: out.copy_(h_out)) if staged else None
        return _Request(req, (h_in, h_out), finish)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> None:
        assert inp.numel() == out.numel() * self.world_size, (out.shape, inp.shape)
        self.meter.record(tag, collective_bytes("reduce_scatter", self._nbytes(inp), self.world_size))
        h_in, _ = self._host(inp)
        h_out, staged = self._host(out)
        self.comm.Reduce_scatter_block(self._buf(h_in, True), self._buf(h_out, True), op=self._MPI.SUM)
        if staged:
            out.copy_(h_out)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> None:
        assert out.numel() == inp.numel() and inp.numel() % self.world_size == 0, (out.shape, inp.shape)
        self.meter.record(tag, collective_bytes("all_to_all", self._nbytes(inp), self.world_size))
        self._ready(inp)
        h_in, _ = self._host(inp)
        h_out, staged = self._host(out)
        self.comm.Alltoall(self._buf(h_in), self._buf(h_out))
        if staged:
            out.copy_(h_out)

    def all_reduce(self, tensor: torch.Tensor, tag: str) -> None:
        self.meter.record(tag, collective_bytes("all_reduce", self._nbytes(tensor), self.world_size))
        h, staged = self._host(tensor)
        self.comm.Allreduce(self._MPI.IN_PLACE, self._buf(h, True), op=self._MPI.SUM)
        if staged:
            tensor.copy_(h)

    def broadcast(self, tensor: torch.Tensor, src: int, tag: str) -> None:
        self.meter.record(tag, collective_bytes("broadcast", self._nbytes(tensor), self.world_size, self.rank == src))
        h, staged = self._host(tensor)
        self.comm.Bcast(self._buf(h), root=src)
        if staged:
            tensor.copy_(h)

    def reduce_async(self, tensor: torch.Tensor, dst: int, tag: str) -> _Request:
        root = self.rank == dst
        self.meter.record(tag, collective_bytes("reduce", self._nbytes(tensor), self.world_size, root))
        self._ready(tensor)
        h, staged = self._host(tensor)
        # the root reduces in place; MPI forbids aliased send and receive buffers, so say IN_PLACE
        send, recv = (self._MPI.IN_PLACE, self._buf(h, True)) if root else (self._buf(h, True), None)
        req = self.comm.Ireduce(send, recv, op=self._MPI.SUM, root=dst)
        finish = (lambda: tensor.copy_(h)) if staged and root else None
        return _Request(req, (h,), finish)

    def broadcast_async(self, tensor: torch.Tensor, src: int, tag: str) -> _Request:
        self.meter.record(tag, collective_bytes("broadcast_all", self._nbytes(tensor), self.world_size,
                                                self.rank == src))
        self._ready(tensor)
        if self.rank != src and tensor.device.type != "cpu" and not self.cuda_aware:
            h, staged = torch.empty(tensor.shape, dtype=tensor.dtype), True  # a receiver: nothing to copy out
        else:
            h, staged = self._host(tensor)
        req = self.comm.Ibcast(self._buf(h), root=src)
        finish = (lambda: tensor.copy_(h)) if staged and self.rank != src else None
        return _Request(req, (h,), finish)

    def barrier(self) -> None:
        self.comm.Barrier()

    def close(self) -> None:
        """Free the sub-communicator (collective over the group)."""
        if self.comm is not None and self.comm != self._MPI.COMM_NULL:
            self.comm.Free()
            self.comm = None
