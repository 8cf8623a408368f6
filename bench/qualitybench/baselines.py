"""Baselines from the papers that are not a config of the product: DiLoCo (arXiv 2311.08105) and
SparseLoCo (arXiv 2508.15706).

DiLoCo: every rank takes ``H`` inner AdamW steps on its own data with no exchange at all, then the
ranks all-reduce the outer gradient ``delta = theta_outer - theta_local`` (the mean over ranks) and
take one outer step with Nesterov momentum (the paper's outer lr 0.7, momentum 0.9); every rank
starts the next round from the new ``theta_outer``, each keeping its own inner AdamW state.

In the bench a baseline is the dense AdamW run of ``ds_configs/dense_adamw.json`` plus two calls
from the training loop: :meth:`DiLoCo.start` (``scape_ds.train.train``'s ``on_start``: switches the
engine's gradient all-reduce off and keeps theta_outer) and :meth:`DiLoCo.__call__` (its
``on_step``: the outer step every ``H`` steps). Bytes: one fp32 all-reduce of the parameters per
outer step, the size of the dense run's gradient all-reduce (:meth:`DiLoCo.bytes_sent`).

SparseLoCo replaces DiLoCo's outer momentum with an error-feedback accumulator per rank:
``e = beta e + delta``; each rank sends the top-k of ``e`` in every chunk of ``chunk`` coordinates,
quantized to 2 bits per value (one fp32 scale per chunk), and keeps the rest in ``e``; the outer step
is ``theta_outer -= outer_lr * mean(sent)``. Bytes: the all-gather of each rank's payload (k values
of 2 bits and k 16-bit offsets per chunk, plus the scale) at each outer step.

Evaluation: the loop runs ``on_step`` (the outer step) before a step's validation, so a validation at
a multiple of ``H`` (the final one of every bench run: 1500 and 2000 are multiples of 30 and 100) sees
theta_outer, the same model on every rank; one between outer steps averages the losses of the ranks'
own local models.

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
        """After inner step ``step``: the outer step when ``step`` is a multiple of ``H``, and every rank
        continues from the new theta_outer (copied in place: the inner optimizer keeps the same tensors)."""
        if step % self.H:
            return
        import torch
        from torch.nn.utils import parameters_to_vector

        params = list(engine.module.parameters())
        self.outer_step(self.outer - parameters_to_vector(params).detach().to(self.outer.dtype))
        with torch.no_grad():
            offset = 0
            for p in params:
                p.copy_(self.outer[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def outer_step(self, delta) -> None:
        """theta_outer from this rank's outer gradient ``delta`` (N,): Nesterov SGD on the mean over ranks."""
        import torch.distributed as dist

        dist.all_reduce(delta)
        delta.div_(dist.get_world_size())  # (N,) the mean over ranks
        if self.buf is None:
            self.buf = delta.clone()
        else:
            self.buf.mul_(self.outer_momentum).add_(delta)
        self.outer.sub_(delta.add_(self.buf, alpha=self.outer_momentum), alpha=self.outer_lr)  # Nesterov

    def bytes_sent(self, rows: list[dict]) -> int:
        """Bytes one rank sent over the run: the dense all-reduce's bytes at each outer step."""
        return sum(r["bytes_dense"] for r in rows if r["step"] % self.H == 0)


class SparseLoCo(DiLoCo):
    """DiLoCo's outer loop with SparseLoCo's outer step (see the module docstring)."""

    def __init__(self, H: int, k: int = 64, chunk: int = 4096, beta: float = 0.95, outer_lr: float = 1.0):
        super().__init__(H, outer_lr=outer_lr, outer_momentum=0.0)
        if not 1 <= k <= chunk or chunk > 65536 or not 0 <= beta <= 1:
            raise ValueError(f"SparseLoCo needs 1 <= k <= chunk <= 65536 and 0 <= beta <= 1; got k={k}, "
                             f"chunk={chunk}, beta={beta}")
        self.k, self.chunk, self.beta = k, chunk, beta
        self.error = None  # (C * chunk,) this rank's accumulator, zero-padded to whole chunks

    def start(self, engine) -> None:
        import torch

        super().start(engine)
        n_chunks = -(-self.outer.numel() // self.chunk)
        self.error = torch.zeros(n_chunks * self.chunk, dtype=self.outer.dtype)

    def payload_bytes(self) -> int:
        """Bytes of one rank's message: per chunk k 2-bit codes, k 16-bit offsets and one fp32 scale."""
        n_chunks = self.error.numel() // self.chunk
        return n_chunks * (-(-2 * self.k // 8) + 2 * self.k + 4)

    def compress(self, delta):
        """Add ``delta`` (N,) into the accumulator, take out what is sent: the decoded message, (N,)."""
        import torch

        n = delta.numel()
        self.error.mul_(self.beta)[:n].add_(delta)
        e = self.error.view(-1, self.chunk)  # (C, chunk)
        idx = e.abs().topk(self.k, dim=1).indices  # (C, k)
        vals = e.gather(1, idx)  # (C, k)
        # 2 bits: the levels (-1.5, -0.5, 0.5, 1.5) x scale, the largest magnitude of the chunk at 1.5
        scale = (vals.abs().amax(dim=1, keepdim=True) / 1.5).clamp_min(torch.finfo(e.dtype).tiny)  # (C, 1)
        codes = (torch.floor(vals / scale) + 0.5).clamp(-1.5, 1.5)  # (C, k)
        sent = torch.zeros_like(e).scatter_(1, idx, codes * scale)  # (C, chunk)
        e.sub_(sent)  # what was not sent stays
        return sent.view(-1)[:n]

    def outer_step(self, delta) -> None:
        """theta_outer from ``delta`` (N,): the mean of every rank's compressed message, at outer_lr."""
        import torch.distributed as dist

        sent = self.compress(delta)  # (N,)
        dist.all_reduce(sent)  # the sum of the decoded messages (bytes: the all-gather, counted below)
        self.outer.sub_(sent, alpha=self.outer_lr / dist.get_world_size())

    def bytes_sent(self, rows: list[dict]) -> int:
        import torch.distributed as dist

        from scape_ds.comm import collective_bytes

        per_outer = collective_bytes("all_gather", self.payload_bytes(), dist.get_world_size())
        return per_outer * sum(1 for r in rows if r["step"] % self.H == 0)


def build_baseline(spec: dict | None):
    """The baseline object of a run's ``BASELINES`` entry (None: the run is a config of the product)."""
    if spec is None:
        return None
    kind, kwargs = spec["kind"], {k: v for k, v in spec.items() if k != "kind"}
    if kind == "diloco":
        return DiLoCo(**kwargs)
    if kind == "sparseloco":
        return SparseLoCo(**kwargs)
    if kind == "demo":
        from .demo import DeMoRun

        return DeMoRun(**kwargs)
    raise ValueError(f"unknown baseline kind {kind!r}")
