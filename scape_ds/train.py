"""Pretrain a small GPT on the bundled World English Bible with SCAPE or a dense baseline.

The training loop behind ``launch/pretrain.py`` (its docstring has the commands). ``main`` runs:

1. parse and check every input (config, corpus, ``--load``) before any process group exists, so bad
   input is one line on stderr and exit 2 (:func:`check_inputs`);
2. start torch.distributed from the launcher's environment, from MPI, or as one rank
   (:func:`init_distributed`);
3. build the data, the model (``scape_ds.models``, single-device code) and the engine
   (``scape_ds.initialize``) over the data-parallel group (:func:`build_engine`);
4. optionally resume from a checkpoint; train with a progress bar, a log line every
   ``--log-interval`` steps, validation every ``--eval-interval`` steps (:func:`evaluate`) and one
   metrics record per step (:class:`scape_ds.metrics.MetricsWriter`);
5. save; print the bytes SCAPE sent against the dense exchange (:func:`format_summary`).

A peer lost mid-run (a dropped link, a dead node) ends every rank within ``--dist-timeout`` (plus a
few seconds) with one line naming the silent rank and the last complete checkpoint, and exit code 3
(:mod:`scape_ds.faults`). SIGTERM, SIGINT or the launcher's end stops every rank after the same
step, saved with ``--save``, with one line naming the tag and exit code 143 (:mod:`scape_ds.stop`).

Rank 0 prints and writes metrics; every rank trains. Heavy imports (torch, DeepSpeed) happen inside
the functions, so a bad input is reported before they load.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["build_parser", "check_inputs", "init_distributed", "TrainSetup", "build_engine", "evaluate", "train",
           "main", "loss_windows", "format_summary", "uses_megatron", "dense_bytes_for"]

_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
_SUMMARY_WINDOW = 5  # steps averaged at each end of the run for the closing line


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
    p.add_argument("--test-fraction", type=float, default=0.0,
                   help="share of the corpus (its end) held apart; > 0: the final model's loss on every window "
                        "of it is reported as test loss after the last step")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="TP size (megatron-core layers)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="PP size (DeepSpeed PipelineEngine)")
    p.add_argument("--model", choices=("auto", "gpt", "megatron"), default="auto",
                   help="gpt: scape_ds.models.GPT; megatron: megatron-core tensor_parallel layers; "
                        "auto: megatron when TP or PP > 1")
    p.add_argument("--dist-timeout", type=float, default=120.0,
                   help="seconds a collective waits for a silent peer; then every rank exits 3 with one line")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (log lines only; also when stderr is not a terminal)")
    return p


def uses_megatron(args) -> bool:
    """Whether the model is built from megatron-core layers: ``--model megatron``, or auto with TP or PP > 1."""
    return args.model == "megatron" or (args.model == "auto" and
                                        args.tensor_model_parallel_size * args.pipeline_model_parallel_size > 1)


def check_inputs(args) -> dict:
    """Everything that can be checked before distributed start-up; returns the DeepSpeed config.

    Raises:
        ValueError, TypeError, ImportError: a bad option, config field, corpus or checkpoint, named.
    """
    import math

    from scape_ds.checkpoint import check_load, check_save_dir
    from scape_ds.config import parse_scape_config, zero_stage
    from scape_ds.data import load_corpus
    from scape_ds.engine import check_block_names, read_ds_config

    for name in ("train_iters", "log_interval", "eval_interval", "eval_iters", "seq_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not (args.dist_timeout > 0 and math.isfinite(args.dist_timeout)):
        raise ValueError(f"--dist-timeout must be a number of seconds > 0, got {args.dist_timeout:g}")
    if not 0.0 <= args.test_fraction <= 0.5 - args.val_fraction:
        raise ValueError(f"--test-fraction must be in [0, 0.5 - --val-fraction = {0.5 - args.val_fraction:g}], got "
                         f"{args.test_fraction:g}")
    if args.save_interval < 0:
        raise ValueError(f"--save-interval must be >= 0 (0: only at the end), got {args.save_interval}")
    cfg = read_ds_config(args.deepspeed_config)
    check_block_names(cfg)
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
        check_load(args.load)  # a named, complete tag (sizes against its manifest; hashes when loading)
    if args.save:
        check_save_dir(args.save)  # created and probed now, not at the first save
    return cfg


def _master_port() -> int:
    """The rendezvous port: the launcher's MASTER_PORT; under mpiexec without one, a port that rank 0
    found free, sent to every rank over MPI (a fixed default would collide with a second job)."""
    if "MASTER_PORT" in os.environ:
        return int(os.environ["MASTER_PORT"])
    from mpi4py import MPI

    from scape_ds.spawn import free_port

    world = MPI.COMM_WORLD
    return world.bcast(free_port() if world.Get_rank() == 0 else None, root=0)


def init_distributed(timeout_s: float) -> None:
    """Start torch.distributed: from the launcher's env, from MPI (mpiexec), or as one rank."""
    import deepspeed
    import torch

    from scape_ds.engine import skip_unused_cpu_ops
    from scape_ds.spawn import free_port

    skip_unused_cpu_ops()
    if "RANK" not in os.environ and not any(v in os.environ for v in _MPI_RANK_VARS):
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    # under mpiexec DeepSpeed maps MPI's world onto torch.distributed (rank 0's address, this port)
    deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=True, verbose=False,
                               distributed_port=_master_port(), timeout=datetime.timedelta(seconds=timeout_s))


