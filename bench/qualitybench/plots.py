"""The plots of bench/: every validation curve, each configuration at its best lr, and the plot of
record, validation loss against bytes per step. PNGs as 64-colour palettes, so bench/ stays small."""
from __future__ import annotations

import re

from .runs import DEFAULTS
from .tables import _num, _reference, _settings, best_by_lr

# the configurations the targets compare, drawn in every panel of BEST_PNG that has them
TARGET_CONFIGS = ["dense AdamW", "dense AdamS", "SCAPE 0.9, T=100", "SCAPE 0.99, T=100", "grad top-k + EF 0.99, T=100"]


def _save_png(fig, path: str, colors: int = 64) -> None:
    """Write ``fig`` as a palette PNG of ``colors`` colours (a line plot needs no more; a quarter of the
    bytes, so bench/ stays small in git). Pillow comes with matplotlib."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    buf.seek(0)
    Image.open(buf).convert("RGB").quantize(colors=colors, method=Image.Quantize.FASTOCTREE).save(path, optimize=True)



def plot(rows: dict[str, dict], curves: dict[str, list], path: str) -> None:
    """Validation loss vs step, one panel per (settings, learning-rate class: 3e-3, 1e-3, others), each with
    dense AdamW at its best lr for those settings dashed when it is not in the panel."""
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
    ncols = min(4, len(keys))  # a grid, not one row 30 panels wide
    nrows = -(-len(keys) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 4 * nrows), sharey=True, squeeze=False)
    for ax in axes.flat[len(keys):]:
        ax.set_visible(False)
    colors = plt.cm.tab20.colors[::2] + plt.cm.tab20.colors[1::2]  # 20 distinct: a panel has up to 14 runs
    groups = best_by_lr(rows)
    for ax, key in zip(axes.flat, keys):
        ids = panels[key]
        ax.set_prop_cycle(color=colors)
        ref = _reference(groups, rows[ids[0]])
        if ref and ref["run"] not in ids and curves.get(ref["run"]):
            steps, vals = zip(*curves[ref["run"]])
            ax.plot(steps, vals, "k--", label=f"{ref['label']} (lr {_num(ref['lr']):g})")
        for rid in ids:
            steps, vals = zip(*curves[rid])
            ax.plot(steps, vals, marker=".", markersize=3, label=rows[rid]["label"] + (
                f" [{rid.split('__')[1]}]" if "__" in rid else ""))
        n_layer, n_embd, steps_, seed, ranks, *_ = key[0]
        ax.set_title(f"{key[1]}: GPT {n_layer}x{n_embd}, {steps_} steps, seed {seed}, {ranks} ranks", fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(ids) <= 16:
            ax.legend(fontsize=5, loc="upper right")
        else:  # a legend of dozens of runs covers the panel; the runs are the CSVs' rows
            ax.text(0.98, 0.98, f"{len(ids)} runs: see quality_summary.csv", transform=ax.transAxes,
                    ha="right", va="top", fontsize=6)
    for row in axes:
        row[0].set_ylabel("validation loss (nats/byte)")
    axes[0][0].set_ylim(top=3.2)
    fig.tight_layout()
    _save_png(fig, path, colors=32)  # the largest plot: an overview of every curve, 32 colours suffice
    plt.close(fig)


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
        n_layer, n_embd, steps_, seed, ranks, *_ = key
        ax.set_title(f"each at its best lr: GPT {n_layer}x{n_embd}, {steps_} steps, seed {seed}, {ranks} ranks",
                     fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylim(top=top + 0.1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    axes[0][0].set_ylabel("validation loss (nats/byte)")
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


# run families drawn as curves on the loss-vs-bytes plot: one exchange, only k per tile varied (fp32 wire)
EQUAL_BYTES_CURVES = {"per_rank": (r"dct9\d|dct99_k32", "tab:red"),
                      "shared mask": (r"dct9\d_shared|dct_shared_k\d+", "tab:orange")}


def plot_loss_vs_bytes(rows: dict[str, dict], path: str) -> None:
    """The plot of record: validation loss against bytes per step / dense (log x), one point per
    configuration at its best lr, one panel per settings with a dense AdamW row (its loss: the
    dashed reference line). Markers by kind: coordinate SCAPE, DCT SCAPE, DeMo, DiLoCo and SparseLoCo,
    dense and others."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    main_split = (str(DEFAULTS["seed"]), str(DEFAULTS["val_fraction"]), "0")  # seed-1234 rows on the validation split
    panels = [(key, g) for key, g in sorted(best_by_lr(rows).items(), key=lambda kv: (int(kv[0][0]), int(kv[0][4])))
              if "dense AdamW" in g and len(g) > 1 and (key[3], key[5], key[6]) == main_split]
    if not panels:
        return
    cols = min(3, len(panels))
    n_rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(7 * cols, 5.5 * n_rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    style = {"dct": ("s", "tab:red"), "coordinate": ("o", "tab:blue"), "demo": ("D", "tab:green"),
             "local": ("v", "tab:purple"), "": ("^", "black")}
    for ax, (key, g) in zip(axes.flat, panels):
        ref = _num(g["dense AdamW"][0]["val_loss"])
        ax.axhline(ref, color="k", linestyle="--", linewidth=1, label=f"dense AdamW {ref:.4f}")
        points = [(name, r, _num(r["bytes_frac"]), _num(r["val_loss"])) for name, (r, _) in sorted(g.items())
                  if name != "dense AdamW" and _num(r["bytes_frac"]) > 0]
        for family, (pattern, color) in EQUAL_BYTES_CURVES.items():  # the same exchange at several k
            line = sorted((frac, loss) for _, r, frac, loss in points if re.fullmatch(pattern, r["run"].split("__")[0]))
            if len(line) > 1:
                ax.plot(*zip(*line), color=color, linewidth=1, alpha=0.6, label=f"dct {family}, k per tile varied")
        for name, r, frac, loss in points:
            method = r.get("method")
            local = method in ("diloco", "sparseloco") or _num(r.get("local_steps") or 1) > 1
            kind = "demo" if method == "demo" else "local" if local else (r.get("basis") or "")
            marker, color = style.get(kind, style[""])
            ax.scatter([frac], [loss], marker=marker, color=color, s=25)
            # names on the frontier (nothing with fewer or equal bytes is lower) and on every transform row
            frontier = not any(f2 <= frac and l2 < loss for _, _, f2, l2 in points)
            if frontier or kind in ("dct", "demo", "local"):
                ax.annotate(f"{name} ({loss / ref:.3f}x)", (frac, loss), fontsize=6, xytext=(4, 2),
                            textcoords="offset points")
        for kind, (marker, color) in style.items():
            ax.plot([], [], marker=marker, color=color, linestyle="none", label={"dct": "SCAPE, basis dct",
                       "coordinate": "SCAPE / top-k, coordinate basis", "demo": "DeMo (bench/qualitybench/demo.py)",
                       "local": "local steps (DiLoCo, SparseLoCo, scape.local_steps)", "": "dense, other"}[kind])
        n_layer, n_embd, steps, seed, ranks, *_ = key
        ax.set_xscale("log")
        top = max([loss for *_, loss in points] + [ref])
        clipped = top > 1.2 * ref
        ax.set_ylim(0.98 * min([loss for *_, loss in points] + [ref]), min(top, 1.2 * ref) * 1.01)
        ax.set_title(f"each at its best lr: GPT {n_layer}x{n_embd}, {steps} steps, seed {seed}, {ranks} ranks"
                     + (" (rows above 1.2x off the plot)" if clipped else ""), fontsize=9)
        ax.set_xlabel("bytes per step / dense (log)")
        ax.set_ylabel("final validation loss (nats/byte)")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)



