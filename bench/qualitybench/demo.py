"""DeMo (Peng, Quesnelle, Kingma, arXiv 2411.19870), written from the paper and its reference code,
independent of scape_ds's optimizers: the baseline the DCT basis is measured against.

Per step, on every data-parallel rank, for each parameter p with local gradient g (the ranks'
gradients are never all-reduced):

1. (the reference training script) clip this rank's gradient to global norm ``clip`` (0: off);
2. decoupled weight decay: ``p *= 1 - lr * wd``;
3. accumulate: ``delta = decay * delta + g`` (``accumulate="lr_grad"``: ``+ lr * g``, as the reference
   code does);
4. transform: the orthonormal DCT-II of each chunk of ``delta``: 2-D tensors in tiles of s1 x s2, 1-D
   tensors in runs of s, where each s is the largest divisor of that dimension that is <= ``chunk``
   (the reference's ``_get_smaller_split``); the top-``topk`` coefficients of each chunk by magnitude
   (at most the chunk's size) are this rank's message;
5. the decoded message leaves the accumulator: ``delta -= idct(message)``;
6. all-gather every rank's indices and values; place them in the chunks: ``average="mean"`` divides
   each coefficient by the number of ranks that sent it (the reference's ``scatter_reduce(...,
   "mean", include_self=False)``), ``"sum"`` divides the sum by the number of ranks;
7. ``p -= lr * sign(idct(average))``.

Bytes one rank sends per step: the all-gather of its message, 4-byte values and 2-byte in-chunk
indices (a chunk holds at most 128 x 128 coefficients; the reference sends int64), metered with the
same formula as the product's (:func:`scape_ds.comm.collective_bytes`).

In the bench :class:`DeMoRun` gives the training loop the optimizer (DeepSpeed wraps it as a client
optimizer over the dense AdamW config, whose ``lr`` and ``weight_decay`` it takes; the engine's own
clipping is off, DeMo clips each rank's gradient itself) and switches the engine's gradient
all-reduce off before step 1.
"""
from __future__ import annotations

import math

import torch

_INDEX_BYTES, _VALUE_BYTES = 2, 4


def largest_divisor_at_most(n: int, limit: int) -> int:
    """The largest divisor of ``n`` that is <= ``limit`` (the reference's chunk of a dimension)."""
    return max(d for d in range(1, min(n, limit) + 1) if n % d == 0)


