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
ZeRO-3 (``zero3``): ``z3_99_dense_small`` (``ds_configs/scape_zero3.json``: norms, biases and small tensors
reduced densely) and ``z3_99_all_sparse`` (the same with every tensor masked, an ablation of the code).
Groups: ``comparison``, ``sweep`` (the lr 3e-3 refresh sweep), ``lr1e-3`` (all lr 1e-3 runs), ``lr_high``,
``hier``, ``update_rules``, ``dct``, ``zero3``, ``all``.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
    # hierarchical SCAPE (dense inside a node of 2 ranks, sparse across nodes): run with --ranks 4 for
    # 2 nodes x 2, next to scape99 at --ranks 4
    "scape99_hier": ("SCAPE 0.99, T=100, hierarchy node (2 ranks per node)", "scape.json",
                     dict(hierarchy="node", intra_node_size=2)),
    # update rules (scape_ds/optim/update_rules.py): how coordinates outside the mask learn
    "catchup99": ("SCAPE 0.99 catchup (gain 0.3), T=100", "scape.json", dict(update_rule="catchup")),
    "catchup99_g0.1": ("SCAPE 0.99 catchup gain 0.1, T=100", "scape.json",
                       dict(update_rule="catchup", catchup_gain=0.1)),
    "catchup99_g0.03": ("SCAPE 0.99 catchup gain 0.03, T=100", "scape.json",
                        dict(update_rule="catchup", catchup_gain=0.03)),
    "catchup99_g0.01": ("SCAPE 0.99 catchup gain 0.01, T=100", "scape.json",
                        dict(update_rule="catchup", catchup_gain=0.01)),
    "drift99_K1": ("SCAPE 0.99 sign_drift K=1, T=100", "scape.json", dict(update_rule="sign_drift", drift_steps=1)),
    "scape995_T50": ("SCAPE 0.995, T=50", "scape.json", dict(sparsity=0.995, mask_refresh_interval=50)),
    "reselect99_R25": ("SCAPE 0.99, T=100, masks re-chosen every 25 steps", "scape.json", dict(reselect_interval=25)),
    "reselect99_R50": ("SCAPE 0.99, T=100, masks re-chosen every 50 steps", "scape.json", dict(reselect_interval=50)),
    "reselect99_R10": ("SCAPE 0.99, T=100, masks re-chosen every 10 steps", "scape.json", dict(reselect_interval=10)),
    "reselect90_R50": ("SCAPE 0.9, T=100, masks re-chosen every 50 steps", "scape.json",
                       dict(sparsity=0.9, reselect_interval=50)),
    "wmean99": ("SCAPE 0.99 window_mean, T=100", "scape.json", dict(update_rule="window_mean")),
    "drift99": ("SCAPE 0.99 sign_drift K=10, T=100", "scape.json", dict(update_rule="sign_drift")),
    "drift99_K3": ("SCAPE 0.99 sign_drift K=3, T=100", "scape.json", dict(update_rule="sign_drift", drift_steps=3)),
    # the best setting of each rule at 0.99, at 0.9
    "catchup90_g0.01": ("SCAPE 0.9 catchup gain 0.01, T=100", "scape.json",
                        dict(sparsity=0.9, update_rule="catchup", catchup_gain=0.01)),
    "drift90_K1": ("SCAPE 0.9 sign_drift K=1, T=100", "scape.json",
                   dict(sparsity=0.9, update_rule="sign_drift", drift_steps=1)),
    "wmean90": ("SCAPE 0.9 window_mean, T=100", "scape.json", dict(sparsity=0.9, update_rule="window_mean")),
    # basis "dct" (ds_configs/scape_dct.json: per_rank mask, sign update, clip_local 1, ef_decay 0.999)
    "dct99": ("SCAPE dct 0.99, per-rank masks", "scape_dct.json", {}),
    "dct99_shared": ("SCAPE dct 0.99, shared mask (nominated union)", "scape_dct.json", dict(mask="shared")),
    "dct90": ("SCAPE dct 0.9, per-rank masks", "scape_dct.json", dict(sparsity=0.9)),
    "dct90_shared": ("SCAPE dct 0.9, shared mask (nominated union)", "scape_dct.json",
                     dict(sparsity=0.9, mask="shared")),
    "dct99_noclip": ("SCAPE dct 0.99, per-rank masks, no clip_local", "scape_dct.json", dict(clip_local=0.0)),
    "dct99_adams": ("SCAPE dct 0.99, per-rank masks, AdamS on the decoded mean", "scape_dct.json",
                    dict(dct_update="adams")),
    "dct99_adamscoef": ("SCAPE dct 0.99, per-rank masks, AdamS on the coefficients", "scape_dct.json",
                        dict(dct_update="adams_coef")),
    # DeMo (arXiv 2411.19870) in these settings: top-32 of each 64 x 64 tile per rank with its offsets,
    # all-gathered, sign of the decoded mean, accumulator decay 0.999, local clip 1.0
    "demo": ("DeMo recipe: top-32 per 64x64 tile per rank", "scape_dct.json", dict(sparsity=1 - 32 / 4096)),
    # ZeRO-3 (path B, ds_configs/scape_zero3.json): norms, biases and tensors under dense_numel_threshold
    # reduced densely as on path A, against every tensor sparse with error feedback (ABLATIONS)
    "z3_99_dense_small": ("SCAPE ZeRO-3 0.99, T=100, small tensors dense", "scape_zero3.json", {}),
    "z3_99_all_sparse": ("SCAPE ZeRO-3 0.99, T=100, every tensor sparse (ablation)", "scape_zero3.json", {}),
}


