"""launch/pretrain.py on the GPU: every shipped single-node config on one GPU (rc 0, loss falls),
and SCAPE over NCCL on two ranks when two GPUs exist."""
from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest
import torch

from .conftest import N_GPUS, PYTHON, REPO, cuda_env

# one launch a test, which _run allows 420 s (the first may build kernels): above pytest.ini's 300 s default
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(480)]


def _fills_no_auto(path: str) -> bool:
    """Configs with "auto" values are for frameworks that fill them (hf_*, accelerate_*); pretrain refuses them."""
    with open(path, encoding="utf-8") as f:
        return '"auto"' not in f.read()


CONFIGS = sorted(os.path.basename(p) for p in glob.glob(os.path.join(REPO, "ds_configs", "*.json"))
                 if _fills_no_auto(p))
MODEL = ["--n-layer", "4", "--n-embd", "256", "--n-head", "4", "--seq-len", "128", "--eval-interval", "60",
         "--log-interval", "20", "--no-progress"]


def _mpi_missing() -> bool:
    try:
        from mpi4py import MPI  # noqa: F401
    except Exception:
        return True
    return False


def _run(cmd, tmp_path, timeout=420):
    metrics = os.path.join(tmp_path, "metrics.jsonl")
    proc = subprocess.run(cmd + ["--metrics-out", metrics], cwd=REPO, env=cuda_env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(metrics, encoding="utf-8") as f:
        return [json.loads(line) for line in f], proc.stdout


def _falls(records):
    losses = [r["loss"] for r in records]
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    return last < 0.9 * first, (first, last)


@pytest.mark.parametrize("config", CONFIGS)
def test_pretrain_one_gpu(tmp_path, config):
    if "mpi" in config and _mpi_missing():
        pytest.skip("comm_backend 'mpi' needs mpi4py and an MPI library")
    cmd = [PYTHON, "launch/pretrain.py", "--deepspeed_config", f"ds_configs/{config}", "--train-iters", "60"] + MODEL
    records, out = _run(cmd, tmp_path)
    assert len(records) == 60
    ok, losses = _falls(records)
    assert ok, (config, losses, out[-2000:])


@pytest.mark.skipif(N_GPUS < 2, reason="needs two GPUs")
@pytest.mark.parametrize("config", ["scape_coordinate.json", "scape_zero3_replica.json", "scape_zero3_bf16.json"])
def test_pretrain_two_ranks_nccl(tmp_path, config):
    cmd = [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "launch/pretrain.py",
           "--deepspeed_config", f"ds_configs/{config}", "--train-iters", "60"] + MODEL
    records, out = _run(cmd, tmp_path)
    ok, losses = _falls(records)
    assert ok, (config, losses)
    sparse = [r for r in records[1:] if r["bytes_sent"] < r["bytes_dense"]]
    assert sparse and all(r["bytes_sent"] <= 0.05 * r["bytes_dense"] for r in sparse), "SCAPE sent dense volumes"
