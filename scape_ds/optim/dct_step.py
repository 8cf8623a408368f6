"""The stage 0/1 update of ``scape.basis = "dct"``: the parameters move by the decoded mean.

The exchange (error feedback in coefficients, the masks, the sum of what every rank sent, the decode)
is :mod:`scape_ds.exchange.coefficients`; every rank then holds the same mean and moves its
replica of the parameters by it, alike (``dct_update``), so replicas stay bitwise equal with no
parameter all-gather. ``apply_update`` is the stateless and momentum rules on one range of the flat
buffer, shared with the overlapped exchange (:mod:`scape_ds.optim.dct_overlap`).
"""
from __future__ import annotations

import math

import torch

from ..exchange.coefficients import decode_dct, square_norm_fp64

__all__ = ["apply_update", "dct_update", "dense_square_norm", "replicated_clip_coefficient"]


def apply_update(rule: str, param: torch.Tensor, signal: torch.Tensor, momentum: torch.Tensor | None,
                 parts: list[tuple[int, int]], lr: float, weight_decay: float, beta1: float) -> None:
    """Move ``param`` by the decoded mean ``signal`` (the same range of the flat buffer; consumed) with
    the stateless or momentum rules of ``dct_update``, alike on every rank: ``sign``: ``p = (1 - lr wd)
    p - lr sign(u)`` (DeMo); ``rms``: ``p = (1 - lr wd) p - lr u / rms(u)``, the RMS over each tensor's
    part of u (``parts``: (offset, numel) of each tensor inside the range); ``signum``: ``m = beta1 m +
    (1 - beta1) u``, ``p = (1 - lr wd) p - lr sign(m)`` (``momentum``: the range of m)."""
    decay = 1.0 - lr * weight_decay
    if rule == "sign":
        param.mul_(decay).add_(torch.sign(signal, out=signal), alpha=-lr)
    elif rule == "rms":
        views = [signal[off : off + n] for off, n in parts]
        squares = torch.stack([square_norm_fp64(v) for v in views]).tolist()  # one host sync
        for view, square in zip(views, squares):
            rms = square**0.5 / view.numel() ** 0.5
            view.mul_(1.0 / rms if rms > 0 else 0.0)
        param.mul_(decay).add_(signal, alpha=-lr)
    elif rule == "signum":
        momentum.lerp_(signal, 1.0 - beta1)
        param.mul_(decay).add_(torch.sign(momentum, out=signal), alpha=-lr)
    else:
        raise ValueError(f"apply_update takes 'sign', 'rms' or 'signum', got {rule!r}")


def dct_update(rule: str, kernels, group: dict, gs, signal: torch.Tensor, scale: float, t: int) -> None:
    """``rule`` = ``scape.dct_update``, ``gs``: the param group's state (its flat parameters, layout,
    momentum, tiles). Move the flat parameters by ``signal``, alike on every rank: "sign" (DeMo; scale-free, so no
    clipping) and "adams" take the decoded mean u (N_pad,); "adams_coef" takes the mean coefficients
    (numel,), runs AdamS there (its momentum in coefficients) and decodes the step."""
    lr, wd = group["lr"], group["weight_decay"]
    beta1, beta2 = group["betas"]
    if rule in ("sign", "rms", "signum"):
        parts = list(zip(gs.layout.offsets, gs.layout.numels))
        apply_update(rule, gs.flat_param, signal, gs.momentum, parts, lr, wd, beta1)
        return
    hyper = dict(grad_scale=scale, lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                 bias_correction=1.0 - beta1**t if group["bias_correction"] else 1.0)
    if rule == "adams":
        kernels.dense_adams_update(gs.flat_param, gs.momentum, signal, None, weight_decay=wd, **hyper)
        return
    # "adams_coef": AdamS on the rotated parameters; its step is delta = -lr m_hat / denom, formed on
    # zeros (numel,) and decoded into the gradient buffer; the decoupled decay stays in real space
    delta = torch.zeros_like(signal)  # (numel,) fp32
    kernels.dense_adams_update(delta, gs.momentum, signal, None, weight_decay=0.0, **hyper)
    step = decode_dct(gs.tiles, delta, gs.flat_grad, gs.dct_q, kernels)  # (N_pad,)
    gs.flat_param.mul_(1.0 - lr * wd).add_(step)


def dense_square_norm(params: list[torch.Tensor], dense_g: torch.Tensor | None) -> float:
    """The squared norm of the dense tensors' reduced gradients ((M,), ``params`` in order), tensors
    marked ``scape_norm_skip`` (counted on another model-parallel rank) left out."""
    if dense_g is None:
        return 0.0
    grads = torch.split(dense_g, [p.numel() for p in params])
    return sum(float(g.double().square().sum()) for p, g in zip(params, grads)
               if not getattr(p, "scape_norm_skip", False))


def replicated_clip_coefficient(groups, signals, max_grad_norm: float,
                                sum_over_norm_group) -> tuple[float, float | None]:
    """basis "dct": the ``gradient_clipping`` factor, and the norm (None when off), from what each
    group's update consumes (``signals``: per group the decoded mean, or the mean coefficients: the same
    norm, Q being orthonormal, up to the tiles' padding; and the dense tensors' mean gradients), which
    every data-parallel rank holds alike (no data-parallel collective; ``sum_over_norm_group`` adds the
    other model-parallel ranks')."""
    if max_grad_norm <= 0:
        return 1.0, None
    total = 0.0
    for gs, (signal, dense_g) in zip(groups, signals):
        if signal is not None and not gs.norm_skip:
            total += float(square_norm_fp64(signal))
        total += dense_square_norm(gs.dense_params, dense_g)
    norm = math.sqrt(sum_over_norm_group(total))
    return min(1.0, max_grad_norm / (norm + 1e-6)), norm