def _zero3_every_tensor_sparse():
    """ZeRO-3 as it was before small tensors went dense (every tensor masked, with error feedback)."""
    from unittest import mock

    return mock.patch("scape_ds.exchange.stage3.dense_tensor_ids", lambda params, threshold: set())


# runs that differ by code, not by config: a context manager around their training, on every rank
ABLATIONS = {"z3_99_all_sparse": _zero3_every_tensor_sparse}
COMPARISON = ["adamw", "adams", "scape90", "scape99", "topk99", "scape99_sparse"]
SWEEP = ["scape99_T10", "scape99_T50", "scape99_T200", "scape99_sparse_T1", "scape99_sparse_T10"]
LR_CHECK = ["adams_lr1e-3", "scape99_lr1e-3", "scape90_lr1e-3", "adamw_lr1e-3", "topk99_lr1e-3", "scape99_T50_lr1e-3"]
SWEEP_LR1E3 = ["scape99_T10_lr1e-3", "scape99_T25_lr1e-3", "scape99_T200_lr1e-3", "scape99_sparse_T1_lr1e-3",
               "scape99_sparse_T10_lr1e-3", "randk99_lr1e-3", "scape95_lr1e-3"]
LR_HIGH = ["adamw_lr6e-3", "scape90_lr6e-3", "scape99_lr6e-3", "scape90_lr1e-2", "scape99_lr1e-2", "scape90_lr4.5e-3",
           "scape99_lr4.5e-3", "scape99_T50_lr6e-3"]
HIER = ["scape99_hier"]
DCT = [n for n in RUNS if n.startswith("dct")] + ["demo"]
ZERO3 = [n for n in RUNS if n.startswith("z3_")]
UPDATE_RULES = [n for n in RUNS if n.startswith(("catchup", "drift", "wmean", "reselect"))] + ["scape995_T50"]
GROUPS = {"comparison": COMPARISON, "sweep": SWEEP, "lr1e-3": LR_CHECK + SWEEP_LR1E3, "lr_high": LR_HIGH,
          "hier": HIER, "update_rules": UPDATE_RULES, "dct": DCT, "zero3": ZERO3, "all": list(RUNS)}

# Settings of a run. The generic ones (GENERIC, with their short form in a run id) may differ per
# invocation; a run id names every generic setting that differs from here. lr None: the run's own lr.
DEFAULTS = dict(steps=1500, seed=1234, n_layer=2, n_embd=128, ranks=2, lr=None, val_fraction=0.05,
                micro_batch=16, warmup=50, eval_interval=100, eval_iters=8, log_interval=250, seq_len=128,
                n_head=4, timeout=300.0, ckpt_interval=250, diag_window=100)
GENERIC = {"seed": "s", "n_layer": "L", "n_embd": "E", "steps": "steps", "ranks": "r", "lr": "lr",
           "val_fraction": "vf"}
SUMMARY_COLUMNS = ["run", "method", "basis", "mask", "update_rule", "sparsity", "mask_refresh_interval",
                   "dense_refresh", "lr", "n_params", "n_layer", "n_embd", "steps", "seed", "ranks", "val_fraction",
                   "val_loss", "bytes_frac", "wall_s", "frac_updated_last_window", "mean_step_frac_last_window",
                   "mean_abs_displacement", "displacement_vs_adams", "label", "git_rev", "torch", "deepspeed",
                   "command"]
CURVE_COLUMNS = ["run", "step", "val_loss"]
SUMMARY_CSV, CURVES_CSV, PLOT_PNG = "quality_summary.csv", "quality_curves.csv", "quality_val_loss.png"
BEST_PNG = "quality_best_lr.png"  # each configuration at its best lr, per size: the targets
BYTES_PNG = "quality_loss_vs_bytes.png"  # the plot of record: loss against bytes per step, each at its best lr
CKPT_STATE = "quality_state.pt"  # the diagnostics' state, saved inside each checkpoint tag directory


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


def resolve_opts(**opts) -> dict:
    """``DEFAULTS`` updated by ``opts`` (``train_iters`` is an alias of ``steps``), checked."""
    if "train_iters" in opts:
        opts["steps"] = opts.pop("train_iters")
    unknown = set(opts) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)}; known: {', '.join(DEFAULTS)}")
    opts = {**DEFAULTS, **opts}
    for key in ("steps", "seed", "n_layer", "n_embd", "ranks", "micro_batch", "eval_interval", "eval_iters",
                "seq_len", "n_head", "diag_window"):
        if not isinstance(opts[key], int) or opts[key] < (0 if key == "seed" else 1):
            low = 0 if key == "seed" else 1
            raise ValueError(f"--{key.replace('_', '-')} must be an int >= {low}, got {opts[key]!r}")
    if opts["n_embd"] % opts["n_head"]:
        raise ValueError(f"--n-embd {opts['n_embd']} must be divisible by the {opts['n_head']} heads")
    if opts["lr"] is not None and not opts["lr"] > 0:
        raise ValueError(f"--lr must be > 0, got {opts['lr']!r}")
    if not 0 < opts["val_fraction"] <= 0.5:
        raise ValueError(f"--val-fraction must be in (0, 0.5], got {opts['val_fraction']!r}")
    if opts["ckpt_interval"] < 0:
        raise ValueError(f"--ckpt-interval must be >= 0 (0: no checkpoints), got {opts['ckpt_interval']!r}")
    return opts


def run_lr(name: str, opts: dict | None = None) -> float:
    """The learning rate run ``name`` trains at: ``opts["lr"]`` if set, else its override, else its base's."""
    if opts and opts.get("lr") is not None:
        return float(opts["lr"])
    _, base, _, *opt_overrides = RUNS[name]
    for o in opt_overrides:
        if "lr" in o:
            return o["lr"]
    with open(os.path.join(REPO, "ds_configs", base), encoding="utf-8") as f:
        return json.load(f)["optimizer"]["params"]["lr"]


