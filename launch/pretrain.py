"""Pretrain a small GPT on the bundled World English Bible with SCAPE or a dense baseline.

Commands (on CPU ``--num_gpus`` is the number of ranks; the config chooses the optimizer)::

    deepspeed --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/scape.json
    deepspeed --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/dense_adamw.json
    deepspeed --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/scape_zero3.json  # ZeRO-3
    deepspeed --num_gpus 2 launch/pretrain.py --deepspeed_config ds_configs/scape_zero3_replica.json  # + replica
    python launch/pretrain.py --deepspeed_config ds_configs/scape.json          # one rank
    mpiexec -n 4 python launch/pretrain.py --deepspeed_config ds_configs/scape_mpi.json   # MPI launch
    deepspeed --num_gpus 4 launch/pretrain.py --deepspeed_config ds_configs/scape_megatron.json \
        --tensor-model-parallel-size 2            # TP2 x DP2, megatron-core layers, SCAPE over DP
    deepspeed --num_gpus 4 launch/pretrain.py --deepspeed_config ds_configs/scape_megatron.json \
        --pipeline-model-parallel-size 2          # PP2 x DP2, DeepSpeed's PipelineEngine
    deepspeed --hostfile hosts --num_gpus 8 launch/pretrain.py --deepspeed_config ds_configs/scape.json

Steps: parse and check every input (config, corpus, --load) before any process group exists, so
bad input is one line on stderr and a non-zero exit; start torch.distributed; build the data, the
model (scape_ds.models, single-device code) and the engine (scape_ds.initialize); optionally load a
checkpoint; train with a progress bar, a log line every --log-interval steps and validation every
--eval-interval steps; save; print the bytes SCAPE sent against the dense exchange.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, _REPO)

_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--deepspeed_config", required=True, help="DeepSpeed JSON config (ds_configs/*.json)")
    p.add_argument("--deepspeed", action="store_true", help="accepted for DeepSpeed compatibility")
    p.add_argument("--local_rank", "--local-rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--train-iters", type=int, default=500, help="optimizer steps to train")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--metrics-out", default=None, help="JSONL file: one object per step (rank 0)")
    p.add_argument("--save", default=None, help="checkpoint directory to save to")
    p.add_argument("--save-interval", type=int, default=0, help="save every N steps (0: only at the end)")
    p.add_argument("--load", default=None, help="checkpoint directory to resume from")
    p.add_argument("--tensorboard-dir", default=None)
    p.add_argument("--log-interval", type=int, default=20)
    p.add_argument("--eval-interval", type=int, default=100, help="validate every N steps (and at the end)")
    p.add_argument("--eval-iters", type=int, default=4, help="validation batches per rank")
    p.add_argument("--corpus", default="web", help="bundled corpus name")
    p.add_argument("--val-fraction", type=float, default=0.05)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size (megatron-core layers)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP size (DeepSpeed PipelineEngine)")
    p.add_argument("--model", choices=("auto", "gpt", "megatron"), default="auto",
                   help="gpt: scape_ds.models.GPT; megatron: megatron-core tensor_parallel layers; "
                        "auto: megatron when TP or PP > 1")
    p.add_argument("--dist-timeout", type=float, default=120.0, help="seconds before a stuck collective fails")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    return p


def uses_megatron(args) -> bool:
    """Whether the model is built from megatron-core layers: ``--model megatron``, or auto with TP or PP > 1."""
    return args.model == "megatron" or (args.model == "auto" and
                                        args.tensor_model_parallel_size * args.pipeline_model_parallel_size > 1)


def check_inputs(args) -> dict:
    """Everything that can be checked before distributed start-up; returns the DeepSpeed config."""
    from scape_ds.checkpoint import read_latest_tag
    from scape_ds.config import parse_scape_config, zero_stage
    from scape_ds.data import load_corpus
    from scape_ds.engine import read_ds_config

    for name in ("train_iters", "log_interval", "eval_interval", "eval_iters", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    cfg = read_ds_config(args.deepspeed_config)
    if "scape" in cfg:
        parse_scape_config(cfg["scape"])
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if args.model == "gpt" and tp * pp > 1:
        raise ValueError("--model gpt has no tensor or pipeline parallelism: use --model megatron (or auto)")
    if uses_megatron(args):
        from scape_ds.megatron import check_topology

        world = int(next((os.environ[v] for v in ("WORLD_SIZE",) + _MPI_SIZE_VARS if v in os.environ), 1))
        check_topology(world, tp, pp, zero_stage(cfg))
        if args.n_head % tp != 0:
            raise ValueError(f"--n-head {args.n_head} must be divisible by --tensor-model-parallel-size {tp}")
        if pp > 1 and args.n_layer < pp:
            raise ValueError(f"--n-layer {args.n_layer} must be >= --pipeline-model-parallel-size {pp}")
    if "train_micro_batch_size_per_gpu" not in cfg:
        raise ValueError(f"{args.deepspeed_config}: set train_micro_batch_size_per_gpu")
    load_corpus(args.corpus)
    if args.load:
        read_latest_tag(args.load)
    return cfg


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(timeout_s: float) -> None:
    """Start torch.distributed: from the launcher's env, from MPI (mpiexec), or as one rank."""
    import deepspeed
    import torch

    if "RANK" not in os.environ and not any(v in os.environ for v in _MPI_RANK_VARS):
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # under mpiexec DeepSpeed maps MPI's world onto torch.distributed (rank 0's address, this port)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=True, verbose=False,
                               distributed_port=int(os.environ.get("MASTER_PORT", 29500)),
                               timeout=datetime.timedelta(seconds=timeout_s))


