"""SCAPE from the Hugging Face Trainer: a tiny GPT-2 (random init, byte vocabulary) on the bundled corpus.

Commands (on CPU ``--num_gpus`` is the number of ranks; nothing is downloaded)::

    deepspeed --num_gpus 2 --master_port 29600 examples/hf_trainer.py --deepspeed ds_configs/hf_scape.json  # basis dct
    deepspeed --num_gpus 2 --master_port 29600 examples/hf_trainer.py --deepspeed ds_configs/hf_scape_coordinate.json
    deepspeed --num_gpus 2 --master_port 29600 examples/hf_trainer.py --deepspeed ds_configs/hf_scape_zero3.json
    deepspeed --num_gpus 2 --master_port 29600 examples/hf_trainer.py \
        --deepspeed ds_configs/hf_scape_zero3_coordinate.json

Save and resume (the Trainer's ``save_strategy="steps"`` and ``resume_from_checkpoint``)::

    deepspeed --num_gpus 2 --master_port 29600 examples/hf_trainer.py --save-steps 5 --output-dir runs/hf
    deepspeed --num_gpus 2 --master_port 29600 examples/hf_trainer.py --resume runs/hf/checkpoint-5 \
        --output-dir runs/hf

(``--master_port``: any free port, so that the job runs beside another one; ZeRO stage 0/1 in basis
"dct", ``hf_scape.json``, is the default config; ``hf_scape_coordinate.json`` is it in the coordinate
basis, ``hf_scape_zero3.json`` SCAPE's ZeRO-3 in basis "dct" (``hf_scape_zero3_coordinate.json``: coordinate
basis). ``"overlap": true`` in basis "dct"
needs ``"gradient_clipping": 0`` and ``--max-grad-norm 0``.) With ``--save-steps`` or ``--resume``
every rank prints a ``scape_state`` line at each save, after the resume's load and at the end:
digests of its optimizer state (SCAPE's master and momentum shards, error feedback, masks, step; in
basis "dct" the error feedback in coefficients and the step) and parameters
(:func:`scape_ds.integrations.state_digest`); a resume that restores exactly what was saved prints
the same digests after its load as the first run printed at its save.

The Trainer reaches DeepSpeed through accelerate, which calls ``deepspeed.initialize`` itself;
``scape_ds.enable()`` makes that call build SCAPE when the config asks for it. The config's
``"auto"`` values (batch sizes, lr, betas, eps, weight decay, clipping, scheduler steps) are filled
in from ``TrainingArguments`` before DeepSpeed sees the config.

Steps: enable SCAPE; build the arguments (this starts torch.distributed); the model from a
``GPT2Config`` (``from_config``, so ZeRO-3 partitions it as it is built); the dataset of byte windows;
train ``--max-steps`` steps (saving a checkpoint every ``--save-steps``, none by default; from
``--resume``'s checkpoint when given). Rank 0 prints one ``scape_step {json}`` line per step (loss,
optimizer, bytes SCAPE sent against the dense exchange) and a closing summary.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist
from transformers import TrainerCallback

import scape_ds
from scape_ds.data import build_datasets
from scape_ds.engine import is_scape_optimizer
from scape_ds.integrations import state_digest


def _print_line(text: str) -> None:
    """One write per line: print() writes the text and the newline apart, and the other ranks'
    output (one stdout under the launcher) can land between them."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class ByteWindows(torch.utils.data.Dataset):
    """``n`` fixed windows of ``seq_len`` bytes from ``data``, at offsets drawn once from ``seed``."""

    def __init__(self, data: torch.Tensor, seq_len: int, n: int, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.data, self.seq_len = data, seq_len
        self.offsets = torch.randint(0, len(data) - seq_len, (n,), generator=gen)  # (n,) int64

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> dict:
        ids = self.data[self.offsets[i] : self.offsets[i] + self.seq_len].long()  # (T,) int64
        return {"input_ids": ids, "labels": ids}  # GPT-2 shifts the labels itself


class ScapeReport(TrainerCallback):
    """Prints one ``scape_step`` JSON line per step on rank 0 (loss, optimizer, bytes sent vs dense)."""

    def __init__(self):
        self.bytes = {}  # global step -> (optimizer class, bytes sent, dense bytes)
        self.sent = self.dense = 0
        self.scape = None  # the SCAPE optimizer, once a step has shown it

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps DeepSpeed's optimizer
        stats = inner.comm_stats if is_scape_optimizer(inner) else {}
        self.scape = inner if is_scape_optimizer(inner) else self.scape
        sent, dense = int(stats.get("bytes_sent", 0)), int(stats.get("bytes_dense", 0))
        self.bytes[state.global_step] = (type(inner).__name__, sent, dense)
        self.sent, self.dense = self.sent + sent, self.dense + dense

    def on_log(self, args, state, control, logs=None, **kwargs):
        if dist.get_rank() != 0 or "loss" not in (logs or {}):
            return
        name, sent, dense = self.bytes.get(state.global_step, ("?", 0, 0))
        record = dict(step=state.global_step, loss=logs["loss"], optimizer=name, bytes_sent=sent,
                      bytes_dense=dense)
        _print_line("scape_step " + json.dumps(record))

    def on_train_end(self, args, state, control, **kwargs):
        if dist.get_rank() == 0 and self.dense:
            print(f"done: {state.global_step} steps | sent {self.sent / 1e6:.2f} MB of a dense "
                  f"{self.dense / 1e6:.2f} MB ({self.sent / self.dense:.2%})", flush=True)


class StateDigests(TrainerCallback):
    """Every rank prints one ``scape_state {json}`` line (rank, global step, when, the digests of
    :func:`state_digest`) at each save, after a resume's load (at train begin) and at the end."""

    def __init__(self, resumed: bool):
        self.resumed = resumed

    def _print(self, when, state, model, optimizer):
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps DeepSpeed's optimizer
        record = dict(rank=dist.get_rank(), step=state.global_step, when=when, digest=state_digest(inner, model))
        _print_line("scape_state " + json.dumps(record))

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.resumed:
            self._print("loaded", state, model, optimizer)

    def on_save(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._print("saved", state, model, optimizer)

    def on_train_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._print("end", state, model, optimizer)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed", default="ds_configs/hf_scape.json", help="DeepSpeed JSON config")
    p.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="set by the deepspeed launcher")
    p.add_argument("--max-steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-grad-norm", type=float, default=1.0,
                   help="TrainingArguments.max_grad_norm, the config's \"auto\" gradient_clipping; 0: no clipping "
                        "(scape.overlap in basis dct needs 0)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--output-dir", default="runs/hf_trainer")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--save-steps", type=int, default=0,
                   help="save a checkpoint (checkpoint-<step> in --output-dir) every N steps; 0: save nothing")
    p.add_argument("--resume", default=None, metavar="DIR",
                   help="resume from this checkpoint folder (OUTPUT_DIR/checkpoint-<step>)")
    args = p.parse_args()
    if args.save_steps < 0:
        p.error(f"--save-steps must be >= 0, got {args.save_steps}")

    scape_ds.enable()  # before the Trainer builds its engine
    from transformers import AutoModelForCausalLM, GPT2Config, Trainer, TrainingArguments

    targs = TrainingArguments(
        output_dir=args.output_dir, deepspeed=args.deepspeed, max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size, learning_rate=args.lr, warmup_steps=2,
        adam_beta1=0.9, adam_beta2=0.95, weight_decay=0.1, max_grad_norm=args.max_grad_norm,
        logging_steps=1, save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        report_to="none", seed=args.seed,
        dataloader_num_workers=0, dataloader_pin_memory=torch.cuda.is_available(), disable_tqdm=True)
    # after TrainingArguments, so that under ZeRO-3 from_config builds the model partitioned (zero.Init)
    config = GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=128, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    model = AutoModelForCausalLM.from_config(config)
    train, _ = build_datasets()
    seed = args.seed
    if targs.world_size != dist.get_world_size():
        # CPU only: accelerate does not count DeepSpeed's gloo ranks (each one is its process 0 of 1
        # and reads the whole dataset), so each rank draws windows of its own
        seed += dist.get_rank()
    dataset = ByteWindows(train, args.seq_len, n=args.max_steps * args.batch_size * targs.world_size, seed=seed)
    report = ScapeReport()
    callbacks = [report]
    if args.save_steps or args.resume:
        callbacks.append(StateDigests(resumed=args.resume is not None))
    trainer = Trainer(model=model, args=targs, train_dataset=dataset, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=args.resume)
    if report.scape is not None:
        report.scape.synchronize()  # a run that ends on a refresh step has its mask all-gather in flight
    # end together: a rank that exits while a peer still holds its gloo connections can abort
    # that peer at interpreter exit ("terminate called without an active exception", exit -6)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
