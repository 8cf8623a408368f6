"""Stopping a run through the real `deepspeed` launcher (2 CPU ranks): SIGTERM to the `deepspeed`
command, SIGINT to its process group (Ctrl-C), or SIGKILL to DeepSpeed's launch.py ends every
process of the job after a checkpoint of the current step, and that checkpoint resumes (issue 35,
item 1)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from scape_ds.spawn import free_port

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
STOPPED = re.compile(r"^pretrain\.py: stopped after step (\d+) \(([^)]*)\): saved (global_step\d+) in (\S+): "
                     r"resume with --load (\S+)$")


def _env():
    return dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1")


def _kill_group(proc) -> None:
    """SIGKILL whatever is left of the job's session (orphans included), after a failed check."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _cmd(*args, config="ds_configs/scape_coordinate.json"):
    return [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()), "launch/pretrain.py",
            "--deepspeed_config", config, "--no-progress", "--log-interval", "1",
            "--eval-interval", "100000", "--eval-iters", "1", "--dist-timeout", "60", *args]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("how", ["sigterm_to_deepspeed", "sigint_to_group", "sigkill_to_launch_py"])
def test_stop_ends_every_process_after_a_checkpoint_that_resumes(tmp_path, how):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(_cmd("--train-iters", "100000", "--save", str(ckpt)), cwd=REPO, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("step     3 |") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-50:])
            time.sleep(0.2)
        job = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert len(job) >= 4, job  # deepspeed, launch.py, two ranks
        t0 = time.monotonic()
        if how == "sigterm_to_deepspeed":
            proc.send_signal(signal.SIGTERM)  # the runner alone: it dies, launch.py and the ranks must follow
        elif how == "sigint_to_group":
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: every process of the job gets SIGINT
        else:  # launch.py dies at once: the ranks get SIGTERM from Linux (PR_SET_PDEATHSIG)
            launch_py = psutil.Process(proc.pid).children()[0]
            assert "deepspeed.launcher.launch" in " ".join(launch_py.cmdline())
            launch_py.kill()
        proc.wait(timeout=30)
        while time.monotonic() - t0 < 30 and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                                 for p in job):
            time.sleep(0.2)
        alive = [p for p in job if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        assert alive == [], f"alive 30 s after the signal: {alive}"
        gone_s = time.monotonic() - t0
    finally:
        _kill_group(proc)
    reader.join(10)
    out = "".join(lines)
    stopped = [m for m in map(STOPPED.match, (line.rstrip("\n") for line in lines)) if m]
    assert len(stopped) == 1, out[-4000:]
    step, reason, tag, where, load = stopped[0].groups()
    assert reason in ("SIGTERM", "SIGINT", "the launcher ended") and where == load == str(ckpt), out[-2000:]
    assert tag == f"global_step{step}" and (ckpt / "latest").read_text() == tag
    assert "Traceback" not in out.split("step     1 |")[-1] or how == "sigint_to_group", out[-4000:]
    print(f"{how}: every process gone {gone_s:.1f} s after the signal; {stopped[0].group(0)}")

    if how != "sigterm_to_deepspeed":
        return
    resumed = subprocess.run(_cmd("--train-iters", str(int(step) + 2), "--load", str(ckpt)), cwd=REPO, env=_env(),
                             capture_output=True, text=True, timeout=400)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {ckpt / tag} at step {step}" in resumed.stdout
    assert f"step {int(step) + 2:5d} | loss" in resumed.stdout


@pytest.mark.timeout(600)
@pytest.mark.parametrize("victim,config", [(1, "scape_coordinate.json"), (0, "scape_coordinate.json"),
                                           (1, "scape_overlap_coordinate.json")])
def test_a_rank_killed_under_the_launcher_gets_one_line(tmp_path, victim, config):
    """Issue 35 items 2 and 3: SIGKILL to one rank; launch.py then SIGTERMs the other, which still
    prints the lost-peer line (no thread traceback when rank 0, the store's host, went first). With
    scape.overlap the survivor may be waiting in a bucket's collective (issue 30): the same line."""
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(_cmd("--train-iters", "100000", "--save", str(ckpt), "--save-interval", "2",
                                 config=f"ds_configs/{config}"), cwd=REPO,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("step     3 |") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-50:])
            time.sleep(0.2)
        job = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        ranks = [p for p in psutil.Process(proc.pid).children(recursive=True)
                 if any(a.startswith("--local_rank=") for a in p.cmdline())]
        target = next(p for p in ranks if f"--local_rank={victim}" in p.cmdline())
        target.kill()
        proc.wait(timeout=60)
        alive = [p for p in job if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
        assert alive == [], alive
    finally:
        _kill_group(proc)
    reader.join(10)
    out = "".join(lines)
    errors = [line for line in lines if line.startswith("pretrain.py: error:")]
    assert len(errors) == 1, out[-4000:]
    assert f"rank {1 - victim}: lost contact with rank {victim} (" in errors[0], errors[0]
    assert f"resume with --load {ckpt}" in errors[0], errors[0]
    assert "Traceback" not in out and "frame #" not in out, out[-4000:]  # no thread or C++ stack either
