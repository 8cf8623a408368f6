"""Network faults in the middle of a 2-node launch/pretrain.py run on the emulated cluster (needs root).

A node whose link goes down ends every rank within --dist-timeout plus a few seconds, each with one
line naming the rank it lost and the checkpoint to resume from, which a run on the healed cluster
loads. A link slowed to 1 Mbit/s mid-run costs time, not steps or numbers.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from scape_ds.cluster import Cluster, namespace_tag, namespaces, need_root

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NO_ROOT = need_root()
pytestmark = [pytest.mark.timeout(300), pytest.mark.skipif(NO_ROOT is not None, reason=str(NO_ROOT))]

TIMEOUT_S = 10
"""--dist-timeout of the runs: the link-down test's clock."""
MARGIN_S = 8
"""What a rank may take past TIMEOUT_S to exit: the peer probe (2.5 s here) and writing its line."""
TINY = ["--n-layer", "1", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--eval-iters", "1", "--no-progress",
        "--log-interval", "1000"]


def _ours() -> set[str]:
    return {n for n in namespaces() if namespace_tag(n) == f"scape{os.getpid()}"}


def _pretrain(c: Cluster, tmp_path, name: str, args: list[str], port_offset: int = 0) -> list[subprocess.Popen]:
    """Start launch/pretrain.py on every rank of ``c``, stdout and stderr to ``tmp_path/<name>.<rank>.{out,err}``."""
    cmd = [sys.executable, "launch/pretrain.py", *TINY, "--dist-timeout", str(TIMEOUT_S), *args]
    procs = []
    for rank in range(c.world_size):
        env = c.rank_env(rank, dict(MASTER_PORT=str(c.master_port + port_offset), PYTHONUNBUFFERED="1",
                                    DS_ACCELERATOR="cpu"))
        with open(tmp_path / f"{name}.{rank}.out", "w") as out, open(tmp_path / f"{name}.{rank}.err", "w") as err:
            procs.append(subprocess.Popen(["ip", "netns", "exec", c.node(rank), *cmd], cwd=REPO, env=env, stdout=out,
                                          stderr=err))
    c.procs += procs
    return procs


def _text(tmp_path, name: str, rank: int, stream: str) -> str:
    return (tmp_path / f"{name}.{rank}.{stream}").read_text()


def _wait_until(cond, procs, timeout: float, what: str, poll: float = 0.1) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert all(p.poll() is None for p in procs), f"a rank ended before {what}"
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(poll)


@contextlib.contextmanager
def _stopped(procs):
    """Every rank frozen (SIGSTOP) inside the block, resumed after it: far below their collective timeout."""
    for p in procs:
        os.kill(p.pid, signal.SIGSTOP)  # `ip netns exec` execs the command: p.pid is the rank
    try:
        yield
    finally:
        for p in procs:
            os.kill(p.pid, signal.SIGCONT)


def _exit_times(procs, timeout: float) -> list[float | None]:
    """Seconds from now until each process ends (None: still running after ``timeout``)."""
    t0, ends = time.monotonic(), [None] * len(procs)
    while any(e is None for e in ends) and time.monotonic() - t0 < timeout:
        for i, p in enumerate(procs):
            if ends[i] is None and p.poll() is not None:
                ends[i] = time.monotonic() - t0
        time.sleep(0.05)
    return ends


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_link_down_ends_every_rank_within_the_timeout_and_the_last_checkpoint_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    assert not _ours()
    with Cluster(2, "1gbit", "0.5ms") as c:
        procs = _pretrain(c, tmp_path, "cut", ["--deepspeed_config", "ds_configs/scape_coordinate.json",
                                               "--train-iters", "5000", "--eval-interval", "5000", "--save", str(ckpt),
                                               "--save-interval", "5"])
        _wait_until(lambda: (ckpt / "latest").exists(), procs, 120, "first checkpoint")
        time.sleep(0.5)  # mid-run: between checkpoints, or in one
        c.link_down(1)
        ends = _exit_times(procs, TIMEOUT_S + 60)
        print(f"ranks exited {ends} s after the cut (--dist-timeout {TIMEOUT_S})")
        codes = [p.returncode for p in procs]
        errs = [_text(tmp_path, "cut", r, "err") for r in range(2)]
        assert codes == [3, 3], (codes, [e[-3000:] for e in errs])
        assert all(e < TIMEOUT_S + MARGIN_S for e in ends), f"exits {ends} s after the cut, timeout {TIMEOUT_S} s"
        tag = (ckpt / "latest").read_text().strip()
        for rank, err in enumerate(errs):
            lines = [line for line in err.splitlines() if line.startswith("pretrain.py: error:")]
            assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
            line = lines[0]
            assert f"rank {rank}: lost contact with rank {1 - rank} (" in line, line
            assert f"timed out after {TIMEOUT_S} s" in line, line
            assert re.search(r"in (step \d+|saving global_step\d+|validation at step \d+)", line), line
            assert f"the last complete checkpoint is {tag} in {ckpt}: resume with --load {ckpt}" in line, line
        step = int(tag.removeprefix("global_step"))

        c.link_up(1)  # healed: the same two nodes resume from the checkpoint the lines name
        metrics = tmp_path / "resume.jsonl"
        procs = _pretrain(c, tmp_path, "resume", ["--deepspeed_config", "ds_configs/scape_coordinate.json",
                                                  "--load", str(ckpt), "--train-iters", str(step + 2),
                                                  "--eval-interval", "1000", "--metrics-out", str(metrics)],
                          port_offset=1)
        assert c.wait(procs, 180) == [0, 0], [_text(tmp_path, "resume", r, "err")[-3000:] for r in range(2)]
        assert f"resumed from {ckpt}/{tag} at step {step}" in _text(tmp_path, "resume", 0, "out")
        assert [r["step"] for r in _rows(metrics)] == [step + 1, step + 2]
    assert not _ours(), "namespaces left behind"


