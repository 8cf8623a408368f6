"""What git keeps: the summary and curves CSVs of bench/, read, merged and written; the markdown tables."""
from __future__ import annotations

import csv
import json
import math
import os
import re
import subprocess
from collections.abc import Iterator

from .runs import (
    COMPARISON,
    CURVE_COLUMNS,
    CURVES_CSV,
    DEFAULTS,
    LR_CHECK,
    LR_HIGH,
    RUNS,
    SUMMARY_COLUMNS,
    SUMMARY_CSV,
    SWEEP,
    SWEEP_LR1E3,
    describe,
    initial_params,
    make_config,
    resolve_opts,
    run_id,
)


def _finished_runs(out_dir: str, run_ids) -> Iterator[tuple[str, dict, list[dict]]]:
    """``(run id, summary, per-step rows)`` of each run in ``run_ids`` that has its summary ``<id>.json``
    in ``out_dir`` (the rows from ``<id>.jsonl``); the others are skipped."""
    for rid in run_ids:
        path = os.path.join(out_dir, f"{rid}.json")
        if not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            summary = json.load(f)
        with open(os.path.join(out_dir, f"{rid}.jsonl"), encoding="utf-8") as f:
            yield rid, summary, [json.loads(line) for line in f if line.strip()]


def _curve(rows: list[dict]) -> list[tuple[int, float]]:
    """[(step, val_loss)] of the per-step rows that have a validation loss."""
    return [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]


def load_results(run_ids: list[str], out_dir: str) -> dict[str, dict]:
    """Summaries of the finished runs among ``run_ids``, each with ``curve`` [(step, val_loss)] and ``losses``."""
    results = {}
    for rid, res, rows in _finished_runs(out_dir, run_ids):
        res["curve"] = _curve(rows)
        res["losses"] = [r["loss"] for r in rows]
        results[rid] = res
    return results