def run_id(name: str, opts: dict) -> str:
    """``name`` plus the generic settings of ``opts`` that differ from ``DEFAULTS`` (lr: from the run's own)."""
    parts = []
    for key, short in GENERIC.items():
        value = opts[key]
        if key == "lr":
            if value is None or float(value) == run_lr(name):
                continue
        elif value == DEFAULTS[key]:
            continue
        parts.append(f"{short}{value:g}" if isinstance(value, float) else f"{short}{value}")
    return name + ("__" + "_".join(parts) if parts else "")


def make_config(name: str, steps: int, micro_batch: int, warmup: int, lr: float | None = None) -> dict:
    """The DeepSpeed config of run ``name``: its ds_configs/ base, the shared schedule, its overrides, ``lr``."""
    if name not in RUNS:
        raise ValueError(f"unknown run {name!r}; choose from {', '.join(RUNS)}")
    _, base, overrides, *opt_overrides = RUNS[name]
    with open(os.path.join(REPO, "ds_configs", base), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = 1
    cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {
        "total_num_steps": steps, "warmup_num_steps": warmup, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1}}
    if overrides:
        cfg["scape"] = {**cfg["scape"], **overrides}
    for o in opt_overrides:
        cfg["optimizer"]["params"].update(o)
    if lr is not None:
        cfg["optimizer"]["params"]["lr"] = float(lr)
    return cfg


def describe(name: str, cfg: dict) -> dict:
    """The method columns of a run: method (adamw | adams | scape | topk | randk), update_rule, sparsity,
    mask_refresh_interval, dense_refresh, lr."""
    lr = cfg["optimizer"]["params"]["lr"]
    if "scape" not in cfg:
        method = "adamw" if cfg["optimizer"]["type"].lower() == "adamw" else "adams"
        return dict(method=method, basis="", mask="", update_rule="", sparsity=0.0, mask_refresh_interval="",
                    dense_refresh="", lr=lr)
    sc = cfg["scape"]
    if sc.get("basis") == "dct":  # masks every step: no refresh interval
        method = "demo" if name == "demo" else "scape"
        return dict(method=method, basis="dct", mask=sc.get("mask", "per_rank"),
                    update_rule=sc.get("dct_update", "sign"), sparsity=sc["sparsity"], mask_refresh_interval="",
                    dense_refresh="", lr=lr)
    return dict(method=sc.get("compressor", "scape"), basis="coordinate", mask="shared",
                update_rule=sc.get("update_rule", "lazy"), sparsity=sc["sparsity"],
                mask_refresh_interval=sc["mask_refresh_interval"], dense_refresh=sc.get("dense_refresh", True), lr=lr)


def rerun_command(name: str, opts: dict) -> str:
    """The command that reruns the row of ``name`` at ``opts``."""
    cmd = ["python bench/quality.py", f"--runs {name}"]
    for key in GENERIC:
        if opts[key] is not None and opts[key] != DEFAULTS[key]:
            cmd.append(f"--{key.replace('_', '-')} {opts[key]}")
    return " ".join(cmd)


# ---------------------------------------------------------------------------------------------------
# Diagnostics: which coordinates move, and how far


def initial_params(opts: dict):
    """The flat fp32 parameters before step 1, rebuilt as the training loop builds the model
    (``torch.manual_seed(seed)`` then ``GPT(...)``), without touching the global RNG: (N,) float32."""
    import torch

    from scape_ds.models import GPT, GPTConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(opts["seed"])
        model = GPT(GPTConfig(vocab_size=256, seq_len=opts["seq_len"], n_layer=opts["n_layer"], n_head=opts["n_head"],
                              n_embd=opts["n_embd"]))
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])  # (N,)