def dense_bytes_for(model, world_size: int) -> int:
    """Bytes a dense fp32 data-parallel exchange sends per step from one rank (all-reduce)."""
    from scape_ds.comm import collective_bytes

    n = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters() if p.requires_grad)
    return collective_bytes("all_reduce", n, world_size)


@dataclass
class TrainSetup:
    """What :func:`build_engine` made: the engine, its model and the data-parallel coordinates."""

    engine: Any
    """The DeepSpeed engine (a ``PipelineEngine`` when ``pipeline``)."""
    model: Any
    """The module the engine wraps (``GPT``, ``MegatronGPT`` or a ``PipelineModule``)."""
    dp_rank: int
    """This rank's index in its data-parallel group: which batches it reads."""
    dp_size: int
    """Ranks in the data-parallel group (the world size without TP/PP)."""
    dp_group: Any = None
    """The data-parallel process group (None: the world)."""
    pipeline: bool = False
    """Whether the engine runs a pipeline (``train_batch``/``eval_batch`` instead of forward/backward/step)."""


def build_engine(args, cfg: dict, device, make_optimizer: Callable[[Any], Any] | None = None) -> TrainSetup:
    """The model and its engine: scape_ds.models.GPT, or megatron-core layers over TP/PP/DP groups.

    ``make_optimizer(model)``, if given, builds a client optimizer that DeepSpeed wraps instead of the
    config's ``optimizer`` block (the config must have none; the GPT model only)."""
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
        optimizer = make_optimizer(model) if make_optimizer is not None else None
        engine, _, _, _ = scape_ds.initialize(model=model, config=cfg, optimizer=optimizer)
        return TrainSetup(engine, model, dist.get_rank(), dist.get_world_size())
    if make_optimizer is not None:
        raise ValueError("a client optimizer (make_optimizer) runs with the GPT model only, not megatron-core's")
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
    return TrainSetup(engine, model, dp_rank, dp_size, dp_group, pp > 1)


def evaluate(setup: TrainSetup, val, args, device) -> float:
    """Mean validation loss over --eval-iters fixed batches per rank, averaged over data-parallel ranks."""
    import torch
    import torch.distributed as dist

    from scape_ds.comm import collective_device
    from scape_ds.data import get_batch

    engine, micro_bs = setup.engine, setup.engine.train_micro_batch_size_per_gpu()
    engine.eval()
    total = torch.zeros(1, dtype=torch.float64, device=collective_device(setup.dp_group))  # NCCL: a CUDA tensor
    with torch.no_grad():
        for i in range(args.eval_iters):
            x, y = get_batch(val, micro_bs, args.seq_len, i, setup.dp_rank, setup.dp_size, args.seed + 7919)
            if setup.pipeline:  # the loss of the last stage, sent to every stage
                loss = engine.eval_batch(iter([(x.to(device), y.to(device))]), num_micro_batches=1)
            else:
                _, loss = engine(x.to(device), y.to(device))
            total += float(loss)
    engine.train()
    dist.all_reduce(total, group=setup.dp_group)
    return float(total) / (args.eval_iters * setup.dp_size)


