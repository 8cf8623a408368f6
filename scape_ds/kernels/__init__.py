"""Kernel dispatch: one place chooses the Triton or the torch implementation of every hot op.

``get_kernels(device, setting)`` returns a namespace with the functions of ``torch_kernels``
(``ef_accumulate_pack``, ``chunk_topk``, ``masked_adams_update``, ``dense_adams_update``, ``scatter_values``,
``encode_mask``, ``decode_mask``, ``mask_uses_bitmask``). ``setting`` is the config's ``kernels``:
``"auto"`` takes Triton for CUDA tensors when it imports and torch otherwise; ``"triton"`` insists
(Triton on CPU tensors works only under ``TRITON_INTERPRET=1``); ``"torch"`` never uses Triton.
Only this package imports triton.
"""
from __future__ import annotations

import types
import warnings

import torch

from . import torch_kernels

__all__ = ["get_kernels", "triton_available", "torch_kernels"]

_WARNED = False


def triton_available() -> bool:
    """True when ``triton`` and our Triton kernels import."""
    try:
        from . import triton_kernels  # noqa: F401
    except ImportError:
        return False
    return True


def get_kernels(device: torch.device | str, setting: str = "auto") -> types.ModuleType:
    """Return the kernel module to use for tensors on ``device``.

    Raises:
        ValueError: unknown ``setting``.
        ImportError: ``setting="triton"`` and triton is not installed.
    """
    global _WARNED
    device = torch.device(device)
    if setting == "torch":
        return torch_kernels
    if setting == "triton":
        from . import triton_kernels  # raises ImportError with the install hint

        return triton_kernels
    if setting != "auto":
        raise ValueError(f"kernels must be 'auto', 'triton' or 'torch', got {setting!r}")
    if device.type != "cuda":
        return torch_kernels
    if triton_available():
        from . import triton_kernels

        return triton_kernels
    if not _WARNED:
        warnings.warn("triton is not importable: SCAPE uses its slower torch kernels on CUDA", stacklevel=2)
        _WARNED = True
    return torch_kernels
