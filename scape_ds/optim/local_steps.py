"""``scape.local_steps`` = H > 1 (basis "dct", stage 0/1): H local steps, then the pseudo-gradient's exchange.

DiLoCo (arXiv 2311.08105) and SparseLoCo (arXiv 2508.15706) let each data-parallel rank take H steps of
a local optimizer on its own data with no exchange, then exchange the pseudo-gradient, the change of
the parameters over those steps, and move one synchronized copy by an outer optimizer. Here the
pseudo-gradient of the weight matrices travels through SCAPE's DCT exchange
(:func:`~scape_ds.exchange.coefficients.exchange_dct`: error feedback in coefficients, ``mask``,
``value_bits``, ``index_code``), that of the dense tensors (norms, biases, small tensors) by a dense
all-reduce (bf16 with its rounding kept under ``dense_wire "bf16"``).

On every rank, step t (theta_s: the synchronized parameters, the same bits on every rank; theta: the
rank's local ones, which the model holds):

  1. inner: clip this rank's own gradient (``clip_local``, then ``gradient_clipping``, each on the
     local norm), then one step of ``inner_optimizer`` (torch.optim.AdamW or AdamS, its own state,
     the param group's lr, betas, eps and weight decay) moves theta;
  2. every H-th step (t % H == 0), outer:
     - Delta = theta_s - theta, (N_pad,) for the flat weight buffer and (M,) for the dense tensors;
     - the weights' Delta through ``exchange_dct`` (``e = ef_decay e + Q Delta``, each rank's top-k of
       every tile, ...), its decoded mean u, the same on every rank; the dense tensors' Delta
       all-reduced and divided by D;
     - ``outer_update`` "nesterov": ``b = mu b + u``, ``theta_s -= outer_lr (u + mu b)``; "sign":
       ``theta_s -= outer_lr sign(u)``; "sign_lr": ``theta_s -= outer_lr lr sign(u)`` (lr: the param
       group's at this step);
     - theta = theta_s on every rank.

Nothing is sent on inner steps; the byte meter records the dense exchange's bytes every step, so
the run's bytes / dense are the outer exchange's / H. Memory beyond the every-step dct path: theta_s
and b (4 N each), the inner optimizer's state (AdamW: 8 N).
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from ..exchange.coefficients import decode_dct, exchange_dct, square_norm_fp64
from ..exchange.core import step_comm_stats
from .adams import AdamS

__all__ = ["LocalSteps", "check_local_settings"]


def check_local_settings(saved: dict, cfg, resharded: bool) -> None:
    """Refuse, before anything loads, a checkpoint (its ``"scape"`` config ``saved``) whose local-steps
    state this run (``cfg``) cannot take: local steps on one side only, another inner optimizer or
    outer update, or an elastic resume (``resharded``)."""
    saved_h = saved.get("local_steps", 1)
    if (saved_h > 1) != (cfg.local_steps > 1):
        raise ValueError(f"checkpoint was saved with scape.local_steps {saved_h}, this run has {cfg.local_steps}: "
                         f"resume with local_steps both 1 or both > 1 (the synchronized parameters and the inner "
                         f"optimizer's state are kept only with local steps)")
    if cfg.local_steps == 1:
        return
    for name in ("inner_optimizer", "outer_update"):
        if saved.get(name) != getattr(cfg, name):
            raise ValueError(f"checkpoint was saved with scape.{name} {saved.get(name)!r}, this run has "
                             f"{getattr(cfg, name)!r}: their states differ; resume with the saved one")
    if resharded:
        raise ValueError("elastic resume with scape.local_steps > 1 is not built: resume on the saved number of "
                         "data-parallel ranks")


@dataclass
class _Synced:
    """One param group's synchronized parameters and outer momentum."""

    flat: torch.Tensor | None  # (N_pad,) fp32 theta_s of the flat weight buffer
    flat_momentum: torch.Tensor | None  # (N_pad,) fp32 b (outer_update "nesterov")
    dense: list[torch.Tensor] = field(default_factory=list)  # theta_s of each dense tensor
    dense_momentum: list[torch.Tensor] = field(default_factory=list)


