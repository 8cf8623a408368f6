"""Shared test set-up.

Triton kernels run on CPU tensors only in Triton's interpreter, which must be chosen before triton
is first imported: without a GPU we choose it here, for every test process.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
