"""Quality sweep: validation loss of SCAPE vs dense AdamW/AdamS vs raw-gradient top-k, same everything else.

    python bench/quality.py --runs comparison,sweep   # the comparison and the refresh sweep, ~45 min on 2 cores
    python bench/quality.py                           # every run (also the lr 1e-3 and lr_high sets), ~2.5 h
    python bench/quality.py --runs adamw,scape99 --steps 2000 --n-layer 4 --n-embd 192 --seed 7
    python bench/quality.py --runs scape90,scape99 --lr 6e-3      # any row at another learning rate
    python bench/quality.py --plot-only                # tables and plots from bench/quality_*.csv
    python bench/quality.py --import-legacy DIR        # summary rows from a results dir of the old layout

Every run trains the same byte-level GPT on the bundled World English Bible (fixed validation split)
through the product's own loop (``scape_ds.train.train`` on ``scape_ds.initialize``), with the
same seed, data order, token budget and learning-rate schedule (WarmupCosineLR over --steps); only
the optimizer / ``"scape"`` block differs. Ranks are spawned in-process (2 gloo ranks by default); one
set of ranks runs the runs one after another.

Run ids. A run is a name of ``RUNS`` plus the generic settings that differ from ``DEFAULTS``:
``adamw`` at the defaults, ``scape99__L4_E192_steps2000_lr0.006`` at 4 layers x 192, 2000 steps, lr 6e-3.

Raw output (never in git) goes under --out (default ``runs/quality/``, ignored by git), per run id:
``<id>.ds_config.json``, ``<id>.jsonl`` (per-step metrics), ``<id>.json`` (the summary, with the
diagnostics) and, while it trains, ``<id>.ckpt/`` (a checkpoint every --ckpt-interval steps, deleted
when the run finishes). A run whose summary exists is skipped unless --force; a run with a checkpoint
resumes from it, so an interrupted sweep (a killed process, a session that ended, --stop-at) continues
where it stopped when the same command is run again, and gives the same losses as an uninterrupted run.

What git keeps (written by every invocation unless --no-summary): ``bench/quality_summary.csv`` (one
row per run id: method, settings, final validation loss, bytes sent / dense, wall time, diagnostics,
git revision, library versions, the command), ``bench/quality_curves.csv`` (validation loss at the
eval points), ``bench/quality_val_loss.png`` (every curve) and ``bench/quality_best_lr.png`` (per model
size: dense AdamW, dense AdamS, SCAPE 0.9 and 0.99, top-k 0.99 and the best other 0.99 configuration, each
at its best lr; the same as a table on stdout). Rows of this invocation replace rows with the same id.

Diagnostics (rank 0, from the parameters after every optimizer step, see :class:`Diagnostics`): per
window of --diag-window steps the fraction of coordinates that changed at least once in the window and
the mean over its steps of the fraction that changed at that step, and the mean |p_t - p_0| per
coordinate; the summary gives the last window's fractions, the final mean |p_T - p_0| and its ratio to
the dense AdamS row with the same settings and lr (``displacement_vs_adams``), when the table has one.

Runs (``--runs``): the comparison ``adamw adams scape90 scape99 topk99 scape99_sparse`` and the
refresh sweep at 0.99 ``scape99_T10 scape99_T50 scape99_T200 scape99_sparse_T1 scape99_sparse_T10``
(``scape99`` is T=100 with dense refresh, ``scape99_sparse`` T=100 with sparse refresh), and the
learning-rate check: the same at lr 1e-3 (``*_lr1e-3``; the others use lr 3e-3), with the refresh sweep
repeated at lr 1e-3 (T=10, 25, 50, 100, 200; sparse refresh T=1, 10), random-k at 0.99 and SCAPE 0.95.
Higher lrs (``lr_high``): dense AdamW at 6e-3, SCAPE 0.9 and 0.99 at 4.5e-3, 6e-3 and 1e-2, 0.99 T=50 at 6e-3.
Hierarchical: ``scape99_hier`` (``hierarchy "node"``, 2 ranks per node; ``--runs scape99,scape99_hier --ranks 4``).
Update rules at 0.99 (``scape.update_rule``): ``catchup99*`` (gains 0.01-1), ``drift99*`` (K = 1-30),
``wmean99``, and ``scape995_T50`` (lazy at 0.995 with T=50: about the bytes of 0.99 at T=100); the
screen in bench/RESULTS.md ran them with ``--steps 500 --lr 6e-3`` (and 3e-3). The best setting of each
rule at 0.9: ``catchup90_g0.01``, ``drift90_K1``, ``wmean90``.
ZeRO-3 (``zero3``): ``z3_99_dense_small`` (``ds_configs/scape_zero3_coordinate.json``, the coordinate basis:
norms, biases and small tensors reduced densely), ``z3_99_all_sparse`` (the same with every tensor masked, an
ablation of the code) and ``z3dct99`` (``ds_configs/scape_zero3.json``: basis dct under ZeRO-3).
Basis dct (``dct``): ``dct99``, ``dct99_shared``, ``dct90``, ``dct90_shared``, the ablations, and ``dct99_k32``
(the default at DeMo's 32 coefficients per tile). DeMo (``demos``), independent of scape_ds's optimizers
(qualitybench/demo.py): ``demo`` (each rank clipped to 1, ``+= grad``, sum / D), ``demo_lrgrad`` (``+= lr *
grad``), ``demo_noclip``, ``demo_mean`` (mean over the ranks that sent a coefficient), ``demo_noclip_lrgrad``.
Local SGD (``local_sgd``): ``diloco_H30``, ``diloco_H100``, DiLoCo, and ``sparseloco_H30``, SparseLoCo, over
the dense AdamW run (qualitybench/baselines.py; no checkpoints).
Groups: ``comparison``, ``sweep`` (the lr 3e-3 refresh sweep), ``lr1e-3`` (all lr 1e-3 runs), ``lr_high``,
``hier``, ``update_rules``, ``dct``, ``demos``, ``local_sgd``, ``local_steps`` (``scape.local_steps``),
``zero3``, ``all``.

Seeds and the held-apart split: ``--test-fraction F`` holds apart the last F of the corpus (validation
is the ``--val-fraction`` before it, training the rest); each run then reports ``test_loss``, its final
model's loss on every window of that split, which no lr was chosen by. Runs that differ only by
``--seed`` (init and data order) are grouped in ``bench/quality_seeds.csv`` and ``quality_seeds.png``:
mean and [min, max] of the validation and test losses, and the test loss over dense AdamW's at the same
seed. A run from a tree with uncommitted changes stores its diff as ``<id>.patch`` beside its log and
the diff's sha256 in the summary row (``git_diff_sha256``); ``git apply`` on the named revision gives
the code it ran.
"""
from __future__ import annotations

