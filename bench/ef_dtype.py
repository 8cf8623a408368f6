"""What a bf16 error-feedback buffer loses (``scape.error_feedback_dtype``), measured on CPU.

    python bench/ef_dtype.py                 # ~6 min on 2 cores; writes runs/ef_dtype.json

1. Conservation: one rank, an MLP (two 1024x1024 weights), SCAPE 0.99 with one dense step then
   99 sparse steps (T=100). Error feedback promises ``sent + residual == every gradient accumulated``;
   in fp32 that holds to fp32 rounding, in bf16 each step's ``e + g`` is rounded to 8 bits of
   mantissa and the rounding is lost. Reported: max |sent + residual - accumulated| relative to
   max |accumulated|, after 100 steps.
2. Training: launch/pretrain.py, 2 gloo ranks, 200 steps of ds_configs/scape_coordinate.json with
   ``error_feedback_dtype`` fp32 and bf16: the mean training loss of the last 20 steps and the
   final validation loss.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

from scape_ds.comm import TorchCommunicator

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _RecordingCommunicator(TorchCommunicator):
    """Keeps the last gradient reduce-scatter's input (what this rank sent)."""

    def reduce_scatter(self, out, inp, tag):
        if tag == "grad_rs":
            self.last = inp.detach().double().clone()
        super().reduce_scatter(out, inp, tag)


def conservation(ef: str, steps: int = 100) -> float:
    from scape_ds.exchange.masks import offsets_to_index
    from scape_ds.optim import ScapeAdamS

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024, bias=False), torch.nn.GELU(),
                                torch.nn.Linear(1024, 1024, bias=False))
    comm = _RecordingCommunicator()
    opt = ScapeAdamS(model.parameters(), lr=1e-3, comm=comm, scape=dict(
        sparsity=0.99, chunk_size=4096, mask_refresh_interval=100, error_feedback_dtype=ef, kernels="torch"))
    gen = torch.Generator().manual_seed(1)
    accumulated = sent = None
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(16, 1024, generator=gen)
        model(x).square().mean().backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).double()
        dense = opt.schedule.is_dense(opt.step_count + 1)
        index = None if dense else offsets_to_index(opt.mask_offsets(), 4096, opt.cfg.k_per_chunk)
        opt.step()
        if accumulated is None:
            n_pad = opt.error_feedback().numel()
            accumulated, sent = torch.zeros(n_pad, dtype=torch.float64), torch.zeros(n_pad, dtype=torch.float64)
        accumulated[: grad.numel()] += grad
        if index is None:
            sent += comm.last
        else:
            sent.index_add_(0, index, comm.last)
    residual = opt.error_feedback().double()
    return float((sent + residual - accumulated).abs().max() / accumulated.abs().max())


def train(ef: str, steps: int, workdir: str) -> dict:
    with open(os.path.join(_REPO, "ds_configs", "scape_coordinate.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["scape"]["error_feedback_dtype"] = ef
    path = os.path.join(workdir, f"scape_ef_{ef}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f)
    metrics = os.path.join(workdir, f"ef_{ef}.jsonl")
    env = dict(os.environ, PYTHONPATH=_REPO, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           os.path.join(_REPO, "launch", "pretrain.py"), "--deepspeed_config", path, "--train-iters", str(steps),
           "--eval-interval", str(steps), "--no-progress", "--metrics-out", metrics]
    subprocess.run(cmd, check=True, env=env, cwd=_REPO, stdout=subprocess.DEVNULL)
    with open(metrics, encoding="utf-8") as f:
        records = [json.loads(line) for line in f]
    last = [r["loss"] for r in records[-20:]]
    return dict(train_loss_last20=round(sum(last) / len(last), 4), val_loss=round(records[-1]["val_loss"], 4))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--out", default=os.path.join(_REPO, "runs", "ef_dtype.json"))
    args = ap.parse_args(argv)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    store = tempfile.mkdtemp(prefix="ef_dtype_")
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(store, "s"), 1), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = {ef: dict(conservation_rel_err_100_steps=conservation(ef)) for ef in ("fp32", "bf16")}
    finally:
        dist.destroy_process_group()
    for ef in ("fp32", "bf16"):
        result[ef].update(train(ef, args.steps, store))
        print(ef, json.dumps(result[ef]), flush=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