def plot_seeds(groups: list[dict], path: str) -> None:
    """Test loss over dense AdamW's (same seed) against bytes per step / dense, one point per
    configuration run at several seeds: the mean, with a bar from the lowest to the highest seed's
    ratio; one panel per model size and rank count. Nothing is drawn without such groups."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: dict[tuple, list[dict]] = {}
    for g in groups:
        if g["test_vs_adamw_mean"] == g["test_vs_adamw_mean"] and g["bytes_frac"] < 1:  # not NaN, not AdamW
            panels.setdefault((g["n_layer"], g["n_embd"], g["steps"], g["ranks"]), []).append(g)
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5), squeeze=False)
    for ax, ((n_layer, n_embd, steps, ranks), gs) in zip(axes[0], sorted(panels.items())):
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="dense AdamW (same seed)")
        for g in gs:
            m, lo, hi = g["test_vs_adamw_mean"], g["test_vs_adamw_min"], g["test_vs_adamw_max"]
            ax.errorbar([g["bytes_frac"]], [m], yerr=[[m - lo], [hi - m]], marker="s", capsize=3, linestyle="none")
            ax.annotate(f"{g['configuration']}, lr {g['lr']:g} ({m:.3f}x)", (g["bytes_frac"], m), fontsize=6,
                        xytext=(4, 2), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_title(f"seeds {gs[0]['seeds']}: GPT {n_layer}x{n_embd}, {steps} steps, {ranks} ranks", fontsize=9)
        ax.set_xlabel("bytes per step / dense (log)")
        ax.set_ylabel("test loss / dense AdamW's: mean, [min, max] over seeds")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="best")
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)