def evaluate_split(setup: TrainSetup, data, args, device) -> float:
    """Mean loss over every non-overlapping window of ``data`` (a held-apart split), the same windows
    for every run and seed.

    1. Cut ``data`` into windows of ``--seq-len`` + 1 tokens that start every ``--seq-len`` tokens;
       keep the largest multiple of micro-batch x data-parallel ranks (at most that many minus one
       are dropped, so every rank runs the same number of batches).
    2. Rank r evaluates windows r, r + D, r + 2D, ... in micro-batches; the mean of the batch means
       is all-reduced over the data-parallel group (every batch has the same size).
    """
    import torch
    import torch.distributed as dist

    from scape_ds.comm import collective_device

    engine, micro_bs, dp = setup.engine, setup.engine.train_micro_batch_size_per_gpu(), setup.dp_size
    n_windows = (data.numel() - 1) // args.seq_len
    n_batches = n_windows // (micro_bs * dp)
    if n_batches == 0:
        raise ValueError(f"--test-fraction: the test split has {n_windows} windows of {args.seq_len} tokens, fewer "
                         f"than one micro-batch per rank ({micro_bs} x {dp}): raise --test-fraction")
    starts = torch.arange(n_batches * micro_bs * dp) * args.seq_len  # (W,) int64 window offsets
    mine = starts[setup.dp_rank::dp].view(n_batches, micro_bs)  # (batches, B) this rank's windows
    total = torch.zeros(1, dtype=torch.float64, device=collective_device(setup.dp_group))  # NCCL: a CUDA tensor
    engine.eval()
    with torch.no_grad():
        for offsets in mine:
            window = data[offsets[:, None] + torch.arange(args.seq_len + 1)].long()  # (B, T + 1) int64
            x, y = window[:, :-1].to(device), window[:, 1:].to(device)  # (B, T), (B, T)
            if setup.pipeline:
                loss = engine.eval_batch(iter([(x, y)]), num_micro_batches=1)
            else:
                _, loss = engine(x, y)
            total += float(loss)
    engine.train()
    dist.all_reduce(total, group=setup.dp_group)
    return float(total) / (n_batches * dp)


def _train_step(setup: TrainSetup, data, args, step: int, device) -> float:
    """One optimizer step over the engine's gradient-accumulation micro-batches; returns the mean
    loss over data-parallel ranks and micro-batches (the same value on every rank)."""
    import torch
    import torch.distributed as dist

    from scape_ds.comm import collective_device
    from scape_ds.data import get_batch

    engine = setup.engine
    micro_bs, gas = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    if setup.pipeline:  # the PipelineEngine runs all gas micro-batches; it returns their mean over DP
        batches = [get_batch(data, micro_bs, args.seq_len, step * gas + m, setup.dp_rank, setup.dp_size, args.seed)
                   for m in range(gas)]
        return float(engine.train_batch(data_iter=iter([(x.to(device), y.to(device)) for x, y in batches])))
    loss_device = collective_device(setup.dp_group)
    loss_sum = torch.zeros(1, dtype=torch.float64, device=loss_device)  # NCCL: a CUDA tensor
    for micro in range(gas):
        x, y = get_batch(data, micro_bs, args.seq_len, step * gas + micro, setup.dp_rank, setup.dp_size, args.seed)
        _, loss = engine(x.to(device), y.to(device))
        engine.backward(loss)
        engine.step()
        loss_sum += loss.detach().double().to(loss_device)
    dist.all_reduce(loss_sum, group=setup.dp_group)  # logging only: the mean over ranks and micro-batches
    return float(loss_sum) / (gas * setup.dp_size)


