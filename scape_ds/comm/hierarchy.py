"""Communicators of a data-parallel group, flat or split by node (``scape.hierarchy``).

``build_communicator(backend, group)`` is one communicator, ``"torch"`` or ``"mpi"``, over ``group``.

``build_dp_communicators(cfg, group)`` returns ``(comm, intra)``: for ``hierarchy="flat"`` the
communicator over the data-parallel group and ``None``; for ``"node"`` the communicator over the
*cross-node* group of this rank's local rank l (rank l of every node, in node order) and the one
over its *node* group (the node's data-parallel ranks, in data-parallel order). Which ranks share a
node: consecutive blocks of ``scape.intra_node_size`` data-parallel ranks; else, under
``comm_backend="mpi"``, MPI's shared-memory split; else the launcher's ranks per node
(``LOCAL_WORLD_SIZE`` and the others of :data:`LOCAL_SIZE_VARS`: global ranks ``g // size`` alike).
With tensor or pipeline parallelism there are several data-parallel groups; each is split alike,
and every rank takes part in creating every torch.distributed group (``dist.new_group`` is
collective over the world).
"""
from __future__ import annotations

import os
from typing import Sequence

from .base import Communicator
from .meter import ByteMeter
from .mpi_comm import MPICommunicator, mpi_available
from .torch_comm import TorchCommunicator

__all__ = ["build_dp_communicators", "split_by_node", "LOCAL_SIZE_VARS"]

LOCAL_SIZE_VARS = ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")
"""Where launchers put the ranks per node: torchrun (and launch/cluster.py), DeepSpeed's launcher,
MPICH's hydra, Open MPI. Ranks are placed on nodes in blocks (global rank // ranks per node)."""


def split_by_node(dp_ranks: Sequence[int], node_keys: Sequence) -> tuple[list[list[int]], list[list[int]]]:
    """Split a data-parallel group into node groups and cross-node groups (global rank lists).

    Args:
        dp_ranks: global ranks of the data-parallel group, in data-parallel order.
        node_keys: for each of them, a value equal exactly for ranks on the same node.

    Returns:
        ``(nodes, cross)``: ``nodes[n]`` the ranks of node n (nodes in order of first appearance),
        ``cross[l] = [nodes[n][l] for every n]``.

    Raises:
        ValueError: nodes of different sizes.
    """
    nodes: dict = {}
    for r, key in zip(dp_ranks, node_keys):
        nodes.setdefault(key, []).append(int(r))
    groups = list(nodes.values())
    sizes = sorted({len(g) for g in groups})
    if len(sizes) != 1:
        raise ValueError(f"scape.hierarchy 'node' needs the same number of data-parallel ranks on every node, got "
                         f"{[len(g) for g in groups]} (data-parallel ranks {list(dp_ranks)}): set "
                         f"scape.intra_node_size or use hierarchy 'flat'")
    return groups, [list(col) for col in zip(*groups)]


def _node_key(cfg, global_rank: int):
    """What identifies this rank's node when ``intra_node_size`` is not given."""
    if cfg.comm_backend == "mpi":
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        shared = world.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks that share this node's memory
        key = shared.allreduce(world.Get_rank(), op=MPI.MIN)
        shared.Free()
        return key
    local = next((os.environ[v] for v in LOCAL_SIZE_VARS if os.environ.get(v)), None)
    if local is None:
        raise ValueError("scape.hierarchy 'node' needs the ranks per node: set scape.intra_node_size, or start "
                         f"with a launcher that sets one of {', '.join(LOCAL_SIZE_VARS)} (torchrun, deepspeed, "
                         "mpiexec)")
    return global_rank // int(local)


def build_communicator(backend: str = "torch", group=None, meter: ByteMeter | None = None) -> Communicator:
    """Return the communicator for ``backend`` ("torch" | "mpi") over the data-parallel ``group``.

    For ``"mpi"``, ``group`` is the list of global ranks of the data-parallel group, a
    torch.distributed group (its ranks are used), or ``None`` for MPI's world.
    """
    if backend == "torch":
        return TorchCommunicator(group, meter)
    if backend == "mpi":
        return MPICommunicator(_group_ranks(group), meter)
    raise ValueError(f"comm_backend must be 'torch' or 'mpi', got {backend!r}")


def _group_ranks(group) -> list[int] | None:
    """Global ranks of ``group`` (a list, a torch.distributed group, or None for the world), checked
    against MPI's world when torch.distributed is also running."""
    reason = mpi_available()
    if reason:
        raise ImportError(reason)
    import torch.distributed as dist
    from mpi4py import MPI

    mpi_rank, mpi_size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    if dist.is_initialized() and (dist.get_rank(), dist.get_world_size()) != (mpi_rank, mpi_size):
        raise ValueError(
            f"comm_backend 'mpi': torch.distributed rank {dist.get_rank()} of {dist.get_world_size()} is MPI rank "
            f"{mpi_rank} of {mpi_size}; start the job with mpiexec (mpiexec -n N python launch/pretrain.py ...)")
    if group is None or isinstance(group, (list, tuple)):
        return None if group is None else list(group)
    return list(dist.get_process_group_ranks(group))



def build_dp_communicators(cfg, group=None) -> tuple[Communicator, Communicator | None]:
    """``(comm, intra)`` for the data-parallel ``group`` (None: the world); see the module docstring.

    Raises:
        ValueError: the data-parallel size is not a multiple of ``intra_node_size``, or nodes of
            different sizes.
    """
    if cfg.hierarchy == "flat":
        return build_communicator(cfg.comm_backend, group), None
    import torch.distributed as dist

    dp_ranks = list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
    me = dist.get_rank()
    key = None if cfg.intra_node_size is not None else _node_key(cfg, me)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (dp_ranks, key))  # every rank's data-parallel group and node
    splits = {}
    for ranks, _ in every:
        ranks = tuple(ranks)
        if ranks in splits:
            continue
        if cfg.intra_node_size is not None:
            G = cfg.intra_node_size
            if len(ranks) % G:
                raise ValueError(f"scape.intra_node_size {G} does not divide the data-parallel size {len(ranks)}")
            keys = [i // G for i in range(len(ranks))]
        else:
            keys = [every[r][1] for r in ranks]
        splits[ranks] = split_by_node(ranks, keys)
    nodes, cross = splits[tuple(dp_ranks)]
    my_node = next(g for g in nodes if me in g)
    my_cross = next(g for g in cross if me in g)
    if cfg.comm_backend == "mpi":  # MPI communicators are created by their members only
        return build_communicator("mpi", my_cross), build_communicator("mpi", my_node)
    made = {}
    for ranks in sorted(splits):  # the same order on every rank: new_group is collective over the world
        for g in splits[ranks][0] + splits[ranks][1]:
            if tuple(g) not in made:
                made[tuple(g)] = dist.new_group(g)
    return build_communicator("torch", made[tuple(my_cross)]), build_communicator("torch", made[tuple(my_node)])
