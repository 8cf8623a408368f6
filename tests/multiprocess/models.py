"""Small models and data shared by the multi-rank tests (importable by spawned ranks)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def make_mlp(seed: int = 0, width: int = 64, hidden: int = 128, bias: bool = True, norm: bool = True) -> nn.Module:
    """Two linear layers (sparse-exchanged) with optional biases and a LayerNorm (dense-exchanged)."""
    torch.manual_seed(seed)
    layers = [nn.Linear(width, hidden, bias=bias)]
    if norm:
        layers.append(nn.LayerNorm(hidden))
    layers += [nn.GELU(), nn.Linear(hidden, width, bias=bias)]
    return nn.Sequential(*layers)


def make_batch(step: int, rank: int, width: int = 64, batch: int = 8,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic regression batch of one rank at one step."""
    g = torch.Generator().manual_seed(seed * 100_003 + step * 101 + rank)
    x = torch.randn(batch, width, generator=g)
    y = torch.sin(x) + 0.1 * torch.randn(batch, width, generator=g)
    return x, y


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def flat_params(model: nn.Module) -> torch.Tensor:
    """Every parameter of ``model``, flattened into one tensor (a copy)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def dense_adams_reference_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
                               world_size: int) -> None:
    """One step of dense data-parallel training: the mean gradient by all-reduce, then ``opt``."""
    opt.zero_grad()
    loss_fn(model, x, y).backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(world_size)
    opt.step()


class SentLedger:
    """One rank's error-feedback account: every local gradient it produced and everything it sent,
    (N_pad,) float64. Nothing is lost when sent + the error buffer equals what was produced."""

    def __init__(self):
        self.produced: torch.Tensor | None = None
        self.sent: torch.Tensor | None = None

    def add(self, opt, packet: torch.Tensor, grad: torch.Tensor, index: torch.Tensor | None) -> float:
        """Book one step: ``grad`` (this rank's local gradient), ``packet`` (what it sent: everything, or
        the values at ``index``). Returns max |sent + residual - produced|."""
        error = opt.error_feedback().double()
        if self.produced is None:
            self.produced = torch.zeros_like(error)
            self.sent = torch.zeros_like(error)
        self.produced[: grad.numel()] += grad.double()
        if index is None:
            self.sent += packet.double()
        else:
            self.sent.index_add_(0, index, packet.double())
        return float((self.sent + error - self.produced).abs().max())