def _describe_run(args, setup: TrainSetup, opt, world: int, tokens_per_step: int, train_data, val_data) -> str:
    """The opening line: model size, parallel layout, optimizer, tokens per step, corpus."""
    from scape_ds.data import unigram_entropy
    from scape_ds.engine import is_scape_stage3

    n_params = sum(getattr(p, "ds_numel", p.numel()) for p in setup.model.parameters())  # ZeRO-3: full sizes
    if opt is None:
        kind = type(setup.engine.optimizer).__name__
    elif opt.cfg.basis == "dct":
        update = f", {opt.cfg.dct_update} update" if opt.cfg.local_steps == 1 else ""  # else the outer step moves
        kind = (f"SCAPE dct sparsity {opt.cfg.sparsity} ({opt.cfg.tile_size}x{opt.cfg.tile_size} tiles, "
                f"{opt.cfg.mask} mask{update})")
    else:
        kind = f"SCAPE {opt.cfg.compressor} sparsity {opt.cfg.sparsity} T={opt.cfg.mask_refresh_interval}"
    if opt is not None and opt.cfg.overlap:
        kind += f", overlap ({opt.cfg.bucket_mb:g} MB buckets)"
    if opt is not None and opt.cfg.local_steps > 1:
        c = opt.cfg
        outer = f"nesterov outer lr {c.outer_lr:g}, momentum {c.outer_momentum:g}" if c.outer_update == "nesterov" \
            else f"sign outer step {c.outer_lr:g}"
        kind += f", local steps H={c.local_steps} ({c.inner_optimizer} inner, {outer})"
    stage3 = is_scape_stage3(opt)
    intra = getattr(opt, "intra_comm", None)
    if intra is not None:  # hierarchy "node": bytes_inter / bytes_intra in the metrics
        kind += f", hierarchy node ({intra.world_size} ranks per node x {opt.comm.world_size} nodes)"
    if stage3 and opt.cfg.basis == "dct":  # tiles over full shapes; dense tensors reduce-scattered in step()
        kind += (f" under ZeRO-3, {opt.cfg.param_exchange} (bytes: the coefficients' exchange + the dense tensors'"
                 f" reduce-scatter{' and all-gather' if opt.replica else ''} vs ZeRO-3's dense reduce-scatter"
                 f"{' + all-gather' if opt.replica else ''})")
    elif stage3 and opt.replica:
        kind += (" under ZeRO-3, sparse_replica (bytes: gradient reduce-scatter + masks + parameter all-gather"
                 " vs ZeRO-3's dense reduce-scatter + all-gather)")
    elif stage3:
        kind += " under ZeRO-3 (bytes: gradient reduce-scatter + masks vs ZeRO-3's dense reduce-scatter)"
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    layout = f"TP{tp} x PP{pp} x DP{setup.dp_size} ({'megatron-core' if uses_megatron(args) else 'GPT'})"
    return (f"GPT {n_params/1e6:.2f}M params on rank 0 | {world} ranks: {layout} | {kind} | "
            f"{tokens_per_step} tokens/step | corpus {train_data.numel()/1e6:.1f}M train / "
            f"{val_data.numel()/1e6:.2f}M val bytes, unigram entropy {unigram_entropy(train_data):.3f} nats")


def _warn_if_low_disk(engine, save_dir: str, is_main: bool) -> None:
    """One warning line (rank 0) when ``save_dir``'s file system has less free space than one
    checkpoint is estimated to take (:func:`scape_ds.checkpoint.estimate_checkpoint_bytes`)."""
    from scape_ds.checkpoint import estimate_checkpoint_bytes, free_bytes

    need, free = estimate_checkpoint_bytes(engine), free_bytes(save_dir)
    if is_main and free < need:
        print(f"pretrain.py: warning: --save {save_dir} has {free / 1e6:.1f} MB free and one checkpoint takes about "
              f"{need / 1e6:.1f} MB: the first save may fail (the previous checkpoint stays)", file=sys.stderr,
              flush=True)


def _log_line(record: dict) -> str:
    """The line printed every --log-interval steps and at each validation."""
    sent, dense = record["bytes_sent"], record["bytes_dense"]
    vl = f" | val loss {record['val_loss']:.4f}" if "val_loss" in record else ""
    vl += f" | test loss {record['test_loss']:.4f}" if "test_loss" in record else ""
    across = ""
    if record.get("bytes_intra"):  # hierarchy "node": what crossed the slow links, on its own
        inter, dense_inter = record["bytes_inter"], record["bytes_dense_inter"]
        across = (f" | across nodes {inter / 1e6:.3f} MB vs dense {dense_inter / 1e6:.3f} MB "
                  f"({inter / max(dense_inter, 1):.1%})")
    return (f"step {record['step']:5d} | loss {record['loss']:.4f}{vl} | lr {record['lr']:.2e} | "
            f"{record['tokens_per_s']:,.0f} tokens/s | sent {sent / 1e6:.3f} MB vs dense "
            f"{dense / 1e6:.3f} MB ({sent / max(dense, 1):.1%}){across}")


