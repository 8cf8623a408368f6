"""AdamS against a float64 reference written from the paper's update (no process group)."""
from __future__ import annotations

import copy
import importlib

import pytest
import torch

from scape_ds.optim import AdamS

adams_module = importlib.import_module("scape_ds.optim.adams")  # the module (scape_ds.optim.adams is the function)


def _reference_adams(p, grads, lr, beta1, beta2, eps, wd, bias_correction):
    """The AdamS update of docs/design.md (The step) in float64, one scalar formula per line."""
    p = p.double().clone()
    m = torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        c = 1 - beta1**t if bias_correction else 1.0
        p = p * (1 - lr * wd)
        denom = torch.sqrt(beta2 * (m / c) ** 2 + (1 - beta2) * g**2) + eps
        m = beta1 * m + (1 - beta1) * g
        p = p - lr * (m / c) / denom
    return p


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize("bias_correction", [True, False])
@pytest.mark.parametrize("foreach", [True, False])
def test_adams_matches_float64_reference(weight_decay, bias_correction, foreach, monkeypatch):
    gen = torch.Generator().manual_seed(7)
    shapes = [(33, 17), (64,), (5, 3, 2)]
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]
    start = [p.detach().clone() for p in params]
    grads = [[torch.randn(s, generator=gen) for _ in range(25)] for s in shapes]
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    opt = AdamS(params, bias_correction=bias_correction, foreach=foreach, **hp)
    # which path ran: foreach=True updates the three tensors in one multi-tensor call a step,
    # foreach=False one tensor at a time (three calls of one tensor each)
    calls = []
    multi_tensor = adams_module._adams_foreach
    monkeypatch.setattr(adams_module, "_adams_foreach",
                        lambda params, *a: calls.append(len(params)) or multi_tensor(params, *a))
    for t in range(25):
        for p, g in zip(params, grads):
            p.grad = g[t].clone()
        opt.step()
    assert calls == ([3] if foreach else [1, 1, 1]) * 25, calls[:6]
    for p, p0, g in zip(params, start, grads):
        ref = _reference_adams(p0, g, 1e-2, 0.9, 0.95, 1e-8, weight_decay, bias_correction)
        rel = float((p.detach().double() - ref).abs().max() / ref.abs().max())
        assert rel < 1e-6, rel


def test_adams_skips_params_without_grad_and_keeps_one_buffer():
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = AdamS([a, b], lr=0.1)
    a.grad = torch.ones(4)
    opt.step()
    assert torch.equal(b.detach(), torch.ones(4))
    assert set(opt.state[a]) == {"step", "momentum"}  # one state buffer, not Adam's two
    assert b not in opt.state


def test_adams_state_dict_round_trip():
    p = torch.nn.Parameter(torch.randn(10))
    opt = AdamS([p], lr=0.1)
    p.grad = torch.randn(10)
    opt.step()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = AdamS([q], lr=0.1)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))  # as after torch.save/torch.load
    g = torch.randn(10)
    p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    opt2.step()
    assert torch.equal(p, q)


@pytest.mark.parametrize("kwargs,field", [(dict(lr=-1.0), "lr"), (dict(betas=(1.0, 0.9)), "betas"),
                                          (dict(eps=-1.0), "eps"), (dict(weight_decay=-0.1), "weight_decay")])
def test_adams_rejects_bad_hyperparameters(kwargs, field):
    with pytest.raises(ValueError, match=field):
        AdamS([torch.nn.Parameter(torch.ones(1))], **kwargs)