class Diagnostics:
    """``on_step`` hook of the training loop: per window of ``window`` steps, the fraction of parameter
    coordinates that changed at least once in the window (``frac_updated``), the mean over its steps of
    the fraction that changed at that step (``mean_step_frac``), and the mean |p_t - p_0| per coordinate
    at the window's end (``mean_abs_displacement``).

    Rank 0 computes them from the full parameters (every rank holds a replica outside ZeRO-3; under
    ZeRO-3 the hook records nothing). Costs two fp32 copies of the parameters (p_0 and the previous
    step's) and one comparison per step. ``state_dict`` / ``load_state_dict`` carry the open window
    across a resume; the wall time of the finished segments travels with them.
    """

    def __init__(self, p0, window: int, rank: int):
        self.p0 = p0  # (N,) float32, rebuilt by initial_params, never saved
        self.window = window
        self.rank = rank
        self.prev = p0.clone()  # (N,) the parameters after the previous step
        self.changed = None  # (N,) bool: changed at least once in the open window
        self.step_frac_sum, self.window_steps = 0.0, 0
        self.windows: list[dict] = []
        self.max_abs_displacement_step1 = None  # 0.0 when p_0 is right: lr is 0 at step 1 (warm-up from 0)
        self.wall_before = 0.0  # seconds of the finished segments of a resumed run
        self.disabled = False

    def _flat(self, engine):
        import torch

        params = list(engine.module.parameters())
        if any(hasattr(p, "ds_tensor") for p in params):
            return None  # ZeRO-3: partitioned parameters, no replica to read
        return torch.cat([p.detach().reshape(-1).float().cpu() for p in params])

    def __call__(self, step: int, engine) -> None:
        if self.rank != 0 or self.disabled:
            return
        p = self._flat(engine)
        if p is None:
            self.disabled = True
            return
        if p.numel() != self.p0.numel():
            raise RuntimeError(f"diagnostics: the model has {p.numel()} parameters, "
                               f"the rebuilt start {self.p0.numel()}")
        moved = p != self.prev  # (N,) bool
        self.changed = moved if self.changed is None else self.changed | moved
        self.step_frac_sum += float(moved.float().mean())
        self.window_steps += 1
        self.prev = p
        if step == 1:
            self.max_abs_displacement_step1 = float((p - self.p0).abs().max())
        if step % self.window == 0:
            self.close_window(step)

    def close_window(self, step: int) -> None:
        """Record the open window (if it has steps) as ending at ``step``."""
        if self.rank != 0 or self.disabled or not self.window_steps:
            return
        self.windows.append(dict(step=step, steps=self.window_steps, frac_updated=float(self.changed.float().mean()),
                                 mean_step_frac=self.step_frac_sum / self.window_steps,
                                 mean_abs_displacement=float((self.prev - self.p0).abs().mean())))
        self.changed, self.step_frac_sum, self.window_steps = None, 0.0, 0

    def state_dict(self, wall_s: float) -> dict:
        return dict(prev=self.prev, changed=self.changed, step_frac_sum=self.step_frac_sum,
                    window_steps=self.window_steps, windows=self.windows, wall_s=wall_s, disabled=self.disabled,
                    max_abs_displacement_step1=self.max_abs_displacement_step1)

    def load_state_dict(self, state: dict) -> None:
        self.prev, self.changed = state["prev"], state["changed"]
        self.step_frac_sum, self.window_steps = state["step_frac_sum"], state["window_steps"]
        self.windows, self.wall_before = state["windows"], state["wall_s"]
        self.disabled, self.max_abs_displacement_step1 = state["disabled"], state["max_abs_displacement_step1"]

    def summary(self) -> dict:
        last = self.windows[-1] if self.windows else {}
        return dict(frac_updated_last_window=last.get("frac_updated"),
                    mean_step_frac_last_window=last.get("mean_step_frac"),
                    mean_abs_displacement=last.get("mean_abs_displacement"),
                    max_abs_displacement_step1=self.max_abs_displacement_step1, diag_windows=self.windows)


# ---------------------------------------------------------------------------------------------------
# Running


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _checkpoint_step(ckpt: str) -> int:
    """The step of the newest complete checkpoint in ``ckpt`` (0: none)."""
    try:
        with open(os.path.join(ckpt, "latest"), encoding="utf-8") as f:
            tag = f.read().strip()
    except OSError:
        return 0
    if not tag.startswith("global_step") or not os.path.isfile(os.path.join(ckpt, tag, CKPT_STATE)):
        return 0
    return int(tag[len("global_step"):])


