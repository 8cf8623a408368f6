"""ScapeAdamS on one GPU (NCCL world of 1 through a FileStore): sparsity 0 equals dense AdamS, and
peak memory of a step against torch's fused AdamW (the issue's targets: <= 1.35x in fp32, <= 2.5x
with bf16 parameters)."""
from __future__ import annotations

import datetime
import os

import pytest
import torch
import torch.distributed as dist

from scape_ds.optim import AdamS, ScapeAdamS

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def nccl_world(tmp_path_factory):
    store = dist.FileStore(os.path.join(tmp_path_factory.mktemp("nccl"), "store"), 1)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=120))
    yield
    dist.destroy_process_group()


def _mlp(seed, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.LayerNorm(1024), torch.nn.GELU(),
                               torch.nn.Linear(1024, 256)).to("cuda", dtype)


@pytest.mark.parametrize("kernels,tol", [("torch", 1e-6), ("triton", 1e-4)])
def test_sparsity_zero_equals_dense_adams_on_gpu(nccl_world, kernels, tol):
    model, ref = _mlp(1), _mlp(1)
    hp = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt = ScapeAdamS(model.parameters(), **hp, max_grad_norm=1.0,
                     scape=dict(sparsity=0.0, chunk_size=4096, mask_refresh_interval=5, kernels=kernels))
    ref_opt = AdamS(ref.parameters(), **hp)
    gen = torch.Generator(device="cuda").manual_seed(0)
    worst = 0.0
    for _ in range(20):
        x = torch.randn(32, 256, device="cuda", generator=gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            torch.nn.functional.mse_loss(m(x), torch.sin(x)).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        ref_opt.step()
        a = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        b = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
        worst = max(worst, float((a - b).abs().max()))
    assert worst <= tol, worst
    assert opt.grad_copies == 0 and opt.comm.device.type == "cuda"


def _peak_step_bytes(make_opt, dtype, n_tensors=16, width=2048):
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(width, width, device="cuda", dtype=dtype) * 0.02)
              for _ in range(n_tensors)]
    opt = make_opt(params)
    for step in range(12):  # past a refresh step (T=10) and sparse steps
        opt.zero_grad()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.normal_(0, 1e-3)
        if step == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        opt.step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    if hasattr(opt, "synchronize"):
        opt.synchronize()
    del opt, params
    return peak


@pytest.mark.parametrize("dtype,limit", [(torch.float32, 1.35), (torch.bfloat16, 2.5)])
def test_peak_memory_against_fused_adamw(nccl_world, dtype, limit):
    adamw = _peak_step_bytes(lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=True), dtype)
    scape = _peak_step_bytes(lambda ps: ScapeAdamS(ps, lr=1e-4, weight_decay=0.1, max_grad_norm=1.0,
                                                   scape=dict(sparsity=0.99, mask_refresh_interval=10)), dtype)
    print(f"peak {dtype}: AdamW {adamw / 2**20:.0f} MiB, SCAPE {scape / 2**20:.0f} MiB ({scape / adamw:.2f}x)")
    assert scape <= limit * adamw, (scape / adamw, limit)


def test_dct_shared_mask_coded_values_run_on_cuda(nccl_world):
    """The coded union (4-bit values summed at the owner, Elias-Fano offsets) on CUDA tensors over NCCL:
    its all-to-all, codes and error feedback run on the device and the parameters move (its numbers
    are checked on gloo ranks in tests/multiprocess/test_dct_quantized.py)."""
    model = _mlp(2)
    opt = ScapeAdamS(model.parameters(), lr=1e-3, weight_decay=0.1,
                     scape=dict(basis="dct", mask="shared", sparsity=0.95, value_bits=4, index_code="elias_fano"))
    before = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(5):
        x = torch.randn(32, 256, device="cuda", generator=gen)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), torch.sin(x)).backward()
        opt.step()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert torch.isfinite(after).all() and not torch.equal(before, after)
    assert opt.comm.device.type == "cuda" and opt.error_feedback().device.type == "cuda"