def test_link_slowed_to_1mbit_mid_run_loses_nothing(tmp_path):
    """The same 18 steps twice: on 1 Gbit/s links, and with node 1's link cut to 1 Mbit/s after step 6.
    The steps after the change take at least the time their bytes need at 1 Mbit/s (less the token
    bucket's 64 KiB burst; a dense step every 4th, the mask refresh, sends 88 KB); the run still
    finishes every step, with the same losses and the same final weights and optimizer state, bit for
    bit."""
    with open(os.path.join(REPO, "ds_configs", "scape_coordinate.json")) as f:
        cfg = json.load(f)
    cfg["scape"]["mask_refresh_interval"] = 4  # a dense exchange every 4 steps: bytes that feel the link
    config = tmp_path / "scape_t4.json"
    config.write_text(json.dumps(cfg))
    steps, slow_after = 18, 6
    assert not _ours()
    with Cluster(2, "1gbit", "0.5ms") as c:
        losses = {}
        for name in ("fast", "slow"):
            metrics = tmp_path / f"{name}.jsonl"
            procs = _pretrain(c, tmp_path, name, ["--deepspeed_config", str(config), "--train-iters", str(steps),
                                                  "--eval-interval", str(steps), "--metrics-out", str(metrics),
                                                  "--save", str(tmp_path / name)],
                              port_offset=0 if name == "fast" else 1)
            if name == "slow":
                _wait_until(lambda: len(_rows(metrics)) >= slow_after, procs, 120, f"step {slow_after}", poll=0.01)
                with _stopped(procs):  # steps take ~20 ms: the run would finish while tc runs
                    c.set_rate(1, "1mbit")
                    changed_at = len(_rows(metrics))  # steps recorded before the link slowed
                assert changed_at <= steps - 8, "the run outpaced the rate change"
            assert c.wait(procs, 240) == [0, 0], [_text(tmp_path, name, r, "err")[-3000:] for r in range(2)]
            rows = _rows(metrics)
            assert [r["step"] for r in rows] == list(range(1, steps + 1))
            losses[name] = [r["loss"] for r in rows]
            if name == "slow":  # a token bucket passes at most burst + rate * time
                after = rows[changed_at + 1:]
                least_s = (sum(r["bytes_sent"] for r in after) - 64 * 1024) * 8 / 1e6
                took_s = sum(r["step_time_s"] for r in after)
                assert least_s > 1 and took_s >= least_s, (took_s, least_s, "the link was not slowed")
    assert losses["slow"] == losses["fast"]
    for name in ("mp_rank_00_model_states.pt", "scape_dp_rank_00000.pt", "scape_dp_rank_00001.pt"):
        fast, slow = (_tensors(_torch_load(tmp_path / run / f"global_step{steps}" / name)) for run in ("fast", "slow"))
        assert fast.keys() == slow.keys() and fast, name  # weights, momentum, error feedback, masks: all equal
        assert all(torch.equal(fast[k], slow[k]) for k in fast), [k for k in fast if not torch.equal(fast[k], slow[k])]
    assert not _ours(), "namespaces left behind"


def _torch_load(path):
    return torch.load(path, map_location="cpu", weights_only=False)  # written by this test's runs


def _tensors(obj, prefix: str = "") -> dict:
    """Every tensor in a nested checkpoint object, by its path of keys."""
    if torch.is_tensor(obj):
        return {prefix: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    return {k: v for key, item in items for k, v in _tensors(item, f"{prefix}/{key}").items()}