def _keep_rows_up_to(path: str, step: int) -> None:
    """Drop the per-step rows after ``step`` (written after the checkpoint a run resumes from)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    _atomic_write(path, "".join(rows))


class _Hook:
    """The on_step of one segment: diagnostics, plus their state saved beside each checkpoint."""

    def __init__(self, diag: Diagnostics, ckpt: str | None, ckpt_interval: int, end: int, t0: float):
        self.diag, self.ckpt, self.ckpt_interval, self.end, self.t0 = diag, ckpt, ckpt_interval, end, t0

    def wall_s(self) -> float:
        return self.diag.wall_before + time.perf_counter() - self.t0

    def __call__(self, step: int, engine) -> None:
        import torch

        self.diag(step, engine)
        # the loop saves a checkpoint at these steps right after this call; the state goes into its tag dir
        if self.diag.rank == 0 and self.ckpt and (step % self.ckpt_interval == 0 or step == self.end):
            tag_dir = os.path.join(self.ckpt, f"global_step{step}")
            os.makedirs(tag_dir, exist_ok=True)
            torch.save(self.diag.state_dict(self.wall_s()), os.path.join(tag_dir, CKPT_STATE + ".tmp"))
            os.replace(os.path.join(tag_dir, CKPT_STATE + ".tmp"), os.path.join(tag_dir, CKPT_STATE))


def _train_one(pretrain, name: str, opts: dict, out_dir: str, rank: int, stop_at: int | None) -> None:
    import torch.distributed as dist

    from scape_ds.checkpoint import safe_load

    rid = run_id(name, opts)
    cfg_path, metrics = os.path.join(out_dir, f"{rid}.ds_config.json"), os.path.join(out_dir, f"{rid}.jsonl")
    ckpt = os.path.join(out_dir, f"{rid}.ckpt") if opts["ckpt_interval"] else None
    start = _checkpoint_step(ckpt) if ckpt else 0
    if rank == 0:
        cfg = make_config(name, opts["steps"], opts["micro_batch"], opts["warmup"], opts["lr"])
        _atomic_write(cfg_path, json.dumps(cfg, indent=2))
        if start:
            _keep_rows_up_to(metrics, start)
        elif ckpt:
            shutil.rmtree(ckpt, ignore_errors=True)  # no complete checkpoint with its state: start over
    dist.barrier()
    end = min(stop_at, opts["steps"]) if stop_at else opts["steps"]
    argv = ["--deepspeed_config", cfg_path, "--train-iters", str(end), "--seed", str(opts["seed"]),
            "--eval-interval", str(opts["eval_interval"]), "--eval-iters", str(opts["eval_iters"]),
            "--log-interval", str(opts["log_interval"]), "--seq-len", str(opts["seq_len"]),
            "--n-layer", str(opts["n_layer"]), "--n-head", str(opts["n_head"]), "--n-embd", str(opts["n_embd"]),
            "--val-fraction", str(opts["val_fraction"]), "--metrics-out", metrics, "--no-progress"]
    if ckpt:
        argv += ["--save", ckpt, "--save-interval", str(opts["ckpt_interval"])]
    if start:
        argv += ["--load", ckpt]
    args = pretrain.build_parser().parse_args(argv)
    cfg = pretrain.check_inputs(args)
    diag = Diagnostics(initial_params(opts), opts["diag_window"], rank)
    if start and rank == 0:
        diag.load_state_dict(safe_load(os.path.join(ckpt, f"global_step{start}", CKPT_STATE)))
    if rank == 0:
        print(f"=== {rid}: {RUNS[name][0]}" + (f" (resumed at step {start})" if start else ""), flush=True)
    hook = _Hook(diag, ckpt, opts["ckpt_interval"], end, time.perf_counter())
    if start < end:
        with ABLATIONS.get(name, contextlib.nullcontext)():
            pretrain.train(args, cfg, on_step=hook)
    else:
        hook.t0 = time.perf_counter()  # nothing left to train: the wall time is the checkpoint's
    if rank == 0 and end == opts["steps"]:
        if diag.window_steps:
            diag.close_window(end)
        _write_summary(name, opts, cfg, metrics, diag, hook.wall_s(), os.path.join(out_dir, f"{rid}.json"))
    dist.barrier()
    if rank == 0 and end == opts["steps"] and ckpt:
        shutil.rmtree(ckpt, ignore_errors=True)  # finished: the summary replaces it
    elif rank == 0 and end < opts["steps"]:
        print(f"{rid}: stopped at step {end} of {opts['steps']}; the same command resumes it", flush=True)


def _versions() -> dict:
    import deepspeed
    import torch

    try:
        rev = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
        rev += "+dirty" if dirty else ""
    except (OSError, subprocess.CalledProcessError):
        rev = ""
    return dict(git_rev=rev, torch=torch.__version__, deepspeed=deepspeed.__version__)


def _write_summary(name: str, opts: dict, cfg: dict, metrics: str, diag: Diagnostics, wall_s: float, path: str):
    with open(metrics, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, opts["steps"] + 1)), "per-step rows missing or repeated"
    sent, dense = sum(r["bytes_sent"] for r in rows), sum(r["bytes_dense"] for r in rows)
    summary = dict(run=run_id(name, opts), name=name, label=RUNS[name][0], **describe(name, cfg),
                   n_params=int(diag.p0.numel()), **{k: opts[k] for k in ("n_layer", "n_embd", "steps", "seed", "ranks",
                                                                          "val_fraction")},
                   val_loss=rows[-1]["val_loss"], final_loss=rows[-1]["loss"], bytes_sent=sent, bytes_dense=dense,
                   bytes_frac=sent / dense if dense else float("nan"), wall_s=wall_s, **diag.summary(),
                   **_versions(), command=rerun_command(name, opts), opts=opts)
    _atomic_write(path, json.dumps(summary, indent=2))


def _worker(rank, world, port, names, opts, out_dir, stop_at):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from scape_ds import train as pretrain

    pretrain.init_distributed(opts["timeout"])
    try:
        for name in names:
            _train_one(pretrain, name, opts, out_dir, rank, stop_at)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(names: list[str], out_dir: str, force: bool = False, stop_at: int | None = None, **opts) -> dict[str, dict]:
    """Train every run in ``names`` at ``opts`` (see ``DEFAULTS``; ``train_iters`` = ``steps``), skipping
    finished ones unless ``force`` and resuming from checkpoints; ``stop_at``: stop every run at that step
    (checkpointed). Returns the summaries of the finished runs, keyed by run id, with their curves."""
    import torch.multiprocessing as mp

    opts = resolve_opts(**opts)
    for n in names:
        make_config(n, opts["steps"], opts["micro_batch"], opts["warmup"])  # fail early on a bad name
    if stop_at is not None and (stop_at < 1 or not opts["ckpt_interval"]):
        raise ValueError(f"--stop-at {stop_at}: needs a step >= 1 and checkpoints (--ckpt-interval > 0)")
    os.makedirs(out_dir, exist_ok=True)
    todo = []
    for n in names:
        rid = run_id(n, opts)
        if force or not os.path.exists(os.path.join(out_dir, f"{rid}.json")):
            if force:
                shutil.rmtree(os.path.join(out_dir, f"{rid}.ckpt"), ignore_errors=True)
                for ext in (".json", ".jsonl"):
                    if os.path.exists(os.path.join(out_dir, rid + ext)):
                        os.remove(os.path.join(out_dir, rid + ext))
            todo.append(n)
    if todo:
        mp.start_processes(_worker, args=(opts["ranks"], _free_port(), todo, opts, out_dir, stop_at),
                           nprocs=opts["ranks"], start_method="spawn")
        update_displacement_ratios(out_dir)
    return load_results([run_id(n, opts) for n in names], out_dir)


def update_displacement_ratios(out_dir: str) -> None:
    """Write ``displacement_vs_adams`` into every run summary in ``out_dir`` (see add_displacement_ratios)."""
    summaries = {}
    for fname in sorted(os.listdir(out_dir)):
        if fname.endswith(".json") and not fname.endswith(".ds_config.json"):
            with open(os.path.join(out_dir, fname), encoding="utf-8") as f:
                summaries[fname] = json.load(f)
    add_displacement_ratios(summaries)
    for fname, summary in summaries.items():
        _atomic_write(os.path.join(out_dir, fname), json.dumps(summary, indent=2))


def load_results(run_ids: list[str], out_dir: str) -> dict[str, dict]:
    """Summaries of the finished runs among ``run_ids``, each with ``curve`` [(step, val_loss)] and ``losses``."""
    results = {}
    for rid in run_ids:
        path = os.path.join(out_dir, f"{rid}.json")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            res = json.load(f)
        with open(os.path.join(out_dir, f"{rid}.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        res["curve"] = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        res["losses"] = [r["loss"] for r in rows]
        results[rid] = res
    return results


# ---------------------------------------------------------------------------------------------------
# What git keeps: the summary CSV, the curves CSV, the plot


def import_legacy(legacy_dir: str) -> dict[str, dict]:
    """Summaries (with curves) of a results dir of the old layout (``<name>.json`` + ``<name>.jsonl``, the
    defaults of ``DEFAULTS``), for the tracked CSVs. The git revision is the last commit that changed each
    summary (the code that produced it is that commit's parent or earlier); library versions were not
    recorded then and stay empty; the command is the one that ran it."""
    commands = {**{n: "python bench/quality.py --runs comparison,sweep" for n in COMPARISON + SWEEP},
                **{n: "python bench/quality.py --runs lr1e-3" for n in LR_CHECK + SWEEP_LR1E3},
                **{n: "python bench/quality.py --runs lr_high" for n in LR_HIGH}}
    results = {}
    for name in RUNS:
        path = os.path.join(legacy_dir, f"{name}.json")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        opts = resolve_opts(**{k: v for k, v in old["opts"].items() if k in DEFAULTS or k == "train_iters"})
        with open(os.path.join(legacy_dir, f"{name}.ds_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        with open(os.path.join(legacy_dir, f"{name}.jsonl"), encoding="utf-8") as f:
            rows = [json.loads(line) for line in f if line.strip()]
        rev = subprocess.run(["git", "-C", legacy_dir, "log", "-1", "--format=%h", "--diff-filter=AM", "--",
                              f"{name}.json"],
                             capture_output=True, text=True).stdout.split()
        rid = run_id(name, opts)
        results[rid] = dict(run=rid, name=name, label=old["label"], **describe(name, cfg),
                            n_params=int(initial_params(opts).numel()),
                            **{k: opts[k] for k in ("n_layer", "n_embd", "steps", "seed", "ranks", "val_fraction")},
                            val_loss=old["val_loss"], bytes_frac=old["bytes_sent"] / old["bytes_dense"],
                            wall_s=old["wall_s"], git_rev=rev[-1] if rev else "", torch="", deepspeed="",
                            command=commands.get(name, ""),
                            curve=[(r["step"], r["val_loss"]) for r in rows if "val_loss" in r])
    return results


def _settings(row: dict) -> tuple:
    return tuple(str(row[k]) for k in ("n_layer", "n_embd", "steps", "seed", "ranks", "val_fraction"))


def _num(x) -> float:
    try:
        return float(x)
    except (TypeError, ValueError):
        return float("nan")


def add_displacement_ratios(rows: dict[str, dict]) -> None:
    """``displacement_vs_adams``: mean |p_T - p_0| over that of the dense AdamS row with the same settings
    and lr, where the table has one with a displacement."""
    adams = {(_settings(r), _num(r["lr"])): _num(r.get("mean_abs_displacement")) for r in rows.values()
             if r["method"] == "adams"}
    for r in rows.values():
        ref = adams.get((_settings(r), _num(r["lr"])), float("nan"))
        d = _num(r.get("mean_abs_displacement"))
        r["displacement_vs_adams"] = d / ref if ref > 0 and not math.isnan(d) else ""


def _fmt(x) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return "" if math.isnan(x) else f"{x:.8g}"
    return str(x)


def write_tables(results: dict[str, dict], bench_dir: str) -> dict[str, dict]:
    """Merge ``results`` into ``bench_dir``'s summary and curves CSVs (rows with the same run id are
    replaced) and return the merged summary rows."""
    rows, curves = read_tables(bench_dir)
    for rid, res in results.items():
        rows[rid] = {c: res.get(c, "") for c in SUMMARY_COLUMNS}
        curves[rid] = [(int(s), float(v)) for s, v in res["curve"]]
    add_displacement_ratios(rows)
    order = {n: i for i, n in enumerate(RUNS)}
    ids = sorted(rows, key=lambda r: (r.split("__")[1] if "__" in r else "", order.get(r.split("__")[0], len(order)),
                                      r))
    os.makedirs(bench_dir, exist_ok=True)
    with open(os.path.join(bench_dir, SUMMARY_CSV) + ".tmp", "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(SUMMARY_COLUMNS)
        for rid in ids:
            w.writerow([_fmt(rows[rid].get(c, "")) for c in SUMMARY_COLUMNS])
    with open(os.path.join(bench_dir, CURVES_CSV) + ".tmp", "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(CURVE_COLUMNS)
        for rid in ids:
            for step, val in curves.get(rid, []):
                w.writerow([rid, step, f"{val:.6f}"])
    for name in (SUMMARY_CSV, CURVES_CSV):
        os.replace(os.path.join(bench_dir, name) + ".tmp", os.path.join(bench_dir, name))
    return {rid: rows[rid] for rid in ids}


def read_tables(bench_dir: str) -> tuple[dict[str, dict], dict[str, list]]:
    """The summary rows (by run id) and curves [(step, val_loss)] in ``bench_dir``'s CSVs (empty if absent)."""
    rows: dict[str, dict] = {}
    curves: dict[str, list] = {}
    path = os.path.join(bench_dir, SUMMARY_CSV)
    if os.path.exists(path):
        with open(path, encoding="utf-8", newline="") as f:
            rows = {r["run"]: r for r in csv.DictReader(f)}
        for r in rows.values():  # rows written before the basis and mask columns: the coordinate basis
            if r["method"] in ("scape", "topk", "randk") and not r.get("basis"):
                r["basis"], r["mask"] = "coordinate", "shared"
    path = os.path.join(bench_dir, CURVES_CSV)
    if os.path.exists(path):
        with open(path, encoding="utf-8", newline="") as f:
            for r in csv.DictReader(f):
                curves.setdefault(r["run"], []).append((int(r["step"]), float(r["val_loss"])))
    return rows, curves


