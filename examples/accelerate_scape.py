"""SCAPE from a Hugging Face accelerate loop: the project's GPT on the bundled corpus.

Commands (on CPU ``--num_processes`` is the number of ranks; nothing is downloaded)::

    accelerate launch --use_deepspeed --deepspeed_config_file ds_configs/accelerate_scape.json \\
        --num_processes 2 examples/accelerate_scape.py                       # ZeRO stage 0/1, basis dct
    accelerate launch --use_deepspeed --deepspeed_config_file ds_configs/accelerate_scape_coordinate.json \
        --num_processes 2 examples/accelerate_scape.py                       # stage 0/1, coordinate basis
    accelerate launch --use_deepspeed --deepspeed_config_file ds_configs/accelerate_scape_zero3.json \\
        --num_processes 2 examples/accelerate_scape.py                       # SCAPE's ZeRO-3, basis dct

The configs work with ``accelerate launch`` as they stand: betas, eps and ZeRO-3's bucket sizes are
numbers (accelerate fills ``"auto"`` there only for the Trainer or a Hugging Face model), and
``"auto"`` is left only where accelerate's ``DummyOptim``/``DummyScheduler`` fill it (lr, weight
decay, the scheduler's steps). The optimizer is the config's: the script passes ``DummyOptim`` and
``DummyScheduler`` to ``accelerator.prepare``, and ``scape_ds.enable()`` makes accelerate's
``deepspeed.initialize`` call build SCAPE.

Data: each rank reads its own share through a ``DistributedSampler`` over torch.distributed's ranks.
On CPU accelerate reports ``num_processes`` 1 under DeepSpeed (each rank is its process 0 of 1), so
the loader it would shard is not given to it; the same sampler runs on GPUs.

Rank 0 prints one ``scape_step {json}`` line per step (loss, optimizer, bytes sent against the dense
exchange) and a ``scape_final {json}`` line: a digest of the parameters and whether every rank holds
the same.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import sys

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.utils import DummyOptim, DummyScheduler

import scape_ds
from scape_ds.data import ByteWindows, build_datasets
from scape_ds.engine import scape_optimizer
from scape_ds.models import GPT, GPTConfig


def _print_line(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write: the ranks share the launcher's stdout
    sys.stdout.flush()


def _digest(model: torch.nn.Module) -> str:
    """sha256 of every parameter (gathered under ZeRO-3), in order."""
    import deepspeed

    params = list(model.parameters())
    zero3 = [p for p in params if hasattr(p, "ds_id")]
    with deepspeed.zero.GatheredParameters(zero3) if zero3 else contextlib.nullcontext():
        flat = torch.cat([p.detach().reshape(-1).float().cpu() for p in params])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()

    scape_ds.enable()  # before accelerator.prepare builds the engine
    accelerator = Accelerator()
    rank, world = dist.get_rank(), dist.get_world_size()  # the data-parallel ranks, whatever accelerate counts
    batch = accelerator.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"]
    torch.manual_seed(args.seed)
    model = GPT(GPTConfig(seq_len=args.seq_len))
    train, _ = build_datasets()
    dataset = ByteWindows(train, args.seq_len, n=args.steps * batch * world, seed=args.seed)
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=args.seed)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch, sampler=sampler)

    optimizer = DummyOptim(model.parameters(), lr=args.lr, weight_decay=0.1)
    # accelerate divides total_num_steps by the processes it counts
    scheduler = DummyScheduler(optimizer, total_num_steps=args.steps * accelerator.num_processes, warmup_num_steps=2)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)

    for step, (x, y) in enumerate(loader, start=1):
        x, y = x.to(accelerator.device), y.to(accelerator.device)  # (B, T) int64 each
        _, loss = model(x, y)
        accelerator.backward(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        opt = scape_optimizer(model)
        stats = opt.comm_stats if opt is not None else {}
        if rank == 0:
            _print_line("scape_step " + json.dumps(dict(
                step=step, loss=float(loss), optimizer=type(opt).__name__, bytes_sent=int(stats.get("bytes_sent", 0)),
                bytes_dense=int(stats.get("bytes_dense", 0)))))

    digest = _digest(model)
    seen = [None] * world  # (digest, the sample indices this rank read) of every rank
    dist.all_gather_object(seen, (digest, sorted(sampler)))
    shards = [set(indices) for _, indices in seen]
    if rank == 0:
        _print_line("scape_final " + json.dumps(dict(
            step=step, digest=digest, replicas_equal=len({d for d, _ in seen}) == 1,
            shards_disjoint=sum(map(len, shards)) == len(set().union(*shards)),
            accelerate_processes=accelerator.num_processes, ranks=world)))
    # the process group is left up, as accelerate scripts do: scape_ds.engine.end_at_exit settles it


if __name__ == "__main__":
    main()
