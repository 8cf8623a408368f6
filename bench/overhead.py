"""Compute overhead of a SCAPE step vs a dense step, 2 gloo ranks on loopback, one run, as a ratio.

    python bench/overhead.py                       # GPT 4x256, batch 8x128, 2 ranks
    python bench/overhead.py --ranks 2 --steps 40 --n-layer 4 --n-embd 256
    python bench/overhead.py --dct                 # + SCAPE 0.99 in the DCT basis, and the transform's share

Both rows run the same model, batches and optimizer code on the same ranks; only the compressor
differs: ``dense`` (sharded dense AdamS: reduce-scatter of the whole gradient, all-gather of all
parameters) and ``scape`` at sparsity 0.99 (mask selection, error feedback, packing, masked update,
scatter). On loopback the link is nearly free, so the ratio of step times is the compute cost SCAPE
adds (target <= 1.15). Rows alternate in blocks of steps so that machine noise hits both alike; the
median over steps after warm-up is reported, for the whole step (forward, backward, exchange,
update) and for ``optimizer.step()`` alone. ``--dct`` adds ``basis "dct"`` at the same sparsity
(ds_configs/scape_dct.json's exchange) and times, inside its steps, the tile transform both ways
(``to_coefficients``, ``from_coefficients``) and the per-tile top-k, to state their share of the step.
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import types

import torch
import torch.distributed as dist

from scape_ds.spawn import run_ranks


def _worker(rank, world, tmp_path, args) -> dict:
    """Both rows on this rank, alternating in blocks; returns their step and optimizer.step times."""
    from scape_ds.data import build_datasets, get_batch
    from scape_ds.exchange import coefficients, node
    from scape_ds.models import GPT, GPTConfig
    from scape_ds.optim import ScapeAdamS

    train, _ = build_datasets()
    runs = {}
    rows = (("dense", dict(compressor="dense")),
            ("scape", dict(compressor="scape", sparsity=args.sparsity, mask_refresh_interval=args.interval)))
    if args.dct:
        rows += (("dct", dict(basis="dct", sparsity=args.sparsity, clip_local=1.0, ef_decay=0.999)),)
    spent = {"transform": 0.0, "topk": 0.0}

    def timed(fn, key):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            out = fn(*a, **kw)
            spent[key] += time.perf_counter() - t
            return out
        return wrapper

    node.to_coefficients = timed(node.to_coefficients, "transform")  # the error feedback's transform
    coefficients.from_coefficients = timed(coefficients.from_coefficients, "transform")  # the decode
    for name, scape in rows:
        torch.manual_seed(0)
        model = GPT(GPTConfig(seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd))
        runs[name] = (model, ScapeAdamS(model.parameters(), lr=1e-3, scape=scape))
    times = {n: dict(step=[], opt=[], dense_steps=0) for n in runs}
    for block in range(args.steps // args.block):
        for name, (model, opt) in runs.items():
            for i in range(args.block):
                s = block * args.block + i
                x, y = get_batch(train, args.batch, args.seq_len, s, rank, world, 0)
                dist.barrier()
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=False)
                _, loss = model(x, y)
                loss.backward()
                t1 = time.perf_counter()
                before = dict(spent)
                if name == "dct":  # the per-tile top-k is a kernel of the optimizer's kernel namespace
                    opt._lazy_init()
                    kern = opt._kernels
                    if not hasattr(kern, "_timed"):
                        opt._kernels = types.SimpleNamespace(**{k: getattr(kern, k) for k in dir(kern)
                                                                if not k.startswith("__")}, _timed=True)
                        opt._kernels.chunk_topk = timed(kern.chunk_topk, "topk")
                opt.step()
                t2 = time.perf_counter()
                if s >= args.warmup:
                    times[name]["step"].append(t2 - t0)
                    times[name]["opt"].append(t2 - t1)
                    for key in spent:
                        times[name].setdefault(key, []).append(spent[key] - before[key])
                    times[name]["dense_steps"] += int(opt.comm_stats["dense_step"])
    for _, opt in runs.values():
        opt.synchronize()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--sparsity", type=float, default=0.99)
    ap.add_argument("--interval", type=int, default=100)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--dct", action="store_true", help="add SCAPE in the DCT basis and the transform's share")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:  # gloo ranks on loopback (FileStore: no port)
        times = run_ranks(_worker, args.ranks, tmp, args, timeout_s=120)[0]  # rank 0's times
    med = {n: {k: statistics.median(v[k]) for k in ("step", "opt")} for n, v in times.items()}
    print(f"{args.ranks} ranks, GPT {args.n_layer}x{args.n_embd}, batch {args.batch}x{args.seq_len}, "
          f"{len(times['dense']['step'])} timed steps each (median)")
    for n in times:
        print(f"  {n:6s} step {med[n]['step'] * 1e3:8.1f} ms   optimizer.step {med[n]['opt'] * 1e3:8.1f} ms"
              f"   (dense refresh steps timed: {times[n]['dense_steps']})")
    print(f"  ratio scape/dense: whole step {med['scape']['step'] / med['dense']['step']:.3f}, "
          f"optimizer.step {med['scape']['opt'] / med['dense']['opt']:.3f}")
    if "dct" in times:
        share = {k: statistics.median(times["dct"][k]) for k in ("transform", "topk")}
        print(f"  ratio dct/scape: whole step {med['dct']['step'] / med['scape']['step']:.3f}, "
              f"optimizer.step {med['dct']['opt'] / med['scape']['opt']:.3f}")
        print(f"  dct step: transform (both ways) {share['transform'] * 1e3:.1f} ms = "
              f"{share['transform'] / med['dct']['step']:.1%} of the step, per-tile top-k {share['topk'] * 1e3:.1f} ms "
              f"= {share['topk'] / med['dct']['step']:.1%}")


if __name__ == "__main__":
    main()
