"""AdamS: Adam with the second moment replaced by the momentum (one state buffer).

Reference: "AdamS: Momentum Itself Can Be A Normalizer for LLM Pretraining and Post-training"
(arXiv 2505.16363; code pku-huzhang/AdamS). Per step t, with c = 1 - beta1^t (or 1 without bias
correction):
  1. ``p *= 1 - lr * wd``                                      (decoupled weight decay)
  2. ``denom = sqrt(beta2 * (m_prev / c)^2 + (1 - beta2) * g^2) + eps``
  3. ``m = beta1 * m_prev + (1 - beta1) * g``
  4. ``p -= lr * (m / c) / denom``
"""
from __future__ import annotations

import torch
from torch.optim import Optimizer

__all__ = ["AdamS", "adams", "check_adams_hyperparameters"]


def check_adams_hyperparameters(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Raise ValueError naming the hyperparameter that is out of range."""
    if not lr >= 0.0:
        raise ValueError(f"AdamS lr must be >= 0, got {lr}")
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ValueError(f"AdamS betas must be two values in [0, 1), got {betas}")
    if not eps >= 0.0:
        raise ValueError(f"AdamS eps must be >= 0, got {eps}")
    if not weight_decay >= 0.0:
        raise ValueError(f"AdamS weight_decay must be >= 0, got {weight_decay}")


def adams(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    momenta: list[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool,
    foreach: bool | None = None,
) -> None:
    """Functional AdamS over lists of tensors (updated in place). See the module docstring.

    ``foreach`` (default: when every tensor is on one device) uses torch's multi-tensor ops.
    """
    if not params:
        return
    c = 1.0 - beta1**step if bias_correction else 1.0
    if foreach is None:
        foreach = len({p.device for p in params}) == 1
    if foreach:
        _adams_foreach(params, grads, momenta, c, lr, beta1, beta2, eps, weight_decay)
    else:
        for p, g, m in zip(params, grads, momenta):
            _adams_foreach([p], [g], [m], c, lr, beta1, beta2, eps, weight_decay)


def _adams_foreach(params, grads, momenta, c, lr, beta1, beta2, eps, weight_decay) -> None:
    grads = [g.to(m.dtype) for g, m in zip(grads, momenta)]
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    # denom = sqrt(beta2 * (m_prev/c)^2 + (1-beta2) * g^2) + eps, from m_prev before it is updated
    second = torch._foreach_div(momenta, c)  # the same rounding as the masked kernels' m / c
    torch._foreach_mul_(second, second)
    torch._foreach_mul_(second, beta2)
    g2 = torch._foreach_mul(grads, grads)
    torch._foreach_add_(second, g2, alpha=1.0 - beta2)
    torch._foreach_sqrt_(second)
    torch._foreach_add_(second, eps)
    torch._foreach_mul_(momenta, beta1)
    torch._foreach_add_(momenta, grads, alpha=1.0 - beta1)
    if params[0].dtype == momenta[0].dtype:
        torch._foreach_addcdiv_(params, momenta, second, value=-lr / c)
    else:  # low-precision params with fp32 state: update in fp32, round once
        upd = torch._foreach_div(momenta, second)
        for p, u in zip(params, upd):
            p.copy_(p.float().add_(u, alpha=-lr / c))


class AdamS(Optimizer):
    """Dense AdamS (the baseline, and the density-1.0 limit of SCAPE).

    Args:
        params: iterable of parameters or param groups.
        lr: learning rate (default 3e-4).
        betas: (beta1, beta2) (default (0.9, 0.95)).
        eps: added to the denominator (default 1e-8).
        weight_decay: decoupled weight decay (default 0.1).
        bias_correction: divide m by 1 - beta1^t (default True, as in the reference code).
        foreach: use multi-tensor ops (default: when all params share a device).

    Raises:
        ValueError: a hyperparameter out of range.
    """

    def __init__(
        self,
        params,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        bias_correction: bool = True,
        foreach: bool | None = None,
    ):
        betas = tuple(betas)
        check_adams_hyperparameters(lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, bias_correction=bias_correction,
                        foreach=foreach)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("bias_correction", True)
            group.setdefault("foreach", None)

    @torch.no_grad()
    def step(self, closure=None):
        """One AdamS step on every parameter that has a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, momenta, steps = [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AdamS does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["momentum"] = torch.zeros_like(p, dtype=torch.promote_types(p.dtype, torch.float32))
                state["step"] += 1
                params.append(p)
                grads.append(p.grad)
                momenta.append(state["momentum"])
                steps.append(state["step"])
            # parameters of a group normally share one step count; split if they do not
            for step in sorted(set(steps)):
                sel = [i for i, s in enumerate(steps) if s == step]
                beta1, beta2 = group["betas"]
                adams(
                    [params[i] for i in sel], [grads[i] for i in sel], [momenta[i] for i in sel],
                    step=step, lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"],
                    weight_decay=group["weight_decay"], bias_correction=group["bias_correction"],
                    foreach=group["foreach"],
                )
        return loss
