"""bench/quality.py without training: run names and ids, settings, configs, the diagnostics hook, resume
bookkeeping and the tracked summary tables."""
import csv
import json
import math
import os

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import quality  # noqa: E402  (bench/ is on pytest's pythonpath, pytest.ini)
from qualitybench import diagnostics, plots, runner, runs, tables  # noqa: E402  (bench/ is on pytest's pythonpath, pytest.ini)


def test_groups_expand_in_order_without_repeats():
    assert runs.expand_runs("comparison") == runs.COMPARISON
    names = runs.expand_runs("adamw,comparison,scape99_T10_lr1e-3,lr1e-3")
    assert names[: len(runs.COMPARISON)] == runs.COMPARISON
    assert names.count("scape99_T10_lr1e-3") == 1 and names.index("scape99_T10_lr1e-3") == len(runs.COMPARISON)
    assert set(runs.expand_runs("all")) == set(runs.RUNS)
    assert len(runs.expand_runs("all")) == len(runs.RUNS)
    named = set().union(*(v for g, v in runs.GROUPS.items() if g != "all"))
    assert named == set(runs.RUNS), "a run that belongs to no group"


def test_unknown_run_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown run 'adamx'"):
        runs.expand_runs("adamw,adamx")
    with pytest.raises(ValueError, match="unknown run 'adamx'"):
        runner.run(["adamw", "adamx"], str(tmp_path))
    assert not os.listdir(tmp_path)


def test_generic_flags_and_train_iters_alias():
    args = quality.build_parser().parse_args(["--train-iters", "60", "--seed", "7", "--n-layer", "4", "--n-embd", "192",
                                              "--ranks", "4", "--lr", "6e-3", "--val-fraction", "0.1"])
    assert (args.steps, args.seed, args.n_layer, args.n_embd, args.ranks, args.lr, args.val_fraction) == \
        (60, 7, 4, 192, 4, 6e-3, 0.1)
    assert quality.build_parser().parse_args(["--steps", "80"]).steps == 80
    assert quality.build_parser().parse_args([]).out == os.path.join(REPO, "runs", "quality")
    assert runs.resolve_opts(train_iters=60)["steps"] == 60


def test_bad_settings_are_refused():
    with pytest.raises(TypeError, match="unknown options"):
        runs.resolve_opts(stepz=3)
    with pytest.raises(ValueError, match="--n-embd 130 must be divisible"):
        runs.resolve_opts(n_embd=130)
    with pytest.raises(ValueError, match="--lr must be > 0"):
        runs.resolve_opts(lr=0.0)
    with pytest.raises(ValueError, match="--val-fraction"):
        runs.resolve_opts(val_fraction=0.9)
    with pytest.raises(ValueError, match="--stop-at"):
        runner.run(["adamw"], "/nonexistent/never", stop_at=10, ckpt_interval=0)


def test_run_id_names_only_the_settings_that_differ():
    d = runs.resolve_opts()
    assert runs.run_id("adamw", d) == "adamw"
    assert runs.run_id("adamw", dict(d, lr=3e-3)) == "adamw"  # its own lr
    assert runs.run_id("adamw_lr1e-3", dict(d, lr=1e-3)) == "adamw_lr1e-3"
    assert runs.run_id("scape99", dict(d, n_layer=4, n_embd=192, steps=2000, lr=6e-3)) == \
        "scape99__L4_E192_steps2000_lr0.006"
    assert runs.run_id("adams", dict(d, seed=7, ranks=4, val_fraction=0.1)) == "adams__s7_r4_vf0.1"
    assert runs.rerun_command("scape99", dict(d, n_layer=4, lr=6e-3)) == \
        "python bench/quality.py --runs scape99 --n-layer 4 --lr 0.006"


