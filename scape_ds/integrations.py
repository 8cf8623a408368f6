"""SCAPE for frameworks that call ``deepspeed.initialize`` themselves (Hugging Face Trainer through
accelerate, Lightning's ``DeepSpeedStrategy``): ``scape_ds.enable()`` / ``scape_ds.disable()``.

    import scape_ds
    scape_ds.enable()          # before the Trainer / strategy builds its engine
    trainer = Trainer(model, TrainingArguments(..., deepspeed="ds_configs/hf_scape.json"), ...)

Steps of :func:`enable`:
  1. remember DeepSpeed's own ``deepspeed.initialize``;
  2. put :func:`routed_initialize` in its place, in the ``deepspeed`` module (accelerate and
     Lightning look it up there at call time) and in every already imported module that holds the
     original under some name (``from deepspeed import initialize`` done before ``enable()``);
  3. :func:`routed_initialize` reads the config it is given; a config with a ``"scape"`` block or
     ``optimizer.type`` ``"ScapeAdamS"``/``"AdamS"`` goes to :func:`scape_ds.initialize`, anything
     else to DeepSpeed unchanged. ``scape_ds.initialize`` calls ``deepspeed.initialize`` itself:
     calls made while a routed call is running go straight to DeepSpeed (a per-thread depth count).

Lightning: :class:`scape_ds.lightning.ScapeDeepSpeedStrategy` (also reachable as
``scape_ds.integrations.ScapeDeepSpeedStrategy``) builds SCAPE itself and runs on CPU too; it needs no
``enable()``.

Without ``enable()`` DeepSpeed meets a SCAPE config on its own: ``"type": "ScapeAdamS"`` stops in
its optimizer check with ``AssertionError: ScapeAdamS is not a supported DeepSpeed Optimizer``
(that message means: call ``scape_ds.enable()`` first). DeepSpeed has no hook that would let us
change that message without replacing its code at import time, which we do not do.
"""
from __future__ import annotations

import hashlib
import inspect
import sys
import threading
from typing import Any

__all__ = ["enable", "disable", "is_enabled", "routed_initialize", "wants_scape", "state_digest"]


def __getattr__(name: str):
    if name == "ScapeDeepSpeedStrategy":  # imported on first use: it needs lightning
        from .lightning import ScapeDeepSpeedStrategy

        return ScapeDeepSpeedStrategy
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

_lock = threading.Lock()
_state = threading.local()  # .depth: routed calls running on this thread
_original = None  # DeepSpeed's initialize while enabled, else None
_replaced: list[tuple[Any, str]] = []  # (module, attribute name) that hold routed_initialize


def wants_scape(config: Any, args: Any = None) -> bool:
    """Whether a DeepSpeed config (dict, JSON path or ``args.deepspeed_config``) asks for SCAPE:
    a ``"scape"`` block or ``optimizer.type`` ``"ScapeAdamS"``/``"AdamS"``. False for configs that
    cannot be read (DeepSpeed then reports them itself)."""
    from .engine import SCAPE_OPTIMIZERS, read_ds_config

    try:
        cfg = read_ds_config(config, args)
    except (ValueError, OSError):
        return False
    opt_block = cfg.get("optimizer")
    opt_type = opt_block.get("type") if isinstance(opt_block, dict) else None
    return "scape" in cfg or opt_type in SCAPE_OPTIMIZERS


def _bind(original, args: tuple, kwargs: dict) -> dict:
    """``deepspeed.initialize``'s arguments as keywords (its positional order differs from
    ``scape_ds.initialize``'s: ``distributed_port`` comes before ``mpu``)."""
    bound = inspect.signature(original).bind(*args, **kwargs)
    return dict(bound.arguments)


def routed_initialize(*args, **kwargs):
    """``deepspeed.initialize`` while :func:`enable` is on: SCAPE configs go to ``scape_ds.initialize``."""
    original = _original
    if original is None:  # disable() ran while a caller still held this function
        import deepspeed

        original = deepspeed.initialize
    depth = getattr(_state, "depth", 0)
    if depth > 0:  # scape_ds.initialize calling DeepSpeed
        return original(*args, **kwargs)
    call = _bind(original, args, kwargs)
    config = call.get("config") if call.get("config") is not None else call.get("config_params")
    if not wants_scape(config, call.get("args")):
        return original(*args, **kwargs)
    from .engine import initialize

    _state.depth = depth + 1
    try:
        return initialize(**call)
    finally:
        _state.depth = depth


def is_enabled() -> bool:
    """Whether :func:`enable` is in effect."""
    return _original is not None


def enable() -> None:
    """Route ``deepspeed.initialize`` calls whose config asks for SCAPE through ``scape_ds.initialize``.

    Idempotent. Also replaces DeepSpeed's function in modules that imported it by name before. On
    the CPU accelerator it also skips DeepSpeed's unused shared-memory op build
    (:func:`scape_ds.engine.skip_unused_cpu_ops`), which accelerate's early comm start would trigger.
    """
    global _original
    import deepspeed

    from .engine import skip_unused_cpu_ops

    skip_unused_cpu_ops()

    with _lock:
        if _original is not None:
            return
        original = deepspeed.initialize
        for module in list(sys.modules.values()):
            # a module's own namespace only; modules without a __dict__ (rare C stubs) are skipped
            namespace = getattr(module, "__dict__", None)
            if module is sys.modules[__name__] or not isinstance(namespace, dict):
                continue
            for name, value in list(namespace.items()):
                if value is original:
                    setattr(module, name, routed_initialize)
                    _replaced.append((module, name))
        _original = original


def disable() -> None:
    """Undo :func:`enable`: every replaced name holds DeepSpeed's ``initialize`` again. Idempotent."""
    global _original
    with _lock:
        if _original is None:
            return
        for module, name in _replaced:
            if getattr(module, name, None) is routed_initialize:
                setattr(module, name, _original)
        _replaced.clear()
        _original = None


def state_digest(optimizer, module) -> dict[str, str]:
    """What this rank holds of a run, as digests: ``optimizer.state_dict()`` leaf by leaf (its path,
    ``"optimizer/scape/groups/0/error"``, to the first 16 hex digits of a sha256 of the tensor's dtype, shape and
    bytes, or of a number's or string's repr) and ``"params/<name>"`` for each of ``module``'s
    parameters (its local partition under ZeRO-3). Two runs with equal digests hold bitwise the
    same state; examples/hf_trainer.py prints them at a save and after a resume's load.
    """
    import torch

    out: dict[str, str] = {}

    def walk(path: str, value) -> None:
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            h = hashlib.sha256(f"{t.dtype} {tuple(t.shape)} ".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            out[path] = h.hexdigest()[:16]
        elif isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(f"{path}/{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{path}/{i}", item)
        elif value is None or isinstance(value, (bool, int, float, str)):
            out[path] = hashlib.sha256(repr(value).encode()).hexdigest()[:16]
        else:  # an object DeepSpeed keeps in its state (its loss scaler): by its attributes, not its address
            walk(f"{path}:{type(value).__name__}", dict(vars(value)) if hasattr(value, "__dict__") else repr(value))

    walk("optimizer", optimizer.state_dict())
    for name, p in module.named_parameters():
        walk(f"params/{name}", getattr(p, "ds_tensor", p))
    return out