import argparse
import os
import sys

from qualitybench.plots import plot, plot_best, plot_loss_vs_bytes, plot_seeds
from qualitybench.runner import run
from qualitybench.runs import (
    BEST_PNG,
    BYTES_PNG,
    CURVES_CSV,
    DEFAULTS,
    GROUPS,
    PLOT_PNG,
    REPO,
    SEEDS_PNG,
    SUMMARY_CSV,
    expand_runs,
)
from qualitybench.tables import (
    SEEDS_CSV,
    add_displacement_ratios,
    best_table,
    import_legacy,
    read_tables,
    seed_groups,
    seed_table,
    table,
    write_seed_table,
    write_tables,
)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--runs", default="all",
                    help="comma-separated run names or groups: "
                         + ", ".join(f"{g} ({len(v)} runs)" for g, v in GROUPS.items()))
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "quality"), help="raw output (git-ignored)")
    ap.add_argument("--bench-dir", default=os.path.join(REPO, "bench"),
                    help=f"where {SUMMARY_CSV}, {CURVES_CSV}, {PLOT_PNG} and {BEST_PNG} are merged and drawn")
    ap.add_argument("--no-summary", action="store_true", help="leave the CSVs and plot of --bench-dir alone")
    ap.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    ap.add_argument("--n-layer", type=int, default=DEFAULTS["n_layer"])
    ap.add_argument("--n-embd", type=int, default=DEFAULTS["n_embd"])
    ap.add_argument("--steps", "--train-iters", dest="steps", type=int, default=DEFAULTS["steps"])
    ap.add_argument("--ranks", type=int, default=DEFAULTS["ranks"])
    ap.add_argument("--lr", type=float, default=None, help="learning rate of every selected run (default: each run's)")
    ap.add_argument("--val-fraction", type=float, default=DEFAULTS["val_fraction"])
    ap.add_argument("--test-fraction", type=float, default=DEFAULTS["test_fraction"],
                    help="the end of the corpus held apart (> 0: each run reports its final test loss there)")
    ap.add_argument("--ckpt-interval", type=int, default=DEFAULTS["ckpt_interval"],
                    help="checkpoint every N steps under --out, to resume an interrupted run (0: never)")
    ap.add_argument("--stop-at", type=int, default=None,
                    help="stop every run at this step (checkpointed; rerun resumes)")
    ap.add_argument("--force", action="store_true", help="rerun runs that already have results (from scratch)")
    ap.add_argument("--plot-only", action="store_true", help="tables and plots from --bench-dir's CSVs")
    ap.add_argument("--import-legacy", metavar="DIR", help="add the runs of an old-layout results dir to the CSVs")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.plot_only:
            rows, curves = read_tables(args.bench_dir)
        else:
            if args.import_legacy:
                results = import_legacy(args.import_legacy)
            else:
                opts = dict(seed=args.seed, n_layer=args.n_layer, n_embd=args.n_embd, steps=args.steps,
                            ranks=args.ranks, lr=args.lr, val_fraction=args.val_fraction,
                            test_fraction=args.test_fraction,
                            ckpt_interval=args.ckpt_interval)
                results = run(expand_runs(args.runs), args.out, force=args.force, stop_at=args.stop_at, **opts)
            if args.no_summary:
                rows = {rid: {**r, "run": rid} for rid, r in results.items()}
                add_displacement_ratios(rows)
                curves = {rid: r["curve"] for rid, r in results.items()}
            else:
                rows = write_tables(results, args.bench_dir)
                _, curves = read_tables(args.bench_dir)
    except ValueError as e:
        print(f"quality.py: error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print("no finished runs yet" + (" (--stop-at: rerun without it to finish them)" if args.stop_at else ""),
              file=sys.stderr)
        return 0 if args.stop_at else 1
    print(table(rows))
    print()
    print(best_table(rows))
    groups = seed_groups(rows) if args.no_summary else write_seed_table(rows, args.bench_dir)
    if groups:
        print()
        print(seed_table(groups))
    if not args.no_summary:
        plot_seeds(groups, os.path.join(args.bench_dir, SEEDS_PNG))
        plot(rows, curves, os.path.join(args.bench_dir, PLOT_PNG))
        plot_best(rows, curves, os.path.join(args.bench_dir, BEST_PNG))
        plot_loss_vs_bytes(rows, os.path.join(args.bench_dir, BYTES_PNG))
        print(f"summary: {os.path.join(args.bench_dir, SUMMARY_CSV)}; plots: {os.path.join(args.bench_dir, PLOT_PNG)}, "
              f"{os.path.join(args.bench_dir, BEST_PNG)}, {os.path.join(args.bench_dir, BYTES_PNG)}; seeds: "
              f"{os.path.join(args.bench_dir, SEEDS_CSV)}, {os.path.join(args.bench_dir, SEEDS_PNG)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
