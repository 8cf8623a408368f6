"""GPU tests: collected everywhere, skipped (module-level) where CUDA is absent.

Every test here carries the ``gpu`` marker, registered below so ``-m gpu`` / ``-m "not gpu"`` and
``--strict-markers`` work whether or not a markers block lists it.
"""
from __future__ import annotations

import os
import sys

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (tests/gpu; skipped without one)")


def cuda_env(**extra) -> dict:
    """Environment for a subprocess on the GPU: DeepSpeed's CUDA accelerator (tests/conftest.py
    chooses the CPU one for the rest of the suite), the checkout first on the path."""
    env = dict(os.environ, DS_ACCELERATOR="cuda", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="4")
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


PYTHON = sys.executable
N_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
