"""Optimizer step time and peak memory of ScapeAdamS against torch's fused AdamW, and kernel bandwidth.

On CUDA (one GPU, an NCCL world of 1 through a FileStore)::

    python bench/gpu_step.py                       # 1.007B fp32 parameters (60 x 4096 x 4096), ~2 min
    python bench/gpu_step.py --tensors 24 --out runs/gpu_step.json

It prints two markdown tables and writes them as JSON (default runs/gpu_step.json):

1. Optimizer step (median ms over the steps of each kind, peak memory of the steps): torch fused
   AdamW; SCAPE 0.99 (sparse and refresh steps, T=10); compressor "dense" (every step a dense
   exchange plus the fused dense AdamS); fp32 and bf16 parameters, fp32 and bf16 error feedback.
   The issue's targets at 1B parameters: refresh <= 1.5x AdamW, dense <= 1.2x, sparse <= 1.0x;
   peak <= 1.35x AdamW in fp32, <= 2.5x with bf16 parameters.
2. Kernels at 2^28 elements (a shard of 2^25 for the per-shard kernels), as a fraction of a device
   copy's bandwidth: Triton against the torch twin, the byte-radix top-k against the first
   one-bit-at-a-time version, the fused dense AdamS against torch's fused AdamW (28 bytes/element).

Without CUDA it runs the same code on the CPU at a tiny size (a smoke test of the script) and says
that the GPU rows are not measured; CPU times say nothing about the GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _peak_reset():
    if CUDA:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if CUDA else float("nan")


def _params(n_tensors: int, width: int, dtype) -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(width, width, device=DEV, dtype=dtype) * 0.02) for _ in range(n_tensors)]
    for p in ps:
        p.grad = torch.randn_like(p) * 1e-3
    return ps


def _time_steps(opt, params, steps: int) -> dict:
    """Median step time by kind (dense/sparse), peak memory over the steps."""
    times: dict[str, list[float]] = {"dense": [], "sparse": []}
    _sync()
    _peak_reset()
    for i in range(steps):
        for p in params:  # a fresh gradient, written where backward would accumulate it
            p.grad.normal_(0, 1e-3)
        _sync()
        t0 = time.perf_counter()
        opt.step()
        _sync()
        if i >= 2:  # compile / first-use steps left out
            dense = bool(getattr(opt, "comm_stats", {}).get("dense_step", True))
            times["dense" if dense else "sparse"].append(1e3 * (time.perf_counter() - t0))
    row = {f"{k}_ms": round(statistics.median(v), 3) if v else None for k, v in times.items()}
    row["peak_GiB"] = round(_peak(), 3)
    return row


def bench_optimizer(n_tensors: int, width: int, steps: int) -> dict:
    from scape_ds.optim import ScapeAdamS

    rows = {}
    for dtype, dn in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        ps = _params(n_tensors, width, dtype)
        rows[f"torch fused AdamW, {dn} params"] = _time_steps(
            torch.optim.AdamW(ps, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=CUDA), ps, steps)
        del ps
        for comp, sp, ef in (("scape", 0.99, "fp32"), ("scape", 0.99, "bf16"), ("dense", 0.0, "fp32")):
            ps = _params(n_tensors, width, dtype)
            opt = ScapeAdamS(ps, lr=1e-4, weight_decay=0.1, max_grad_norm=1.0,
                             scape=dict(compressor=comp, sparsity=sp, mask_refresh_interval=10, chunk_size=4096,
                                        error_feedback_dtype=ef))
            row = _time_steps(opt, ps, steps)
            row["memory_bytes"] = opt.memory_bytes()
            rows[f"SCAPE {comp} {sp}, {dn} params, {ef} EF"] = row
            opt.synchronize()
            del opt, ps
    base = {dn: rows[f"torch fused AdamW, {dn} params"] for dn in ("fp32", "bf16")}
    for name, row in rows.items():
        ref = base["fp32" if "fp32 params" in name else "bf16"]
        for key in ("dense_ms", "sparse_ms", "peak_GiB"):
            if row.get(key) and ref["dense_ms"] and CUDA:
                denom = ref["peak_GiB"] if key == "peak_GiB" else ref["dense_ms"]
                row[key.replace("_ms", "_x").replace("_GiB", "_x")] = round(row[key] / denom, 2)
    return rows


def bench_kernels(log2_n: int) -> dict:
    from scape_ds.exchange.masks import offsets_to_index
    from scape_ds.kernels import torch_kernels as tk

    if CUDA:
        from triton.testing import do_bench

        from scape_ds.kernels import triton_kernels as trk
    else:  # the script's CPU smoke run: one timed call, torch kernels only
        trk = None

        def do_bench(fn, warmup=1, rep=1):
            fn()
            t0 = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t0)

    N = 1 << log2_n
    S = N // 8  # a shard at D = 8
    C, kc = 4096, 41
    K, k = N // C * kc, S // C * kc
    g = torch.Generator(device=DEV).manual_seed(0)
    x, y = torch.empty(N, device=DEV), torch.empty(N, device=DEV)
    copy_ms = do_bench(lambda: y.copy_(x), warmup=5, rep=50)
    copy_bw = 8 * N / (copy_ms * 1e-3)
    rows = {"device copy": dict(ms=round(copy_ms, 4), GBps=round(copy_bw / 1e9, 1), frac_of_copy=1.0)}
    err = torch.randn(N, device=DEV, generator=g)
    grad = torch.randn(N, device=DEV, generator=g)
    idx_all = torch.randperm(N, device=DEV, generator=g)[:K].sort().values
    scores = torch.randn(S, device=DEV, generator=g)
    offs = tk.chunk_topk(scores, C, kc)
    idx = offsets_to_index(offs, C, kc)
    p, m = torch.randn(S, device=DEV, generator=g), torch.randn(S, device=DEV, generator=g)
    gs, gk = torch.randn(S, device=DEV, generator=g), torch.randn(k, device=DEV, generator=g)
    outK, outk = torch.empty(K, device=DEV), torch.empty(k, device=DEV)
    flat = torch.zeros(N, device=DEV)
    H = dict(lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, bias_correction=0.5)

    def rec(name, fn, nbytes, impls):
        for impl, mod in impls:
            ms = do_bench(lambda: fn(mod), warmup=3, rep=30)
            bw = nbytes / (ms * 1e-3)
            rows[f"{name} [{impl}]"] = dict(ms=round(ms, 4), GBps=round(bw / 1e9, 1),
                                            frac_of_copy=round(bw / copy_bw, 3))

    both = [("triton", trk), ("torch", tk)] if trk else [("torch", tk)]
    rec(f"ef_accumulate_pack N=2^{log2_n}", lambda mod: mod.ef_accumulate_pack(err, grad, idx_all, outK),
        12 * N + 16 * K, both)
    topk = both + ([("triton 1-bit passes", type("M", (), {"chunk_topk": staticmethod(trk.chunk_topk_bitwise)}))]
                   if trk else [])
    rec(f"chunk_topk S=2^{log2_n - 3} C=4096", lambda mod: mod.chunk_topk(scores, C, kc), 4 * S + 2 * k, topk)
    rec("masked_adams_update k=S/100", lambda mod: mod.masked_adams_update(p, m, idx, gk, outk, **H), 36 * k, both)
    rec(f"dense_adams_update S=2^{log2_n - 3}",
        lambda mod: mod.dense_adams_update(p, m, gs, grad_scale=1.0, **H), 20 * S, both)
    rec("scatter_values K=N/100", lambda mod: mod.scatter_values(flat, idx_all, outK), 16 * K, both)
    if CUDA:
        ps, gr, m1, v1 = ([torch.randn(S, device=DEV)] for _ in range(4))
        steps = [torch.tensor(1.0, device=DEV)]
        ms = do_bench(lambda: torch._fused_adamw_(ps, gr, m1, v1, [], steps, lr=1e-4, beta1=0.9, beta2=0.95,
                                                  weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False),
                      warmup=3, rep=30)
        bw = 28 * S / (ms * 1e-3)
        rows[f"torch fused AdamW S=2^{log2_n - 3}"] = dict(ms=round(ms, 4), GBps=round(bw / 1e9, 1),
                                                          frac_of_copy=round(bw / copy_bw, 3))
    return rows


def _table(rows: dict, cols: list[str]) -> str:
    lines = ["| | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, row in rows.items():
        lines.append(f"| {name} | " + " | ".join("" if row.get(c) is None else str(row.get(c)) for c in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensors", type=int, default=60, help="4096 x 4096 tensors (60: 1.007B parameters)")
    ap.add_argument("--steps", type=int, default=32, help="optimizer steps per row (T=10: 3 refreshes)")
    ap.add_argument("--log2-n", type=int, default=28, help="kernel table size 2^n")
    ap.add_argument("--out", default=os.path.join(_REPO, "runs", "gpu_step.json"))
    args = ap.parse_args(argv)
    width, n_tensors, log2_n = 4096, args.tensors, args.log2_n
    if not CUDA:
        width, n_tensors, log2_n = 512, 4, 18
        print("no CUDA device: a CPU smoke run at a tiny size; GPU rows: not measured", flush=True)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store_dir = tempfile.mkdtemp(prefix="gpu_step_")
    if CUDA:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if CUDA else "gloo", store=dist.FileStore(os.path.join(store_dir, "store"), 1),
                            rank=0, world_size=1)
    try:
        result = dict(device=torch.cuda.get_device_name(0) if CUDA else "cpu (GPU rows not measured)",
                      torch=torch.__version__, n_params=n_tensors * width * width)
        result["optimizer"] = bench_optimizer(n_tensors, width, args.steps)
        print(f"\n## Optimizer step, {result['n_params'] / 1e9:.3f}B parameters, one rank ({result['device']})\n")
        print(_table(result["optimizer"], ["sparse_ms", "dense_ms", "peak_GiB", "sparse_x", "dense_x", "peak_x"]))
        result["kernels"] = bench_kernels(log2_n)
        print(f"\n## Kernels ({result['device']})\n")
        print(_table(result["kernels"], ["ms", "GBps", "frac_of_copy"]))
    finally:
        dist.destroy_process_group()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(f"\nwritten: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
