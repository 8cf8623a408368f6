"""Memory per rank of SCAPE and of the AdamW it replaces: bytes per parameter, by buffer.

Two levels:
  * :func:`scape_stage01_bytes` is the exact byte count of :class:`~scape_ds.optim.ScapeAdamS`'s
    buffers for one param group of ``numel`` sparse-exchanged elements, padding included; a test
    checks it against ``ScapeAdamS.memory_bytes()``.
  * :func:`bytes_per_param` is the per-parameter limit (large N, every tensor sparse-exchanged) for
    each path and for DeepSpeed's AdamW at the same ZeRO stage: the memory table in docs/memory.md.

Accounting (p = bytes of a parameter in the compute dtype, e = bytes of an error-feedback value,
rho = 1 - sparsity, D = data-parallel ranks; activations and transient buffers are not counted):

  * SCAPE stage 0/1 (ScapeAdamS): parameters p and gradients p (views into two flat buffers), fp32
    master 4/D only when p < 4 (for fp32 it is a view of the parameters), momentum 4/D, error
    feedback e, masks 10*rho + 8*rho/D (int16 offsets and int64 indices of every shard, int64 local
    indices of this shard); ``rule_state`` for update_rule "catchup" 4/D (its v), "sign_drift" 1 (int8 signs), and 4/D
    for reselect_interval > 0 (int32 decay marks).
  * AdamW, as the ZeRO paper (Rajbhandari et al. 2020) accounts it: fp32 training keeps parameters
    4, gradients 4 and the two moments 8; bf16 mixed precision keeps parameters 2, gradients 2 and
    K = 12 bytes of fp32 state (master, two moments). Stage 0 keeps everything on every rank;
    stage 1 divides the optimizer state by D; stage 3 divides everything by D.
  * ZeRO-3, both optimizers: ZeRO-3's own partitions, parameters p/D, fp32 partition 4/D and fp32
    gradient partition 4/D (identical under both). AdamW adds its two moments 8/D; SCAPE adds the
    momentum 4/D, a full fp32 error feedback 4 (keyed by parameter) and its masks 8*rho (int64
    offsets of every rank's piece); ``sparse_replica`` adds a full compute-dtype copy p.
"""
from __future__ import annotations

import math

__all__ = ["scape_stage01_bytes", "scape_zero3_bytes", "bytes_per_param", "PATHS", "DTYPE_BYTES"]

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
PATHS = ("stage0", "stage1", "zero3", "zero3_sparse_replica")


def scape_stage01_bytes(numel: int, world_size: int, chunk_size: int, k_per_chunk: int, param_bytes: int,
                        error_feedback_bytes: int, compressor: str = "scape",
                        update_rule: str = "lazy", reselect: bool = False) -> dict[str, int]:
    """Exact bytes ScapeAdamS holds on one rank for one group of ``numel`` sparse elements (after its
    first step, masks included). Keys as ``ScapeAdamS.memory_bytes()``."""
    D, C = world_size, chunk_size
    quantum = D * C
    n_pad = max(quantum, -(-numel // quantum) * quantum)
    S = n_pad // D
    K = n_pad // C * k_per_chunk
    state = max(4, param_bytes)  # fp32 state, fp64 for fp64 parameters
    masks = 0 if compressor == "dense" else (2 + 8) * K + 8 * (K // D)
    return dict(
        params=param_bytes * n_pad,
        grads=param_bytes * n_pad,
        master=0 if param_bytes == state else state * S,
        momentum=state * S,
        error_feedback=0 if compressor == "dense" else error_feedback_bytes * n_pad,
        masks=masks,
        # scape.update_rule: "catchup" keeps v on the owned shard, "sign_drift" an int8 sign per coordinate;
        # reselect_interval > 0 an int32 decay mark per owned coordinate
        rule_state=dict(catchup=state * S, sign_drift=n_pad).get(update_rule, 0) + (4 * S if reselect else 0),
    )


def scape_zero3_bytes(numels: list[int], world_size: int, sparsity: float, param_bytes: int,
                      replica: bool, dense_numels: tuple[int, ...] = ()) -> dict[str, int]:
    """Exact bytes the SCAPE stage 3 holds on one rank for sparse-exchanged parameters of ``numels``
    elements and dense-exchanged ones of ``dense_numels`` (no error feedback, no mask), by the keys
    of ``ScapeStage3.memory_bytes()`` (ZeRO-3 pads each parameter to D pieces of P elements)."""
    D = world_size
    pieces = [math.ceil(n / D) for n in numels]
    all_pieces = pieces + [math.ceil(n / D) for n in dense_numels]
    ks = [max(1, math.ceil((1.0 - sparsity) * P)) for P in pieces]
    return dict(
        error_feedback=4 * D * sum(pieces),
        masks=8 * D * sum(ks),
        replica=param_bytes * (sum(numels) + sum(dense_numels)) if replica else 0,
        param_partitions=param_bytes * sum(all_pieces),
        fp32_partitions=4 * sum(all_pieces),
        momentum=4 * sum(all_pieces),
    )


def bytes_per_param(path: str, optimizer: str, world_size: int, dtype: str = "fp32", sparsity: float = 0.99,
                    error_feedback_dtype: str = "fp32") -> float:
    """Bytes per parameter on one rank, in the large-model limit.

    Args:
        path: "stage0", "stage1" (SCAPE runs both as its own sharded path), "zero3" (ZeRO-3 with
            ZeRO-3's parameter all-gather) or "zero3_sparse_replica".
        optimizer: "scape" or "adamw" (DeepSpeed's AdamW at the same stage; for the replica path,
            AdamW under plain ZeRO-3).
        world_size: D.
        dtype: compute dtype of the parameters, "fp32" or "bf16".
        error_feedback_dtype: SCAPE stage 0/1's ``scape.error_feedback_dtype``.
    """
    if path not in PATHS:
        raise ValueError(f"path must be one of {PATHS}, got {path!r}")
    if optimizer not in ("scape", "adamw"):
        raise ValueError(f"optimizer must be 'scape' or 'adamw', got {optimizer!r}")
    D, p, rho = world_size, DTYPE_BYTES[dtype], 1.0 - sparsity
    if optimizer == "adamw":
        state = 8 if dtype == "fp32" else 12  # two moments, plus an fp32 master under bf16
        if path == "stage0":
            return 2 * p + state
        if path == "stage1":
            return 2 * p + state / D
        return (p + 4 + 4 + 8) / D  # ZeRO-3: parameter, fp32 and gradient partitions, two moments
    if path in ("stage0", "stage1"):
        master = 0.0 if p == 4 else 4 / D
        return 2 * p + master + 4 / D + DTYPE_BYTES[error_feedback_dtype] + 10 * rho + 8 * rho / D
    zero3 = (p + 4 + 4 + 4) / D + 4 + 8 * rho  # partitions, momentum, fp32 error feedback, masks
    return zero3 + (p if path == "zero3_sparse_replica" else 0.0)
