"""Compute overhead of a SCAPE step vs a dense step, 2 gloo ranks on loopback, one run, as a ratio.

    python bench/overhead.py                       # GPT 4x256, batch 8x128, 2 ranks
    python bench/overhead.py --ranks 2 --steps 40 --n-layer 4 --n-embd 256

Both rows run the same model, batches and optimizer code on the same ranks; only the compressor
differs: ``dense`` (sharded dense AdamS: reduce-scatter of the whole gradient, all-gather of all
parameters) and ``scape`` at sparsity 0.99 (mask selection, error feedback, packing, masked update,
scatter). On loopback the link is nearly free, so the ratio of step times is the compute cost SCAPE
adds (target <= 1.15). Rows alternate in blocks of steps so that machine noise hits both alike; the
median over steps after warm-up is reported, for the whole step (forward, backward, exchange,
update) and for ``optimizer.step()`` alone.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(rank, world, store_dir, args, out_path):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from scape_ds.data import build_datasets, get_batch
    from scape_ds.models import GPT, GPTConfig
    from scape_ds.optim import ScapeAdamS

    store = dist.FileStore(os.path.join(store_dir, "store"), world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        train, _ = build_datasets()
        runs = {}
        for name, scape in (("dense", dict(compressor="dense")),
                            ("scape", dict(compressor="scape", sparsity=args.sparsity,
                                           mask_refresh_interval=args.interval))):
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
                    opt.step()
                    t2 = time.perf_counter()
                    if s >= args.warmup:
                        times[name]["step"].append(t2 - t0)
                        times[name]["opt"].append(t2 - t1)
                        times[name]["dense_steps"] += int(opt.comm_stats["dense_step"])
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(times, f)
    finally:
        dist.destroy_process_group()


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
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "times.json")
        mp.start_processes(_worker, args=(args.ranks, tmp, args, out), nprocs=args.ranks, start_method="spawn")
        with open(out) as f:
            times = json.load(f)
    med = {n: {k: statistics.median(v[k]) for k in ("step", "opt")} for n, v in times.items()}
    print(f"{args.ranks} ranks, GPT {args.n_layer}x{args.n_embd}, batch {args.batch}x{args.seq_len}, "
          f"{len(times['dense']['step'])} timed steps each (median)")
    for n in ("dense", "scape"):
        print(f"  {n:6s} step {med[n]['step'] * 1e3:8.1f} ms   optimizer.step {med[n]['opt'] * 1e3:8.1f} ms"
              f"   (dense refresh steps timed: {times[n]['dense_steps']})")
    print(f"  ratio scape/dense: whole step {med['scape']['step'] / med['dense']['step']:.3f}, "
          f"optimizer.step {med['scape']['opt'] / med['dense']['opt']:.3f}")


if __name__ == "__main__":
    main()
