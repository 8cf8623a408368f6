"""SCAPE from PyTorch Lightning: the project's GPT on the bundled corpus, on CPU or GPU ranks.

Commands (Lightning starts the other ranks itself; nothing is downloaded)::

    python examples/lightning_scape.py --config ds_configs/scape_dct.json      # ZeRO stage 0/1, basis dct
    python examples/lightning_scape.py --config ds_configs/scape_coordinate.json          # stage 0/1, coordinate basis
    python examples/lightning_scape.py --config ds_configs/scape_zero3.json    # SCAPE's ZeRO-3, basis dct
    python examples/lightning_scape.py --config ds_configs/scape_zero3_coordinate.json   # ZeRO-3, coordinate basis
    python examples/lightning_scape.py --resume runs/lightning/step=4.ckpt     # resume after step 4
    python examples/lightning_scape.py --accelerator gpu --devices 8           # on GPUs

The strategy is :class:`scape_ds.lightning.ScapeDeepSpeedStrategy`: Lightning's DeepSpeed strategy
that builds SCAPE from the config's ``"scape"`` block and runs on CPU too. The module below is all a
user writes: the optimizer comes from the config, so there is no ``configure_optimizers``.

Steps: the dataset of byte windows (Lightning gives each rank its share through a
DistributedSampler); the module; a checkpoint at the end of every epoch (every rank's SCAPE state,
scape_ds.checkpoint); train ``--max-steps`` steps, from ``--resume`` if given. Rank 0 prints one
``scape_step {json}`` line per step (loss, optimizer, bytes sent against the dense exchange) and a
``scape_final {json}`` line: a digest of the parameters and whether every rank holds the same.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys

import lightning as L
import torch
import torch.distributed as dist

from scape_ds.data import ByteWindows, build_datasets
from scape_ds.engine import scape_optimizer
from scape_ds.lightning import ScapeDeepSpeedStrategy
from scape_ds.models import GPT, GPTConfig


class ByteGPT(L.LightningModule):
    """The smallest LightningModule for SCAPE: a model and a training step."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.model = GPT(config)

    def training_step(self, batch, batch_idx):
        x, y = batch  # (B, T) int64 each
        _, loss = self.model(x, y)
        return loss


def _print_line(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write: the ranks share the terminal
    sys.stdout.flush()


class ScapeReport(L.Callback):
    """Rank 0 prints a ``scape_step`` line per step and a ``scape_final`` line with the parameters' digest."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        opt = scape_optimizer(trainer.strategy.model)
        stats = opt.comm_stats if opt is not None else {}
        if trainer.is_global_zero:
            _print_line("scape_step " + json.dumps(dict(
                step=trainer.global_step, loss=float(outputs["loss"]), optimizer=type(opt).__name__,
                lr=trainer.strategy.model.get_lr()[0],
                bytes_sent=int(stats.get("bytes_sent", 0)), bytes_dense=int(stats.get("bytes_dense", 0)))))

    def on_train_end(self, trainer, pl_module):
        import deepspeed

        params = list(pl_module.parameters())
        zero3 = [p for p in params if hasattr(p, "ds_id")]
        with deepspeed.zero.GatheredParameters(zero3) if zero3 else contextlib.nullcontext():
            flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in params])  # every parameter, in order
        digest = hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, digest)
        opt = scape_optimizer(trainer.strategy.model)
        if opt is not None:
            opt.synchronize()  # a run that ends on a refresh step has its mask all-gather in flight
        if trainer.is_global_zero:
            _print_line("scape_final " + json.dumps(dict(step=trainer.global_step, digest=digest,
                                                         replicas_equal=len(set(digests)) == 1)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="ds_configs/scape_dct.json", help="DeepSpeed JSON config with a scape block")
    p.add_argument("--accelerator", default="cpu")
    p.add_argument("--devices", type=int, default=2, help="ranks")
    p.add_argument("--max-steps", type=int, default=8)
    p.add_argument("--epoch-steps", type=int, default=4, help="steps per epoch (a checkpoint after each)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--out", default="runs/lightning", help="checkpoint directory")
    p.add_argument("--resume", default=None, help="a checkpoint this script saved")
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()

    L.seed_everything(args.seed)
    strategy = ScapeDeepSpeedStrategy(config=args.config)
    batch = strategy.config["train_micro_batch_size_per_gpu"]
    train, _ = build_datasets()
    dataset = ByteWindows(train, args.seq_len, n=args.epoch_steps * batch * args.devices, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, shuffle=True)
    # after the last batch of each epoch: Lightning then resumes at the start of the next one (a
    # checkpoint taken in on_train_epoch_end would replay that epoch's end)
    every_epoch = L.pytorch.callbacks.ModelCheckpoint(dirpath=args.out, filename="{step}", save_top_k=-1,
                                                      every_n_train_steps=args.epoch_steps)
    trainer = L.Trainer(accelerator=args.accelerator, devices=args.devices, strategy=strategy,
                        max_steps=args.max_steps, callbacks=[every_epoch, ScapeReport()], logger=False,
                        enable_progress_bar=False, enable_model_summary=False)
    module = ByteGPT(GPTConfig(seq_len=args.seq_len))
    trainer.fit(module, train_dataloaders=loader, ckpt_path=args.resume)


if __name__ == "__main__":
    main()
