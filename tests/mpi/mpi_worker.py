"""One MPI-launched test case, run from the repository as ``mpiexec -n N python -m tests.mpi.mpi_worker CASE``.

Ranks come from MPI (``deepspeed.init_distributed(auto_mpi_discovery=True)`` maps MPI's world onto
torch.distributed, gloo); SCAPE's exchange runs over mpi4py (``comm_backend "mpi"``) or
torch.distributed (``"torch"``) in the same job. Rank 0 prints one line ``RESULT {json}``; any
failed check raises, which makes mpiexec exit non-zero.

Cases:
  replicas   sparsity 0.99 (dense and sparse refresh), both backends: every rank holds bitwise
             identical parameters after every step, and the MPI backend's byte count of every step
             equals the torch backend's
  dense      sparsity 0.0 over MPI equals dense data-parallel AdamS (fp64, 1e-10)
  groups     two data-parallel groups of 2 (sub-communicators): replicas equal within a group; then
             hierarchy "node", 2 ranks per node, both backends: replicas equal after every step and
             the inter- and intra-node bytes of every step equal across backends; without
             intra_node_size MPI's shared-memory split puts every rank of this machine on one node
             (one mpiexec job for both: a launch costs more than the cases)
  kill       rank 1 dies at step 3 (SIGKILL); the others must not hang: under mpiexec the launcher
             ends the job, without it (BACKEND=torch, ranks from RANK/WORLD_SIZE) gloo's
             timeout or its closed connection makes them raise, and they print the lost-peer line
             of scape_ds.faults and exit 3, as launch/pretrain.py does
"""
from __future__ import annotations

import datetime
import json
import os
import signal
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from mpi4py import MPI  # noqa: E402

from scape_ds.comm import build_communicator, build_dp_communicators  # noqa: E402
from scape_ds.config import parse_scape_config  # noqa: E402
from scape_ds.optim import AdamS, ScapeAdamS  # noqa: E402
from tests.multiprocess.models import dense_adams_reference_step, flat_params, loss_fn, make_batch, make_mlp  # noqa: E402

WORLD = MPI.COMM_WORLD


def _init() -> None:
    import deepspeed

    from scape_ds.engine import skip_unused_cpu_ops

    skip_unused_cpu_ops()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=True, verbose=False,
                               distributed_port=int(os.environ["MASTER_PORT"]),  # the test picks a free one
                               timeout=datetime.timedelta(seconds=60))
    if "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        assert (dist.get_rank(), dist.get_world_size()) == (WORLD.Get_rank(), WORLD.Get_size())


def _all_equal(t: torch.Tensor, comm=WORLD) -> bool:
    copies = comm.allgather(t.numpy().tobytes())
    return all(c == copies[0] for c in copies)


def _train(backend: str, scape: dict, steps: int, dtype=torch.float32, group=None, check_comm=WORLD):
    model = make_mlp(seed=3).to(dtype)
    comm = build_communicator(backend, group)
    opt = ScapeAdamS(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, comm=comm,
                     scape=dict(chunk_size=256, dense_numel_threshold=1024, comm_backend=backend, **scape))
    if scape.get("overlap"):
        opt.attach_model(model)  # the forward waits per layer for its new values
    per_step, equal = [], []
    rank = comm.rank
    for step in range(steps):
        x, y = (t.to(dtype) for t in make_batch(step, rank))
        opt.zero_grad()
        loss_fn(model, x, y).backward()
        opt.step()
        per_step.append(int(opt.comm_stats["bytes_sent"]))
        if scape.get("overlap"):
            opt.synchronize()  # read outside a forward: wait for the new values in flight
        equal.append(_all_equal(flat_params(model), check_comm))
    opt.synchronize()
    return model, per_step, equal


def case_replicas() -> dict:
    out = {}
    for name, scape in (("dense_refresh", dict(sparsity=0.99, mask_refresh_interval=4)),
                        ("sparse_refresh", dict(sparsity=0.99, mask_refresh_interval=4, dense_refresh=False))):
        _, bytes_mpi, eq_mpi = _train("mpi", scape, 12)
        _, bytes_torch, eq_torch = _train("torch", scape, 12)
        assert all(eq_mpi), f"{name}: MPI backend replicas differ at steps {[i for i, e in enumerate(eq_mpi) if not e]}"
        assert all(eq_torch), f"{name}: torch backend replicas differ"
        assert bytes_mpi == bytes_torch, (name, bytes_mpi, bytes_torch)
        out[name] = dict(bytes_mpi=bytes_mpi, bytes_torch=bytes_torch, steps=len(eq_mpi))
    return out


def case_overlap() -> dict:
    """scape.overlap over MPI (Ireduce / Ibcast per bucket) against the torch backend without it."""
    scape = dict(sparsity=0.99, mask_refresh_interval=4)
    model_mpi, bytes_mpi, eq_mpi = _train("mpi", dict(scape, overlap=True, bucket_mb=3 * 256 * 4 / 2**20), 12)
    model_torch, bytes_torch, _ = _train("torch", scape, 12)
    assert all(eq_mpi), f"replicas differ at steps {[i for i, e in enumerate(eq_mpi) if not e]}"
    assert bytes_mpi == bytes_torch, (bytes_mpi, bytes_torch)
    diff = float((flat_params(model_mpi) - flat_params(model_torch)).abs().max())
    return dict(max_diff=max(WORLD.allgather(diff)), bytes=bytes_mpi)


