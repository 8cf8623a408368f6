"""Running quality runs: in-process gloo ranks through the product's own loop, checkpointed and resumable.

:func:`run` spawns ``ranks`` processes; each trains the runs one after another with
``scape_ds.train.train`` on ``scape_ds.initialize`` (:func:`_train_one`), writing ``<id>.jsonl`` (per
step), ``<id>.json`` (the summary) and, while it trains, ``<id>.ckpt/`` (checkpoints with the
diagnostics' state, deleted when the run finishes) under the output folder.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time

from .baselines import build_baseline
from .diagnostics import Diagnostics
from .runs import (
    ABLATIONS,
    BASELINES,
    CKPT_STATE,
    REPO,
    RUNS,
    describe,
    initial_params,
    make_config,
    rerun_command,
    resolve_opts,
    run_id,
)
from .tables import add_displacement_ratios, load_results


def _atomic_write(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _checkpoint_step(ckpt: str) -> int:
    """The step of the newest complete checkpoint in ``ckpt`` (0: none)."""
    try:
        with open(os.path.join(ckpt, "latest"), encoding="utf-8") as f:
            tag = f.read().strip()
    except OSError:
        return 0
    if not tag.startswith("global_step") or not os.path.isfile(os.path.join(ckpt, tag, CKPT_STATE)):
        return 0
    return int(tag[len("global_step"):])


def _keep_rows_up_to(path: str, step: int) -> None:
    """Drop the per-step rows after ``step`` (written after the checkpoint a run resumes from)."""
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    _atomic_write(path, "".join(rows))


class _Hook:
    """The on_step of one segment: a baseline's step (if any), diagnostics, and their state saved beside
    each checkpoint."""

    def __init__(self, diag: Diagnostics, ckpt: str | None, ckpt_interval: int, end: int, t0: float, baseline=None):
        self.diag, self.ckpt, self.ckpt_interval, self.end, self.t0 = diag, ckpt, ckpt_interval, end, t0
        self.baseline = baseline

    def wall_s(self) -> float:
        return self.diag.wall_before + time.perf_counter() - self.t0

    def __call__(self, step: int, engine) -> None:
        import torch

        if self.baseline is not None:
            self.baseline(step, engine)
        self.diag(step, engine)
        # the loop saves a checkpoint at these steps right after this call; the state goes into its tag dir
        if self.diag.rank == 0 and self.ckpt and (step % self.ckpt_interval == 0 or step == self.end):
            tag_dir = os.path.join(self.ckpt, f"global_step{step}")
            os.makedirs(tag_dir, exist_ok=True)
            torch.save(self.diag.state_dict(self.wall_s()), os.path.join(tag_dir, CKPT_STATE + ".tmp"))
            os.replace(os.path.join(tag_dir, CKPT_STATE + ".tmp"), os.path.join(tag_dir, CKPT_STATE))


def _train_one(pretrain, name: str, opts: dict, out_dir: str, rank: int, stop_at: int | None) -> None:
    import torch.distributed as dist

    from scape_ds.checkpoint import safe_load

    rid = run_id(name, opts)
    cfg_path, metrics = os.path.join(out_dir, f"{rid}.ds_config.json"), os.path.join(out_dir, f"{rid}.jsonl")
    baseline = build_baseline(BASELINES.get(name))  # no checkpoints: see baselines.py
    ckpt = os.path.join(out_dir, f"{rid}.ckpt") if opts["ckpt_interval"] and baseline is None else None
    start = _checkpoint_step(ckpt) if ckpt else 0
    if rank == 0:
        cfg = make_config(name, opts["steps"], opts["micro_batch"], opts["warmup"], opts["lr"])
        _atomic_write(cfg_path, json.dumps(cfg, indent=2))
        if start:
            _keep_rows_up_to(metrics, start)
        elif ckpt:
            shutil.rmtree(ckpt, ignore_errors=True)  # no complete checkpoint with its state: start over
    dist.barrier()
    end = min(stop_at, opts["steps"]) if stop_at else opts["steps"]
    argv = ["--deepspeed_config", cfg_path, "--train-iters", str(end), "--seed", str(opts["seed"]),
            "--eval-interval", str(opts["eval_interval"]), "--eval-iters", str(opts["eval_iters"]),
            "--log-interval", str(opts["log_interval"]), "--seq-len", str(opts["seq_len"]),
            "--n-layer", str(opts["n_layer"]), "--n-head", str(opts["n_head"]), "--n-embd", str(opts["n_embd"]),
            "--val-fraction", str(opts["val_fraction"]), "--test-fraction", str(opts["test_fraction"]),
            "--metrics-out", metrics, "--no-progress"]
    if ckpt:
        argv += ["--save", ckpt, "--save-interval", str(opts["ckpt_interval"])]
    if start:
        argv += ["--load", ckpt]
    args = pretrain.build_parser().parse_args(argv)
    cfg = pretrain.check_inputs(args)
    diag = Diagnostics(initial_params(opts), opts["diag_window"], rank)
    if start and rank == 0:
        diag.load_state_dict(safe_load(os.path.join(ckpt, f"global_step{start}", CKPT_STATE)))
    if rank == 0:
        print(f"=== {rid}: {RUNS[name][0]}" + (f" (resumed at step {start})" if start else ""), flush=True)
    hook = _Hook(diag, ckpt, opts["ckpt_interval"], end, time.perf_counter(), baseline)
    if rank == 0 and start == 0:
        _record_diff(os.path.join(out_dir, f"{rid}.patch"))
    if start < end:
        train_cfg = baseline.engine_config(cfg) if hasattr(baseline, "engine_config") else cfg
        with ABLATIONS.get(name, contextlib.nullcontext)():
            pretrain.train(args, train_cfg, on_step=hook, on_start=baseline.start if baseline is not None else None,
                           make_optimizer=getattr(baseline, "make_optimizer", None))
    else:
        hook.t0 = time.perf_counter()  # nothing left to train: the wall time is the checkpoint's
    if rank == 0 and end == opts["steps"]:
        if diag.window_steps:
            diag.close_window(end)
        _write_summary(name, opts, cfg, metrics, diag, hook.wall_s(), os.path.join(out_dir, f"{rid}.json"),
                       baseline)
    dist.barrier()
    if rank == 0 and end == opts["steps"] and ckpt:
        shutil.rmtree(ckpt, ignore_errors=True)  # finished: the summary replaces it
    elif rank == 0 and end < opts["steps"]:
        print(f"{rid}: stopped at step {end} of {opts['steps']}; the same command resumes it", flush=True)


def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, check=True).stdout


def _record_diff(path: str) -> None:
    """Write the diff of the working tree against HEAD (tracked files) to ``path``, or remove ``path``
    when the tree is clean: a ``+dirty`` row names the exact code it ran (its sha256 is in the csv)."""
    try:
        diff = _git("diff", "HEAD", "--binary")
    except (OSError, subprocess.CalledProcessError):
        diff = ""
    if diff:
        _atomic_write(path, diff)
    elif os.path.exists(path):
        os.remove(path)


def _versions(patch: str) -> dict:
    """git revision (``+dirty`` with the sha256 of the run's diff, stored as ``patch`` when it started),
    torch and DeepSpeed versions."""
    import hashlib

    import deepspeed
    import torch

    try:
        rev = _git("rev-parse", "--short", "HEAD").strip()
    except (OSError, subprocess.CalledProcessError):
        rev = ""
    digest = ""
    if os.path.exists(patch):
        rev += "+dirty"
        with open(patch, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
    return dict(git_rev=rev, git_diff_sha256=digest, torch=torch.__version__, deepspeed=deepspeed.__version__)


def _write_summary(name: str, opts: dict, cfg: dict, metrics: str, diag: Diagnostics, wall_s: float, path: str,
                   baseline=None):
    with open(metrics, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    assert [r["step"] for r in rows] == list(range(1, opts["steps"] + 1)), "per-step rows missing or repeated"
    sent, dense = sum(r["bytes_sent"] for r in rows), sum(r["bytes_dense"] for r in rows)
    if baseline is not None:  # the loop counted the dense run's bytes; the baseline knows what it sent
        sent = baseline.bytes_sent(rows)
    summary = dict(run=run_id(name, opts), name=name, label=RUNS[name][0], **describe(name, cfg, opts["ranks"]),
                   n_params=int(diag.p0.numel()), **{k: opts[k] for k in ("n_layer", "n_embd", "steps", "seed", "ranks",
                                                                          "val_fraction", "test_fraction")},
                   val_loss=rows[-1]["val_loss"], test_loss=rows[-1].get("test_loss", ""), final_loss=rows[-1]["loss"],
                   bytes_sent=sent, bytes_dense=dense,
                   bytes_frac=sent / dense if dense else float("nan"), wall_s=wall_s, **diag.summary(),
                   **_versions(path[:-len(".json")] + ".patch"), command=rerun_command(name, opts), opts=opts)
    _atomic_write(path, json.dumps(summary, indent=2))


def _worker(rank, world, port, names, opts, out_dir, stop_at):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                      DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from scape_ds import train as pretrain

    pretrain.init_distributed(opts["timeout"])
    try:
        for name in names:
            _train_one(pretrain, name, opts, out_dir, rank, stop_at)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(names: list[str], out_dir: str, force: bool = False, stop_at: int | None = None, **opts) -> dict[str, dict]:
    """Train every run in ``names`` at ``opts`` (see ``DEFAULTS``; ``train_iters`` = ``steps``), skipping
    finished ones unless ``force`` and resuming from checkpoints; ``stop_at``: stop every run at that step
    (checkpointed). Returns the summaries of the finished runs, keyed by run id, with their curves."""
    import torch.multiprocessing as mp

    opts = resolve_opts(**opts)
    for n in names:
        make_config(n, opts["steps"], opts["micro_batch"], opts["warmup"])  # fail early on a bad name
    if stop_at is not None and (stop_at < 1 or not opts["ckpt_interval"]):
        raise ValueError(f"--stop-at {stop_at}: needs a step >= 1 and checkpoints (--ckpt-interval > 0)")
    os.makedirs(out_dir, exist_ok=True)
    todo = []
    for n in names:
        rid = run_id(n, opts)
        if force or not os.path.exists(os.path.join(out_dir, f"{rid}.json")):
            if force:
                shutil.rmtree(os.path.join(out_dir, f"{rid}.ckpt"), ignore_errors=True)
                for ext in (".json", ".jsonl"):
                    if os.path.exists(os.path.join(out_dir, rid + ext)):
                        os.remove(os.path.join(out_dir, rid + ext))
            todo.append(n)
    if todo:
        mp.start_processes(_worker, args=(opts["ranks"], _free_port(), todo, opts, out_dir, stop_at),
                           nprocs=opts["ranks"], start_method="spawn")
        update_displacement_ratios(out_dir)
    return load_results([run_id(n, opts) for n in names], out_dir)


def update_displacement_ratios(out_dir: str) -> None:
    """Write ``displacement_vs_adams`` into every run summary in ``out_dir`` (see add_displacement_ratios)."""
    summaries = {}
    for fname in sorted(os.listdir(out_dir)):
        if fname.endswith(".json") and not fname.endswith(".ds_config.json"):
            with open(os.path.join(out_dir, fname), encoding="utf-8") as f:
                summaries[fname] = json.load(f)
    add_displacement_ratios(summaries)
    for fname, summary in summaries.items():
        _atomic_write(os.path.join(out_dir, fname), json.dumps(summary, indent=2))