def dense_bytes_for(model, world_size: int) -> int:
    """Bytes a dense fp32 data-parallel exchange sends per step from one rank (all-reduce)."""
    from scape_ds.comm import collective_bytes

    n = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters() if p.requires_grad)
    return collective_bytes("all_reduce", n, world_size)


def evaluate(engine, val, args, micro_bs, dp_rank, dp_size, device, dp_group=None, pipeline=False) -> float:
    """Mean validation loss over --eval-iters fixed batches per rank, averaged over data-parallel ranks."""
    import torch
    import torch.distributed as dist

    from scape_ds.comm import collective_device
    from scape_ds.data import get_batch

    engine.eval()
    total = torch.zeros(1, dtype=torch.float64, device=collective_device(dp_group))  # NCCL: a CUDA tensor
    with torch.no_grad():
        for i in range(args.eval_iters):
            x, y = get_batch(val, micro_bs, args.seq_len, i, dp_rank, dp_size, args.seed + 7919)
            if pipeline:  # the loss of the last stage, sent to every stage
                loss = engine.eval_batch(iter([(x.to(device), y.to(device))]), num_micro_batches=1)
            else:
                _, loss = engine(x.to(device), y.to(device))
            total += float(loss)
    engine.train()
    dist.all_reduce(total, group=dp_group)
    return float(total) / (args.eval_iters * dp_size)


def build_engine(args, cfg: dict, device):
    """The model and its engine: scape_ds.models.GPT, or megatron-core layers over TP/PP/DP groups.

    Returns ``(engine, model, dp_rank, dp_size, dp_group, pipeline)``.
    """
    import torch
    import torch.distributed as dist

    import scape_ds
    from scape_ds.config import zero_stage
    from scape_ds.models import GPT, GPTConfig

    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    gcfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    if not uses_megatron(args):
        torch.manual_seed(args.seed)
        model = GPT(gcfg).to(device)
        engine, _, _, _ = scape_ds.initialize(model=model, config=cfg)
        return engine, model, dist.get_rank(), dist.get_world_size(), None, False
    from scape_ds.megatron import MegatronGPT, build_pipeline_gpt, init_model_parallel, model_parallel_seed

    mpu = init_model_parallel(tp, pp, zero_stage(cfg))
    dp_rank, dp_size = mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()
    dp_group = mpu.get_data_parallel_group()
    if pp > 1:
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        model = build_pipeline_gpt(gcfg, PipeModelDataParallelTopology(num_pp=pp, num_mp=tp, num_dp=dp_size),
                                   seed=args.seed)
        model_parallel_seed(args.seed)
        engine, _, _, _ = scape_ds.initialize(model=model, config=cfg)  # the PipelineModule brings its grid
    else:
        torch.manual_seed(args.seed)
        model = MegatronGPT(gcfg).to(device)
        model_parallel_seed(args.seed)
        engine, _, _, _ = scape_ds.initialize(model=model, config=cfg, mpu=mpu)
    return engine, model, dp_rank, dp_size, dp_group, pp > 1