def case_dct() -> dict:
    """basis "dct" over MPI against the torch backend, both masks, the shared mask's 8-bit values (an
    all-to-all), and per_rank with scape.overlap over MPI (Iallgather per bucket) against the torch
    backend without it: the same parameters and bytes."""
    out = {}
    for mask in ("per_rank", "shared", "shared_q8", "per_rank_overlap"):
        scape = dict(basis="dct", mask="shared" if mask.startswith("shared") else "per_rank", sparsity=0.9,
                     clip_local=1.0, ef_decay=0.999)
        scape.update(dict(value_bits=8) if mask == "shared_q8" else {})
        overlap = dict(overlap=True, bucket_mb=8192 * 4 / 2**20) if mask.endswith("_overlap") else {}
        model_mpi, bytes_mpi, eq_mpi = _train("mpi", dict(scape, **overlap), 8)  # two buckets of one weight
        model_torch, bytes_torch, _ = _train("torch", scape, 8)
        assert all(eq_mpi), f"{mask}: replicas differ at steps {[i for i, e in enumerate(eq_mpi) if not e]}"
        assert bytes_mpi == bytes_torch, (mask, bytes_mpi, bytes_torch)
        diff = float((flat_params(model_mpi) - flat_params(model_torch)).abs().max())
        out[mask] = dict(max_diff=max(WORLD.allgather(diff)), bytes=bytes_mpi)
    return out


def case_dense() -> dict:
    model, _, equal = _train("mpi", dict(sparsity=0.0, mask_refresh_interval=5), 20, dtype=torch.float64)
    ref = make_mlp(seed=3).to(torch.float64)
    ref_opt = AdamS(ref.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    D = WORLD.Get_size()
    for step in range(20):
        x, y = (t.to(torch.float64) for t in make_batch(step, WORLD.Get_rank()))
        dense_adams_reference_step(ref, ref_opt, x, y, D)
    diff = float((flat_params(model) - flat_params(ref)).abs().max())
    diffs = WORLD.allgather(diff)
    assert all(equal) and max(diffs) <= 1e-10, (diffs, equal)
    return dict(max_diff=max(diffs))


def case_groups() -> dict:
    r, D = WORLD.Get_rank(), WORLD.Get_size()
    assert D % 2 == 0, "groups needs an even world"
    # data-parallel groups {0, 2, ...} and {1, 3, ...}, as with tensor parallel size 2
    groups = [list(range(i, D, 2)) for i in range(2)]
    torch_groups = [dist.new_group(g) for g in groups]
    mine = r % 2
    sub = WORLD.Split(color=mine, key=r)
    out = {}
    for backend, group in (("mpi", groups[mine]), ("torch", torch_groups[mine])):
        _, per_step, equal = _train(backend, dict(sparsity=0.99, mask_refresh_interval=4), 8, group=group,
                                    check_comm=sub)
        assert all(equal), (backend, equal)
        out[backend] = per_step
    assert out["mpi"] == out["torch"], out
    sub.Free()
    return dict(groups=groups, bytes=out["mpi"], hier=_hierarchy())


def _hierarchy() -> dict:
    out = {}
    for backend in ("mpi", "torch"):
        cfg = parse_scape_config(dict(sparsity=0.99, mask_refresh_interval=4, chunk_size=256,
                                      dense_numel_threshold=1024, comm_backend=backend, hierarchy="node",
                                      intra_node_size=2))
        comm, intra = build_dp_communicators(cfg)
        assert (comm.world_size, intra.world_size) == (WORLD.Get_size() // 2, 2)
        model = make_mlp(seed=3)
        opt = ScapeAdamS(model.parameters(), lr=1e-2, comm=comm, intra_comm=intra, scape=cfg)
        steps = []
        for step in range(8):
            x, y = make_batch(step, WORLD.Get_rank())
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
            assert _all_equal(flat_params(model)), (backend, step)
            steps.append((opt.comm_stats["bytes_inter"], opt.comm_stats["bytes_intra"]))
        opt.synchronize()
        out[backend] = steps
    assert out["mpi"] == out["torch"], out
    _, intra = build_dp_communicators(parse_scape_config(dict(comm_backend="mpi", hierarchy="node")))
    return dict(bytes=out["mpi"], shared_memory_node=intra.world_size)


def case_kill() -> dict:
    from scape_ds.faults import PeerWatch, is_peer_lost, report_lost_peer

    model = make_mlp(seed=3)
    opt = ScapeAdamS(model.parameters(), lr=1e-2, comm=build_communicator(os.environ.get("BACKEND", "mpi")),
                     scape=dict(sparsity=0.99, chunk_size=256, dense_numel_threshold=1024, mask_refresh_interval=4))
    rank = dist.get_rank()
    watch = PeerWatch()
    try:
        for step in range(10):
            watch.phase = f"step {step + 1}"
            if step == 3 and rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            x, y = make_batch(step, rank)
            opt.zero_grad()
            loss_fn(model, x, y).backward()
            opt.step()
    except Exception as e:  # as launch/pretrain.py (scape_ds.train.main): one line naming the lost rank, exit 3
        if not is_peer_lost(e):
            raise
        print(f"mpi_worker: error: {report_lost_peer(e, watch, 60, None)}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(3)
    raise AssertionError("rank survived a dead peer for 10 steps")


def main() -> None:
    case = sys.argv[1]
    _init()
    result = globals()[f"case_{case}"]()
    opt_done = WORLD.allgather(True)
    assert all(opt_done)
    if WORLD.Get_rank() == 0:
        print("RESULT " + json.dumps(dict(case=case, world=WORLD.Get_size(), **result)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
