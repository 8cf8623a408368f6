"""Update rules of ScapeAdamS (``scape.update_rule``): how the coordinates outside the mask learn.

Notation, per data-parallel rank r at step t: D ranks, T = ``mask_refresh_interval``, M the mask
(k = (1 - sparsity) of the coordinates, chosen at each refresh from |m| by each shard's owner),
lr_t the scheduled lr, c_t = 1 - beta1^t (1 without bias correction), e the error feedback.

``"lazy"`` (the first rule; ``scape.py``): on a sparse step only the coordinates at M are updated,
by AdamS on the mean of ``e + g`` at M; every other coordinate keeps its value and its momentum and
accumulates its gradient in e. The dense refresh step (every T steps) sends all of ``e + g``, and
the owner applies one AdamS step to the mean ``a``. For a coordinate outside M, ``a`` holds the
gradients of the whole window of w = T steps; AdamS's denominator grows with ``|a|``, so that step
moves it by about ``lr * (1 - beta1) / sqrt(1 - beta2)`` (0.45 lr at betas (0.9, 0.95)) however much
the window accumulated, where dense AdamS would have moved it by up to ``w * lr``. At sparsity 0.99
the 99% of coordinates outside M train at a few percent of the lr (bench/RESULTS.md, "Update rules").

``"catchup"`` (a window-sized step at the refresh): everything of "lazy", and on the dense refresh
step the owner also moves every coordinate of its shard that was outside the last window's mask:

  1. ``a`` = the reduced mean of ``e + g`` (the window's accumulated gradient; clipping applied);
     ``w_i`` = the steps since the last dense step for a coordinate outside the old mask, 1 at it
  2. ``v = catchup_beta * v + (1 - catchup_beta) * a^2 / w_i``; ``v_hat = v / (1 - catchup_beta^n)``
     (n: refreshes so far; every coordinate, so v is current when a coordinate leaves the mask)
  3. outside the old mask (w_i > 1): ``p -= catchup_gain * lr_t * sqrt(w_i) * a / (sqrt(v_hat) + eps)``

``v`` estimates ``w * mu^2 + sigma^2`` per step (mu the mean, sigma the noise of a coordinate's
gradient), so step 3 is a signSGD-like step of ``catchup_gain * w * lr`` on the window ("Adam at
the scale of windows": with ``catchup_beta = 0`` exactly ``catchup_gain * lr * w * sign(a)``), and
with ``catchup_beta > 0`` at most ``catchup_gain * lr * w / sqrt(1 - catchup_beta)``. The new
values travel in the refresh step's dense all-gather, so the bytes are those of "lazy"; error
feedback is the same (it carries raw gradients, and the refresh flushes it). Extra memory: ``v``,
4 bytes per owned coordinate (4N/D per rank), and four (S,) fp32 temporaries at a refresh step.
At sparsity 0 (compressor "dense") there is no window and no catch-up: "lazy" exactly.

``"sign_drift"`` (AdamS's own step between refreshes, from one bit per coordinate): on the refresh
step each owner packs ``sign(m)`` of its shard (after the step's AdamS update) into bits and one
all-gather gives every rank the signs of all N coordinates; the signs at the next mask are set to
0 on every rank when the mask arrives. For the K = ``drift_steps`` steps after the refresh, every
rank moves every coordinate outside the mask by

  ``p -= lr_t * beta1 / sqrt(beta2) * sign(m)``

which is AdamS's step for a zero gradient (``m = beta1 * m``, ``denom = sqrt(beta2) * |m| / c_t``;
eps neglected) from the refresh's momentum. Every replica applies the same op to the same values,
so the replicas stay bitwise equal; with fp32 parameters the owner's master shard is a view of its
replica and drifts with it, otherwise the owner applies the same drift to the master. The momentum
is not decayed (as in "lazy", it is frozen outside the mask) and error feedback is unchanged: the
gradients the replicas see at the drifted values reach the owner at the next refresh, which can
undo a drift that went too far. Extra bytes: N/8 per refresh (+1/64 of a dense step every T
steps; +0.016% of dense at T=100). Extra memory: the signs, 1 byte per coordinate on every rank
(N bytes), and one (N,) temporary per drifting step.

``"window_mean"`` (AdamS sees a mean gradient per step): on the dense refresh step the owner divides
the reduced ``a`` of every coordinate outside the old mask by its window, ``a_i / w_i``, before
the AdamS update; nothing else changes. The momentum then holds the window's mean gradient instead
of its sum (lazy's ``m = beta1 * m + (1 - beta1) * a`` makes |m| about ``(1 - beta1) * w`` times a
step's gradient for those coordinates), so the next mask, the top |m| of each chunk, compares
coordinates inside and outside the old mask on one scale, and the new mask's first AdamS steps are
not dominated by that momentum. No extra bytes, no extra memory (one (S,) temporary at a refresh).

Measured (docs/results_history.md, "Update rules at 99% sparsity"): at lazy's best lr none of the three
beats "lazy" at 0.45M parameters; the default stays "lazy".
"""
from __future__ import annotations

