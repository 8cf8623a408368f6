"""Which optimizer of an engine is SCAPE's: :func:`scape_optimizer`, :func:`synchronized_optimizer`,
:func:`is_scape_optimizer`, :func:`is_scape_stage3`.

Below the engine and the checkpoint package, so that both can ask without importing each other.
``is_scape_stage3`` looks the ZeRO-3 class up in ``sys.modules`` instead of importing
``scape_ds.zero3`` (and DeepSpeed's stage 3 with it): an object can only be a ``ScapeStage3`` once
that module was imported.
"""
from __future__ import annotations

import sys

from .scape import ScapeAdamS

__all__ = ["scape_optimizer", "synchronized_optimizer", "is_scape_optimizer", "is_scape_stage3"]


def scape_optimizer(engine):
    """The engine's SCAPE optimizer (:class:`ScapeAdamS`, or the ZeRO-3 ``ScapeStage3``), or None.

    Both have ``cfg``, ``comm``, ``comm_stats`` (``bytes_sent``, ``bytes_dense`` per step) and ``synchronize()``.
    """
    opt = getattr(engine, "optimizer", None)
    return opt if is_scape_optimizer(opt) else None


def synchronized_optimizer(engine):
    """:func:`scape_optimizer`, after it has waited for its collectives in flight (``scape.overlap``'s
    new values or updates, a refresh's mask): what a save or load of the model's weights needs first."""
    opt = scape_optimizer(engine)
    if opt is not None:
        opt.synchronize()
    return opt


def is_scape_optimizer(opt) -> bool:
    """Whether ``opt`` is a SCAPE optimizer (:class:`ScapeAdamS` or the ZeRO-3 ``ScapeStage3``)."""
    return isinstance(opt, ScapeAdamS) or is_scape_stage3(opt)


def is_scape_stage3(opt) -> bool:
    """Whether ``opt`` is the ZeRO-3 ``ScapeStage3``."""
    if opt is None or isinstance(opt, ScapeAdamS):
        return False
    zero3 = sys.modules.get("scape_ds.zero3")
    return zero3 is not None and isinstance(opt, zero3.ScapeStage3)