def loss_windows(losses: list[float]) -> tuple[int, float, float]:
    """``(w, mean of the first w losses, mean of the last w)`` with ``w = min(5, n // 2 or 1)``.

    The two windows never overlap once there are two steps; a one-step run compares its loss with
    itself; no steps give ``(0, nan, nan)``.
    """
    n = len(losses)
    if n == 0:
        return 0, float("nan"), float("nan")
    w = min(_SUMMARY_WINDOW, n // 2 or 1)
    return w, sum(losses[:w]) / w, sum(losses[-w:]) / w


def format_summary(summary: dict, losses: list[float]) -> str:
    """The closing line: steps, wall time, loss at the start and the end, validation loss, bytes.

    Args:
        summary: :func:`train`'s result (``steps``, ``wall_s``, ``val_loss``, ``bytes_sent``, ``bytes_dense``).
        losses: the mean training loss of every step of this run, in order.
    """
    sent, dense = summary["bytes_sent"], summary["bytes_dense"]
    frac = sent / dense if dense else 0.0
    saved = f"{1 - frac:.1%} saved" if dense else "one rank: nothing to exchange"
    w, first, last = loss_windows(losses)
    test = f" | test loss {summary['test_loss']:.4f}" if "test_loss" in summary else ""
    return (f"done: {summary['steps']} steps in {summary['wall_s']:.0f} s | loss {first:.3f} (first {w}) -> "
            f"{last:.3f} (last {w}) | val loss {summary['val_loss']:.4f}{test} | sent {sent / 1e6:.1f} MB of a dense "
            f"{dense / 1e6:.1f} MB: {frac:.2%} ({saved})")


def train(args, cfg: dict, on_step: Callable[[int, Any], None] | None = None, watch=None, stop=None,
          on_start: Callable[[Any], None] | None = None, make_optimizer: Callable[[Any], Any] | None = None) -> dict:
    """Train ``args.train_iters`` optimizer steps (from the checkpoint's step with ``--load``).

    Needs torch.distributed started (:func:`init_distributed`).

    Args:
        args: the parsed options (:func:`build_parser`), checked by :func:`check_inputs`.
        cfg: the DeepSpeed config :func:`check_inputs` returned.
        on_step: called as ``on_step(step, engine)`` on every rank after each optimizer step (``step``
            counts from 1), outside the timed region and before that step's validation and metrics
            record: a baseline that completes a step there (the outer step of DiLoCo and SparseLoCo)
            is evaluated on the model every rank holds after it.
        watch: a :class:`scape_ds.faults.PeerWatch` whose ``phase`` the loop keeps current (step,
            validation, save), for the report of a lost peer.
        stop: a :class:`scape_ds.stop.StopRequest` asked after every step (and before the first)
            whether any rank was asked to stop; if so the ranks save that step (with ``--save``)
            and raise :class:`scape_ds.stop.Stopped`. None: no check (no extra collective).
        on_start: called as ``on_start(engine)`` on every rank once the engine is built (and loaded
            with ``--load``), before the first step: a baseline that changes how the engine
            exchanges (the quality bench's DiLoCo) sets itself up there.
        make_optimizer: builds a client optimizer from the model (:func:`build_engine`); the quality
            bench's independent DeMo runs through it.

    Raises:
        scape_ds.stop.Stopped: the ranks stopped on request (``stop``), after saving with ``--save``.

    Returns:
        ``steps`` (of this run), ``final_loss`` (the last step's), ``val_loss`` (the last validation),
        ``test_loss`` (with ``--test-fraction`` > 0 and a last step in this run: the held-apart split),
        ``bytes_sent`` and ``bytes_dense`` (summed over this run, per rank), ``wall_s``.
    """
    import torch
    import torch.distributed as dist
    from tqdm import tqdm

    from scape_ds.checkpoint import load_checkpoint, resolve_load, save_checkpoint
    from scape_ds.data import build_splits
    from scape_ds.engine import scape_optimizer
    from scape_ds.faults import PeerWatch, bound_group_timeouts
    from scape_ds.metrics import MetricsWriter
    from scape_ds.stop import Stopped

    rank, world = dist.get_rank(), dist.get_world_size()
    is_main = rank == 0
    device = torch.device(f"cuda:{args.local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(args.seed)
    train_data, val_data, test_data = build_splits(args.val_fraction, args.test_fraction, name=args.corpus)
    watch = watch or PeerWatch()
    setup = build_engine(args, cfg, device, make_optimizer)
    bound_group_timeouts(args.dist_timeout)  # DeepSpeed's and megatron-core's groups: --dist-timeout too
    engine = setup.engine
    opt = scape_optimizer(engine)
    dense_bytes = dense_bytes_for(setup.model, setup.dp_size)
    if args.save:
        _warn_if_low_disk(engine, args.save, is_main)
    start = 0
    if args.load:
        tag, client = load_checkpoint(engine, args.load)
        start = int(client.get("step", engine.global_steps))
        if is_main:
            print(f"resumed from {os.path.join(resolve_load(args.load)[0], tag)} at step {start}", flush=True)
    if on_start is not None:
        on_start(engine)
    tokens_per_step = (engine.train_micro_batch_size_per_gpu() * engine.gradient_accumulation_steps()
                       * setup.dp_size * args.seq_len)
    if is_main:
        print(_describe_run(args, setup, opt, world, tokens_per_step, train_data, val_data), flush=True)
    metrics = MetricsWriter(args.metrics_out if is_main else None, args.tensorboard_dir if is_main else None,
                            append=bool(args.load))
    # a bar only on a terminal: into a file or a pipe its carriage-return updates make one huge line, so
    # there the log lines (every --log-interval steps) are the progress
    bar = tqdm(total=args.train_iters, initial=start, desc="pretrain", dynamic_ncols=True,
               disable=not is_main or args.no_progress or not sys.stderr.isatty())
    sent_total = dense_total = 0
    losses, val_loss, test_loss = [], float("nan"), None
    t_run = time.perf_counter()
    with metrics:
        if stop is not None and (reason := stop.agreed()):  # asked during start-up: nothing new to save
            bar.close()
            raise Stopped(start, reason, None)
        for step in range(start, args.train_iters):
            watch.phase = f"step {step + 1}"
            lr = engine.get_lr()[0]
            t0 = time.perf_counter()
            mean_loss = _train_step(setup, train_data, args, step, device)
            step_time = time.perf_counter() - t0
            if opt is not None:
                stats = opt.comm_stats
                sent, dense = int(stats["bytes_sent"]), int(stats["bytes_dense"])
                inter, intra = int(stats["bytes_inter"]), int(stats["bytes_intra"])
                dense_inter = int(stats["bytes_dense_inter"])
            else:  # a dense baseline does not know the topology: every byte counts as inter-node
                sent = dense = inter = dense_inter = dense_bytes
                intra = 0
            sent_total += sent
            dense_total += dense
            record = dict(step=step + 1, loss=mean_loss, lr=lr, step_time_s=step_time, bytes_sent=sent,
                          bytes_dense=dense, bytes_inter=inter, bytes_intra=intra, bytes_dense_inter=dense_inter,
                          tokens_per_s=tokens_per_step / step_time)
            if on_step is not None:  # first: a baseline's outer step finishes the step it evaluates
                on_step(step + 1, engine)
            if (step + 1) % args.eval_interval == 0 or step + 1 == args.train_iters:
                watch.phase = f"validation at step {step + 1}"
                val_loss = record["val_loss"] = evaluate(setup, val_data, args, device)
            if step + 1 == args.train_iters and test_data.numel():
                watch.phase = f"test at step {step + 1}"
                test_loss = record["test_loss"] = evaluate_split(setup, test_data, args, device)
            losses.append(mean_loss)
            metrics.write(record)
            bar.update(1)
            bar.set_postfix(loss=f"{mean_loss:.3f}", sent=f"{sent / max(dense, 1):.1%}")
            if is_main and ((step + 1) % args.log_interval == 0 or "val_loss" in record):
                if bar.disable:
                    print(_log_line(record), flush=True)
                else:
                    bar.write(_log_line(record))
            saved = None
            if (args.save and args.save_interval and (step + 1) % args.save_interval == 0
                    and step + 1 != args.train_iters):
                watch.phase = f"saving global_step{step + 1}"
                saved = save_checkpoint(engine, args.save, step + 1, dict(step=step + 1))
            if stop is not None and step + 1 != args.train_iters and (reason := stop.agreed()):
                if args.save and saved is None:
                    watch.phase = f"saving global_step{step + 1}"
                    saved = save_checkpoint(engine, args.save, step + 1, dict(step=step + 1))
                bar.close()
                raise Stopped(step + 1, reason, saved)
        bar.close()
        if opt is not None:
            opt.synchronize()  # a run that ends on a refresh step has its mask all-gather in flight
        if args.save:
            watch.phase = f"saving global_step{args.train_iters}"
            save_checkpoint(engine, args.save, args.train_iters, dict(step=args.train_iters))
        summary = dict(steps=args.train_iters - start, final_loss=losses[-1] if losses else float("nan"),
                       val_loss=val_loss, bytes_sent=sent_total, bytes_dense=dense_total,
                       wall_s=time.perf_counter() - t_run)
        if test_loss is not None:
            summary["test_loss"] = test_loss
        if is_main:
            print(format_summary(summary, losses), flush=True)
    return summary


def main(argv=None) -> int:
    """Run ``launch/pretrain.py``: 0 on success, 2 (one line on stderr) on bad input, 1 (one line)
    when a checkpoint could not be written, 143 when SIGTERM, SIGINT or the launcher's end stopped
    the run (after saving the step with ``--save``; one line naming the tag, :mod:`scape_ds.stop`);
    a rank whose peer stopped answering prints one line (:mod:`scape_ds.faults`) and ends the
    process with exit code 3."""
    args = build_parser().parse_args(argv)
    try:
        cfg = check_inputs(args)
    except (ValueError, ImportError, TypeError) as e:
        print(f"pretrain.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from scape_ds.stop import STOP_EXIT_CODE, Stopped, StopRequest

    stop = StopRequest()
    stop.install()  # SIGTERM/SIGINT and the launcher's end: stop after the step, with a checkpoint
    init_distributed(args.dist_timeout)
    from scape_ds.checkpoint import CheckpointSaveError
    from scape_ds.faults import PeerWatch, is_peer_lost, report_lost_peer

    watch = PeerWatch()
    try:
        train(args, cfg, watch=watch, stop=stop)
    except Stopped as e:  # every rank, after the same step
        import torch.distributed as dist

        if dist.get_rank() == 0:
            print(f"pretrain.py: {_stopped_line(e, args.save)}", file=sys.stderr, flush=True)
        return STOP_EXIT_CODE
    except (ValueError, ImportError) as e:
        print(f"pretrain.py: error: {e}", file=sys.stderr, flush=True)
        return 2
    except CheckpointSaveError as e:  # a full disk: the run stops, the previous checkpoint stays
        print(f"pretrain.py: error: {e}", file=sys.stderr, flush=True)
        return 1
    except RuntimeError as e:
        if not is_peer_lost(e):
            raise
        if args.save and watch.phase.startswith("saving "):  # a tag half written: not left behind
            from scape_ds.checkpoint import discard_partial_tag

            discard_partial_tag(args.save, watch.phase.split()[1])
        print(f"pretrain.py: error: {report_lost_peer(e, watch, args.dist_timeout, args.save)}", file=sys.stderr,
              flush=True)
        sys.stdout.flush()
        # at once: the interpreter's teardown of torch and DeepSpeed takes seconds of garbage collection
        # on a busy machine, and gloo's threads may still wait on the dead link (metrics are closed)
        os._exit(3)
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _stopped_line(e, save_dir: str | None) -> str:
    """The line rank 0 prints when the ranks stopped on request (:class:`scape_ds.stop.Stopped`)."""
    from scape_ds.faults import last_checkpoint

    where = f"after step {e.step}" if e.step else "before the first step"
    if e.tag_dir:
        saved = f"saved {os.path.basename(e.tag_dir)} in {save_dir}: resume with --load {save_dir}"
    elif save_dir:
        saved = f"nothing new to save; {last_checkpoint(save_dir)}"
    else:
        saved = "nothing saved (no --save)"
    return f"stopped {where} ({e.reason}): {saved}"


def run(argv=None) -> None:
    """:func:`main`, then end the process without the interpreter's finalization (the process group
    is destroyed by then). gloo's worker threads can still hold finished work with tensors in it, and
    freeing those while the interpreter is torn down aborts the process ("terminate called without an
    active exception", pytorch/pytorch#179291): it happened once to rank 1 of a successful ``make
    pretrain``, which then failed with the launcher's exit code. Output is flushed first."""
    rc = main(argv)
    mpi = sys.modules.get("mpi4py.MPI")  # under mpiexec: finalize, as mpi4py's exit hook would
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    run()
