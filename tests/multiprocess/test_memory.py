"""ScapeAdamS's memory on 1-2 gloo ranks: no N-sized allocation on a sparse step, at most one on a
refresh step, gradients as views into the flat buffer (no staging copy), and memory_bytes() equal to
the formulas of scape_ds.optim.memory.

A TorchDispatchMode records every op output of >= N/8 elements during one optimizer step, N being
the elements of the flat sparse buffer; an output counts as an allocation when its storage is none
of the op's inputs' (views, in-place and out= ops write into memory that exists). The torch kernels
work in blocks of BLOCK_NUMEL elements, so the model is big enough (N = 4.2M) that a block is below
N/8: what is counted grows with the model.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from scape_ds.kernels.torch_kernels import BLOCK_NUMEL
from scape_ds.optim import ScapeAdamS
from scape_ds.optim.memory import DTYPE_BYTES, bytes_per_param, scape_stage01_bytes, scape_zero3_bytes

from .harness import run_ranks

pytestmark = pytest.mark.timeout(600)

WIDTH, HIDDEN = 1024, 2048  # two weight matrices: N = 4,194,304


class BigOps(TorchDispatchMode):
    """Records (op, numel, "alloc" | "write") for every op output of at least ``threshold`` elements."""

    def __init__(self, threshold: int):
        super().__init__()
        self.threshold = threshold
        self.ops: list[tuple[str, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.numel()}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.numel() >= self.threshold:
                kind = "write" if t.untyped_storage().data_ptr() in inputs else "alloc"
                self.ops.append((func.__name__, t.numel(), kind))
        return out


def _model(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, HIDDEN, bias=False), torch.nn.GELU(),
                                torch.nn.Linear(HIDDEN, WIDTH, bias=False))
    return model.to(dtype)


def _worker(rank, world_size, tmp_path, scape, dtype, staging):
    model = _model(dtype)
    cfg = dict(sparsity=0.99, chunk_size=4096, mask_refresh_interval=4, kernels="torch", **scape)
    opt = ScapeAdamS(model.parameters(), lr=1e-3, max_grad_norm=1.0, scape=cfg)
    n = sum(p.numel() for p in model.parameters())
    assert BLOCK_NUMEL < n // 8
    recorded = {}
    views = True
    for t in range(1, 6):  # refresh steps 1 and 5 (dense), sparse steps 2-4
        opt.zero_grad()
        if staging:  # what DeepSpeed's own zero_grad does: every .grad set to None
            for p in model.parameters():
                p.grad = None
        x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(10 * t + rank)).to(dtype)
        model(x).float().square().mean().backward()
        if t > 1:
            flat = opt._groups[0].flat_grad.untyped_storage().data_ptr()
            views &= all(p.grad.untyped_storage().data_ptr() == flat for p in model.parameters())
        if t in (3, 5):
            with BigOps(n // 8) as rec:
                opt.step()
            recorded["sparse" if t == 3 else "refresh"] = rec.ops
        else:
            opt.step()
    assert opt.comm_stats["dense_step"] and opt.schedule.is_dense(3) == (opt.cfg.compressor == "dense")
    mem = opt.memory_bytes()
    sc = opt.cfg
    ef = DTYPE_BYTES[sc.error_feedback_dtype] if dtype != torch.float64 else 8
    want = scape_stage01_bytes(n, world_size, sc.chunk_size, sc.k_per_chunk, model[0].weight.element_size(), ef,
                               sc.compressor, sc.update_rule, sc.reselect_interval > 0)
    opt.synchronize()
    return dict(recorded=recorded, views=views, copies=opt.grad_copies, memory=mem, want=want, n=n)


def _allocs(ops):
    return [op for op in ops if op[2] == "alloc"]


CASES = [
    # (scape settings, parameter dtype, N-sized allocations on a refresh step)
    (dict(), torch.float32, 0),  # a = e + g formed in the error buffer, reduced into the gradient buffer
    (dict(error_feedback_dtype="bf16"), torch.float32, 1),  # the fp32 reduce-scatter output
    (dict(compressor="dense"), torch.float32, 1),  # the reduce-scatter output (no error buffer)
    (dict(), torch.bfloat16, 1),  # a rounded to bf16 for the wire (the fp32 residual stays)
]


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("scape,dtype,refresh_allocs", CASES)
def test_no_n_sized_allocation_and_gradient_views(tmp_path, world_size, scape, dtype, refresh_allocs):
    results = run_ranks(_worker, world_size, tmp_path, scape, dtype, False)
    for res in results:
        sparse, refresh = res["recorded"].get("sparse", []), res["recorded"]["refresh"]
        if scape.get("compressor") != "dense":
            assert _allocs(sparse) == [], sparse
        else:  # every step is dense
            assert len(_allocs(sparse)) == refresh_allocs, sparse
        assert len(_allocs(refresh)) == refresh_allocs, refresh
        assert not any(op[0].startswith("cat") for op in sparse + refresh), "a staging copy of the gradients"
        assert res["views"] and res["copies"] == 0, "gradients did not land in the flat buffer"
        assert res["memory"] == res["want"], (res["memory"], res["want"])


def test_grads_replaced_by_someone_else_are_copied_in_and_counted(tmp_path):
    (res,) = run_ranks(_worker, 1, tmp_path, dict(), torch.float32, True)
    assert res["copies"] == 2 * 4  # two weights, steps 2-5: the fallback works and is visible
    assert res["views"] is False


def test_bytes_per_param_table_matches_the_exact_accounting():
    # the per-parameter limit is the exact count over N for a large, unpadded model
    for D in (8, 64):
        for dtype, p in DTYPE_BYTES.items():
            for ef in ("fp32", "bf16"):
                n = D * 4096 * 4096
                exact = sum(scape_stage01_bytes(n, D, 4096, 41, p, DTYPE_BYTES[ef]).values()) / n
                limit = bytes_per_param("stage0", "scape", D, dtype, sparsity=1 - 41 / 4096, error_feedback_dtype=ef)
                assert exact == pytest.approx(limit, rel=1e-12), (D, dtype, ef)
    for D in (8, 64):  # ZeRO-3: memory_bytes() plus ZeRO-3's fp32 gradient partition (4/D, as under AdamW)
        for dtype, p in DTYPE_BYTES.items():
            for replica in (False, True):
                numels = [D * 4096 * 4096] * 3
                exact = sum(scape_zero3_bytes(numels, D, 0.99, p, replica).values()) / sum(numels) + 4 / D
                path = "zero3_sparse_replica" if replica else "zero3"
                # (k_p = ceil(rho * P) rounds up by under one element per parameter)
                assert exact == pytest.approx(bytes_per_param(path, "scape", D, dtype), rel=1e-6)
    # the yardsticks: fp32 AdamW stage 0 keeps 16 bytes a parameter; SCAPE fp32 at D=8 about 12.6
    assert bytes_per_param("stage0", "adamw", 8) == 16
    assert bytes_per_param("stage1", "adamw", 8, "bf16") == 4 + 12 / 8
    assert bytes_per_param("stage0", "scape", 8) == pytest.approx(12 + 0.5 + 0.1 + 0.01)
    with pytest.raises(ValueError, match="path"):
        bytes_per_param("stage2", "scape", 8)


def _worker_zero3(rank, world_size, tmp_path, exchange):
    import os

    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import scape_ds
    from scape_ds.exchange.layout import split_dense_sparse

    from .models import loss_fn, make_batch, make_mlp

    model = make_mlp(seed=5, bias=True, norm=True)
    sparse, dense = split_dense_sparse(list(model.parameters()), 4096)  # biases, LayerNorm: no EF, no mask
    numels, dense_numels = [p.numel() for p in sparse], tuple(p.numel() for p in dense)
    zero = {"stage": 3} if exchange == "sparse_replica" else {"stage": 3, "stage3_param_persistence_threshold": 0}
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 10**9, "zero_optimization": zero,
           "optimizer": {"type": "ScapeAdamS", "params": {"lr": 1e-2}},
           "scape": {"sparsity": 0.99, "mask_refresh_interval": 2, "chunk_size": 256, "param_exchange": exchange}}
    engine, *_ = scape_ds.initialize(model=model, config=cfg)
    for step in range(3):
        x, y = make_batch(step, rank)
        engine.backward(loss_fn(engine, x, y))
        engine.step()
    engine.optimizer.synchronize()
    return engine.optimizer.memory_bytes(), scape_zero3_bytes(numels, world_size, 0.99, 4, exchange == "sparse_replica",
                                                                dense_numels)


@pytest.mark.parametrize("exchange", ["dense", "sparse_replica"])
def test_zero3_memory_bytes_match_the_formula(tmp_path, exchange):
    for got, want in run_ranks(_worker_zero3, 2, tmp_path, exchange):
        assert got == want, (got, want)