def test_config_lr_override_and_method_columns():
    cfg = runs.make_config("scape99_lr1e-3", 300, 16, 50)
    assert cfg["optimizer"]["params"]["lr"] == 1e-3
    assert runs.make_config("scape99_lr1e-3", 300, 16, 50, lr=6e-3)["optimizer"]["params"]["lr"] == 6e-3
    assert cfg["scheduler"]["params"]["total_num_steps"] == 300
    assert cfg["scheduler"]["params"]["cos_min_ratio"] == 0.1  # the shared schedule; SCHEDULES by name
    assert runs.make_config("adamw_floor0", 300, 16, 50)["scheduler"]["params"]["cos_min_ratio"] == 0.0
    methods = {n: runs.describe(n, runs.make_config(n, 10, 16, 5)) for n in ("adamw", "adams", "scape90",
                                                                                    "topk99", "randk99_lr1e-3")}
    assert {n: m["method"] for n, m in methods.items()} == {"adamw": "adamw", "adams": "adams", "scape90": "scape",
                                                             "topk99": "topk", "randk99_lr1e-3": "randk"}
    assert methods["scape90"]["update_rule"] == "lazy" and methods["scape90"]["sparsity"] == 0.9
    assert methods["adamw"]["sparsity"] == 0.0 and methods["adamw"]["update_rule"] == ""


def test_the_shipped_scale_config_is_the_bench_run_it_reports():
    # ds_configs/scape_dct_scale.json is what README's D = 4 and 8 rows measured: dct_shared4ef_s940 at 4.5e-3;
    # the entries that ran on its per_rank predecessor pin that config (PER_RANK_SCALE) over scape_dct.json
    with open(os.path.join(REPO, "ds_configs", "scape_dct_scale.json"), encoding="utf-8") as f:
        shipped = json.load(f)
    bench = runs.make_config("dct_shared4ef_s940", 1500, 16, 20, lr=4.5e-3)
    assert shipped["scape"] == bench["scape"]
    assert shipped["optimizer"] == bench["optimizer"]
    old = runs.make_config("dct_scale_ef_b224", 1500, 16, 20)["scape"]
    assert old["mask"] == "per_rank" and old["tile_budget"] == 224 and "sparsity" not in old
    assert (old["value_bits"], old["dense_wire"], old["index_code"]) == (8, "bf16", "elias_fano")