import math

import torch

__all__ = ["UPDATE_RULES", "catchup_step", "pack_signs", "unpack_signs", "drift_coefficient", "window_mean"]

UPDATE_RULES: tuple[str, ...] = ("lazy", "catchup", "sign_drift", "window_mean")


def window_mean(reduced: torch.Tensor, kept: torch.Tensor | None, window: int) -> None:
    """"window_mean" at a dense refresh: divide the reduced ``e + g`` of every coordinate outside the
    last window's mask (``kept``, shard-local) by the window's steps, in place."""
    if window <= 1:
        return
    scale = torch.full((reduced.numel(),), 1.0 / window, dtype=reduced.dtype, device=reduced.device)  # (S,)
    if kept is not None:
        scale.index_fill_(0, kept, 1.0)
    reduced.mul_(scale)


def catchup_step(
    master: torch.Tensor,
    second: torch.Tensor,
    reduced: torch.Tensor,
    kept: torch.Tensor | None,
    *,
    grad_scale: float,
    window: int,
    refreshes: int,
    lr: float,
    gain: float,
    beta: float,
    eps: float,
) -> None:
    """"catchup" steps 1-3 on the owner's shard at a dense refresh step (in place).

    Args:
        master: (S,) fp32 master shard, after the step's AdamS update.
        second: (S,) fp32 ``v``, the EMA of ``a^2 / w``, updated in place.
        reduced: (S,) the reduced ``e + g`` of the shard (a sum or mean; times ``grad_scale`` is ``a``).
        kept: (k,) int64 shard-local indices of the last window's mask (updated every step), or None.
        window: steps since the last dense step (the w of every coordinate outside ``kept``).
        refreshes: n, the number of dense steps including this one (bias correction of ``v``).
    """
    a = reduced.to(master.dtype) * grad_scale  # (S,) fp32
    w = torch.full_like(a, float(window))  # (S,) per-coordinate window
    if kept is not None:
        w.index_fill_(0, kept, 1.0)
    second.mul_(beta).add_(a * a / w, alpha=1.0 - beta)
    if window <= 1:
        return  # no coordinate waited: the AdamS step was the whole update
    v_hat = second / (1.0 - beta**refreshes)  # (S,)
    step = a.mul_(w.sqrt_()).div_(v_hat.sqrt_().add_(eps))  # (S,) sqrt(w) * a / (sqrt(v_hat) + eps)
    if kept is not None:
        step.index_fill_(0, kept, 0.0)  # the mask's coordinates had their AdamS steps
    master.sub_(step, alpha=gain * lr)


def drift_coefficient(lr: float, beta1: float, beta2: float) -> float:
    """The size of one "sign_drift" step: AdamS's step for a zero gradient, ``lr * beta1 / sqrt(beta2)``."""
    return lr * beta1 / math.sqrt(beta2)


_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def pack_signs(momentum: torch.Tensor) -> torch.Tensor:
    """(S,) momentum -> (S/8,) uint8, bit j of byte i set where ``momentum[8i + j] > 0``; S % 8 == 0."""
    assert momentum.numel() % 8 == 0, momentum.numel()
    bits = (momentum > 0).view(-1, 8).to(torch.uint8)  # (S/8, 8)
    return (bits * _BITS.to(bits.device)).sum(dim=1, dtype=torch.uint8)  # (S/8,)


def unpack_signs(packed: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """(N/8,) uint8 from :func:`pack_signs` -> ``out`` (N,) int8 of +1 / -1 (in place)."""
    bits = packed.view(-1, 1).bitwise_and(_BITS.to(packed.device)).ne_(0)  # (N/8, 8) bool
    out.view(-1, 8).copy_(bits).mul_(2).sub_(1)
    return out
