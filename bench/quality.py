"""Quality sweep: validation loss of SCAPE vs dense AdamW/AdamS vs raw-gradient top-k, same everything else.

    python bench/quality.py --runs comparison,sweep   # the method comparison and refresh sweep, ~45 min on 2 cores
    python bench/quality.py                        # everything (also the lr 1e-3 and lr_high sets), ~2.5 h
    python bench/quality.py --runs adamw,scape99 --train-iters 300
    python bench/quality.py --plot-only            # redraw the table and plot from saved results

Every run trains the same byte-level GPT on the bundled World English Bible (fixed validation
split) through the product's own loop (``launch/pretrain.py:train`` on ``scape_ds.initialize``),
with the same seed, data order, token budget and learning-rate schedule (WarmupCosineLR over
--train-iters); only the optimizer / ``"scape"`` block differs. Ranks are spawned in-process (2 gloo
ranks by default), one rank pair runs the runs one after another. Per run the results directory gets
``<name>.jsonl`` (the per-step metrics) and ``<name>.json`` (the summary); runs whose summary exists
are skipped unless --force, so an interrupted sweep resumes. At the end it prints a markdown table
(final validation loss, its ratio to dense AdamW, bytes sent / dense, wall time) and writes
``val_loss.png`` (validation loss vs step).

Runs (``--runs``): the comparison ``adamw adams scape90 scape99 topk99 scape99_sparse`` and the
refresh sweep at 0.99 ``scape99_T10 scape99_T50 scape99_T200 scape99_sparse_T1 scape99_sparse_T10``
(``scape99`` is T=100 with dense refresh, ``scape99_sparse`` T=100 with sparse refresh), and the
learning-rate check: the same at lr 1e-3 (``*_lr1e-3``; the others use lr 3e-3), with the refresh sweep
repeated at lr 1e-3 (T=10, 25, 50, 100, 200; sparse refresh T=1, 10), random-k at 0.99 and SCAPE 0.95.
Higher lrs (``lr_high``): dense AdamW at 6e-3, SCAPE 0.9 and 0.99 at 4.5e-3, 6e-3 and 1e-2, 0.99 T=50 at 6e-3.
Groups: ``comparison``, ``sweep`` (the lr 3e-3 refresh sweep), ``lr1e-3`` (all lr 1e-3 runs), ``lr_high``,
``all``.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# name -> (label, base config in ds_configs/, overrides of the "scape" block[, of the optimizer params])
RUNS: dict[str, tuple] = {
    "adamw": ("dense AdamW", "dense_adamw.json", {}),
    "adams": ("dense AdamS", "dense_adams.json", {}),
    "scape90": ("SCAPE 0.9, T=100", "scape.json", dict(sparsity=0.9, mask_refresh_interval=100)),
    "scape99": ("SCAPE 0.99, T=100", "scape.json", dict(sparsity=0.99, mask_refresh_interval=100)),
    "topk99": ("grad top-k + EF 0.99, T=100", "topk.json", dict(sparsity=0.99)),
    "scape99_sparse": ("SCAPE 0.99, sparse refresh T=100", "scape.json", dict(dense_refresh=False)),
    "scape99_T10": ("SCAPE 0.99, T=10", "scape.json", dict(mask_refresh_interval=10)),
    "scape99_T50": ("SCAPE 0.99, T=50", "scape.json", dict(mask_refresh_interval=50)),
    "scape99_T200": ("SCAPE 0.99, T=200", "scape.json", dict(mask_refresh_interval=200)),
    "scape99_sparse_T1": ("SCAPE 0.99, sparse refresh T=1", "scape.json",
                          dict(dense_refresh=False, mask_refresh_interval=1)),
    "scape99_sparse_T10": ("SCAPE 0.99, sparse refresh T=10", "scape.json",
                           dict(dense_refresh=False, mask_refresh_interval=10)),
    # learning-rate check: AdamS's update is bounded near 1 per coordinate (sign-like), so it
    # wants a smaller lr than AdamW; SCAPE at a sparse step moves only the masked coordinates
    "adams_lr1e-3": ("dense AdamS, lr 1e-3", "dense_adams.json", {}, dict(lr=1e-3)),
    "scape99_lr1e-3": ("SCAPE 0.99, T=100, lr 1e-3", "scape.json", {}, dict(lr=1e-3)),
    "scape90_lr1e-3": ("SCAPE 0.9, T=100, lr 1e-3", "scape.json", dict(sparsity=0.9), dict(lr=1e-3)),
    "adamw_lr1e-3": ("dense AdamW, lr 1e-3", "dense_adamw.json", {}, dict(lr=1e-3)),
    "topk99_lr1e-3": ("grad top-k + EF 0.99, T=100, lr 1e-3", "topk.json", {}, dict(lr=1e-3)),
    "scape99_T50_lr1e-3": ("SCAPE 0.99, T=50, lr 1e-3", "scape.json", dict(mask_refresh_interval=50), dict(lr=1e-3)),
    # the refresh sweep again at lr 1e-3, where dense AdamS is healthy (it stalls at 3e-3), and random-k
    "scape99_T10_lr1e-3": ("SCAPE 0.99, T=10, lr 1e-3", "scape.json", dict(mask_refresh_interval=10), dict(lr=1e-3)),
    "scape99_T25_lr1e-3": ("SCAPE 0.99, T=25, lr 1e-3", "scape.json", dict(mask_refresh_interval=25), dict(lr=1e-3)),
    "scape99_T200_lr1e-3": ("SCAPE 0.99, T=200, lr 1e-3", "scape.json", dict(mask_refresh_interval=200),
                            dict(lr=1e-3)),
    "scape99_sparse_T1_lr1e-3": ("SCAPE 0.99, sparse refresh T=1, lr 1e-3", "scape.json",
                                 dict(dense_refresh=False, mask_refresh_interval=1), dict(lr=1e-3)),
    "scape99_sparse_T10_lr1e-3": ("SCAPE 0.99, sparse refresh T=10, lr 1e-3", "scape.json",
                                  dict(dense_refresh=False, mask_refresh_interval=10), dict(lr=1e-3)),
    "randk99_lr1e-3": ("random-k + EF 0.99, T=100, lr 1e-3", "scape.json", dict(compressor="randk"), dict(lr=1e-3)),
    # bytes spent on density instead of refreshes: about the bytes of 0.99 at T=25
    "scape95_lr1e-3": ("SCAPE 0.95, T=100, lr 1e-3", "scape.json", dict(sparsity=0.95), dict(lr=1e-3)),
    # higher lrs: SCAPE did better at 3e-3 than at 1e-3; does it keep improving, and does AdamW?
    "adamw_lr6e-3": ("dense AdamW, lr 6e-3", "dense_adamw.json", {}, dict(lr=6e-3)),
    "scape90_lr6e-3": ("SCAPE 0.9, T=100, lr 6e-3", "scape.json", dict(sparsity=0.9), dict(lr=6e-3)),
    "scape99_lr6e-3": ("SCAPE 0.99, T=100, lr 6e-3", "scape.json", {}, dict(lr=6e-3)),
    "scape90_lr1e-2": ("SCAPE 0.9, T=100, lr 1e-2", "scape.json", dict(sparsity=0.9), dict(lr=1e-2)),
    "scape99_lr1e-2": ("SCAPE 0.99, T=100, lr 1e-2", "scape.json", {}, dict(lr=1e-2)),
    "scape90_lr4.5e-3": ("SCAPE 0.9, T=100, lr 4.5e-3", "scape.json", dict(sparsity=0.9), dict(lr=4.5e-3)),
    "scape99_lr4.5e-3": ("SCAPE 0.99, T=100, lr 4.5e-3", "scape.json", {}, dict(lr=4.5e-3)),
    "scape99_T50_lr6e-3": ("SCAPE 0.99, T=50, lr 6e-3", "scape.json", dict(mask_refresh_interval=50), dict(lr=6e-3)),
}
COMPARISON = ["adamw", "adams", "scape90", "scape99", "topk99", "scape99_sparse"]
SWEEP = ["scape99_T10", "scape99_T50", "scape99_T200", "scape99_sparse_T1", "scape99_sparse_T10"]
LR_CHECK = ["adams_lr1e-3", "scape99_lr1e-3", "scape90_lr1e-3", "adamw_lr1e-3", "topk99_lr1e-3", "scape99_T50_lr1e-3"]
SWEEP_LR1E3 = ["scape99_T10_lr1e-3", "scape99_T25_lr1e-3", "scape99_T200_lr1e-3", "scape99_sparse_T1_lr1e-3",
               "scape99_sparse_T10_lr1e-3", "randk99_lr1e-3", "scape95_lr1e-3"]
LR_HIGH = ["adamw_lr6e-3", "scape90_lr6e-3", "scape99_lr6e-3", "scape90_lr1e-2", "scape99_lr1e-2", "scape90_lr4.5e-3",
           "scape99_lr4.5e-3", "scape99_T50_lr6e-3"]
GROUPS = {"comparison": COMPARISON, "sweep": SWEEP, "lr1e-3": LR_CHECK + SWEEP_LR1E3, "lr_high": LR_HIGH,
          "all": list(RUNS)}


def expand_runs(spec: str) -> list[str]:
    """``--runs``: comma-separated run names and names of ``GROUPS``, in order, without repeats. An
    unknown name raises ``ValueError``."""
    names: list[str] = []
    for item in (x.strip() for x in spec.split(",")):
        for n in GROUPS.get(item, [item] if item else []):
            if n not in RUNS:
                raise ValueError(f"unknown run {n!r}; choose from the groups {', '.join(GROUPS)} or {', '.join(RUNS)}")
            if n not in names:
                names.append(n)
    return names


def make_config(name: str, train_iters: int, micro_batch: int, warmup: int) -> dict:
    """The DeepSpeed config of run ``name``: its ds_configs/ base, the shared schedule, its overrides."""
    if name not in RUNS:
        raise ValueError(f"unknown run {name!r}; choose from {', '.join(RUNS)}")
    _, base, overrides, *opt_overrides = RUNS[name]
    with open(os.path.join(REPO, "ds_configs", base), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = 1
    cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {
        "total_num_steps": train_iters, "warmup_num_steps": warmup, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}}
    if overrides:
        cfg["scape"] = {**cfg["scape"], **overrides}
    for o in opt_overrides:
        cfg["optimizer"]["params"].update(o)
    return cfg


def _load_pretrain():
    spec = importlib.util.spec_from_file_location("scape_pretrain", os.path.join(REPO, "launch", "pretrain.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _worker(rank, world, port, names, opts, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    pretrain = _load_pretrain()
    pretrain.init_distributed(opts["timeout"])
    try:
        for name in names:
            cfg_path = os.path.join(out_dir, f"{name}.ds_config.json")
            if rank == 0:
                with open(cfg_path, "w", encoding="utf-8") as f:
                    json.dump(make_config(name, opts["train_iters"], opts["micro_batch"], opts["warmup"]), f, indent=2)
            dist.barrier()
            argv = ["--deepspeed_config", cfg_path, "--train-iters", str(opts["train_iters"]),
                    "--seed", str(opts["seed"]),
                    "--eval-interval", str(opts["eval_interval"]), "--eval-iters", str(opts["eval_iters"]),
                    "--log-interval", str(opts["log_interval"]), "--seq-len", str(opts["seq_len"]),
                    "--n-layer", str(opts["n_layer"]), "--n-head", str(opts["n_head"]), "--n-embd", str(opts["n_embd"]),
                    "--metrics-out", os.path.join(out_dir, f"{name}.jsonl"), "--no-progress"]
            args = pretrain.build_parser().parse_args(argv)
            cfg = pretrain.check_inputs(args)
            if rank == 0:
                print(f"=== {name}: {RUNS[name][0]}", flush=True)
            t0 = time.perf_counter()
            summary = pretrain.train(args, cfg)
            summary.update(name=name, label=RUNS[name][0], wall_s=time.perf_counter() - t0, opts=opts)
            if rank == 0:
                tmp = os.path.join(out_dir, f"{name}.json.tmp")
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(summary, f, indent=2)
                os.replace(tmp, os.path.join(out_dir, f"{name}.json"))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(names: list[str], out_dir: str, ranks: int = 2, force: bool = False, **opts) -> dict[str, dict]:
    """Train every run in ``names`` (skipping finished ones unless ``force``); return their summaries."""
    import torch.multiprocessing as mp

    defaults = dict(train_iters=1500, micro_batch=16, warmup=50, seed=1234, eval_interval=100, eval_iters=8,
                    log_interval=250, seq_len=128, n_layer=2, n_head=4, n_embd=128, timeout=300.0)
    unknown = set(opts) - set(defaults)
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)}")
    opts = {**defaults, **opts}
    for n in names:
        make_config(n, opts["train_iters"], opts["micro_batch"], opts["warmup"])  # fail early on a bad name
    os.makedirs(out_dir, exist_ok=True)
    todo = [n for n in names if force or not os.path.exists(os.path.join(out_dir, f"{n}.json"))]
    if todo:
        mp.start_processes(_worker, args=(ranks, _free_port(), todo, opts, out_dir), nprocs=ranks, start_method="spawn")
    return load_results(names, out_dir)


def load_results(names: list[str], out_dir: str) -> dict[str, dict]:
    """Summaries and validation curves of the finished runs among ``names``."""
    results = {}
    for n in names:
        path = os.path.join(out_dir, f"{n}.json")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
        with open(os.path.join(out_dir, f"{n}.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        res["curve"] = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        res["losses"] = [r["loss"] for r in rows]
        results[n] = res
    return results


def table(results: dict[str, dict]) -> str:
    """Markdown table: final validation loss, ratio to dense AdamW, bytes sent / dense, wall time."""
    ref = results.get("adamw", {}).get("val_loss")
    lines = ["| run | final val loss | / dense AdamW | bytes sent / dense | wall s |", "|---|---|---|---|---|"]
    for n, r in results.items():
        ratio = f"{r['val_loss'] / ref:.4f}" if ref else "-"
        frac = r["bytes_sent"] / r["bytes_dense"] if r["bytes_dense"] else float("nan")
        lines.append(f"| {r['label']} | {r['val_loss']:.4f} | {ratio} | {frac:.2%} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def _lr(name: str) -> float:
    """The learning rate of run ``name`` (its override, else its ds_configs/ base's)."""
    _, base, _, *opt_overrides = RUNS[name]
    for o in opt_overrides:
        if "lr" in o:
            return o["lr"]
    with open(os.path.join(REPO, "ds_configs", base), encoding="utf-8") as f:
        return json.load(f)["optimizer"]["params"]["lr"]


def plot(results: dict[str, dict], path: str) -> None:
    """Validation loss vs step, one panel per learning rate (lr 3e-3, 1e-3, higher ones), each with dense
    AdamW at lr 3e-3, the reference of the ratio column, dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lr = {n: _lr(n) for n in results}
    panels = [("lr 3e-3", [n for n in results if lr[n] == 3e-3]), ("lr 1e-3", [n for n in results if lr[n] == 1e-3]),
              ("lr 4.5e-3 to 1e-2", [n for n in results if lr[n] not in (3e-3, 1e-3)])]
    panels = [(title, names) for title, names in panels if names]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5.5), sharey=True, squeeze=False)
    colors = plt.cm.tab20.colors[::2] + plt.cm.tab20.colors[1::2]  # 20 distinct: a panel has up to 14 runs
    for ax, (title, names) in zip(axes[0], panels):
        ax.set_prop_cycle(color=colors)
        if "adamw" in results and "adamw" not in names:
            steps, vals = zip(*results["adamw"]["curve"])
            ax.plot(steps, vals, "k--", label=results["adamw"]["label"] + " (lr 3e-3)")
        for n in names:
            steps, vals = zip(*results[n]["curve"])
            ax.plot(steps, vals, marker=".", label=results[n]["label"])
        ax.set_title(f"{title}: GPT on the World English Bible, 2 ranks")
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("validation loss (nats/byte)")
    axes[0][0].set_ylim(top=3.2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runs", default="all",
                    help="comma-separated run names or groups: "
                    + ", ".join(f"{g} ({len(v)} runs)" for g, v in GROUPS.items()))
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "quality_results"))
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--train-iters", type=int, default=1500)
    ap.add_argument("--force", action="store_true", help="rerun runs that already have results")
    ap.add_argument("--plot-only", action="store_true")
    args = ap.parse_args()
    try:
        names = expand_runs(args.runs)
        if args.plot_only:
            results = load_results(names, args.out)
        else:
            results = run(names, args.out, ranks=args.ranks, force=args.force, train_iters=args.train_iters)
    except ValueError as e:
        print(f"quality.py: error: {e}", file=sys.stderr)
        return 2
    if not results:
        print("no results yet", file=sys.stderr)
        return 1
    print(table(results))
    plot(results, os.path.join(args.out, "val_loss.png"))
    print(f"plot: {os.path.join(args.out, 'val_loss.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
