"""DeepSpeed settings the SCAPE exchange does not run with, one table for both integration paths.

Path A (ZeRO stage 0/1, ``engine._check_path_a``) and path B (ZeRO stage 3,
``zero3.check_stage3_config``) ask :func:`refused_settings` which of a config's settings their stage
refuses and raise :func:`refusal_message` as one ``ValueError`` line (docs/design.md section 2).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import offload_enabled

__all__ = ["RefusedSetting", "refused_settings", "refusal_message"]


@dataclass(frozen=True)
class RefusedSetting:
    """One DeepSpeed setting SCAPE refuses.

    Attributes:
        stages: the ZeRO stages that refuse it.
        setting: the setting as the config spells it (and the value refused, where it matters).
        is_set: whether a DeepSpeed config dict has it.
        why: the reason and what to do instead.
    """

    stages: tuple[int, ...]
    setting: str
    is_set: Callable[[dict], bool]
    why: str


def _zero(cfg: dict) -> dict:
    return cfg.get("zero_optimization") or {}


def _enabled(block: str) -> Callable[[dict], bool]:
    return lambda cfg: bool((cfg.get(block) or {}).get("enabled", False))


_STATE = "SCAPE keeps its optimizer state with its exchange, on the device: remove it"
_REDUCE = "SCAPE would otherwise run dense or reduce the wrong values: remove it"

_REFUSED = (
    RefusedSetting((0, 1, 3), "zero_optimization.offload_optimizer",
                   lambda c: offload_enabled(_zero(c).get("offload_optimizer")), _STATE),
    RefusedSetting((0, 1, 3), "zero_optimization.offload_param",
                   lambda c: offload_enabled(_zero(c).get("offload_param")), _STATE),
    RefusedSetting((0, 1, 3), "fp16", _enabled("fp16"), "dynamic loss scaling is not combined with error "
                   "feedback yet: use fp32, or bf16 under ZeRO stage 3"),
    RefusedSetting((0, 1), "bf16", lambda c: _enabled("bf16")(c) or _enabled("bfloat16")(c),
                   "not on the stage 0/1 path yet: use fp32, or ZeRO stage 3"),
    RefusedSetting((0, 1, 3), "torch_autocast", _enabled("torch_autocast"),
                   "not supported yet: use fp32, or bf16 under ZeRO stage 3"),
    RefusedSetting((3,), "zero_optimization.reduce_scatter false",
                   lambda c: _zero(c).get("reduce_scatter", True) is False, _REDUCE),
    RefusedSetting((3,), "zero_optimization.zero_quantized_gradients",
                   lambda c: bool(_zero(c).get("zero_quantized_gradients")), _REDUCE),
    RefusedSetting((3,), "zero_optimization.zero_quantized_weights",
                   lambda c: bool(_zero(c).get("zero_quantized_weights")), _REDUCE),
    RefusedSetting((3,), "zero_optimization.zero_hpz_partition_size > 1",
                   lambda c: int(_zero(c).get("zero_hpz_partition_size", 1) or 1) > 1, _REDUCE),
    RefusedSetting((3,), "gradient_predivide_factor != 1",
                   lambda c: float(c.get("gradient_predivide_factor", 1.0)) != 1.0, _REDUCE),
    RefusedSetting((3,), "prescale_gradients", lambda c: c.get("prescale_gradients", False) is True, _REDUCE),
)


def refused_settings(cfg: dict, stage: int) -> list[RefusedSetting]:
    """The settings of DeepSpeed config ``cfg`` that SCAPE refuses at ZeRO stage ``stage``, in table order."""
    return [r for r in _REFUSED if stage in r.stages and r.is_set(cfg)]


def refusal_message(refused: list[RefusedSetting], stage: int) -> str:
    """One line naming every refused setting with its reason."""
    listed = "; ".join(f"{r.setting} ({r.why})" for r in refused)
    return f"ScapeAdamS under ZeRO stage {stage} does not support {listed}"