def train(args, cfg: dict) -> dict:
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from scape_ds.checkpoint import load_checkpoint, save_checkpoint
    from scape_ds.comm import collective_device
    from scape_ds.data import build_datasets, get_batch, unigram_entropy
    from scape_ds.engine import scape_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    device = torch.device(f"cuda:{args.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(args.seed)
    train_data, val_data = build_datasets(args.val_fraction, name=args.corpus)
    engine, model, dp_rank, dp_size, dp_group, pipeline = build_engine(args, cfg, device)
    opt = scape_optimizer(engine)
    loss_device = collective_device(dp_group)
    micro_bs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    dense_bytes = dense_bytes_for(model, dp_size)
    start = 0
    if args.load:
        tag, client = load_checkpoint(engine, args.load)
        start = int(client.get("step", engine.global_steps))
        if is_main:
            print(f"resumed from {args.load}/{tag} at step {start}", flush=True)
    tokens_per_step = micro_bs * gas * dp_size * args.seq_len
    if is_main:
        n_params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3: full sizes
        kind = f"SCAPE {opt.cfg.compressor} sparsity {opt.cfg.sparsity} T={opt.cfg.mask_refresh_interval}" if opt \
            else type(engine.optimizer).__name__
        if getattr(opt, "scape_stage3", False) and opt.replica:
            kind += (" under ZeRO-3, sparse_replica (bytes: gradient reduce-scatter + masks + parameter all-gather"
                     " vs ZeRO-3's dense reduce-scatter + all-gather)")
        elif getattr(opt, "scape_stage3", False):
            kind += " under ZeRO-3 (bytes: gradient reduce-scatter + masks vs ZeRO-3's dense reduce-scatter)"
        tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        layout = f"TP{tp} x PP{pp} x DP{dp_size} ({'megatron-core' if uses_megatron(args) else 'GPT'})"
        print(f"GPT {n_params/1e6:.2f}M params on rank 0 | {world} ranks: {layout} | {kind} | "
              f"{tokens_per_step} tokens/step | "
              f"corpus {train_data.numel()/1e6:.1f}M train / {val_data.numel()/1e6:.2f}M val bytes, "
              f"unigram entropy {unigram_entropy(train_data):.3f} nats", flush=True)
    metrics_f = None
    if is_main and args.metrics_out:
        metrics_f = open(args.metrics_out, "a" if args.load else "w", encoding="utf-8")
    writer = None
    if is_main and args.tensorboard_dir:
        from torch.utils.tensorboard import SummaryWriter

        writer = SummaryWriter(args.tensorboard_dir)
    bar = tqdm(total=args.train_iters, initial=start, disable=not is_main or args.no_progress, desc="pretrain",
               dynamic_ncols=True)
    sent_total = dense_total = 0
    first_losses, last_losses, val_loss = [], [], float("nan")
    t_run = time.perf_counter()
    for step in range(start, args.train_iters):
        lr = engine.get_lr()[0]
        t0 = time.perf_counter()
        if pipeline:  # the PipelineEngine runs all gas micro-batches; it returns their mean over DP
            batches = [get_batch(train_data, micro_bs, args.seq_len, step * gas + m, dp_rank, dp_size, args.seed)
                       for m in range(gas)]
            mean_loss = float(engine.train_batch(data_iter=iter([(x.to(device), y.to(device)) for x, y in batches])))
        else:
            loss_sum = torch.zeros(1, dtype=torch.float64, device=loss_device)  # NCCL: a CUDA tensor
            for micro in range(gas):
                x, y = get_batch(train_data, micro_bs, args.seq_len, step * gas + micro, dp_rank, dp_size, args.seed)
                _, loss = engine(x.to(device), y.to(device))
                engine.backward(loss)
                engine.step()
                loss_sum += loss.detach().double().to(loss_device)
            dist.all_reduce(loss_sum, group=dp_group)  # logging only: the mean over ranks and micro-batches
            mean_loss = float(loss_sum) / (gas * dp_size)
        step_time = time.perf_counter() - t0
        if opt is not None:
            sent, dense = int(opt.comm_stats["bytes_sent"]), int(opt.comm_stats["bytes_dense"])
        else:
            sent = dense = dense_bytes
        sent_total += sent
        dense_total += dense
        record = dict(step=step + 1, loss=mean_loss, lr=lr, step_time_s=step_time, bytes_sent=sent, bytes_dense=dense,
                      tokens_per_s=tokens_per_step / step_time)
        if (step + 1) % args.eval_interval == 0 or step + 1 == args.train_iters:
            val_loss = evaluate(engine, val_data, args, micro_bs, dp_rank, dp_size, device, dp_group, pipeline)
            record["val_loss"] = val_loss
        (first_losses if len(first_losses) < 5 else last_losses).append(mean_loss)
        last_losses = last_losses[-5:]
        if metrics_f:
            metrics_f.write(json.dumps(record) + "\n")
            metrics_f.flush()
        if writer:
            keys = ("loss", "lr", "step_time_s", "bytes_sent", "tokens_per_s")
            for key in keys + (("val_loss",) if "val_loss" in record else ()):
                writer.add_scalar(f"train/{key}" if key != "val_loss" else "val/loss", record[key], step + 1)
        bar.update(1)
        bar.set_postfix(loss=f"{mean_loss:.3f}", sent=f"{sent / max(dense, 1):.1%}")
        if is_main and ((step + 1) % args.log_interval == 0 or "val_loss" in record):
            vl = f" | val loss {record['val_loss']:.4f}" if "val_loss" in record else ""
            bar.write(f"step {step + 1:5d} | loss {mean_loss:.4f}{vl} | lr {lr:.2e} | "
                      f"{tokens_per_step / step_time:,.0f} tokens/s | sent {sent / 1e6:.3f} MB vs dense "
                      f"{dense / 1e6:.3f} MB ({sent / max(dense, 1):.1%})")
        if args.save and args.save_interval and (step + 1) % args.save_interval == 0 and step + 1 != args.train_iters:
            save_checkpoint(engine, args.save, step + 1, dict(step=step + 1))
    bar.close()
    if opt is not None:
        opt.synchronize()  # a run that ends on a refresh step has its mask all-gather in flight
    if args.save:
        save_checkpoint(engine, args.save, args.train_iters, dict(step=args.train_iters))
    summary = dict(steps=args.train_iters - start, final_loss=last_losses[-1] if last_losses else float("nan"),
                   val_loss=val_loss, bytes_sent=sent_total, bytes_dense=dense_total,
                   wall_s=time.perf_counter() - t_run)
    if is_main:
        frac = sent_total / dense_total if dense_total else 0.0
        saved = f"{1 - frac:.1%} saved" if dense_total else "one rank: nothing to exchange"
        first = sum(first_losses) / max(len(first_losses), 1)
        last = sum(last_losses) / max(len(last_losses), 1)
        print(f"done: {summary['steps']} steps in {summary['wall_s']:.0f} s | loss {first:.3f} (first 5) -> "
              f"{last:.3f} (last 5) | val loss {val_loss:.4f} | sent {sent_total / 1e6:.1f} MB of a dense "
              f"{dense_total / 1e6:.1f} MB: {frac:.2%} ({saved})", flush=True)
    if metrics_f:
        metrics_f.close()
    if writer:
        writer.close()
    return summary


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = check_inputs(args)
    except (ValueError, ImportError, TypeError) as e:
        print(f"pretrain.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init_distributed(args.dist_timeout)
    try:
        train(args, cfg)
    except (ValueError, ImportError) as e:
        print(f"pretrain.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