def dct_matrix(n: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix, (n, n) float64: ``C[k, j] = a_k cos(pi (2j + 1) k / 2n)``."""
    j = torch.arange(n, dtype=torch.float64)
    c = torch.cos(math.pi * (2 * j[None, :] + 1) * j[:, None] / (2 * n)) * math.sqrt(2.0 / n)  # (n, n)
    c[0] /= math.sqrt(2.0)
    return c


class ChunkDCT:
    """Chunk-wise DCT of one tensor shape: ``encode`` (shape) -> (chunks, chunk size), ``decode`` back."""

    def __init__(self, shape: torch.Size, chunk: int):
        if len(shape) not in (1, 2):
            raise ValueError(f"DeMo: tensors of 1 or 2 dimensions, got shape {tuple(shape)}")
        self.shape = shape
        self.sizes = [largest_divisor_at_most(n, chunk) for n in shape]
        self.mats = [dct_matrix(s).float() for s in self.sizes]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.shape) == 1:
            (s,), (c,) = self.sizes, self.mats
            return x.reshape(-1, s) @ c.T  # (n/s, s)
        (s1, s2), (c1, c2) = self.sizes, self.mats
        n1, n2 = self.shape
        tiles = x.reshape(n1 // s1, s1, n2 // s2, s2).permute(0, 2, 1, 3)  # (a, b, s1, s2)
        return (c1 @ tiles @ c2.T).reshape(-1, s1 * s2)  # (a * b, s1 * s2)

    def decode(self, coef: torch.Tensor) -> torch.Tensor:
        if len(self.shape) == 1:
            return (coef @ self.mats[0]).reshape(self.shape)  # (n,)
        (s1, s2), (c1, c2) = self.sizes, self.mats
        n1, n2 = self.shape
        tiles = c1.T @ coef.reshape(n1 // s1, n2 // s2, s1, s2) @ c2  # (a, b, s1, s2)
        return tiles.permute(0, 2, 1, 3).reshape(n1, n2)


class DeMo(torch.optim.Optimizer):
    """DeMo's optimizer over the default process group (see the module docstring for the step)."""

    def __init__(self, params, lr: float, weight_decay: float = 0.0, topk: int = 32, chunk: int = 64,
                 decay: float = 0.999, accumulate: str = "grad", average: str = "sum", clip: float = 1.0):
        if not lr > 0 or weight_decay < 0 or topk < 1 or not 1 <= chunk <= 128 or not 0 <= decay <= 1 or clip < 0:
            raise ValueError(f"DeMo: lr > 0, weight_decay >= 0, topk >= 1, 1 <= chunk <= 128, 0 <= decay <= 1, "
                             f"clip >= 0; got {lr}, {weight_decay}, {topk}, {chunk}, {decay}, {clip}")
        if accumulate not in ("grad", "lr_grad") or average not in ("sum", "mean"):
            raise ValueError(f"DeMo: accumulate 'grad' | 'lr_grad', average 'sum' | 'mean'; got {accumulate!r}, "
                             f"{average!r}")
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay))
        self.topk, self.chunk, self.decay, self.accumulate, self.average, self.clip = (
            topk, chunk, decay, accumulate, average, clip)
        self._transforms: dict[tuple, ChunkDCT] = {}
        self.payload_bytes = 0  # bytes of one rank's message at the last step

    def _transform(self, shape: torch.Size) -> ChunkDCT:
        if tuple(shape) not in self._transforms:
            self._transforms[tuple(shape)] = ChunkDCT(shape, self.chunk)
        return self._transforms[tuple(shape)]

    @torch.no_grad()
    def step(self, closure=None):
        import torch.distributed as dist

        loss = closure() if closure is not None else None
        params = [(p, g) for g in self.param_groups for p in g["params"] if p.grad is not None]
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_([p for p, _ in params], self.clip)  # this rank's gradient
        world = dist.get_world_size() if dist.is_initialized() else 1
        msgs = []  # per parameter: (transform, chunks, k, idx (chunks, k) int64, vals (chunks, k) fp32)
        for p, group in params:
            lr = group["lr"]
            p.mul_(1 - lr * group["weight_decay"])
            state = self.state[p]
            if "delta" not in state:
                state["delta"] = torch.zeros_like(p, dtype=torch.float32)
            delta = state["delta"]
            delta.mul_(self.decay).add_(p.grad.float(), alpha=lr if self.accumulate == "lr_grad" else 1.0)
            t = self._transform(p.shape)
            coef = t.encode(delta)  # (chunks, s)
            k = min(self.topk, coef.shape[1])
            idx = coef.abs().topk(k, dim=1).indices  # (chunks, k) int64
            vals = coef.gather(1, idx)  # (chunks, k)
            delta.sub_(t.decode(torch.zeros_like(coef).scatter_(1, idx, vals)))  # sent leaves the accumulator
            msgs.append((t, coef.shape, k, idx, vals))
        # one all-gather of every parameter's values and one of its indices (the same bytes as one per tensor)
        vals = torch.cat([m[4].reshape(-1) for m in msgs])  # (K,) fp32
        idx = torch.cat([m[3].reshape(-1) for m in msgs]).to(torch.int16)  # (K,) in-chunk offsets (< 128 * 128)
        self.payload_bytes = vals.numel() * (_VALUE_BYTES + _INDEX_BYTES)
        idx_bytes = idx.view(torch.uint8)  # (2K,) gloo has no int16 collectives: the same bytes as uint8
        if world > 1:
            all_vals = [torch.empty_like(vals) for _ in range(world)]
            all_idx = [torch.empty_like(idx_bytes) for _ in range(world)]
            dist.all_gather(all_vals, vals)
            dist.all_gather(all_idx, idx_bytes)
        else:
            all_vals, all_idx = [vals], [idx_bytes]
        gathered_vals = torch.stack(all_vals)  # (D, K)
        gathered_idx = torch.stack(all_idx).view(torch.int16).long()  # (D, K)
        offset = 0
        for (p, group), (t, shape, k, _, _) in zip(params, msgs):
            n = shape[0] * k
            v = gathered_vals[:, offset:offset + n].reshape(world, shape[0], k).permute(1, 0, 2).reshape(shape[0], -1)
            i = gathered_idx[:, offset:offset + n].reshape(world, shape[0], k).permute(1, 0, 2).reshape(shape[0], -1)
            offset += n
            agg = torch.zeros(shape, dtype=torch.float32)  # (chunks, s)
            if self.average == "mean":
                agg.scatter_reduce_(1, i, v, reduce="mean", include_self=False)
            else:
                agg.scatter_add_(1, i, v).div_(world)
            p.add_(t.decode(agg).sign().to(p.dtype), alpha=-group["lr"])
        return loss


class DeMoRun:
    """DeMo in the quality bench: the optimizer for the loop, the engine set up, the bytes counted."""

    def __init__(self, **demo_kwargs):
        self.demo_kwargs = demo_kwargs
        self.optimizer: DeMo | None = None

    def engine_config(self, cfg: dict) -> dict:
        """The run's DeepSpeed config without its optimizer block (DeMo is the client optimizer) and
        without the engine's clipping (DeMo clips each rank's gradient); keeps ``lr`` and ``weight_decay``."""
        params = cfg["optimizer"]["params"]
        self.lr, self.weight_decay = float(params["lr"]), float(params.get("weight_decay", 0.0))
        return {**{k: v for k, v in cfg.items() if k != "optimizer"}, "gradient_clipping": 0.0}

    def make_optimizer(self, model) -> DeMo:
        self.optimizer = DeMo(model.parameters(), lr=self.lr, weight_decay=self.weight_decay, **self.demo_kwargs)
        return self.optimizer

    def start(self, engine) -> None:
        """Before step 1: no gradient all-reduce (DeMo's all-gather is the only exchange)."""
        engine.enable_backward_allreduce = False

    def __call__(self, step: int, engine) -> None:
        """Nothing after a step: DeMo's exchange is inside its optimizer step."""

    def bytes_sent(self, rows: list[dict]) -> int:
        """Bytes one rank sent over the run: the all-gather of its message at every step."""
        import torch.distributed as dist

        from scape_ds.comm import collective_bytes

        return collective_bytes("all_gather", self.optimizer.payload_bytes, dist.get_world_size()) * len(rows)
