"""Baselines from the papers that are not a config of the product: DiLoCo (arXiv 2311.08105).

DiLoCo: every rank takes ``H`` inner AdamW steps on its own data with no exchange at all, then the
ranks all-reduce the outer gradient ``delta = theta_outer - theta_local`` (the mean over ranks) and
take one outer step with Nesterov momentum (the paper's outer lr 0.7, momentum 0.9); every rank
starts the next round from the new ``theta_outer``, each keeping its own inner AdamW state.

In the bench a baseline is the dense AdamW run of ``ds_configs/dense_adamw.json`` plus two calls
from the training loop: :meth:`DiLoCo.start` (``scape_ds.train.train``'s ``on_start``: switches the
engine's gradient all-reduce off and keeps theta_outer) and :meth:`DiLoCo.__call__` (its
``on_step``: the outer step every ``H`` steps). Bytes: one fp32 all-reduce of the parameters per
outer step, the size of the dense run's gradient all-reduce (:meth:`DiLoCo.bytes_sent`).
No checkpoints: between outer steps the ranks hold different parameters and DeepSpeed's stage-0
checkpoint keeps rank 0's alone, so an interrupted DiLoCo run starts over.
"""
from __future__ import annotations


class DiLoCo:
    """The outer loop of DiLoCo over a DeepSpeed engine whose optimizer is the inner AdamW."""

    def __init__(self, H: int, outer_lr: float = 0.7, outer_momentum: float = 0.9):
        if H < 1 or not outer_lr > 0 or not 0 <= outer_momentum < 1:
            raise ValueError(f"DiLoCo needs H >= 1, outer_lr > 0, 0 <= outer_momentum < 1; got {H}, {outer_lr}, "
                             f"{outer_momentum}")
        self.H, self.outer_lr, self.outer_momentum = H, outer_lr, outer_momentum
        self.outer = None  # (N,) fp32 (fp64 for an fp64 model): theta_outer, the same on every rank
        self.buf = None  # (N,) the Nesterov momentum buffer, created at the first outer step

    def start(self, engine) -> None:
        """Before step 1: inner steps exchange nothing; keep the starting parameters as theta_outer."""
        import torch
        from torch.nn.utils import parameters_to_vector

        engine.enable_backward_allreduce = False
        flat = parameters_to_vector(engine.module.parameters()).detach()
        self.outer = flat.to(torch.promote_types(flat.dtype, torch.float32)).clone()  # (N,) fp32, or fp64

    def __call__(self, step: int, engine) -> None:
        """After inner step ``step``: the outer step when ``step`` is a multiple of ``H``."""
        if step % self.H:
            return
        import torch
        import torch.distributed as dist
        from torch.nn.utils import parameters_to_vector

        params = list(engine.module.parameters())
        delta = self.outer - parameters_to_vector(params).detach().to(self.outer.dtype)  # (N,) this rank's
        dist.all_reduce(delta)
        delta.div_(dist.get_world_size())  # (N,) the mean over ranks
        if self.buf is None:
            self.buf = delta.clone()
        else:
            self.buf.mul_(self.outer_momentum).add_(delta)
        self.outer.sub_(delta.add_(self.buf, alpha=self.outer_momentum), alpha=self.outer_lr)  # Nesterov
        with torch.no_grad():  # copied in place: the inner optimizer keeps the same tensors
            offset = 0
            for p in params:
                p.copy_(self.outer[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def bytes_sent(self, rows: list[dict]) -> int:
        """Bytes one rank sent over the run: the dense all-reduce's bytes at each outer step."""
        return sum(r["bytes_dense"] for r in rows if r["step"] % self.H == 0)


def build_baseline(spec: dict | None):
    """The baseline object of a run's ``BASELINES`` entry (None: the run is a config of the product)."""
    if spec is None:
        return None
    kind, kwargs = spec["kind"], {k: v for k, v in spec.items() if k != "kind"}
    if kind == "diloco":
        return DiLoCo(**kwargs)
    raise ValueError(f"unknown baseline kind {kind!r}")
