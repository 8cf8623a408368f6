"""examples/hf_trainer.py and examples/hf_gpt2_script.py through the `deepspeed` launcher on 2 CPU ranks.

Each example prints one ``scape_step {json}`` line per step on rank 0: loss, the optimizer's class,
bytes SCAPE sent and the dense exchange's bytes. 10 steps: the first is a dense refresh, the other
nine sparse at sparsity 0.99.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from scape_ds.spawn import free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
STEPS = 10


def _run_example(script, *args):
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), script, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=840)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    # searched, not split by lines: other ranks' output shares the launcher's stdout
    return [json.loads(m) for m in re.findall(r"scape_step (\{[^{}]*\})", proc.stdout)]


def _check_scape_run(rows, optimizer):
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    assert {r["optimizer"] for r in rows} == {optimizer}
    first = sum(r["loss"] for r in rows[:3]) / 3
    last = sum(r["loss"] for r in rows[-3:]) / 3
    assert last < first - 0.1, (first, last)
    assert rows[0]["bytes_sent"] >= rows[0]["bytes_dense"] > 0  # the first step is a dense refresh
    sparse = rows[1:]
    assert all(0 < r["bytes_sent"] < 0.05 * r["bytes_dense"] for r in sparse), [
        (r["bytes_sent"], r["bytes_dense"]) for r in sparse]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("config,optimizer", [
    ("ds_configs/hf_scape.json", "ScapeAdamS"),  # ZeRO stage 0/1: SCAPE shards the state itself
    ("ds_configs/hf_scape_zero3.json", "ScapeStage3"),  # DeepSpeed's stage 3 with SCAPE's exchange
])
def test_hf_trainer_example_trains_with_scape(config, optimizer, tmp_path):
    rows = _run_example("examples/hf_trainer.py", "--deepspeed", config, "--max-steps", str(STEPS),
                        "--output-dir", str(tmp_path / "out"))
    _check_scape_run(rows, optimizer)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("scape", [
    # ds_configs/scape_dct.json's exchange: every step sends this step's top coefficients, none is dense
    dict(basis="dct", mask="per_rank", sparsity=0.99, clip_local=1.0, ef_decay=0.999),
    dict(overlap=True),  # scape.overlap: the Trainer's backward and forward hooked, its accumulation boundary
])
def test_hf_trainer_example_with_the_dct_basis_and_overlap(scape, tmp_path):
    with open(os.path.join(REPO, "ds_configs", "hf_scape.json")) as f:
        cfg = json.load(f)
    cfg["scape"].update(scape)
    config = tmp_path / "hf.json"
    config.write_text(json.dumps(cfg))
    rows = _run_example("examples/hf_trainer.py", "--deepspeed", str(config), "--max-steps", str(STEPS),
                        "--output-dir", str(tmp_path / "out"))
    if scape.get("basis") != "dct":
        _check_scape_run(rows, "ScapeAdamS")
        return
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)) and {r["optimizer"] for r in rows} == {"ScapeAdamS"}
    assert sum(r["loss"] for r in rows[-3:]) < sum(r["loss"] for r in rows[:3]) - 0.3, rows
    assert all(0 < r["bytes_sent"] < 0.05 * r["bytes_dense"] for r in rows), rows


@pytest.mark.timeout(900)
def test_hf_gpt2_script_example_trains_with_scape():
    rows = _run_example("examples/hf_gpt2_script.py", "--deepspeed_config", "ds_configs/scape.json",
                        "--train-iters", str(STEPS))
    _check_scape_run(rows, "ScapeAdamS")
