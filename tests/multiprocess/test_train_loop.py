"""scape_ds.train.train on 2 gloo ranks: the on_step hook, the returned summary, the metrics file."""
from __future__ import annotations

import json
import math
import os

import pytest

from .harness import run_ranks

pytestmark = pytest.mark.timeout(600)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(rank, world_size, tmp_path, steps, config, extra=()):
    from scape_ds.train import build_parser, check_inputs, train

    os.environ["LOCAL_RANK"] = str(rank)  # what a launcher sets; DeepSpeed's engine asks for it
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # one node: scape_hier.json takes G from here
    args = build_parser().parse_args([
        "--deepspeed_config", os.path.join(REPO, "ds_configs", config), "--train-iters", str(steps),
        "--eval-interval", "2", "--eval-iters", "1", "--seq-len", "32", "--n-layer", "1", "--n-head", "2",
        "--n-embd", "32", "--no-progress", "--metrics-out", os.path.join(tmp_path, "m.jsonl"), *extra])
    calls = []
    summary = train(args, check_inputs(args), on_step=lambda step, engine: calls.append((step, engine.global_steps)))
    return calls, summary


def _worker_opening(rank, world_size, tmp_path, config):
    """The run's opening line (rank 0 prints it) from a 1-step run."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        _worker(rank, world_size, tmp_path, 1, config)
    return next((line for line in out.getvalue().splitlines() if "params on rank 0" in line), None)


def test_opening_line_names_the_overlap(tmp_path):
    line, _ = run_ranks(_worker_opening, 2, tmp_path / "a", "scape_dct_overlap.json", timeout_s=120)
    assert "SCAPE dct sparsity 0.99" in line and "overlap (25 MB buckets)" in line, line
    line, _ = run_ranks(_worker_opening, 2, tmp_path / "b", "scape_dct.json", timeout_s=120)
    assert "SCAPE dct sparsity 0.99" in line and "overlap" not in line, line


@pytest.mark.parametrize("config", ["scape_coordinate.json", "scape_hier.json", "scape_dct.json"])
def test_on_step_runs_on_every_rank_after_each_step_and_summary_is_shared(tmp_path, config):
    steps = 3
    (calls0, s0), (calls1, s1) = run_ranks(_worker, 2, tmp_path, steps, config, timeout_s=120)
    assert calls0 == calls1 == [(t, t) for t in range(1, steps + 1)]  # after the optimizer step: engine counted it
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]  # rank 0 writes
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert s0["steps"] == steps and s0["final_loss"] == rows[-1]["loss"] and math.isfinite(s0["final_loss"])
    assert s0["final_loss"] == s1["final_loss"] and s0["val_loss"] == s1["val_loss"] == rows[-1]["val_loss"]
    assert s0["bytes_sent"] == sum(r["bytes_sent"] for r in rows)
    assert s0["bytes_dense"] == sum(r["bytes_dense"] for r in rows)
    for r in rows:  # flat: every byte counts as inter-node; one node of 2 (scape_hier.json): every byte intra
        assert r["bytes_inter"] + r["bytes_intra"] == r["bytes_sent"]
        assert (r["bytes_inter"] if config == "scape_hier.json" else r["bytes_intra"]) == 0


@pytest.mark.parametrize("config", ["scape_hier.json", "scape_dct.json", "scape_dct_overlap.json", "scape_local.json"])
def test_run_resumes_exactly_from_its_checkpoint(tmp_path, config):
    """through save_checkpoint/load_checkpoint: 4 steps straight, or 2 + a resume to 4."""
    ckpt = os.path.join(tmp_path, "ckpt")
    straight = run_ranks(_worker, 2, tmp_path / "a", 4, config, timeout_s=120)
    run_ranks(_worker, 2, tmp_path / "b", 2, config, ("--save", ckpt), timeout_s=120)
    if config == "scape_hier.json":
        assert sorted(n for n in os.listdir(os.path.join(ckpt, "global_step2")) if n.startswith("scape_")) == [
            "scape_dp_rank_00000_global_rank_00000.pt", "scape_dp_rank_00000_global_rank_00001.pt"]  # per node rank
    resumed = run_ranks(_worker, 2, tmp_path / "c", 4, config, ("--load", ckpt), timeout_s=120)
    assert [c for c, _ in resumed] == [[(3, 3), (4, 4)]] * 2
    assert resumed[0][1]["final_loss"] == straight[0][1]["final_loss"]
    assert resumed[0][1]["val_loss"] == straight[0][1]["val_loss"]


def test_dct_resume_across_sparsity_trains_on_and_another_basis_is_refused(tmp_path):
    """basis "dct" chooses its masks every step: a checkpoint resumes at another sparsity as it is; a
    run in the coordinate basis refuses it before DeepSpeed loads anything."""
    ckpt = os.path.join(tmp_path, "ckpt")
    run_ranks(_worker, 2, tmp_path / "a", 2, "scape_dct.json", ("--save", ckpt), timeout_s=120)
    with open(os.path.join(REPO, "ds_configs", "scape_dct.json")) as f:
        cfg = json.load(f)
    cfg["scape"]["sparsity"] = 0.9
    (tmp_path / "s90.json").write_text(json.dumps(cfg))
    resumed = run_ranks(_worker, 2, tmp_path / "b", 4, str(tmp_path / "s90.json"), ("--load", ckpt), timeout_s=120)
    assert [c for c, _ in resumed] == [[(3, 3), (4, 4)]] * 2
    assert math.isfinite(resumed[0][1]["final_loss"])
    with pytest.raises(AssertionError, match="saved with scape.basis 'dct', this run has 'coordinate'"):
        run_ranks(_worker, 2, tmp_path / "c", 4, "scape_coordinate.json", ("--load", ckpt), timeout_s=120)


def _zero_params(step, engine):
    """An on_step that sets every parameter to 0: the GPT's logits are then 0, its loss ln 256 exactly."""
    import torch

    with torch.no_grad():
        for p in engine.module.parameters():
            p.zero_()


def _worker_zeroed(rank, world_size, tmp_path, extra):
    from scape_ds.train import build_parser, check_inputs, train

    os.environ["LOCAL_RANK"] = str(rank)
    args = build_parser().parse_args([
        "--deepspeed_config", os.path.join(REPO, "ds_configs", "dense_adamw.json"), "--train-iters", "2",
        "--eval-interval", "1", "--eval-iters", "1", "--seq-len", "32", "--n-layer", "1", "--n-head", "2",
        "--n-embd", "32", "--no-progress", "--metrics-out", os.path.join(tmp_path, "m.jsonl"), *extra])
    return train(args, check_inputs(args), on_step=_zero_params)


def test_validation_and_test_see_the_model_after_on_step(tmp_path):
    """on_step (a local-step baseline's outer step) runs before the step's validation; the held-apart
    test split is evaluated once, after the last step, on every window of it."""
    s0, s1 = run_ranks(_worker_zeroed, 2, tmp_path, ("--test-fraction", "0.02"), timeout_s=120)
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["val_loss"] for r in rows] == pytest.approx([math.log(256)] * 2, abs=1e-5)  # fp32 logits
    assert [("test_loss" in r) for r in rows] == [False, True]
    assert s0["test_loss"] == s1["test_loss"] == rows[-1]["test_loss"] == pytest.approx(math.log(256), abs=1e-5)
    assert "test_loss" not in run_ranks(_worker_zeroed, 2, tmp_path / "b", (), timeout_s=120)[0]