def _reference(rows: dict[str, dict], row: dict) -> dict | None:
    """The dense AdamW row (its own default lr) with the settings of ``row``."""
    for r in rows.values():
        if r["run"].split("__")[0] == "adamw" and _settings(r) == _settings(row) and \
                _num(r["lr"]) == run_lr("adamw"):
            return r
    return None


def table(rows: dict[str, dict]) -> str:
    """Markdown table: final validation loss, ratio to dense AdamW (same settings), bytes sent / dense, wall time."""
    lines = ["| run | final val loss | / dense AdamW | bytes sent / dense | wall s | updated / step (last 100) "
             "| mean abs displacement |", "|---|---|---|---|---|---|---|"]
    for rid, r in rows.items():
        ref = _reference(rows, r)
        ratio = f"{_num(r['val_loss']) / _num(ref['val_loss']):.4f}" if ref else "-"
        step_frac = _num(r.get("mean_step_frac_last_window"))
        disp = _num(r.get("mean_abs_displacement"))
        lines.append(f"| {rid} | {_num(r['val_loss']):.4f} | {ratio} | {_num(r['bytes_frac']):.2%} | "
                     f"{_num(r['wall_s']):.0f} | {'-' if math.isnan(step_frac) else f'{step_frac:.2%}'} | "
                     f"{'-' if math.isnan(disp) else f'{disp:.3g}'} |")
    return "\n".join(lines)


