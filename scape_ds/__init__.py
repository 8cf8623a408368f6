"""scape_ds: SCAPE sparse, error-compensated communication for DeepSpeed and Megatron-core.

``scape_ds.initialize`` is ``deepspeed.initialize`` with the SCAPE optimizer (docs/design.md); the
pieces are importable on their own: ``scape_ds.optim`` (AdamS, ScapeAdamS), ``scape_ds.comm``
(exchange backends and the byte meter), ``scape_ds.kernels``, ``scape_ds.config``.
``scape_ds.enable()`` routes frameworks that call ``deepspeed.initialize`` themselves (Hugging Face
Trainer, Lightning) through it (``scape_ds.integrations``).
"""
from .config import ScapeConfig, parse_scape_config
from .integrations import disable, enable, is_enabled

__version__ = "0.1.0"
__all__ = ["initialize", "enable", "disable", "is_enabled", "ScapeConfig", "parse_scape_config", "__version__"]


def initialize(*args, **kwargs):
    """``deepspeed.initialize`` with SCAPE; see :func:`scape_ds.engine.initialize`."""
    from .engine import initialize as _initialize

    return _initialize(*args, **kwargs)