def import_legacy(legacy_dir: str) -> dict[str, dict]:
    """Summaries (with curves) of a results dir of the old layout (``<name>.json`` + ``<name>.jsonl``, the
    defaults of ``DEFAULTS``), for the tracked CSVs. The git revision is the last commit that changed each
    summary (the code that produced it is that commit's parent or earlier); library versions were not
    recorded then and stay empty; the command is the one that ran it."""
    commands = {**{n: "python bench/quality.py --runs comparison,sweep" for n in COMPARISON + SWEEP},
                **{n: "python bench/quality.py --runs lr1e-3" for n in LR_CHECK + SWEEP_LR1E3},
                **{n: "python bench/quality.py --runs lr_high" for n in LR_HIGH}}
    results = {}
    for name, old, rows in _finished_runs(legacy_dir, RUNS):
        opts = resolve_opts(**{k: v for k, v in old["opts"].items() if k in DEFAULTS or k == "train_iters"})
        with open(os.path.join(legacy_dir, f"{name}.ds_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
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
                            curve=_curve(rows))
    return results


def _settings(row: dict) -> tuple:
    """(n_layer, n_embd, steps, seed, ranks, val_fraction, test_fraction): the settings a comparison shares."""
    return tuple(str(row[k]) for k in ("n_layer", "n_embd", "steps", "seed", "ranks", "val_fraction")) + (
        f"{_num(row.get('test_fraction') or 0):g}",)


def _but_seed(row: dict) -> tuple[tuple, str]:
    """:func:`_settings` of ``row`` without its seed, and the seed (as the string :func:`_settings` gives: a
    fresh result carries an int, a row read back a string)."""
    s = _settings(row)
    return s[:3] + s[4:], s[3]


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
                w.writerow([rid, step, f"{val:.4f}"])
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
            if not r.get("local_steps"):  # rows written before the local_steps column: from the run's entry
                r["local_steps"] = _local_steps_of(r["run"].split("__")[0])
    path = os.path.join(bench_dir, CURVES_CSV)
    if os.path.exists(path):
        with open(path, encoding="utf-8", newline="") as f:
            for r in csv.DictReader(f):
                curves.setdefault(r["run"], []).append((int(r["step"]), float(r["val_loss"])))
    return rows, curves


def _local_steps_of(name: str):
    """H of run ``name`` by its entry in runs.py ("" for a run no longer listed)."""
    if name not in RUNS:
        return ""
    return describe(name, make_config(name, DEFAULTS["steps"], DEFAULTS["micro_batch"], DEFAULTS["warmup"]))[
        "local_steps"]


def _reference(groups: dict[tuple, dict[str, tuple[dict, list[float]]]], row: dict) -> dict | None:
    """The dense AdamW row with the settings of ``row`` at AdamW's best lr there, from ``groups``
    (:func:`best_by_lr` of the rows), or None."""
    best = groups.get(_settings(row), {}).get("dense AdamW")
    return best[0] if best else None


def table(rows: dict[str, dict]) -> str:
    """Markdown table: final validation loss, ratio to dense AdamW at its best lr (same settings), bytes sent /
    dense, wall time."""
    lines = ["| run | final val loss | / best dense AdamW | bytes sent / dense | wall s | updated / step (last 100) "
             "| mean abs displacement |", "|---|---|---|---|---|---|---|"]
    groups = best_by_lr(rows)
    for rid, r in rows.items():
        ref = _reference(groups, r)
        ratio = f"{_num(r['val_loss']) / _num(ref['val_loss']):.4f}" if ref else "-"
        step_frac = _num(r.get("mean_step_frac_last_window"))
        disp = _num(r.get("mean_abs_displacement"))
        lines.append(f"| {rid} | {_num(r['val_loss']):.4f} | {ratio} | {_num(r['bytes_frac']):.2%} | "
                     f"{_num(r['wall_s']):.0f} | {'-' if math.isnan(step_frac) else f'{step_frac:.2%}'} | "
                     f"{'-' if math.isnan(disp) else f'{disp:.3g}'} |")
    return "\n".join(lines)



_LR_SUFFIX = re.compile(r", lr [0-9.e+-]+$")


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
        n_layer, n_embd, steps, seed, ranks, *_ = key
        for name, (r, lrs) in sorted(g.items(), key=lambda kv: _num(kv[1][0]["val_loss"])):
            lr_list = ", ".join(f"{x:g}" for x in lrs)
            lines.append(f"| {n_layer}x{n_embd}, {steps} steps, seed {seed}, {ranks} ranks | {name} | "
                         f"{_num(r['lr']):g} ({lr_list}) | {_num(r['val_loss']):.4f} | "
                         f"{_num(r['val_loss']) / ref:.3f}x | {_num(r['bytes_frac']):.2%} |")
    return "\n".join(lines)



SEEDS_CSV = "quality_seeds.csv"
SEED_COLUMNS = ["configuration", "lr", "n_layer", "n_embd", "steps", "ranks", "val_fraction", "test_fraction", "seeds",
                "val_mean", "val_min", "val_max", "test_mean", "test_min", "test_max", "test_vs_adamw_mean",
                "test_vs_adamw_min", "test_vs_adamw_max", "bytes_frac", "runs"]


def seed_groups(rows: dict[str, dict]) -> list[dict]:
    """Runs that differ only by ``seed`` (same configuration, lr, size, steps, ranks, splits), grouped,
    with 2 seeds or more: the mean, min and max of the validation and test losses, and the test loss
    over dense AdamW's of the same seed (paired: AdamW at its best lr for the same settings, the lr of
    its lowest mean validation loss over the seeds run there), mean/min/max. Loss columns are NaN
    where the rows have none (runs without a test split)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows.values():
        groups.setdefault((config_key(r), _num(r["lr"]), *_but_seed(r)[0]), []).append(r)
    val_by_lr: dict[tuple, dict[float, list[float]]] = {}
    adamw_rows = [r for r in rows.values() if r["run"].split("__")[0] == "adamw"]
    for r in adamw_rows:
        val_by_lr.setdefault(_but_seed(r)[0], {}).setdefault(_num(r["lr"]), []).append(_num(r["val_loss"]))
    best_lr = {k: min(by_lr, key=lambda lr: sum(by_lr[lr]) / len(by_lr[lr])) for k, by_lr in val_by_lr.items()}
    adamw = {_but_seed(r): r for r in adamw_rows if _num(r["lr"]) == best_lr[_but_seed(r)[0]]}
    out = []
    for (conf, lr, n_layer, n_embd, steps, ranks, vf, tf), rs in groups.items():
        if len({_but_seed(r)[1] for r in rs}) < 2:
            continue
        val, test = [_num(r["val_loss"]) for r in rs], [_num(r.get("test_loss")) for r in rs]
        ratios = []
        for r in rs:
            ref = adamw.get(_but_seed(r))
            if ref is not None:
                ratios.append(_num(r.get("test_loss")) / _num(ref.get("test_loss")))

        def stats(xs):
            return (sum(xs) / len(xs), min(xs), max(xs)) if xs else (float("nan"),) * 3

        out.append(dict(configuration=conf, lr=lr, n_layer=n_layer, n_embd=n_embd, steps=steps, ranks=ranks,
                        val_fraction=vf, test_fraction=tf, seeds=" ".join(sorted(str(r["seed"]) for r in rs)),
                        **dict(zip(("val_mean", "val_min", "val_max"), stats(val))),
                        **dict(zip(("test_mean", "test_min", "test_max"), stats(test))),
                        **dict(zip(("test_vs_adamw_mean", "test_vs_adamw_min", "test_vs_adamw_max"), stats(ratios))),
                        bytes_frac=sum(_num(r["bytes_frac"]) for r in rs) / len(rs),
                        runs=" ".join(sorted(r["run"] for r in rs))))
    return sorted(out, key=lambda g: (g["n_layer"], g["n_embd"], g["ranks"], g["test_mean"]))


def write_seed_table(rows: dict[str, dict], bench_dir: str) -> list[dict]:
    """Write :func:`seed_groups` of ``rows`` to ``bench_dir``/quality_seeds.csv; returns the groups."""
    groups = seed_groups(rows)
    path = os.path.join(bench_dir, SEEDS_CSV)
    with open(path + ".tmp", "w", encoding="utf-8", newline="") as f:
        w = csv.writer(f, lineterminator="\n")
        w.writerow(SEED_COLUMNS)
        for g in groups:
            w.writerow([_fmt(g[c]) for c in SEED_COLUMNS])
    os.replace(path + ".tmp", path)
    return groups


def seed_table(groups: list[dict]) -> str:
    """Markdown table of :func:`seed_groups`: the mean and the [min, max] over seeds."""
    lines = ["| model, ranks | configuration | lr | seeds | val loss mean [min, max] | test loss mean [min, max] "
             "| test / AdamW, same seed: mean [min, max] | bytes / dense |", "|---|---|---|---|---|---|---|---|"]
    for g in groups:
        lines.append(f"| {g['n_layer']}x{g['n_embd']}, {g['steps']} steps, {g['ranks']} ranks | {g['configuration']} "
                     f"| {g['lr']:g} | {g['seeds']} | {g['val_mean']:.4f} [{g['val_min']:.4f}, {g['val_max']:.4f}] | "
                     f"{g['test_mean']:.4f} [{g['test_min']:.4f}, {g['test_max']:.4f}] | "
                     f"{g['test_vs_adamw_mean']:.4f}x [{g['test_vs_adamw_min']:.4f}, {g['test_vs_adamw_max']:.4f}] | "
                     f"{g['bytes_frac']:.2%} |")
    return "\n".join(lines)