def _state_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in the optimizer state's dtype: fp32, or fp64 for fp64 parameters."""
    return t.detach().to(torch.float64 if t.dtype == torch.float64 else torch.float32, copy=True)


class LocalSteps:
    """The step of a :class:`~scape_ds.optim.ScapeAdamS` with ``scape.local_steps`` > 1 (see the module
    docstring). Built by the optimizer after its flat buffers exist; reads its groups, communicators
    and kernels."""

    def __init__(self, opt):
        self.opt, cfg = opt, opt.cfg
        self.H = cfg.local_steps
        kind = torch.optim.AdamW if cfg.inner_optimizer == "adamw" else AdamS
        self._keys = ("lr", "betas", "eps", "weight_decay") + (("bias_correction",) if kind is AdamS else ())
        groups = [dict({k: v for k, v in g.items() if k in self._keys}, params=list(g["params"]))
                  for g in opt.param_groups]
        self.inner = kind(groups)  # the local parameters (the sparse ones are views into flat_param)
        nesterov = cfg.outer_update == "nesterov"
        self.synced = []
        for gs in opt._groups:
            flat = None if gs.flat_param is None else _state_copy(gs.flat_param)
            dense = [_state_copy(p) for p in gs.dense_params]
            self.synced.append(_Synced(
                flat, None if flat is None or not nesterov else torch.zeros_like(flat), dense,
                [torch.zeros_like(d) for d in dense] if nesterov else []))

    # ------------------------------------------------------------------ step
    def step(self, t: int) -> None:
        opt = self.opt
        for group, inner in zip(opt.param_groups, self.inner.param_groups):  # a scheduler moves the outer group
            inner.update({k: group[k] for k in self._keys})
        for gs in opt._groups:
            if gs.flat_param is not None:
                opt._attach_grads(gs)
        if opt.cfg.clip_local > 0:
            opt._clip_local()
        self._clip_to(opt.max_grad_norm)
        self.inner.step()
        if t % self.H == 0:
            self._outer()
        meter = opt.comm.meter
        for gs in opt._groups:
            inter, intra = opt._dense_bytes(gs)  # what a dense exchange would have sent this step
            meter.record_dense(inter)
            if opt._node.meter is not None:
                opt._node.meter.record_dense(intra)
        stats = step_comm_stats(meter, t, False, opt._node.meter)
        if opt.cfg.log_comm:
            opt.comm_stats = stats

    def _clip_to(self, max_norm: float) -> None:
        """``gradient_clipping`` on this rank's own gradient (no data-parallel exchange on inner steps)."""
        opt = self.opt
        if max_norm <= 0:
            opt.last_grad_norm = None
            return
        grads = [p.grad for g in opt.param_groups for p in g["params"] if p.grad is not None]
        counted = [p.grad for g in opt.param_groups for p in g["params"]
                   if p.grad is not None and not getattr(p, "scape_norm_skip", False)]
        total = float(torch.stack([square_norm_fp64(g) for g in counted]).sum()) if counted else 0.0
        norm = math.sqrt(opt._sum_over_norm_group(total))
        opt.last_grad_norm = norm
        if norm > max_norm:
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))

    def _outer(self) -> None:
        opt, cfg = self.opt, self.opt.cfg
        for gs, sy, group in zip(opt._groups, self.synced, opt.param_groups):
            if gs.flat_param is not None:
                delta = torch.sub(sy.flat, gs.flat_param, out=gs.flat_grad)  # (N_pad,) theta_s - theta
                mean, _ = exchange_dct(opt.comm, opt._kernels, gs.tiles, gs.error, delta, gs.dct_q, mask=cfg.mask,
                                       k_per_chunk=cfg.k_per_chunk, ef_decay=cfg.ef_decay, node=opt._node,
                                       value_bits=cfg.value_bits, decode=cfg.decode,
                                       index_code=cfg.index_code)  # (numel,) the same on every rank
                u = decode_dct(gs.tiles, mean, gs.flat_grad, gs.dct_q, opt._kernels)  # (N_pad,)
                self._move(sy.flat, sy.flat_momentum, u, group["lr"])
                gs.flat_param.copy_(sy.flat)
            if gs.dense_params:
                delta = torch.cat([(s - p.detach()).reshape(-1) for s, p in zip(sy.dense, gs.dense_params)])
                delta = opt._dense_mean(gs, delta)  # (M,) fp32 mean over every rank (bf16 on the wire, its
                # rounding kept, under dense_wire "bf16")
                for i, (p, u) in enumerate(zip(gs.dense_params, delta.split([s.numel() for s in sy.dense]))):
                    self._move(sy.dense[i], sy.dense_momentum[i] if sy.dense_momentum else None, u.view_as(p),
                               group["lr"])
                    p.data.copy_(sy.dense[i])

    def _move(self, synced: torch.Tensor, momentum: torch.Tensor | None, u: torch.Tensor, lr: float) -> None:
        """The outer step on one synchronized tensor, from the mean pseudo-gradient ``u`` (consumed);
        ``lr``: its param group's learning rate now (``sign_lr``)."""
        cfg = self.opt.cfg
        if cfg.outer_update in ("sign", "sign_lr"):
            step = cfg.outer_lr * (lr if cfg.outer_update == "sign_lr" else 1.0)
            synced.add_(torch.sign(u), alpha=-step)
            return
        momentum.mul_(cfg.outer_momentum).add_(u)
        synced.add_(u.add_(momentum, alpha=cfg.outer_momentum), alpha=-cfg.outer_lr)

    def memory_bytes(self) -> int:
        """Bytes of the synchronized parameters, the outer momentum and the inner optimizer's state."""
        tensors = [t for s in self.synced for t in (s.flat, s.flat_momentum, *s.dense, *s.dense_momentum)]
        tensors += [v for st in self.inner.state.values() for v in st.values() if torch.is_tensor(v) and v.dim()]
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The inner optimizer's state, theta_s and b, and this rank's own local parameters: between
        outer steps they differ by rank, and DeepSpeed saves the module's parameters once (data-parallel
        rank 0's), so each rank keeps its own here. Copies (a state dict loaded in memory shares nothing)."""
        opt = self.opt
        return dict(inner=copy.deepcopy(self.inner.state_dict()), H=self.H,
                    local=[dict(flat=None if gs.flat_param is None else gs.flat_param.detach().clone(),
                                dense=[p.detach().clone() for p in gs.dense_params]) for gs in opt._groups],
                    synced=[dict(flat=None if s.flat is None else s.flat.clone(),
                                 flat_momentum=None if s.flat_momentum is None else s.flat_momentum.clone(),
                                 dense=[d.clone() for d in s.dense],
                                 dense_momentum=[m.clone() for m in s.dense_momentum]) for s in self.synced])

    def load_state_dict(self, saved: dict) -> None:
        """Restore :meth:`state_dict`'s: this rank's local parameters too (see there)."""
        for gs, mine in zip(self.opt._groups, saved["local"]):
            if gs.flat_param is not None:
                gs.flat_param.copy_(mine["flat"])
            for p, d in zip(gs.dense_params, mine["dense"]):
                p.data.copy_(d)
        self.inner.load_state_dict(copy.deepcopy(saved["inner"]))
        for lg in self.inner.param_groups:  # the outer optimizer's group settings are the truth
            lg.pop("initial_lr", None)
        for s, d in zip(self.synced, saved["synced"]):
            for dst, src in ((s.flat, d["flat"]), (s.flat_momentum, d["flat_momentum"])):
                if dst is not None:
                    dst.copy_(src)
            for dst, src in zip(s.dense + s.dense_momentum, d["dense"] + d["dense_momentum"]):
                dst.copy_(src)