def _save_png(fig, path: str) -> None:
    """Write ``fig`` as a 64-colour palette PNG (a line plot needs no more; a quarter of the bytes, so
    bench/ stays small in git). Pillow comes with matplotlib."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=64).save(path, optimize=True)


def plot(rows: dict[str, dict], curves: dict[str, list], path: str) -> None:
    """Validation loss vs step, one panel per (settings, learning-rate class: 3e-3, 1e-3, others), each with
    dense AdamW at its default lr dashed when it is not in the panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def lr_class(r):
        lr = _num(r["lr"])
        return "lr 3e-3" if lr == 3e-3 else "lr 1e-3" if lr == 1e-3 else "other lrs"

    panels: dict[tuple, list] = {}
    for rid, r in rows.items():
        if curves.get(rid):
            panels.setdefault((_settings(r), lr_class(r)), []).append(rid)
    order = {"lr 3e-3": 0, "lr 1e-3": 1, "other lrs": 2}
    keys = sorted(panels, key=lambda k: (k[0] != _settings(dict(DEFAULTS, n_params=0)), k[0], order[k[1]]))
    fig, axes = plt.subplots(1, len(keys), figsize=(6.5 * len(keys), 5), sharey=True, squeeze=False)
    colors = plt.cm.tab20.colors[::2] + plt.cm.tab20.colors[1::2]  # 20 distinct: a panel has up to 14 runs
    for ax, key in zip(axes[0], keys):
        ids = panels[key]
        ax.set_prop_cycle(color=colors)
        ref = _reference(rows, rows[ids[0]])
        if ref and ref["run"] not in ids and curves.get(ref["run"]):
            steps, vals = zip(*curves[ref["run"]])
            ax.plot(steps, vals, "k--", label=f"{ref['label']} (lr {_num(ref['lr']):g})")
        for rid in ids:
            steps, vals = zip(*curves[rid])
            ax.plot(steps, vals, marker=".", markersize=3, label=rows[rid]["label"] + (
                f" [{rid.split('__')[1]}]" if "__" in rid else ""))
        n_layer, n_embd, steps_, seed, ranks, _ = key[0]
        ax.set_title(f"{key[1]}: GPT {n_layer}x{n_embd}, {steps_} steps, seed {seed}, {ranks} ranks", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    axes[0][0].set_ylabel("validation loss (nats/byte)")
    axes[0][0].set_ylim(top=3.2)
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


_LR_SUFFIX = re.compile(r", lr [0-9.e+-]+$")
# the configurations the targets compare, drawn in every panel of BEST_PNG that has them
TARGET_CONFIGS = ["dense AdamW", "dense AdamS", "SCAPE 0.9, T=100", "SCAPE 0.99, T=100", "grad top-k + EF 0.99, T=100"]


def config_key(row: dict) -> str:
    """What a row ran, less its learning rate: its label without a trailing ``, lr X``."""
    return _LR_SUFFIX.sub("", row["label"])


def best_by_lr(rows: dict[str, dict]) -> dict[tuple, dict[str, tuple[dict, list[float]]]]:
    """Per settings (size, steps, seed, ranks, split): each configuration's row at its best (lowest
    validation loss) learning rate, and the sorted learning rates it was run at."""
    groups: dict[tuple, dict[str, tuple[dict, list[float]]]] = {}
    for r in rows.values():
        g, key = groups.setdefault(_settings(r), {}), config_key(r)
        best, lrs = g.get(key, (r, []))
        if _num(r["val_loss"]) < _num(best["val_loss"]):
            best = r
        g[key] = (best, sorted(set(lrs) | {_num(r["lr"])}))
    return groups


def best_table(rows: dict[str, dict]) -> str:
    """Markdown table, per settings that have a dense AdamW row: every configuration at its best lr,
    best first, with its ratio to dense AdamW at *its* best lr."""
    lines = ["| model, steps | configuration | best lr (of the lrs run) | val loss | / best dense AdamW "
             "| bytes / dense |", "|---|---|---|---|---|---|"]
    for key, g in sorted(best_by_lr(rows).items()):
        if "dense AdamW" not in g:
            continue
        ref = _num(g["dense AdamW"][0]["val_loss"])
        n_layer, n_embd, steps, seed, ranks, _ = key
        for name, (r, lrs) in sorted(g.items(), key=lambda kv: _num(kv[1][0]["val_loss"])):
            lr_list = ", ".join(f"{x:g}" for x in lrs)
            lines.append(f"| {n_layer}x{n_embd}, {steps} steps, seed {seed}, {ranks} ranks | {name} | "
                         f"{_num(r['lr']):g} ({lr_list}) | {_num(r['val_loss']):.4f} | "
                         f"{_num(r['val_loss']) / ref:.3f}x | {_num(r['bytes_frac']):.2%} |")
    return "\n".join(lines)


def plot_best(rows: dict[str, dict], curves: dict[str, list], path: str) -> None:
    """Validation curves of TARGET_CONFIGS at their best lrs, plus the best other SCAPE configuration at
    sparsity 0.99 within 3% of the dense bytes; one panel per settings with a dense AdamW row and a SCAPE row."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = []
    for key, g in sorted(best_by_lr(rows).items()):
        shown = [c for c in TARGET_CONFIGS if c in g]
        others = [c for c, (r, _) in g.items() if c not in TARGET_CONFIGS and r["method"] == "scape"
                  and _num(r["sparsity"]) == 0.99 and _num(r["bytes_frac"]) <= 0.03]
        if others:
            shown.append(min(others, key=lambda c: _num(g[c][0]["val_loss"])))
        if "dense AdamW" in g and any(g[c][0]["method"] == "scape" for c in shown):
            panels.append((key, g, shown))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, (key, g, shown) in zip(axes[0], panels):
        ref = _num(g["dense AdamW"][0]["val_loss"])
        top = 0.0
        for c in shown:
            r, lrs = g[c]
            if not curves.get(r["run"]):
                continue
            steps, vals = zip(*curves[r["run"]])
            top = max(top, vals[len(vals) // 5])
            ax.plot(steps, vals, "k--" if c == "dense AdamW" else "-", marker=".", markersize=3,
                    label=f"{c}: lr {_num(r['lr']):g} (best of {len(lrs)}), {_num(r['val_loss']):.4f} = "
                          f"{_num(r['val_loss']) / ref:.3f}x, {_num(r['bytes_frac']):.1%} of bytes")
        n_layer, n_embd, steps_, seed, ranks, _ = key
        ax.set_title(f"each at its best lr: GPT {n_layer}x{n_embd}, {steps_} steps, seed {seed}, {ranks} ranks",
                     fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylim(top=top + 0.1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper right")
    axes[0][0].set_ylabel("validation loss (nats/byte)")
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


def plot_loss_vs_bytes(rows: dict[str, dict], path: str) -> None:
    """The plot of record: validation loss against bytes per step / dense (log x), one point per
    configuration at its best lr, one panel per settings with a dense AdamW row (its loss: the
    dashed reference line). Markers by basis: coordinate SCAPE, DCT SCAPE, DeMo, dense, others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(key, g) for key, g in sorted(best_by_lr(rows).items()) if "dense AdamW" in g and len(g) > 1]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5.5), squeeze=False)
    style = {"dct": ("s", "tab:red"), "coordinate": ("o", "tab:blue"), "demo": ("D", "tab:green"),
             "": ("^", "black")}
    for ax, (key, g) in zip(axes[0], panels):
        ref = _num(g["dense AdamW"][0]["val_loss"])
        ax.axhline(ref, color="k", linestyle="--", linewidth=1, label=f"dense AdamW {ref:.4f}")
        points = [(name, r, _num(r["bytes_frac"]), _num(r["val_loss"])) for name, (r, _) in sorted(g.items())
                  if name != "dense AdamW" and _num(r["bytes_frac"]) > 0]
        for name, r, frac, loss in points:
            kind = "demo" if r.get("method") == "demo" else (r.get("basis") or "")
            marker, color = style.get(kind, style[""])
            ax.scatter([frac], [loss], marker=marker, color=color, s=25)
            # names on the frontier (nothing with fewer or equal bytes is lower) and on every transform row
            frontier = not any(f2 <= frac and l2 < loss for _, _, f2, l2 in points)
            if frontier or kind in ("dct", "demo"):
                ax.annotate(f"{name} ({loss / ref:.3f}x)", (frac, loss), fontsize=6, xytext=(4, 2),
                            textcoords="offset points")
        for kind, (marker, color) in style.items():
            ax.plot([], [], marker=marker, color=color, linestyle="none", label={"dct": "SCAPE, basis dct",
                       "coordinate": "SCAPE / top-k, coordinate basis", "demo": "DeMo recipe",
                       "": "dense, other"}[kind])
        n_layer, n_embd, steps, seed, ranks, _ = key
        ax.set_xscale("log")
        ax.set_title(f"each at its best lr: GPT {n_layer}x{n_embd}, {steps} steps, seed {seed}, {ranks} ranks",
                     fontsize=9)
        ax.set_xlabel("bytes per step / dense (log)")
        ax.set_ylabel("final validation loss (nats/byte)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


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
    if not args.no_summary:
        plot(rows, curves, os.path.join(args.bench_dir, PLOT_PNG))
        plot_best(rows, curves, os.path.join(args.bench_dir, BEST_PNG))
        plot_loss_vs_bytes(rows, os.path.join(args.bench_dir, BYTES_PNG))
        print(f"summary: {os.path.join(args.bench_dir, SUMMARY_CSV)}; plots: {os.path.join(args.bench_dir, PLOT_PNG)}, "
              f"{os.path.join(args.bench_dir, BEST_PNG)}, {os.path.join(args.bench_dir, BYTES_PNG)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
