"""The update rules' per-shard functions (scape_ds/optim/update_rules.py) on hand-made tensors."""
from __future__ import annotations

import math

import pytest
import torch

from scape_ds.optim.adams import adams
from scape_ds.optim.update_rules import catchup_step, drift_coefficient, pack_signs, unpack_signs, window_mean


def test_signs_round_trip_through_one_bit_each():
    m = torch.randn(1024, generator=torch.Generator().manual_seed(0))
    m[::7] = 0.0  # zero counts as negative: a drift needs a direction, and padding is zeroed by the caller
    packed = pack_signs(m)
    assert packed.dtype == torch.uint8 and packed.numel() == 1024 // 8
    out = torch.empty(1024, dtype=torch.int8)
    unpack_signs(packed, out)
    assert torch.equal(out, torch.where(m > 0, 1, -1).to(torch.int8))


def test_catchup_with_beta_zero_is_a_signed_window_step_outside_the_mask():
    a = torch.tensor([2.0, -3.0, 0.5, -0.25, 4.0, -1.0, 1e-3, 7.0])
    master = torch.zeros(8)
    second = torch.zeros(8)
    kept = torch.tensor([4, 7])
    catchup_step(master, second, a * 2, kept, grad_scale=0.5, window=10, refreshes=3, lr=0.01, gain=0.5, beta=0.0,
                 eps=0.0)
    want = -0.5 * 0.01 * 10 * torch.sign(a)  # gain * lr * w * sign(a)
    want[kept] = 0.0
    assert torch.allclose(master, want, rtol=1e-6, atol=0), master
    # v holds a^2 / w outside the mask and a^2 at it
    assert torch.allclose(second, torch.where(torch.isin(torch.arange(8), kept), a * a, a * a / 10))


def test_catchup_is_bounded_by_gain_lr_w_over_sqrt_one_minus_beta():
    g = torch.Generator().manual_seed(1)
    master, second = torch.zeros(4096), torch.full((4096,), 1e-12)  # a quiet history, then a large window
    a = torch.randn(4096, generator=g) * 100
    catchup_step(master, second, a, None, grad_scale=1.0, window=50, refreshes=50, lr=1e-3, gain=0.3, beta=0.5,
                 eps=1e-8)
    assert float(master.abs().max()) <= 0.3 * 1e-3 * 50 / math.sqrt(0.5) * (1 + 1e-5)


def test_first_refresh_has_no_window_to_catch_up():
    master, second = torch.ones(8), torch.zeros(8)
    catchup_step(master, second, torch.arange(8.0), None, grad_scale=1.0, window=1, refreshes=1, lr=0.1, gain=1.0,
                 beta=0.5, eps=1e-8)
    assert torch.equal(master, torch.ones(8))
    assert torch.equal(second, 0.5 * torch.arange(8.0) ** 2)


def test_window_mean_divides_outside_the_mask_only():
    r = torch.arange(1.0, 9.0)
    window_mean(r, torch.tensor([0, 3]), 4)
    assert torch.equal(r, torch.tensor([1.0, 0.5, 0.75, 4.0, 1.25, 1.5, 1.75, 2.0]))


@pytest.mark.parametrize("lr,beta1,beta2", [(0.01, 0.9, 0.95), (3e-4, 0.8, 0.999)])
def test_drift_coefficient_is_adams_step_for_a_zero_gradient(lr, beta1, beta2):
    """The oracle is one real AdamS step (scape_ds.optim.adams) with a zero gradient on a momentum
    state of either sign and any size: every coordinate moves by the same amount against its sign."""
    momentum = torch.tensor([1.0, -1.0, 3e-3, -250.0, 0.5], dtype=torch.float64)
    param = torch.zeros(5, dtype=torch.float64)
    adams([param], [torch.zeros(5, dtype=torch.float64)], [momentum.clone()], step=7, lr=lr, beta1=beta1,
          beta2=beta2, eps=0.0, weight_decay=0.0, bias_correction=False)
    step = -param * torch.sign(momentum)  # the distance moved, each against its momentum's sign
    assert torch.allclose(step, torch.full((5,), drift_coefficient(lr, beta1, beta2), dtype=torch.float64),
                          rtol=1e-12, atol=0), (step, drift_coefficient(lr, beta1, beta2))
