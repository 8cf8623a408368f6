"""SCAPE under PyTorch Lightning: :class:`ScapeDeepSpeedStrategy`, Lightning's ``DeepSpeedStrategy``
that builds SCAPE and also runs on CPU (docs/design.md, "Around the optimizer").

    import lightning as L
    from scape_ds.lightning import ScapeDeepSpeedStrategy

    strategy = ScapeDeepSpeedStrategy(config="ds_configs/scape_dct.json")   # or scape_zero3.json (ZeRO-3)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=100)

What it changes in Lightning's strategy (written against lightning 2.6; the private names it
overrides are checked when it is built, :func:`check_lightning_internals`):

1. CPU: the stock strategy refuses any accelerator but CUDA ("The DeepSpeed strategy is only
   supported on CUDA GPUs") and then requires device indices equal to the local ranks (a CPU
   device has none); on CPU both checks are skipped, and DeepSpeed's unused shared-memory op build
   is skipped before its comm backend starts (:func:`scape_ds.engine.skip_unused_cpu_ops`).
2. The engine is built by :func:`scape_ds.initialize` (no ``scape_ds.enable()`` needed) with
   ``device_rank`` the local rank where the device has no index (Lightning passes the device's
   index, None on CPU, which DeepSpeed cannot compare).
3. Config: ``gradient_accumulation_steps`` may stay in the JSON when it equals the Trainer's
   ``accumulate_grad_batches`` (the stock strategy refuses it whatever its value); with an
   ``optimizer`` block the LightningModule needs no ``configure_optimizers``.
4. Checkpoints: :func:`scape_ds.checkpoint.save_checkpoint` / ``load_checkpoint`` (every rank's
   SCAPE state, a manifest, loading checked on every rank first) in place of the engine's own
   ``save_checkpoint``, which at stage 0/1 keeps only rank 0's optimizer state. A Lightning
   checkpoint "file" is then a directory holding ``latest`` and ``global_step<N>/``.

On CUDA it behaves as the stock strategy, with 2-4.
"""
from __future__ import annotations

import argparse
import types
from typing import Any

try:
    import lightning
except ImportError as e:  # only this module needs lightning
    raise ImportError("scape_ds.lightning needs Lightning: pip install 'lightning>=2.6,<3' "
                      "(or pip install -e '.[test]')") from e
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.utilities.model_helpers import is_overridden

__all__ = ["ScapeDeepSpeedStrategy", "check_lightning_internals"]

# DeepSpeedStrategy's private methods this subclass overrides or calls
_OVERRIDDEN = ("_setup_model_and_optimizer", "_init_deepspeed_distributed", "_format_batch_size_and_grad_accum_config")


def check_lightning_internals() -> None:
    """Fail with Lightning's version and what is missing if the private names moved."""
    missing = [name for name in _OVERRIDDEN if not callable(getattr(DeepSpeedStrategy, name, None))]
    if missing:
        raise RuntimeError(f"scape_ds.lightning does not support lightning {lightning.__version__}: "
                           f"DeepSpeedStrategy has no {', '.join(missing)} (written against 2.6)")


def _optimizer_from_config(self) -> None:
    """configure_optimizers of a module whose optimizer is the DeepSpeed config's."""
    return None


class ScapeDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` building SCAPE, on CPU and GPU (see the module docstring).

    Args: as ``DeepSpeedStrategy``; ``config`` is a DeepSpeed JSON path or dict with a ``"scape"``
    block (any other config trains as DeepSpeed would).
    """

    strategy_name = "scape_deepspeed"

    def __init__(self, *args, **kwargs):
        check_lightning_internals()
        super().__init__(*args, **kwargs)

    @property
    def _on_cuda(self) -> bool:
        return isinstance(self.accelerator, CUDAAccelerator)

    def connect(self, model) -> None:
        super().connect(model)
        if isinstance(self.config, dict) and "optimizer" in self.config and \
                not is_overridden("configure_optimizers", model):
            # Lightning's trainer refuses a module without configure_optimizers; here the optimizer
            # is the config's (the strategy builds it), so the module gets one that returns None
            model.configure_optimizers = types.MethodType(_optimizer_from_config, model)

    def setup_environment(self) -> None:
        if self._on_cuda:
            return super().setup_environment()
        DDPStrategy.setup_environment(self)  # what the stock strategy does after its CUDA check

    def setup_distributed(self) -> None:
        if self._on_cuda:
            return super().setup_distributed()
        from .engine import skip_unused_cpu_ops

        skip_unused_cpu_ops()  # before DeepSpeed's comm backend starts
        reset_seed()  # the stock order, without the device-index check
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    def setup_optimizers(self, trainer) -> None:
        if isinstance(self.config, dict) and "optimizer" in self.config:
            self.optimizers, self.lr_scheduler_configs = [], []  # the engine builds it from the config
            return
        super().setup_optimizers(trainer)

    def _format_batch_size_and_grad_accum_config(self) -> None:
        gas = self.config.get("gradient_accumulation_steps")
        if gas is not None and self.lightning_module is not None:
            wanted = self.lightning_module.trainer.accumulate_grad_batches
            if gas != wanted:
                raise ValueError(f"gradient_accumulation_steps = {gas} in the DeepSpeed config but Trainer("
                                 f"accumulate_grad_batches={wanted}): make them equal, or drop the config's")
            del self.config["gradient_accumulation_steps"]  # the stock method sets it from the Trainer
        super()._format_batch_size_and_grad_accum_config()

    def _setup_model_and_optimizer(self, model, optimizer, lr_scheduler=None):
        from .engine import initialize

        index = self.root_device.index
        engine, deepspeed_optimizer, _, _ = initialize(
            args=argparse.Namespace(device_rank=self.local_rank if index is None else index),
            config=self.config, model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
            optimizer=optimizer, lr_scheduler=lr_scheduler, dist_init_required=False)
        return engine, deepspeed_optimizer

    # -------------------------------------------------------------- checkpoints
    def save_checkpoint(self, checkpoint: dict, filepath, storage_options: Any = None) -> None:
        """Every rank saves its part under ``filepath`` (a directory) with scape_ds's atomic save."""
        from .checkpoint import save_checkpoint

        if storage_options is not None:
            raise TypeError(f"{type(self).__name__}.save_checkpoint takes no storage_options (CheckpointIO is unused)")
        filepath = self.broadcast(str(filepath))  # one directory for every rank
        client = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
        save_checkpoint(self.deepspeed_engine, filepath, int(checkpoint.get("global_step", 0)), client)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """Model, optimizer and SCAPE state from ``checkpoint_path``; returns Lightning's client state."""
        from .checkpoint import load_checkpoint

        _, client = load_checkpoint(self.deepspeed_engine, str(checkpoint_path))
        return client
