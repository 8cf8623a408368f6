"""torch.distributed implementation of the Communicator (gloo on CPU, NCCL on GPU)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from .meter import ByteMeter, collective_bytes

__all__ = ["TorchCommunicator", "collective_device"]

# torch 2.13 renamed the flat-tensor collectives (the old names warn); keep both working
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device whose tensors ``group``'s backend takes: the current CUDA device for NCCL, else CPU.

    Every tensor handed to a collective over ``group`` (scalars for norms and losses included) must
    be allocated here: NCCL rejects CPU tensors ("No backend type associated with device type cpu").
    """
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class TorchCommunicator:
    """Collectives over a torch.distributed process group, metered.

    Args:
        group: the data-parallel process group (``None``: the default group).
        meter: byte meter to add to (a new one if omitted).
        device: where the tensors it is given must live (default: :func:`collective_device` of
            ``group``); a tensor elsewhere is refused with the collective's tag, before it reaches
            the backend.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, meter: ByteMeter | None = None,
                 device: torch.device | None = None):
        if not dist.is_initialized():
            raise RuntimeError("TorchCommunicator needs torch.distributed initialized (deepspeed.init_distributed())")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.meter = meter if meter is not None else ByteMeter()
        self.device = torch.device(device) if device is not None else collective_device(group)
        self._src_global = [dist.get_global_rank(group, r) if group is not None else r for r in range(self.world_size)]

    def _nbytes(self, t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    def _check(self, tag: str, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device.type != self.device.type:
                raise RuntimeError(f"collective {tag!r}: a {t.device.type} tensor for a communicator on "
                                   f"{self.device} (allocate it on comm.device)")

    def all_gather(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> None:
        self.all_gather_async(out, inp, tag).wait()

    def all_gather_async(self, out: torch.Tensor, inp: torch.Tensor, tag: str):
        assert out.numel() == inp.numel() * self.world_size, (out.shape, inp.shape)
        self._check(tag, out, inp)
        self.meter.record(tag, collective_bytes("all_gather", self._nbytes(inp), self.world_size))
        return _all_gather_flat(out, inp, group=self.group, async_op=True)

    def reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> None:
        assert inp.numel() == out.numel() * self.world_size, (out.shape, inp.shape)
        self._check(tag, out, inp)
        self.meter.record(tag, collective_bytes("reduce_scatter", self._nbytes(inp), self.world_size))
        _reduce_scatter_flat(out, inp, op=dist.ReduceOp.SUM, group=self.group)

    def all_to_all(self, out: torch.Tensor, inp: torch.Tensor, tag: str) -> None:
        assert out.numel() == inp.numel() and inp.numel() % self.world_size == 0, (out.shape, inp.shape)
        self._check(tag, out, inp)
        self.meter.record(tag, collective_bytes("all_to_all", self._nbytes(inp), self.world_size))
        dist.all_to_all_single(out, inp, group=self.group)

    def all_reduce(self, tensor: torch.Tensor, tag: str) -> None:
        self._check(tag, tensor)
        self.meter.record(tag, collective_bytes("all_reduce", self._nbytes(tensor), self.world_size))
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def broadcast(self, tensor: torch.Tensor, src: int, tag: str) -> None:
        self._check(tag, tensor)
        self.meter.record(tag, collective_bytes("broadcast", self._nbytes(tensor), self.world_size, self.rank == src))
        dist.broadcast(tensor, src=self._src_global[src], group=self.group)

    def reduce_async(self, tensor: torch.Tensor, dst: int, tag: str):
        self._check(tag, tensor)
        self.meter.record(tag, collective_bytes("reduce", self._nbytes(tensor), self.world_size, self.rank == dst))
        return dist.reduce(tensor, dst=self._src_global[dst], op=dist.ReduceOp.SUM, group=self.group, async_op=True)

    def broadcast_async(self, tensor: torch.Tensor, src: int, tag: str):
        self._check(tag, tensor)
        self.meter.record(tag, collective_bytes("broadcast_all", self._nbytes(tensor), self.world_size,
                                                self.rank == src))
        return dist.broadcast(tensor, src=self._src_global[src], group=self.group, async_op=True)

    def barrier(self) -> None:
        dist.barrier(group=self.group)
