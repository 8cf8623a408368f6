"""Bytes per step, dense vs SCAPE, for a GPT-2 125M shape on 8 data-parallel ranks (counted, not timed).

    python bench/bytes.py                     # 125M shape, 8 ranks, sparsity 0.9/0.99, T 10/100
    python bench/bytes.py --ranks 16 --shape gpt2-125m --out bench/bytes.json
    python bench/bytes.py --configs ds_configs/scape_dct_scale.json --ranks 2 4 8   # a config's scape
        # block on the quality bench's 0.45M GPT (--set '{"index_code": "int16"}' to change a field)

How it counts: one process plays rank 0 of D. The real ScapeAdamS runs on parameters of the real
shapes with ``scape_ds.comm.SimulatedCommunicator``, which moves no data (every "other rank" holds
the same values) but meters every collective exactly as the torch and MPI communicators do (the
byte meter of scape_ds.comm). It runs steps 1..T+1 and averages one full refresh period, steps 2..T+1 (T-1
sparse steps and one dense refresh with its mask all-gather), and checks the count against the
closed form. Dense = what ZeRO-1/DDP send: a reduce-scatter of gradients and an all-gather of
parameters (the same bytes as one all-reduce), fp32.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from scape_ds.comm import SimulatedCommunicator, collective_bytes
from scape_ds.models import GPT, GPT_SHAPES
from scape_ds.optim import ScapeAdamS


def build_params(shape: str) -> list[torch.nn.Parameter]:
    """Parameters with the shapes (and order) of the GPT ``shape``, random values."""
    with torch.device("meta"):
        model = GPT(GPT_SHAPES[shape])
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(p.shape, generator=gen) * 0.02) for p in model.parameters()]


def count(params, grads, world_size: int, sparsity: float, interval: int) -> dict:
    comm = SimulatedCommunicator(world_size)
    opt = ScapeAdamS(params, lr=1e-4, scape=dict(sparsity=sparsity, mask_refresh_interval=interval), comm=comm)
    per_step = []
    for t in range(1, interval + 2):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        per_step.append(dict(opt.comm_stats))
    period = per_step[1:]  # steps 2..T+1: T-1 sparse steps and one dense refresh
    sparse = [s for s in period if not s["dense_step"]]
    refresh = [s for s in period if s["dense_step"]]
    assert len(refresh) == 1 and len(sparse) == interval - 1
    assert len({s["bytes_sent"] for s in sparse}) <= 1, "every sparse step sends the same bytes"
    gs = opt._groups[0]
    D, S, C, kc = world_size, gs.layout.shard_numel, opt.cfg.chunk_size, opt.cfg.k_per_chunk
    k = S // C * kc
    mask = (D - 1) * (S // C) * min(C // 8, 2 * kc)
    dense_small = sum(collective_bytes("all_reduce", p.numel() * 4, D) for p in gs.dense_params)
    closed_sparse = (collective_bytes("reduce_scatter", D * k * 4, D) + collective_bytes("all_gather", k * 4, D)
                     + dense_small)
    closed_refresh = 2 * (D - 1) * S * 4 + dense_small + mask
    assert not sparse or sparse[0]["bytes_sent"] == closed_sparse, (sparse[0], closed_sparse)
    assert refresh[0]["bytes_sent"] == closed_refresh, (refresh[0], closed_refresh)
    mean = sum(s["bytes_sent"] for s in period) / len(period)
    dense = period[0]["bytes_dense"]
    return dict(sparsity=sparsity, T=interval, dense_bytes=dense,
                sparse_step_bytes=sparse[0]["bytes_sent"] if sparse else None,
                refresh_step_bytes=refresh[0]["bytes_sent"], mask_bytes=mask, mean_bytes=mean,
                mean_vs_dense=mean / dense,
                sparse_step_vs_dense=(sparse[0]["bytes_sent"] + mask / interval) / dense if sparse else None)


def bench_model():
    """The quality bench's 0.45M byte-level GPT (bench/qualitybench/runs.py's defaults)."""
    from scape_ds.models import GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=256, seq_len=128, n_layer=2, n_head=4, n_embd=128))


def count_config(scape: dict, world_size: int) -> dict:
    """Bytes per step of a ``scape`` block on the bench model over ``world_size`` simulated ranks: the
    mean over one period of ``local_steps`` (1: two steps, the second counted), against the dense
    exchange's, with the meter's split by collective tag."""
    model = bench_model()
    comm = SimulatedCommunicator(world_size)
    opt = ScapeAdamS(model.parameters(), lr=1e-3, scape=scape, comm=comm)
    x = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    period = scape.get("local_steps", 1)
    sent = dense = 0
    by_tag: dict[str, int] = {}
    for t in range(1 + period):
        opt.zero_grad()
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        if t >= 1:
            stats = opt.comm_stats
            sent, dense = sent + stats["bytes_sent"], dense + stats["bytes_dense"]
            for tag, b in stats["by_tag"].items():
                by_tag[tag] = by_tag.get(tag, 0) + b
    return dict(ranks=world_size, bytes_per_step=sent / period, dense_per_step=dense / period,
                vs_dense=sent / dense, by_tag={k: v / period for k, v in by_tag.items()})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="gpt2-125m", choices=sorted(GPT_SHAPES))
    ap.add_argument("--ranks", type=int, nargs="+", default=[8])
    ap.add_argument("--configs", nargs="+", default=None,
                    help="DeepSpeed configs whose scape block to count on the quality bench's model instead")
    ap.add_argument("--set", default="{}", help="JSON object of scape fields to change in each of --configs")
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.9, 0.99])
    ap.add_argument("--intervals", type=int, nargs="+", default=[10, 100])
    ap.add_argument("--out", default=None, help="write the rows as JSON")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    if args.configs:
        rows = []
        for path in args.configs:
            with open(path, encoding="utf-8") as f:
                scape = dict(json.load(f)["scape"], **json.loads(args.set))
            for D in args.ranks:
                row = dict(count_config(scape, D), config=path, set=args.set)
                rows.append(row)
                tags = ", ".join(f"{k} {v:,.0f}" for k, v in sorted(row["by_tag"].items()))
                print(f"{path} {args.set} D={D}: {row['bytes_per_step']:,.0f} B/step, "
                      f"{row['vs_dense']:.3%} of dense ({tags})", flush=True)
        if args.out:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(rows, f, indent=2)
        return
    if len(args.ranks) != 1:
        ap.error("--ranks takes one value without --configs")
    args.ranks = args.ranks[0]
    params = build_params(args.shape)
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    n = sum(p.numel() for p in params)
    print(f"{args.shape}: {n / 1e6:.1f}M parameters, {args.ranks} ranks, fp32 exchange")
    print(f"{'sparsity':>8} {'T':>5} {'dense MB/step':>14} {'sparse-step MB':>15} {'refresh MB':>11} "
          f"{'mean MB/step':>13} {'mean/dense':>11}")
    rows = []
    for sparsity in args.sparsity:
        for interval in args.intervals:
            t0 = time.perf_counter()
            fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
            row = count(fresh, grads, args.ranks, sparsity, interval)
            row["count_s"] = time.perf_counter() - t0
            rows.append(row)
            print(f"{sparsity:8.2f} {interval:5d} {row['dense_bytes'] / 1e6:14.1f} "
                  f"{row['sparse_step_bytes'] / 1e6:15.2f} {row['refresh_step_bytes'] / 1e6:11.1f} "
                  f"{row['mean_bytes'] / 1e6:13.2f} {row['mean_vs_dense']:11.2%}",
                  flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(dict(shape=args.shape, ranks=args.ranks, params=n, rows=rows), f, indent=2)


if __name__ == "__main__":
    main()
