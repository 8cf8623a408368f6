"""Step time over shaped links: dense AdamW / AdamS vs SCAPE 0.9 / 0.99, inside launch/cluster.py.

    sudo python bench/step_time.py                           # 2 and 4 nodes x 1 and 10 Gbit/s
    sudo python bench/step_time.py --nodes 4 --rates 1gbit --steps 10
    sudo python bench/step_time.py --zero3 --micro-batch 1 --seq-len 32   # + ZeRO-3 rows, less compute
    sudo python bench/step_time.py --dct --nodes 4 --rates 1gbit --out runs/step_time_dct.json  # basis "dct"
    sudo python bench/step_time.py --overlap --nodes 4 --rates 1gbit --block 3 --steps 12  # scape.overlap
    sudo python bench/step_time.py --overlap --dct --nodes 4 --rates 1gbit --block 3 --steps 12  # ... basis "dct"

For every (nodes, rate) it builds an emulated cluster (one rank per node, gloo bound to the
node's shaped eth0) and runs the same GPT and batches through ``scape_ds.initialize`` with four
optimizer configs, one after another in the same processes: dense AdamW (DeepSpeed's all-reduce),
dense AdamS (same exchange), SCAPE 0.9 and SCAPE 0.99 (T=100, dense refresh). Per row it reports
the median step time over the steps after warm-up (forward, backward, exchange, update), the
bytes each rank sent per step (the byte meter; dense rows: one ring all-reduce of the fp32
gradient), the speedup vs dense AdamW, and the floor: compute time (forward + backward, no
exchange and no optimizer step, measured in the same run) plus bytes / link rate. The model is
wide and shallow with a small batch, so that at 1 Gbit/s the dense exchange dominates the step,
as it does for LLMs on real clusters. Timed SCAPE steps are sparse steps (the refresh is step 0,
in the warm-up); with dense refresh every T steps, a refresh costs about one dense step.
``--zero3`` adds dense ZeRO-3 and the SCAPE stage 3 at 0.99 in both ``param_exchange`` modes
(their bytes include ZeRO-3's own parameter all-gathers, counted at DeepSpeed's backend).
Writes ``bench/step_time_results.json`` and ``bench/step_time.png`` (step time vs bandwidth).

    python bench/step_time.py --mpi-loopback --nodes 2,4     # no root: MPI vs torch backend

    sudo python bench/step_time.py --mpi --micro-batch 1   # ranks from mpiexec, + the mpi-backend rows

``--mpi`` starts the cluster's ranks with MPICH's ``mpiexec`` inside the nodes (``Cluster.launch_mpi``)
and adds SCAPE 0.9 and 0.99 over the mpi4py backend, each timed in the same job as its torch row
(the "mpi / torch backend" column). ``--mpi-loopback`` starts the ranks with the venv's ``mpiexec``
on this machine's loopback (no shaping) and times
SCAPE 0.9 and 0.99 with ``comm_backend`` "torch" (gloo) and "mpi" (mpi4py) side by side in the
same processes, for the MPI-vs-torch step-time ratio. Writes ``bench/mpi_vs_torch_results.json``.
    sudo python bench/step_time.py --hier --nodes 2 --ranks-per-node 2 --rates 1gbit --micro-batch 1

``--hier`` runs G = ``--ranks-per-node`` ranks per node (they share the node's namespace: their
traffic is unshaped, only inter-node traffic crosses the links) and compares hierarchical SCAPE
(``"hierarchy": "node"``) with flat SCAPE at 0.9 and 0.99, dense AdamW and the compute floor. The
SCAPE rows refresh every ``--refresh-every`` steps so that sparse and refresh steps are both timed
(medians of each); the period mean is ((T-1) sparse + 1 refresh) / T for T = ``--period`` (the
default T = 100). The rows are interleaved (``--interleave``: every engine is built first, then step s
of every row, compute floor included, runs before step s + 1), so that load from other jobs on a
shared machine falls on every row alike. Writes ``bench/step_time_hier_results.json`` and ``bench/step_time_hier.png``.
``--hier --dct``: dense AdamW, flat dct 0.99 and hierarchical dct 0.99 (ds_configs/scape_hier.json's
exchange); writes ``bench/step_time_hier_dct_results.json`` and ``bench/step_time_hier_dct.png``.

``--zero3-loopback`` does the same for dense ZeRO-3 (DeepSpeed's stage 3 with dense AdamS) against
the SCAPE stage 3 at 0.9 and 0.99 in both ``param_exchange`` modes. Bytes per step: what SCAPE's
meter counts (gradient reduce-scatter, masks, and under sparse_replica the parameter all-gather;
dense ZeRO-3's reduce-scatter by the same formula) plus DeepSpeed's own all-gathers (ZeRO-3's
parameter fetches in forward and backward), counted at DeepSpeed's communication backend.
Writes ``bench/zero3_results.json``.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BASE = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
        "steps_per_print": 10**9}
OPT = {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}
ROWS = {
    "dense AdamW": {"optimizer": {"type": "AdamW", "params": {**OPT, "torch_adam": True}}},
    "dense AdamS": {"optimizer": {"type": "AdamS", "params": OPT}},
    "SCAPE 0.9": {"optimizer": {"type": "ScapeAdamS", "params": OPT},
                  "scape": {"sparsity": 0.9, "mask_refresh_interval": 100}},
    "SCAPE 0.99": {"optimizer": {"type": "ScapeAdamS", "params": OPT},
                   "scape": {"sparsity": 0.99, "mask_refresh_interval": 100}},
    "SCAPE 0.9 (mpi)": {"optimizer": {"type": "ScapeAdamS", "params": OPT},
                        "scape": {"sparsity": 0.9, "mask_refresh_interval": 100, "comm_backend": "mpi"}},
    "SCAPE 0.99 (mpi)": {"optimizer": {"type": "ScapeAdamS", "params": OPT},
                         "scape": {"sparsity": 0.99, "mask_refresh_interval": 100, "comm_backend": "mpi"}},
}
_Z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}
ROWS.update({
    "dense ZeRO-3 AdamS": {"optimizer": {"type": "AdamS", "params": OPT}, "zero_optimization": _Z3},
    "SCAPE ZeRO-3 0.9": {"optimizer": {"type": "ScapeAdamS", "params": OPT}, "zero_optimization": _Z3,
                         "scape": {"sparsity": 0.9, "mask_refresh_interval": 100}},
    "SCAPE ZeRO-3 0.99": {"optimizer": {"type": "ScapeAdamS", "params": OPT}, "zero_optimization": _Z3,
                          "scape": {"sparsity": 0.99, "mask_refresh_interval": 100}},
    "SCAPE ZeRO-3 0.9 replica": {"optimizer": {"type": "ScapeAdamS", "params": OPT}, "zero_optimization": {"stage": 3},
                                 "scape": {"sparsity": 0.9, "mask_refresh_interval": 100,
                                           "param_exchange": "sparse_replica"}},
    "SCAPE ZeRO-3 0.99 replica": {"optimizer": {"type": "ScapeAdamS", "params": OPT}, "zero_optimization": {"stage": 3},
                                  "scape": {"sparsity": 0.99, "mask_refresh_interval": 100,
                                            "param_exchange": "sparse_replica"}},
})
ROWS.update({f"SCAPE {s} hier": {"optimizer": {"type": "ScapeAdamS", "params": OPT},
                                  "scape": {"sparsity": s, "mask_refresh_interval": 100, "hierarchy": "node"}}
             for s in (0.9, 0.99)})
# basis "dct" (ds_configs/scape_dct.json's exchange): every step is alike, no refresh
ROWS.update({f"SCAPE {s} dct": {"optimizer": {"type": "ScapeAdamS", "params": OPT},
                                 "scape": {"sparsity": s, "basis": "dct", "mask": "per_rank", "clip_local": 1.0,
                                           "ef_decay": 0.999}} for s in (0.9, 0.99)})
ROWS["SCAPE 0.99 dct hier"] = {**ROWS["SCAPE 0.99 dct"], "scape": {**ROWS["SCAPE 0.99 dct"]["scape"],
                                                                 "hierarchy": "node"}}
# --dct --overlap: ds_configs/scape_dct_overlap.json's exchange with and without overlap, both with
# gradient_clipping 0 (the overlap refuses the global clip), beside the coordinate basis with overlap
ROWS.update({f"SCAPE {s} dct noclip{' overlap' if o else ''}": {
    "optimizer": {"type": "ScapeAdamS", "params": OPT}, "gradient_clipping": 0.0,
    "scape": {"sparsity": s, "basis": "dct", "mask": "per_rank", "clip_local": 1.0, "ef_decay": 0.999, "overlap": o}}
    for s in (0.9, 0.99) for o in (False, True)})
# scape.overlap (--overlap): the bucketed exchange beside the same SCAPE rows, and dense AdamW at the
# settings a user would run it with overlap: DeepSpeed ZeRO-1 with overlap_comm, and torch DDP
# (bucketed all-reduce from autograd hooks, its default 25 MB buckets)
ROWS.update({f"SCAPE {s} overlap": {"optimizer": {"type": "ScapeAdamS", "params": OPT},
                                     "scape": {"sparsity": s, "mask_refresh_interval": 100, "overlap": True}}
             for s in (0.9, 0.99)})
ROWS["SCAPE 0.99 overlap 4MB"] = {"optimizer": {"type": "ScapeAdamS", "params": OPT},
                                  "scape": {"sparsity": 0.99, "mask_refresh_interval": 100, "overlap": True,
                                            "bucket_mb": 4.0}}
ROWS["SCAPE ZeRO-3 0.99 replica overlap"] = {"optimizer": {"type": "ScapeAdamS", "params": OPT},
                                            "zero_optimization": {"stage": 3},
                                            "scape": {"sparsity": 0.99, "mask_refresh_interval": 100,
                                                      "param_exchange": "sparse_replica", "overlap": True}}
ROWS["dense AdamW ZeRO-1 overlap_comm"] = {"optimizer": {"type": "AdamW", "params": {**OPT, "torch_adam": True}},
                                           "zero_optimization": {"stage": 1, "overlap_comm": True,
                                                                 "reduce_bucket_size": 25 * 2**20 // 4,
                                                                 "allgather_bucket_size": 25 * 2**20 // 4}}
ROWS["dense AdamW DDP"] = {}  # torch DDP + torch.optim.AdamW, built by _Row itself
CLUSTER_ROWS = ["dense AdamW", "dense AdamS", "SCAPE 0.9", "SCAPE 0.99"]
OVERLAP_ROWS = ["dense AdamW", "dense AdamW ZeRO-1 overlap_comm", "dense AdamW DDP", "SCAPE 0.9", "SCAPE 0.9 overlap",
                "SCAPE 0.99", "SCAPE 0.99 overlap 4MB", "SCAPE 0.99 overlap"]
DCT_ROWS = ["dense AdamW", "SCAPE 0.99", "SCAPE 0.99 dct", "SCAPE 0.9", "SCAPE 0.9 dct"]
DCT_OVERLAP_ROWS = ["dense AdamW", "SCAPE 0.99 overlap", "SCAPE 0.99 dct noclip", "SCAPE 0.99 dct noclip overlap",
                    "SCAPE 0.9 overlap", "SCAPE 0.9 dct noclip", "SCAPE 0.9 dct noclip overlap"]
HIER_ROWS = ["dense AdamW", "SCAPE 0.9", "SCAPE 0.9 hier", "SCAPE 0.99", "SCAPE 0.99 hier"]
HIER_DCT_ROWS = ["dense AdamW", "SCAPE 0.99 dct", "SCAPE 0.99 dct hier"]  # --hier --dct
ZERO3_ROWS = ["dense ZeRO-3 AdamS", "SCAPE ZeRO-3 0.9", "SCAPE ZeRO-3 0.99", "SCAPE ZeRO-3 0.9 replica",
              "SCAPE ZeRO-3 0.99 replica"]
MPI_ROWS = ["dense AdamW", "SCAPE 0.9", "SCAPE 0.9 (mpi)", "SCAPE 0.99", "SCAPE 0.99 (mpi)"]


class DeepSpeedAllGatherBytes:
    """Bytes this rank sends in DeepSpeed's own all-gathers (ZeRO-3's parameter fetches), counted at
    DeepSpeed's communication backend: (D - 1) x the input, as SCAPE's meter counts an all-gather."""

    def __init__(self):
        from deepspeed.comm import comm

        self.bytes = 0
        cdb = comm.cdb
        world = cdb.get_world_size()
        for name, arg in (("all_gather_into_tensor", "input_tensor"), ("all_gather", "tensor")):
            fn = getattr(cdb, name)

            def counted(*a, _fn=fn, _arg=arg, **kw):
                t = kw.get(_arg, a[1] if len(a) > 1 else None)
                if t is not None and (kw.get("group") is None or cdb.get_world_size(kw["group"]) == world):
                    self.bytes += (world - 1) * t.numel() * t.element_size()
                return _fn(*a, **kw)
            setattr(cdb, name, counted)


class _DDPEngine:
    """torch DDP with torch.optim.AdamW, called like a DeepSpeed engine (``engine(x, y)``,
    ``backward``, ``step``): its bucketed all-reduce runs from autograd hooks during backward."""

    def __init__(self, model, opt: dict, clip: float):
        import torch
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = DistributedDataParallel(model)
        self.module, self.clip = model, clip
        self.opt = torch.optim.AdamW(model.parameters(), lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                     weight_decay=opt["weight_decay"])

    def __call__(self, *a):
        return self.ddp(*a)

    def backward(self, loss):
        loss.backward()

    def step(self):
        import torch

        torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)


class _Row:
    """One optimizer config's engine and its timed steps (``worker``'s unit; built inside the ranks)."""

    def __init__(self, name: str, args, shape: dict, batch, world: int):
        import torch

        import scape_ds
        from scape_ds.comm import collective_bytes
        from scape_ds.engine import scape_optimizer
        from scape_ds.models import GPT, GPTConfig

        extra = ROWS[name]
        if args.refresh_every and "scape" in extra:  # --hier: refresh steps among the timed ones
            extra = {**extra, "scape": {**extra["scape"], "mask_refresh_interval": args.refresh_every}}
        self.name, self.batch, self.warmup = name, batch, args.warmup
        torch.manual_seed(0)
        self.model = GPT(GPTConfig(**shape))
        n_params = sum(p.numel() for p in self.model.parameters())
        config = {**BASE, **extra, "train_micro_batch_size_per_gpu": args.micro_batch}
        if name == "dense AdamW DDP":
            self.engine = _DDPEngine(self.model, OPT, BASE["gradient_clipping"])
        else:
            self.engine, *_ = scape_ds.initialize(model=self.model, config=config)
        self.opt = scape_optimizer(self.engine)  # None for the dense rows
        self.dense_bytes = collective_bytes("all_reduce", 4 * n_params, world)  # the fp32 gradient all-reduce
        self.zero3 = extra.get("zero_optimization", {}).get("stage") == 3
        if self.zero3:  # ZeRO-3: its gradient reduce-scatter (+ its parameter all-gathers, counted as they happen)
            self.dense_bytes = sum(collective_bytes("reduce_scatter", 4 * world * -(-p.ds_numel // world), world)
                                   for p in self.engine.module.parameters())
            self.fetched = DeepSpeedAllGatherBytes()
        self.times, self.sent, self.gathered, self.kinds = [], [], [], []

    def step(self, s: int, n: int = 1) -> None:
        """Time steps s .. s + n - 1 back to back (one barrier before, none between) and record their
        mean as one sample. The clock stops after ``synchronize()``: what a step left in flight (the
        new values under ``scape.overlap``, which the next forward would wait for) is counted, since a
        barrier would otherwise finish it off the clock (gloo's barrier waits for earlier work)."""
        import torch.distributed as dist

        dist.barrier()
        if self.zero3:
            self.fetched.bytes = 0
        t0 = time.perf_counter()
        for i in range(s, s + n):
            x, y = self.batch(i)
            _, loss = self.engine(x, y)
            self.engine.backward(loss)
            self.engine.step()
        if self.opt is not None:
            self.opt.synchronize()
        dt = (time.perf_counter() - t0) / n
        if s < self.warmup:
            return
        opt = self.opt
        self.times.append(dt)
        self.sent.append(int(opt.comm_stats["bytes_sent"]) if opt else self.dense_bytes)
        stats = opt.comm_stats if opt else dict(dense_step=True, bytes_inter=self.dense_bytes, bytes_intra=0)
        self.kinds.append((bool(stats["dense_step"]), int(stats.get("bytes_inter", self.sent[-1])),
                           int(stats.get("bytes_intra", 0))))
        if self.zero3:
            self.gathered.append(self.fetched.bytes // n)

    def result(self) -> dict:
        if self.opt is not None:
            self.opt.synchronize()
        out = dict(step_s=statistics.median(self.times), bytes=statistics.median(self.sent),
                   dense_bytes=self.dense_bytes)
        for key, dense in (("sparse", False), ("refresh", True)):  # each kind of step on its own
            picked = [(t, k) for t, k in zip(self.times, self.kinds) if k[0] == dense]
            if picked:
                out.update({f"{key}_s": statistics.median(t for t, _ in picked),
                            f"{key}_inter": statistics.median(k[1] for _, k in picked),
                            f"{key}_intra": statistics.median(k[2] for _, k in picked)})
        if self.zero3:  # DeepSpeed's own all-gathers (0 under sparse_replica, whose all-gather SCAPE meters)
            out.update(ds_allgather_bytes=statistics.median(self.gathered),
                       total_bytes=statistics.median(a + b for a, b in zip(self.sent, self.gathered)))
        if hasattr(self.opt, "memory_bytes"):  # the SCAPE stage 3: what it holds beyond ZeRO-3
            out["memory_bytes"] = self.opt.memory_bytes()
        return out


def worker(args) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist

    from scape_ds.data import build_datasets, get_batch
    from scape_ds.engine import skip_unused_cpu_ops
    from scape_ds.models import GPT, GPTConfig

    torch.set_num_threads(1)
    under_mpi = any(v in os.environ for v in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"))
    skip_unused_cpu_ops()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=under_mpi, verbose=False,
                               distributed_port=int(os.environ["MASTER_PORT"]), timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    train, _ = build_datasets()
    shape = dict(vocab_size=256, seq_len=args.seq_len, n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd)
    bs = args.micro_batch

    def batch(s):
        return get_batch(train, bs, args.seq_len, s, rank, world, 0)

    # compute floor: the same model, forward + backward only (no exchange, no optimizer step), a
    # lower bound on every row's compute
    torch.manual_seed(0)
    model = GPT(GPTConfig(**shape))
    compute = []

    def compute_step(s, n=1):
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(s, s + n):
            x, y = batch(i)
            model.zero_grad(set_to_none=False)
            model(x, y)[1].backward()
        if s >= args.warmup:
            compute.append((time.perf_counter() - t0) / n)

    names = args.rows.split(",")
    results = dict(n_params=sum(p.numel() for p in model.parameters()), rows={}, interleaved=args.interleave)
    if args.interleave:  # every row's step s, then step s + 1: all rows see the same load from other jobs
        rows = [_Row(name, args, shape, batch, world) for name in names]
        for s in range(0, args.warmup + args.steps, args.block):  # --block steps of a row back to back
            compute_step(s, args.block)
            for row in rows:
                row.step(s, args.block)
        results["rows"] = {row.name: row.result() for row in rows}
    else:  # one row after another, each engine freed before the next is built
        for s in range(args.warmup + args.steps):
            compute_step(s)
        for name in names:
            row = _Row(name, args, shape, batch, world)
            for s in range(args.warmup + args.steps):
                row.step(s)
            results["rows"][name] = row.result()
            del row
    results["compute_s"] = statistics.median(compute)
    if args.trace and args.interleave:  # two more steps of the last row, profiled on rank 0
        trace_step(rows[-1], args.warmup + args.steps, args.trace if rank == 0 else None)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def trace_step(row, s: int, path: str | None) -> None:
    """Run step ``s`` of ``row`` with ``forward``/``backward``/``step`` marked; with ``path``, under
    torch.profiler, written there as a Chrome trace (gloo's collectives appear on their threads)."""
    import contextlib

    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    x, y = row.batch(s)
    dist.barrier()
    prof = profile(activities=[ProfilerActivity.CPU]) if path else contextlib.nullcontext()
    with prof:
        for _ in range(2):  # the second step's forward waits for the first step's broadcasts
            with record_function("forward"):
                _, loss = row.engine(x, y)
            with record_function("backward"):
                row.engine.backward(loss)
            with record_function("step"):
                row.engine.step()
        with record_function("forward"):
            row.engine(x, y)
    if path:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        prof.export_chrome_trace(path)
    del torch


def cluster_rows(args) -> list[str]:
    """The cluster run's rows; ``--mpi`` adds SCAPE 0.9 and 0.99 over the mpi4py backend, ``--zero3`` dense
    ZeRO-3 and the SCAPE stage 3 (both modes) at 0.99."""
    if args.hier:
        return list(HIER_DCT_ROWS if args.dct else HIER_ROWS)
    if args.overlap and args.dct:
        return list(DCT_OVERLAP_ROWS)
    if args.overlap:  # --zero3: the SCAPE stage 3 in sparse_replica mode, with and without overlap
        return list(OVERLAP_ROWS) + (["SCAPE ZeRO-3 0.99 replica", "SCAPE ZeRO-3 0.99 replica overlap"]
                                     if args.zero3 else [])
    if args.dct:
        return list(DCT_ROWS)
    rows = list(CLUSTER_ROWS)
    if args.mpi:
        rows += ["SCAPE 0.9 (mpi)", "SCAPE 0.99 (mpi)"]
    if args.zero3:
        rows += ["dense ZeRO-3 AdamS", "SCAPE ZeRO-3 0.99", "SCAPE ZeRO-3 0.99 replica"]
    return rows


def run_setting(nodes: int, rate: str, args) -> dict:
    from scape_ds.cluster import Cluster, parse_rate_bits

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--out", out, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd),
               "--n-head", str(args.n_head), "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
               "--rows", ",".join(cluster_rows(args))]
        if args.refresh_every:
            cmd += ["--refresh-every", str(args.refresh_every)]
        if args.interleave:
            cmd += ["--interleave"]
        if args.trace:
            cmd += ["--trace", os.path.abspath(args.trace)]
        if args.block > 1:
            cmd += ["--block", str(args.block)]
        # its default port, inside namespaces it has just made; G ranks per node share its namespace
        with Cluster(nodes, rate, args.delay, ranks_per_node=args.ranks_per_node) as c:
            env, err = dict(DS_ACCELERATOR="cpu"), None if args.verbose else subprocess.DEVNULL
            # --mpi: MPI starts the ranks inside the nodes (both backends then run in the same job)
            procs = [c.launch_mpi(cmd, env=env, stderr=err)] if args.mpi else c.launch(cmd, env=env, stderr=err)
            codes = c.wait(procs, timeout=1800)
            delay_applied = c.delay_applied
        if any(codes):
            raise RuntimeError(f"{nodes} nodes at {rate}: {'mpiexec' if args.mpi else 'ranks'} exited {codes}")
        with open(out) as f:
            res = json.load(f)
    res.update(nodes=nodes, rate=rate, rate_bits=parse_rate_bits(rate), delay=args.delay, delay_applied=delay_applied,
               launcher="mpiexec" if args.mpi else "cluster", micro_batch=args.micro_batch, seq_len=args.seq_len,
               ranks_per_node=args.ranks_per_node, refresh_every=args.refresh_every)
    return res


def _save_png(fig, path: str) -> None:
    """The quality bench's palette PNG (bench/ stays under 1 MB in git)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from qualitybench.plots import _save_png as save

    save(fig, path)


def period_s(row: dict, period: int) -> float:
    """Mean step time over one refresh period of ``period`` steps: T-1 sparse steps and one refresh
    (a row without both kinds, dense AdamW: its median step)."""
    if "sparse_s" not in row or "refresh_s" not in row:
        return row["step_s"]
    return ((period - 1) * row["sparse_s"] + row["refresh_s"]) / period


def hier_report(all_res: list[dict], period: int) -> str:
    """The --hier table: sparse and refresh steps, the period mean, bytes by link, against flat and the floor."""
    lines = [f"| nodes x ranks | link | row | sparse step ms | refresh step ms | period mean ms (T={period}) | "
             "MB inter-node / sparse step | MB inter-node / refresh | MB intra-node / sparse step | "
             "refresh vs flat | period vs flat | period / compute floor |", "|" + "---|" * 12]
    for res in all_res:
        rows = res["rows"]
        for name, r in rows.items():
            flat = rows.get(name.replace(" hier", "")) if name.endswith(" hier") else None
            refresh = f"{r['refresh_s'] * 1e3:.0f}" if "refresh_s" in r else ""
            sparse = f"{r['sparse_s'] * 1e3:.0f}" if "sparse_s" in r else f"{r['step_s'] * 1e3:.0f}"
            vs_refresh = f"{flat['refresh_s'] / r['refresh_s']:.2f}x faster" if flat and "refresh_s" in r else ""
            vs_period = f"{period_s(r, period) / period_s(flat, period):.2f}" if flat else ""
            inter_sparse = r.get("sparse_inter", r["bytes"])
            # a row without refresh steps (basis dct) has no refresh column; dense AdamW's step is its own
            inter_refresh = (f"{r['refresh_inter'] / 1e6:.2f}" if "refresh_inter" in r
                             else "" if "sparse_s" in r else f"{r['bytes'] / 1e6:.2f}")
            lines.append(f"| {res['nodes']} x {res.get('ranks_per_node', 1)} | {res['rate']} | {name} | {sparse} | "
                         f"{refresh} | {period_s(r, period) * 1e3:.0f} | {inter_sparse / 1e6:.2f} | "
                         f"{inter_refresh} | {r.get('sparse_intra', 0) / 1e6:.2f} | "
                         f"{vs_refresh} | {vs_period} | {period_s(r, period) / res['compute_s']:.2f} |")
    return "\n".join(lines)


def _png_for(out: str) -> str:
    """The plot beside a results file: ``x_results.json`` -> ``x.png``, ``x.json`` -> ``x.png``."""
    return os.path.splitext(out)[0].removesuffix("_results") + ".png"


def hier_plot(all_res: list[dict], period: int, path: str) -> None:
    """Bars per row: sparse step, refresh step, period mean; the compute floor as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(all_res), figsize=(7 * len(all_res), 4.5), squeeze=False)
    for ax, res in zip(axes[0], all_res):
        names = list(res["rows"])
        rows = [res["rows"][n] for n in names]
        x = range(len(names))
        for i, (label, values) in enumerate((
                ("sparse step", [r.get("sparse_s", r["step_s"]) for r in rows]),
                ("refresh step", [r.get("refresh_s", r["step_s"]) for r in rows]),
                (f"period mean (T={period})", [period_s(r, period) for r in rows]))):
            ax.bar([j + (i - 1) * 0.27 for j in x], [v * 1e3 for v in values], 0.27, label=label)
        ax.axhline(res["compute_s"] * 1e3, color="k", ls=":", label="compute floor")
        ax.set_xticks(list(x), names, rotation=20, fontsize=8)
        ax.set_ylabel("ms per step")
        ax.set_title(f"{res['nodes']} nodes x {res.get('ranks_per_node', 1)} ranks, {res['rate']} links")
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


def report(all_res: list[dict]) -> str:
    lines = ["| nodes | link | row | step ms | MB sent/step | speedup vs dense AdamW | speedup vs dense ZeRO-3 | "
             "floor ms | step / floor | mpi / torch backend |", "|---|---|---|---|---|---|---|---|---|---|"]
    for res in all_res:
        ref = res["rows"]["dense AdamW"]["step_s"]
        z3 = res["rows"].get("dense ZeRO-3 AdamS")
        for name, r in res["rows"].items():
            sent = r.get("total_bytes", r["bytes"])  # ZeRO-3 rows: with DeepSpeed's own parameter all-gathers
            floor = res["compute_s"] + sent * 8 / res["rate_bits"]
            vs_z3 = f"{z3['step_s'] / r['step_s']:.2f}x" if z3 is not None and "ZeRO-3" in name else ""
            torch_row = res["rows"].get(name.replace(" (mpi)", "")) if name.endswith(" (mpi)") else None
            vs_torch = f"{r['step_s'] / torch_row['step_s']:.2f}" if torch_row else ""
            lines.append(f"| {res['nodes']} | {res['rate']} | {name} | {r['step_s'] * 1e3:.0f} | {sent / 1e6:.2f} | "
                         f"{ref / r['step_s']:.2f}x | {vs_z3} | {floor * 1e3:.0f} | {r['step_s'] / floor:.2f} | "
                         f"{vs_torch} |")
    return "\n".join(lines)


def overlap_report(all_res: list[dict]) -> str:
    """The --overlap table: each row against the compute-only step (forward + backward, no exchange,
    no optimizer step) measured in the same job; exposed = step - compute-only."""
    lines = ["| nodes | link | row | step ms | compute-only ms | step / compute-only | exposed ms | MB sent/step | "
             "speedup vs dense AdamW |", "|---|---|---|---|---|---|---|---|---|"]
    for res in all_res:
        ref, c = res["rows"]["dense AdamW"]["step_s"], res["compute_s"]
        for name, r in res["rows"].items():
            lines.append(f"| {res['nodes']} | {res['rate']} | {name} | {r['step_s'] * 1e3:.0f} | {c * 1e3:.0f} | "
                         f"{r['step_s'] / c:.2f} | {(r['step_s'] - c) * 1e3:.0f} | {r['bytes'] / 1e6:.2f} | "
                         f"{ref / r['step_s']:.2f}x |")
    return "\n".join(lines)


def plot(all_res: list[dict], path: str) -> None:
    """Step time vs link bandwidth, one panel per node count; one colour per row (the same in every
    panel), the floor of each SCAPE row dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    node_counts = sorted({r["nodes"] for r in all_res})
    names = list(all_res[0]["rows"])
    colours = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
    fig, axes = plt.subplots(1, len(node_counts), figsize=(6 * len(node_counts) + 2.5, 5), sharey=True, squeeze=False)
    for ax, nodes in zip(axes[0], node_counts):
        sub = sorted((r for r in all_res if r["nodes"] == nodes), key=lambda r: r["rate_bits"])
        gbit = [r["rate_bits"] / 1e9 for r in sub]
        for name in names:
            style = "--" if name.endswith("(mpi)") else "-"
            ax.plot(gbit, [r["rows"][name]["step_s"] * 1e3 for r in sub], style, marker="o", color=colours[name],
                    label=name)
            if name.startswith("SCAPE") and not name.endswith("(mpi)"):
                floor = [(r["compute_s"] + r["rows"][name].get("total_bytes", r["rows"][name]["bytes"]) * 8
                          / r["rate_bits"]) * 1e3 for r in sub]
                ax.plot(gbit, floor, ":", color=colours[name], alpha=0.7)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(gbit, [f"{g:g}" for g in gbit])
        ax.set_title(f"{nodes} nodes, one rank each")
        ax.set_xlabel("link bandwidth (Gbit/s, tc tbf)")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("median step time (ms); dotted: floor")
    axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    _save_png(fig, path)
    plt.close(fig)


def mpi_loopback(args, rows=None, out_name="mpi_vs_torch_results.json", ref=None) -> int:
    """Rows side by side under mpiexec on loopback: SCAPE with the torch and the mpi backend, or
    (``--zero3-loopback``) dense ZeRO-3 against the SCAPE stage 3."""
    rows = rows or MPI_ROWS
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        print("step_time.py: error: no mpiexec next to this python: pip install -e '.[mpi]'", file=sys.stderr)
        return 2
    from scape_ds.spawn import free_port

    all_res, lines = [], []
    head = "mpi / torch step time" if ref is None else f"{ref} / row step time"
    if ref is None:
        lines += [f"| ranks | row | step ms | MB sent/step | {head} |", "|---|---|---|---|---|"]
    else:  # ZeRO-3: SCAPE's metered exchanges, DeepSpeed's own parameter all-gathers, and the memory SCAPE adds
        lines += [f"| ranks | row | step ms | MB SCAPE-metered/step | MB DeepSpeed all-gather/step | MB total/step | "
                  f"MB held beyond ZeRO-3 (EF + masks + replica) | {head} |", "|---|---|---|---|---|---|---|---|"]
    for n in [int(v) for v in args.nodes.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "r.json")
            cmd = [mpiexec, "-n", str(n), sys.executable, os.path.abspath(__file__), "--worker", "--out", out,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--n-layer", str(args.n_layer),
                   "--n-embd", str(args.n_embd), "--n-head", str(args.n_head), "--seq-len", str(args.seq_len),
                   "--micro-batch", str(args.micro_batch), "--rows", ",".join(rows)]
            env = dict(os.environ, MASTER_PORT=str(free_port()), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
            print(f"-- {n} ranks under mpiexec (loopback) ...", flush=True)
            proc = subprocess.run(cmd, env=env, stderr=None if args.verbose else subprocess.DEVNULL)
            if proc.returncode != 0:
                raise RuntimeError(f"mpiexec -n {n}: exit {proc.returncode}")
            with open(out) as f:
                res = json.load(f)
        res.update(ranks=n)
        all_res.append(res)
        for name in rows:
            r = res["rows"][name]
            if ref is None:
                torch_row = name.replace(" (mpi)", "")
                ratio = f"{r['step_s'] / res['rows'][torch_row]['step_s']:.2f}" if name != torch_row else ""
            else:
                ratio = f"{res['rows'][ref]['step_s'] / r['step_s']:.2f}x"
            if ref is None:
                lines.append(f"| {n} | {name} | {r['step_s'] * 1e3:.0f} | {r['bytes'] / 1e6:.2f} | {ratio} |")
            else:
                mem = r.get("memory_bytes") or {}
                held = sum(mem.get(k, 0) for k in ("error_feedback", "masks", "replica"))
                lines.append(f"| {n} | {name} | {r['step_s'] * 1e3:.0f} | {r['bytes'] / 1e6:.2f} | "
                             f"{r['ds_allgather_bytes'] / 1e6:.2f} | {r['total_bytes'] / 1e6:.2f} | "
                             f"{held / 1e6:.1f} | {ratio} |")
        print("\n".join(lines), flush=True)
    out = os.path.join(REPO, "bench", out_name)
    with open(out, "w") as f:
        json.dump(all_res, f, indent=1)
    print(f"results: {out}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--nodes", default="2,4")
    ap.add_argument("--rates", default="1gbit,10gbit")
    ap.add_argument("--delay", default="0.5ms")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-embd", type=int, default=768)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=BASE["train_micro_batch_size_per_gpu"],
                    help="sequences per rank")
    ap.add_argument("--zero3", action="store_true", help="cluster run: add the ZeRO-3 rows")
    ap.add_argument("--mpi", action="store_true",
                    help="cluster run: start the ranks with mpiexec inside the nodes and add the mpi-backend rows")
    ap.add_argument("--hier", action="store_true",
                    help="cluster run: hierarchical vs flat SCAPE, sparse and refresh steps timed apart")
    ap.add_argument("--ranks-per-node", type=int, default=1, help="G ranks sharing each node's namespace")
    ap.add_argument("--dct", action="store_true",
                    help="cluster run: SCAPE 0.9 and 0.99 with basis 'dct' beside the coordinate basis, interleaved")
    ap.add_argument("--overlap", action="store_true",
                    help="cluster run: scape.overlap beside the same SCAPE rows, dense AdamW with ZeRO-1 "
                         "overlap_comm and with torch DDP, interleaved; the overlap table")
    ap.add_argument("--block", type=int, default=1,
                    help="time this many steps of a row back to back, the mean one sample (--steps and --warmup "
                         "are rounded up to multiples of it; interleaved runs only)")
    ap.add_argument("--trace", default=None,
                    help="after the timed steps, profile two more steps of the last row on rank 0 and write "
                         "this Chrome trace (e.g. runs/overlap_trace.json)")
    ap.add_argument("--refresh-every", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--interleave", action="store_true",
                    help="build every row's engine first, then time step s of every row before step s+1 "
                         "(the same load from other jobs on every row; the default with --hier)")
    ap.add_argument("--period", type=int, default=100, help="--hier: T of the period mean")
    ap.add_argument("--out", default=None, help="results JSON (default bench/step_time_results.json, "
                                                "bench/step_time_hier_results.json with --hier)")
    ap.add_argument("--verbose", action="store_true", help="show the ranks' stderr")
    ap.add_argument("--mpi-loopback", action="store_true", help="MPI vs torch backend under mpiexec on loopback")
    ap.add_argument("--zero3-loopback", action="store_true", help="dense ZeRO-3 vs SCAPE stage 3 on loopback")
    ap.add_argument("--replot", action="store_true", help="redraw step_time.png and the table from --out, run nothing")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rows", default=",".join(CLUSTER_ROWS), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.out is None:
        name = ("step_time_hier_dct_results.json" if args.dct else "step_time_hier_results.json") if args.hier \
            else "step_time_results.json"
        args.out = os.path.join(REPO, "bench", name)
    if args.hier:
        args.rows = ",".join(HIER_DCT_ROWS if args.dct else HIER_ROWS)
        args.refresh_every = args.refresh_every or 4
        args.interleave = True
    if args.dct or args.overlap:
        args.interleave = True
    if args.block > 1:  # whole blocks of warm-up and of timed steps
        args.warmup = -(-args.warmup // args.block) * args.block
        args.steps = -(-args.steps // args.block) * args.block
    if args.worker:
        worker(args)
        return 0
    if args.mpi_loopback:
        return mpi_loopback(args)
    if args.zero3_loopback:
        return mpi_loopback(args, ZERO3_ROWS, "zero3_results.json", ref="dense ZeRO-3 AdamS")
    if args.replot:
        with open(args.out) as f:
            all_res = json.load(f)
        if args.hier:
            print(hier_report(all_res, args.period))
            hier_plot(all_res, args.period, _png_for(args.out))
            return 0
        if args.overlap:
            print(overlap_report(all_res))
            return 0
        print(report(all_res))
        plot(all_res, os.path.join(os.path.dirname(args.out), "step_time.png"))
        return 0
    from scape_ds.cluster import need_root

    reason = need_root()
    if reason:
        print(f"step_time.py: error: {reason}", file=sys.stderr)
        return 2
    all_res = []
    for nodes in [int(n) for n in args.nodes.split(",")]:
        for rate in args.rates.split(","):
            print(f"-- {nodes} nodes, {rate} ...", flush=True)
            all_res.append(run_setting(nodes, rate, args))
            table = hier_report if args.hier else (overlap_report if args.overlap else report)
            print(table(all_res[-1:], args.period) if args.hier else table(all_res[-1:]), flush=True)
    with open(args.out, "w") as f:
        json.dump(all_res, f, indent=1)
    if args.hier:
        print(hier_report(all_res, args.period))
        png = _png_for(args.out)
        hier_plot(all_res, args.period, png)
        print(f"compute (no exchange) per step: {all_res[0]['compute_s'] * 1e3:.0f} ms; "
              f"results: {args.out}, plot: {png}")
        return 0
    if args.overlap:
        print(overlap_report(all_res))
        print(f"results: {args.out}")
        return 0
    print(report(all_res))
    png = os.path.join(os.path.dirname(args.out), "step_time.png")
    plot(all_res, png)
    print("compute (no exchange) per step: "
          + ", ".join(f"{r['nodes']} nodes {r['rate']}: {r['compute_s'] * 1e3:.0f} ms" for r in all_res))
    print(f"results: {args.out}, plot: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