def test_local_steps_column_for_new_rows_and_rows_written_before_it(tmp_path):
    steps = {n: runs.describe(n, runs.make_config(n, 10, 16, 5))["local_steps"]
             for n in ("adamw", "dct99", "demo", "diloco_H100", "sparseloco_H30", "local30_dct99")}
    assert steps == {"adamw": 1, "dct99": 1, "demo": 1, "diloco_H100": 100, "sparseloco_H30": 30, "local30_dct99": 30}
    budget = runs.make_config("dct99", 10, 16, 5)
    budget["scape"] = dict(budget["scape"], tile_budget=160)
    del budget["scape"]["sparsity"]
    assert runs.describe("dct99", budget, 8)["sparsity"] == 1 - 20 / 4096  # scape.tile_budget over 8 ranks
    local = runs.make_config("local100_tb1638_olr13", 10, 16, 5)["scape"]  # an override of None drops the field
    assert "sparsity" not in local and local["tile_budget"] == 1638 and local["local_steps"] == 100
    assert runs.describe("local100_tb1638_olr13", {"optimizer": {"params": {"lr": 1e-3}}, "scape": local},
                         4)["sparsity"] == 1 - 409 / 4096
    old = [c for c in runs.SUMMARY_COLUMNS if c != "local_steps"]
    with open(tmp_path / runs.SUMMARY_CSV, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(old)
        for rid, method in (("diloco_H30__r4", "diloco"), ("dct99", "scape"), ("gone_run", "scape")):
            w.writerow([dict(run=rid, method=method).get(c, "") for c in old])
    rows, _ = tables.read_tables(str(tmp_path))
    assert {rid: r["local_steps"] for rid, r in rows.items()} == {"diloco_H30__r4": 30, "dct99": 1, "gone_run": ""}


def test_initial_params_rebuild_the_model_without_touching_the_rng():
    from scape_ds.models import GPT, GPTConfig

    opts = runs.resolve_opts(n_layer=1, n_embd=32)
    torch.manual_seed(99)
    before = torch.rand(3)
    torch.manual_seed(99)
    p0 = runs.initial_params(opts)
    assert torch.equal(torch.rand(3), before)
    torch.manual_seed(opts["seed"])
    model = GPT(GPTConfig(vocab_size=256, seq_len=128, n_layer=1, n_head=4, n_embd=32))
    assert torch.equal(p0, torch.cat([p.detach().reshape(-1) for p in model.parameters()]))


class _Engine:
    def __init__(self, n):
        self.module = torch.nn.Linear(n, 1, bias=False)  # n parameters


def _step(engine, idx, delta=0.5):
    with torch.no_grad():
        engine.module.weight.view(-1)[idx] += delta


def test_diagnostics_count_moved_coordinates_per_window_and_resume_exactly():
    eng = _Engine(10)
    p0 = eng.module.weight.detach().reshape(-1).clone()
    diag = diagnostics.Diagnostics(p0, window=2, rank=0)
    diag(1, eng)  # nothing moved (lr 0 at step 1)
    _step(eng, [0, 1, 2])
    diag(2, eng)
    assert diag.max_abs_displacement_step1 == 0.0
    assert diag.windows == [dict(step=2, steps=2, frac_updated=pytest.approx(0.3), mean_step_frac=pytest.approx(0.15),
                                 mean_abs_displacement=pytest.approx(0.15))]
    _step(eng, [0])
    diag(3, eng)
    state = json.loads(json.dumps({k: v for k, v in diag.state_dict(12.5).items() if k not in ("prev", "changed")}))
    resumed = diagnostics.Diagnostics(p0, window=2, rank=0)
    resumed.load_state_dict(dict(state, prev=diag.prev.clone(), changed=diag.changed.clone()))
    assert resumed.wall_before == 12.5
    _step(eng, [5, 6])
    diag(4, eng)
    resumed(4, eng)
    assert resumed.windows == diag.windows
    # step 3 moved 1 coordinate, step 4 two others: 3 of 10 in the window, 0.15 per step on average
    assert diag.windows[1] == dict(step=4, steps=2, frac_updated=pytest.approx(0.3), mean_step_frac=pytest.approx(0.15),
                                   mean_abs_displacement=pytest.approx(3.0 / 10))
    s = diag.summary()
    assert s["frac_updated_last_window"] == pytest.approx(0.3) and s["mean_abs_displacement"] == pytest.approx(0.3)
    other_rank = diagnostics.Diagnostics(p0, window=2, rank=1)
    other_rank(1, eng)
    assert other_rank.windows == [] and other_rank.window_steps == 0


def test_resume_bookkeeping(tmp_path):
    ckpt = tmp_path / "r.ckpt"
    assert runner._checkpoint_step(str(ckpt)) == 0
    (ckpt / "global_step30").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step30")
    assert runner._checkpoint_step(str(ckpt)) == 0, "a checkpoint without the diagnostics' state is not resumable"
    (ckpt / "global_step30" / runs.CKPT_STATE).write_bytes(b"x")
    assert runner._checkpoint_step(str(ckpt)) == 30
    metrics = tmp_path / "r.jsonl"
    metrics.write_text("".join(json.dumps(dict(step=s, loss=1.0)) + "\n" for s in range(1, 41)))
    runner._keep_rows_up_to(str(metrics), 30)
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == list(range(1, 31))


def _legacy_run(d, name, val_loss, wall_s=10.0):
    cfg = runs.make_config(name, 20, 16, 5)
    opts = dict(runs.DEFAULTS, train_iters=20)
    del opts["steps"], opts["lr"], opts["ranks"], opts["val_fraction"], opts["ckpt_interval"], opts["diag_window"]
    (d / f"{name}.ds_config.json").write_text(json.dumps(cfg))
    (d / f"{name}.json").write_text(json.dumps(dict(steps=20, val_loss=val_loss, bytes_sent=10, bytes_dense=40,
                                                    wall_s=wall_s, name=name, label=runs.RUNS[name][0], opts=opts)))
    rows = [dict(step=s, loss=5.0 - s / 10) | (dict(val_loss=val_loss + (20 - s) / 100) if s % 10 == 0 else {})
            for s in range(1, 21)]
    (d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_legacy_import_and_tables(tmp_path):
    legacy, bench = tmp_path / "legacy", tmp_path / "bench"
    legacy.mkdir()
    _legacy_run(legacy, "adamw", 2.0)
    _legacy_run(legacy, "scape99", 2.5)
    results = tables.import_legacy(str(legacy))
    assert set(results) == {"adamw__steps20", "scape99__steps20"}
    rows = tables.write_tables(results, str(bench))
    assert list(rows) == ["adamw__steps20", "scape99__steps20"]
    with open(bench / runs.SUMMARY_CSV, newline="") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == runs.SUMMARY_COLUMNS
    assert [(r["run"], r["method"], r["update_rule"], float(r["val_loss"]), float(r["bytes_frac"]), r["steps"])
            for r in table] == [("adamw__steps20", "adamw", "", 2.0, 0.25, "20"),
                                ("scape99__steps20", "scape", "lazy", 2.5, 0.25, "20")]
    assert table[1]["command"] == "python bench/quality.py --runs comparison,sweep"
    _, curves = tables.read_tables(str(bench))
    assert curves["scape99__steps20"] == [(10, pytest.approx(2.6)), (20, pytest.approx(2.5))]
    # a new row with diagnostics, and the dense AdamS row it is compared with; same id replaces
    new = {"adams__steps20": dict(run="adams__steps20", method="adams", lr=3e-3, n_layer=2, n_embd=128, steps=20,
                                  seed=1234, ranks=2, val_fraction=0.05, val_loss=2.2, bytes_frac=1.0, wall_s=9.0,
                                  mean_abs_displacement=0.02, label="dense AdamS", curve=[(20, 2.2)]),
           "scape99__steps20": dict(results["scape99__steps20"], val_loss=2.4, mean_abs_displacement=0.005)}
    rows = tables.write_tables(new, str(bench))
    assert len(rows) == 3 and float(rows["scape99__steps20"]["val_loss"]) == 2.4
    assert float(rows["scape99__steps20"]["displacement_vs_adams"]) == pytest.approx(0.25)
    assert rows["adamw__steps20"]["displacement_vs_adams"] == ""
    text = tables.table(rows)
    assert "| scape99__steps20 | 2.4000 | 1.2000 | 25.00% |" in text
    rows, curves = tables.read_tables(str(bench))
    plots.plot(rows, curves, str(bench / runs.PLOT_PNG))
    assert os.path.getsize(bench / runs.PLOT_PNG) > 0
    assert not math.isnan(tables._num(rows["adams__steps20"]["mean_abs_displacement"]))


def test_tracked_tables_cover_the_bundled_runs():
    rows, curves = tables.read_tables(os.path.join(REPO, "bench"))
    assert set(runs.RUNS) <= {r.split("__")[0] for r in rows}
    for rid, r in rows.items():
        assert r["command"].startswith("python bench/quality.py"), rid
        assert curves.get(rid), rid
        assert int(r["steps"]) == curves[rid][-1][0]
        assert float(r["val_loss"]) == pytest.approx(curves[rid][-1][1], abs=5.1e-5)  # curves keep 4 decimals


def test_summaries_get_their_ratio_to_dense_adams_in_the_same_dir(tmp_path):
    base = dict(lr=1e-3, n_layer=2, n_embd=128, steps=100, seed=1234, ranks=2, val_fraction=0.05)
    runs = {"adams_lr1e-3__steps100": dict(base, method="adams", mean_abs_displacement=0.04),
            "scape99_lr1e-3__steps100": dict(base, method="scape", mean_abs_displacement=0.01),
            "scape99__steps100": dict(base, lr=3e-3, method="scape", mean_abs_displacement=0.02)}
    for rid, s in runs.items():
        (tmp_path / f"{rid}.json").write_text(json.dumps(s))
    (tmp_path / "x.ds_config.json").write_text("{}")
    runner.update_displacement_ratios(str(tmp_path))
    ratio = {rid: json.loads((tmp_path / f"{rid}.json").read_text())["displacement_vs_adams"] for rid in runs}
    assert ratio == {"adams_lr1e-3__steps100": 1.0, "scape99_lr1e-3__steps100": 0.25, "scape99__steps100": ""}


def test_best_lr_table_and_plot(tmp_path):
    small = dict(n_layer=2, n_embd=128, steps=20, seed=1234, ranks=2, val_fraction=0.05)

    def row(rid, label, method, lr, val, bytes_frac=1.0, sparsity="", settings=small):
        return rid, dict(settings, run=rid, label=label, method=method, lr=lr, val_loss=val, bytes_frac=bytes_frac,
                         sparsity=sparsity)

    rows = dict([
        row("adamw__steps20", "dense AdamW", "adamw", 3e-3, 2.0),
        row("adamw_lr1e-3__steps20", "dense AdamW, lr 1e-3", "adamw", 1e-3, 1.8),
        row("scape99__steps20", "SCAPE 0.99, T=100", "scape", 3e-3, 2.7, 0.0278, 0.99),
        row("scape99__steps20_lr0.006", "SCAPE 0.99, T=100", "scape", 6e-3, 2.25, 0.0278, 0.99),
        row("reselect99_R50__steps20", "SCAPE 0.99, T=100, masks re-chosen every 50 steps", "scape", 6e-3, 2.16,
            0.0278, 0.99),
        row("scape99__steps30", "SCAPE 0.99, T=100", "scape", 3e-3, 2.5, 0.0278, 0.99, dict(small, steps=30)),
    ])
    groups = tables.best_by_lr(rows)
    g = groups[tables._settings(rows["adamw__steps20"])]
    assert g["dense AdamW"][0]["run"] == "adamw_lr1e-3__steps20" and g["dense AdamW"][1] == [1e-3, 3e-3]
    assert g["SCAPE 0.99, T=100"][0]["run"] == "scape99__steps20_lr0.006"
    lines = tables.best_table(rows).splitlines()[2:]
    assert [line.split(" | ")[1] for line in lines] == [  # best first; the 30-step group has no AdamW row
        "dense AdamW", "SCAPE 0.99, T=100, masks re-chosen every 50 steps", "SCAPE 0.99, T=100"]
    assert lines[2].endswith("| SCAPE 0.99, T=100 | 0.006 (0.003, 0.006) | 2.2500 | 1.250x | 2.78% |")
    # the per-run table's ratio: over AdamW at its best lr for the same settings (1.8 at 1e-3), "-" without one
    ratios = {line.split(" | ")[0][2:]: line.split(" | ")[2]
              for line in tables.table({k: dict(r, wall_s=1) for k, r in rows.items()}).splitlines()[2:]}
    assert ratios["scape99__steps20_lr0.006"] == "1.2500" and ratios["adamw__steps20"] == "1.1111"
    assert ratios["scape99__steps30"] == "-"
    curves = {rid: [(10, r["val_loss"] + 0.5), (20, r["val_loss"])] for rid, r in rows.items()}
    plots.plot_best(rows, curves, str(tmp_path / runs.BEST_PNG))
    assert os.path.getsize(tmp_path / runs.BEST_PNG) > 0


def test_seed_groups_give_mean_spread_and_the_ratio_to_adamw_of_the_same_seed(tmp_path):
    base = dict(n_layer=2, n_embd=128, steps=20, ranks=2, val_fraction=0.05, test_fraction=0.02)

    def row(rid, label, lr, seed, val, test, bytes_frac=1.0):
        return rid, dict(base, run=rid, label=label, method="x", lr=lr, seed=seed, val_loss=val, test_loss=test,
                         bytes_frac=bytes_frac)

    rows = dict([
        row("adamw__a", "dense AdamW", 3e-3, 1, 2.0, 2.1), row("adamw__b", "dense AdamW", 3e-3, 2, 2.2, 2.3),
        row("dct99__a", "SCAPE dct", 3e-3, 1, 2.02, 2.0, 0.02), row("dct99__b", "SCAPE dct", 3e-3, 2, 2.1, 2.3, 0.02),
        row("dct99__c", "SCAPE dct", 6e-3, 1, 2.5, 2.6, 0.02),  # one seed at this lr: no group
    ])
    groups = {g["configuration"]: g for g in tables.write_seed_table(rows, str(tmp_path))}
    assert set(groups) == {"dense AdamW", "SCAPE dct"}
    g = groups["SCAPE dct"]
    assert g["seeds"] == "1 2" and g["val_mean"] == pytest.approx(2.06) and (g["val_min"], g["val_max"]) == (2.02, 2.1)
    assert (g["test_mean"], g["test_min"], g["test_max"]) == (pytest.approx(2.15), 2.0, 2.3)
    # paired by seed: 2.0 / 2.1 and 2.3 / 2.3, not the ratio of the means
    assert g["test_vs_adamw_min"] == pytest.approx(2.0 / 2.1) and g["test_vs_adamw_max"] == pytest.approx(1.0)
    assert g["test_vs_adamw_mean"] == pytest.approx((2.0 / 2.1 + 1.0) / 2)
    with open(tmp_path / tables.SEEDS_CSV, encoding="utf-8") as f:
        written = list(csv.DictReader(f))
    assert [r["configuration"] for r in written] == ["SCAPE dct", "dense AdamW"]  # lowest mean test loss first
    assert "SCAPE dct | 0.003 | 1 2 | 2.0600 [2.0200, 2.1000]" in tables.seed_table(list(groups.values()))
    plots.plot_seeds(list(groups.values()), str(tmp_path / "seeds.png"))
    assert os.path.getsize(tmp_path / "seeds.png") > 0


def test_seed_groups_pair_with_adamw_at_its_best_lr_for_the_same_settings(tmp_path):
    # at 4 ranks AdamW's best lr is 4.5e-3, not the entry's 3e-3: the ratio is against the lr of AdamW's
    # lowest mean validation loss at those settings, whatever the other configuration's lr
    base = dict(n_layer=2, n_embd=128, steps=20, ranks=4, val_fraction=0.05, test_fraction=0.02)

    def row(rid, label, lr, seed, val, test):
        return rid, dict(base, run=rid, label=label, method="x", lr=lr, seed=seed, val_loss=val, test_loss=test,
                         bytes_frac=1.0)

    rows = dict([
        row("adamw__s1_a", "dense AdamW", 3e-3, 1, 2.3, 2.2), row("adamw__s2_a", "dense AdamW", 3e-3, 2, 2.1, 2.0),
        row("adamw__s1_b", "dense AdamW", 4.5e-3, 1, 2.0, 2.5), row("adamw__s2_b", "dense AdamW", 4.5e-3, 2, 2.2, 2.4),
        row("dct99__s1", "SCAPE dct", 3e-3, 1, 2.0, 2.25), row("dct99__s2", "SCAPE dct", 3e-3, 2, 2.0, 2.4),
    ])  # AdamW's mean val: 2.2 at 3e-3, 2.1 at 4.5e-3 (its test losses do not choose)
    for rid in ("adamw__s1_a", "adamw__s2_a", "adamw__s1_b", "adamw__s2_b"):
        rows[rid]["seed"] = str(rows[rid]["seed"])  # read back from the csv; the dct99 rows fresh (int seeds)
    g = {g["configuration"]: g for g in tables.seed_groups(rows)}["SCAPE dct"]
    assert (g["test_vs_adamw_min"], g["test_vs_adamw_max"]) == (pytest.approx(0.9), pytest.approx(1.0))


def test_a_dirty_run_stores_its_diff_and_names_its_hash(tmp_path, monkeypatch):
    import hashlib
    import subprocess

    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run(["git", "init", "-q", str(repo)], check=True)
    (repo / "f.py").write_text("a = 1\n")
    subprocess.run(git + ["add", "f.py"], check=True)
    subprocess.run(git + ["commit", "-qm", "x"], check=True)
    monkeypatch.setattr(runner, "REPO", str(repo))
    patch = str(tmp_path / "run.patch")
    runner._record_diff(patch)
    assert not os.path.exists(patch) and runner._versions(patch)["git_diff_sha256"] == ""  # clean: no patch
    assert not runner._versions(patch)["git_rev"].endswith("+dirty")
    (repo / "f.py").write_text("a = 2\n")
    runner._record_diff(patch)
    text = open(patch, encoding="utf-8").read()
    assert "-a = 1" in text and "+a = 2" in text
    v = runner._versions(patch)
    assert v["git_rev"].endswith("+dirty") and v["git_diff_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    # the patch applies: the dirty run's code is recoverable from HEAD + the patch
    subprocess.run(git + ["checkout", "-q", "f.py"], check=True)
    subprocess.run(git + ["apply", patch], check=True)
    assert (repo / "f.py").read_text() == "a = 2\n"
