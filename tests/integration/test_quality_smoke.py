"""Smoke version of bench/quality.py (2 ranks, 100 steps, same start, data and schedule per run), and its
resume: a run stopped at a checkpoint and continued gives the same losses as one run straight through.

What a short run can honestly show, from the measurements in bench/RESULTS.md: at 100 steps SCAPE
0.9 is already at dense AdamS's validation loss (measured 2.545 vs 2.557), while SCAPE 0.99 still
lags (3.26: with T=100 its first 100 steps use one mask chosen at step 0); the 1500-step sweep is
where 0.99 is judged. So this asserts 0.9 within 5% of dense AdamS, 0.99 learning (validation loss
below the untrained model's ln 256 = 5.55 by a wide margin), the bytes each sent, and the diagnostics:
with one mask for the whole run, only about (1 - sparsity) of the coordinates move, while dense AdamS
moves (nearly) all of them at every step.
"""
from __future__ import annotations

import math
import os

import pytest
from qualitybench import runner, runs  # noqa: E402  (bench/ is on pytest's pythonpath, pytest.ini)


@pytest.mark.timeout(900)
def test_quality_smoke_scape90_matches_dense_adams_at_100_steps(tmp_path):
    opts = dict(steps=100, eval_interval=50)
    res = runner.run(["adams", "scape90", "scape99"], str(tmp_path), **opts)
    ids = {n: runs.run_id(n, runs.resolve_opts(**opts)) for n in ("adams", "scape90", "scape99")}
    assert set(res) == set(ids.values())
    res = {n: res[rid] for n, rid in ids.items()}
    dense, s90, s99 = (res[n]["val_loss"] for n in ("adams", "scape90", "scape99"))
    assert s90 <= 1.05 * dense, (s90, dense)
    assert s99 < math.log(256) - 1.5, s99
    assert res["adams"]["bytes_sent"] == res["adams"]["bytes_dense"]
    assert res["scape90"]["bytes_sent"] <= 0.13 * res["scape90"]["bytes_dense"]
    assert res["scape99"]["bytes_sent"] <= 0.04 * res["scape99"]["bytes_dense"]
    # every run started from the same model and data: identical first-step loss
    firsts = {round(r["losses"][0], 6) for r in res.values()}
    assert len(firsts) == 1, firsts
    assert [s for s, _ in res["scape99"]["curve"]] == [50, 100]
    # diagnostics: p_0 is rebuilt right (lr is 0 at step 1, so nothing has moved from it yet); the one
    # mask of a 100-step run at T=100 moves ~1% (0.99) or ~10% (0.9) of the coordinates, dense all
    for r in res.values():
        assert r["max_abs_displacement_step1"] == 0.0, r["run"]
        assert r["n_params"] == 445952 and r["method"] in ("adams", "scape")
    assert res["adams"]["mean_step_frac_last_window"] > 0.9, res["adams"]["diag_windows"]
    assert res["scape99"]["frac_updated_last_window"] < 0.03, res["scape99"]["diag_windows"]
    assert res["scape90"]["frac_updated_last_window"] < 0.15, res["scape90"]["diag_windows"]
    ratio = {n: r["displacement_vs_adams"] for n, r in res.items()}  # against dense AdamS in the same dir
    assert ratio["adams"] == 1.0 and 0 < ratio["scape99"] < ratio["scape90"] < 1.0, ratio


@pytest.mark.timeout(900)
def test_quality_run_resumes_from_its_checkpoint_with_the_same_losses(tmp_path):
    """A tiny model, 20 steps: straight through, and stopped at step 13 (mid refresh period, mid window)
    then resumed; per-step losses, bytes, final validation loss and diagnostics are identical."""
    names = ["adamw", "scape99_T10"]
    opts = dict(steps=20, n_layer=1, n_embd=32, eval_interval=10, ckpt_interval=5, diag_window=10)
    straight = runner.run(names, str(tmp_path / "straight"), **opts)
    assert runner.run(names, str(tmp_path / "resumed"), stop_at=13, **opts) == {}
    assert sorted(os.listdir(tmp_path / "resumed" / "scape99_T10__L1_E32_steps20.ckpt")) == \
        ["global_step10", "global_step13", "global_step5", "latest"]
    resumed = runner.run(names, str(tmp_path / "resumed"), **opts)
    assert set(straight) == set(resumed) == {"adamw__L1_E32_steps20", "scape99_T10__L1_E32_steps20"}
    for rid, a in straight.items():
        b = resumed[rid]
        assert b["losses"] == a["losses"], rid
        assert b["val_loss"] == a["val_loss"]
        assert (b["bytes_sent"], b["bytes_dense"]) == (a["bytes_sent"], a["bytes_dense"])
        assert b["diag_windows"] == a["diag_windows"], rid
        assert [c for c in b["curve"] if c[0] % 10 == 0] == a["curve"]  # the stop adds a validation at step 13
    assert not os.path.exists(tmp_path / "resumed" / "scape99_T10__L1_E32_steps20.ckpt"), "kept after finishing"
