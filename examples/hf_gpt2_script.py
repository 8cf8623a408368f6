"""SCAPE in a training script of your own: a tiny Hugging Face GPT-2 (random init, byte vocabulary)
through ``scape_ds.initialize`` on the bundled corpus. Nothing is downloaded.

Commands (on CPU ``--num_gpus`` is the number of ranks)::

    deepspeed --num_gpus 2 examples/hf_gpt2_script.py --deepspeed_config ds_configs/scape_dct.json
    deepspeed --num_gpus 2 examples/hf_gpt2_script.py --deepspeed_config ds_configs/scape_coordinate.json
    deepspeed --num_gpus 2 examples/hf_gpt2_script.py --deepspeed_config ds_configs/scape_zero3.json  # ZeRO-3, dct

Steps: start torch.distributed; build the model from a ``GPT2Config``; ``scape_ds.initialize`` with
the config (the same call as ``deepspeed.initialize``); train ``--train-iters`` steps on random
windows of the corpus (``scape_ds.data.get_batch``: each rank its own rows). Rank 0 prints one
``scape_step {json}`` line per step (loss averaged over ranks, optimizer, bytes SCAPE sent against
the dense exchange) and a closing summary.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import deepspeed
import torch
import torch.distributed as dist

import scape_ds
from scape_ds.comm import collective_device
from scape_ds.data import build_datasets, get_batch
from scape_ds.engine import scape_optimizer


def _print_line(text: str) -> None:
    """One write per line: print() writes the text and the newline apart, and the other ranks'
    output (one stdout under the launcher) can land between them."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--deepspeed_config", default="ds_configs/scape_dct.json")
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--train-iters", type=int, default=10)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo",
                               timeout=datetime.timedelta(seconds=120))
    device = torch.device(f"cuda:{args.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    config = GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=128, n_layer=2, n_head=4,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    model = GPT2LMHeadModel(config).to(device)
    engine, _, _, _ = scape_ds.initialize(model=model, config=args.deepspeed_config)
    opt = scape_optimizer(engine)
    rank, world = dist.get_rank(), dist.get_world_size()
    micro_bs = engine.train_micro_batch_size_per_gpu()
    train, _ = build_datasets()
    sent_total = dense_total = 0
    for step in range(args.train_iters):
        x, _ = get_batch(train, micro_bs, args.seq_len, step, rank, world, args.seed)  # (B, T) int64
        loss = engine(input_ids=x.to(device), labels=x.to(device)).loss  # GPT-2 shifts the labels itself
        engine.backward(loss)
        engine.step()
        mean = loss.detach().double().to(collective_device(None))  # NCCL: a CUDA tensor
        dist.all_reduce(mean)
        stats = opt.comm_stats if opt is not None else {}
        sent, dense = int(stats.get("bytes_sent", 0)), int(stats.get("bytes_dense", 0))
        sent_total, dense_total = sent_total + sent, dense_total + dense
        if rank == 0:
            record = dict(step=step + 1, loss=float(mean) / world, optimizer=type(engine.optimizer).__name__,
                          bytes_sent=sent, bytes_dense=dense)
            _print_line("scape_step " + json.dumps(record))
    if opt is not None:
        opt.synchronize()  # a run that ends on a refresh step has its mask all-gather in flight
    if rank == 0 and dense_total:
        print(f"done: {args.train_iters} steps | sent {sent_total / 1e6:.2f} MB of a dense "
              f"{dense_total / 1e6:.2f} MB ({sent_total / dense_total:.2%})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
