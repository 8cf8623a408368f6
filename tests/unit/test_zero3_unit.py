"""Single-process parts of the ZeRO-3 path: Stage3AdamS's masked and lazy-decay steps, the config refusals."""
from __future__ import annotations

import pytest
import torch

from scape_ds.optim.adams import adams
from scape_ds.zero3 import Stage3AdamS, check_deepspeed_internals, check_stage3_config, replica_zero_config

HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def test_masked_steps_touch_only_the_mask_and_decay_is_settled_at_the_dense_step():
    torch.manual_seed(0)
    flat = torch.randn(64, requires_grad=True)
    opt = Stage3AdamS([flat], **HP)
    ref_p, ref_m = flat.detach().clone(), torch.zeros(64)
    index = torch.tensor([3, 10, 40])
    grads = [torch.randn(64) for _ in range(4)]
    for t, g in enumerate(grads, start=1):
        sparse = t in (2, 3)
        opt.active = {id(flat): index} if sparse else {}
        flat.grad = g.clone()
        before = flat.detach().clone()
        opt.step()
        if sparse:
            outside = torch.ones(64, dtype=torch.bool)
            outside[index] = False
            assert torch.equal(flat.detach()[outside], before[outside])  # untouched until the dense step
            sub_p, sub_m = ref_p[index].clone(), ref_m[index].clone()
            adams([sub_p], [g[index]], [sub_m], step=t, bias_correction=True, lr=HP["lr"], beta1=0.9, beta2=0.95,
                  eps=HP["eps"], weight_decay=HP["weight_decay"])
            ref_p[index], ref_m[index] = sub_p, sub_m
        else:
            if t == 4:  # two sparse steps of weight decay owed outside the mask
                keep = ref_p[index].clone()
                ref_p.mul_((1 - HP["lr"] * HP["weight_decay"]) ** 2)
                ref_p[index] = keep
            adams([ref_p], [g], [ref_m], step=t, bias_correction=True, lr=HP["lr"], beta1=0.9, beta2=0.95,
                  eps=HP["eps"], weight_decay=HP["weight_decay"])
        torch.testing.assert_close(flat.detach(), ref_p, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("edit,message", [
    (dict(zero_optimization={"stage": 3, "reduce_scatter": False}), "reduce_scatter false"),
    (dict(zero_optimization={"stage": 3, "offload_optimizer": {"device": "cpu"}}), "offload_optimizer"),
    (dict(zero_optimization={"stage": 3}, gradient_predivide_factor=2.0), "gradient_predivide_factor"),
])
def test_stage3_refusals(edit, message):
    with pytest.raises(ValueError, match=message):
        check_stage3_config(edit)


def test_installed_deepspeed_has_the_private_names():
    check_deepspeed_internals()  # raises naming the DeepSpeed version if they moved


def test_sparse_replica_makes_every_parameter_persistent_and_refuses_a_threshold():
    zero = replica_zero_config({"stage": 3})
    assert zero["stage3_param_persistence_threshold"] == zero["stage3_model_persistence_threshold"] > 2**62
    with pytest.raises(ValueError, match="stage3_param_persistence_threshold = 0 .*sparse_replica"):
        replica_zero_config({"stage": 3, "stage3_param_persistence_threshold": 0})
