"""SCAPE's state and exchange under ZeRO-3, kept out of DeepSpeed's optimizer object.

``scape_ds.zero3.ScapeStage3`` (the DeepSpeed subclass) holds one :class:`Stage3Exchange` and
calls it from DeepSpeed's hooks; this module imports nothing of DeepSpeed. It reads the ZeRO-3
attributes of the parameters it is given (``ds_id``, ``ds_numel``, ``ds_shape``, ``ds_tensor``,
``ds_persist``, ``partition_numel()``) and touches nothing else of ZeRO-3. The algorithm is in
the docstring of ``scape_ds/zero3.py`` and docs/design.md section 2; the index arithmetic in
:mod:`scape_ds.exchange.pieces`.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from ..comm import collective_bytes
from ..config import ScapeConfig
from .core import MaskSchedule, PendingMasks, check_same_layout, step_comm_stats
from .layout import is_dense_tensor
from .pieces import (
    flat_indices,
    k_per_piece,
    pack_for_reduce_scatter,
    piece_numel,
    real_numel,
    replica_positions,
    split_rank_major,
    unpack_pieces,
)

__all__ = ["Stage3Exchange", "dense_tensor_ids"]


def dense_tensor_ids(params: Iterable, dense_numel_threshold: int) -> set[int]:
    """``ds_id`` of the ZeRO-3 parameters exchanged densely (:func:`~scape_ds.exchange.layout.is_dense_tensor`
    on their full ``ds_shape`` and ``ds_numel``: 1-D, under the threshold, or marked ``scape_dense``)."""
    return {p.ds_id for p in params
            if is_dense_tensor(tuple(p.ds_shape), p.ds_numel, dense_numel_threshold, getattr(p, "scape_dense", False))}


class Stage3Exchange:
    """Error feedback, masks and collectives of SCAPE for the parameters of one ZeRO-3 optimizer.

    Args:
        cfg: the ``"scape"`` settings.
        comm: the data-parallel communicator (ZeRO-3's partition group).
        params: every ZeRO-3 parameter of the optimizer. Those :func:`~scape_ds.exchange.layout.is_dense_tensor`
            calls dense (1-D, under ``dense_numel_threshold`` elements, marked ``scape_dense``) are
            reduce-scattered whole on every step (tag ``dense_rs``), with no mask and no error
            feedback, and the optimizer updates their whole piece, as on path A.
        masked: the inner optimizer applies masks (``Stage3AdamS``); otherwise every step is dense.
        grad_comm_dtype: the dtype dense ZeRO-3 reduces gradients in (for ``bytes_dense``).

    Raises:
        ValueError: ``param_exchange`` ``"sparse_replica"`` with parameters that are not persistent.
    """

    def __init__(self, cfg: ScapeConfig, comm, params: Iterable, masked: bool, grad_comm_dtype: torch.dtype):
        # settings
        self.cfg = cfg.for_ranks(comm.world_size)  # scape.tile_budget: the sparsity of this many ranks
        self.comm = comm
        self.world_size, self.rank = comm.world_size, comm.rank
        self.masked = masked
        self.replica = cfg.param_exchange == "sparse_replica"
        self.schedule = MaskSchedule(cfg.mask_refresh_interval, cfg.dense_refresh, always_dense=not masked)
        self.params = sorted(params, key=lambda p: p.ds_id)
        self.dense_ids = dense_tensor_ids(self.params, cfg.dense_numel_threshold)  # exchanged whole every step
        if self.replica:
            partial = [p.ds_id for p in self.params if not getattr(p, "ds_persist", False)]
            if partial:
                raise ValueError(f"param_exchange 'sparse_replica' needs every parameter persistent; {len(partial)} "
                                 f"are not (build the engine through scape_ds.initialize)")
        # state
        self.step = 0  # completed optimizer steps
        self.error: dict[int, torch.Tensor] = {}  # ds_id -> (D*P,) fp32 error feedback, one gradient's size
        self.masks: dict[int, torch.Tensor] = {}  # ds_id -> (D, k) int64 offsets within each piece (sparse ones)
        self._whole: dict[int, torch.Tensor] = {}  # ds_id -> (D, P) int64 0..P-1: a dense tensor's "mask"
        self.refresh_next = False  # the next step chooses masks (after an elastic load: no masks, so dense)
        self.pending = PendingMasks()  # the masks of the last refresh step, in flight
        self.step_dense = True  # the step in progress exchanges densely
        self.in_step = False  # inside DeepSpeed's step (its parameter release is skipped under sparse_replica)
        self._flat_index: dict | None = None  # id(flat fp32 partition) -> this rank's mask in it, per mask
        self._replica_index: list | None = None  # [(flat positions in p, valid)] per parameter, per mask
        # statistics: a dense ZeRO-3 step's gradient reduce-scatter (in its communication dtype; SCAPE
        # always sends fp32, its error-feedback dtype), plus under sparse_replica the parameter all-gather
        # it replaces. Under "dense" the all-gather is ZeRO-3's own in both and counted in neither
        size = torch.empty(0, dtype=grad_comm_dtype).element_size()
        D = self.world_size
        self.dense_bytes = sum(collective_bytes("reduce_scatter", D * self.piece(p) * size, D) for p in self.params)
        if self.replica:  # each rank's piece in, D pieces out
            self.dense_bytes += sum(collective_bytes("all_gather", self.piece(p) * p.ds_tensor.element_size(), D)
                                    for p in self.params)
        self.comm_stats: dict[str, Any] = {}

    # -------------------------------------------------------------- schedule
    def piece(self, p) -> int:
        """P of ZeRO-3 parameter ``p``."""
        return piece_numel(p.ds_numel, self.world_size)

    def k(self, p) -> int:
        """k of ZeRO-3 parameter ``p`` (P for a dense tensor)."""
        return self.piece(p) if p.ds_id in self.dense_ids else k_per_piece(self.piece(p), self.cfg.sparsity)

    def mask(self, p) -> torch.Tensor:
        """(D, k) offsets of ``p``'s pieces a sparse step updates: its mask, or every position of a dense tensor."""
        if p.ds_id not in self.dense_ids:
            return self.masks[p.ds_id]
        whole = self._whole.get(p.ds_id)
        if whole is None:
            P = self.piece(p)
            whole = self._whole[p.ds_id] = torch.arange(P, device=p.ds_tensor.device).expand(self.world_size, P)
        return whole

    def is_dense(self, t: int) -> bool:
        """Whether step ``t`` (1-based) exchanges densely (also while no mask has arrived, and
        always when every tensor is dense)."""
        return self.schedule.is_dense(t) or not self.masks

    def begin_step(self) -> bool:
        """Before DeepSpeed's step: the masks in flight arrive; returns whether the step is dense."""
        self.pending.wait()
        self.step_dense = self.is_dense(self.step + 1)
        return self.step_dense

    def end_step(self, momenta: Iterable[tuple[torch.Tensor, int, Any]]) -> None:
        """After a step that was not skipped: count it, select the next masks on a refresh step
        (``momenta`` as for :meth:`select_masks`), fill ``comm_stats``."""
        self.step += 1
        forced, self.refresh_next = self.refresh_next, False
        if (forced or self.schedule.is_refresh(self.step)) and self.masked:
            self.select_masks(momenta)
        self.comm.meter.record_dense(self.dense_bytes)
        self.comm_stats = step_comm_stats(self.comm.meter, self.step, self.step_dense)

    # -------------------------------------------------------------- gradient exchange
    def reduce_scatter_grads(self, params_to_reduce: list, out_dtype: torch.dtype) -> list[torch.Tensor]:
        """DeepSpeed's ``__avg_scatter_grads``: every rank's mean gradient piece, SCAPE's way.

        Adds each gradient of a sparse-exchanged tensor to its error feedback, packs (dense step:
        everything; sparse: the values at every piece's mask), reduce-scatters the mean (tag
        ``grad_rs``); the dense tensors' gradients go whole in a second reduce-scatter (tag
        ``dense_rs``), every step, with no error feedback. Returns per parameter this rank's (real
        part of the) piece in ``out_dtype``, zero outside the mask on a sparse step.
        """
        self.pending.wait()
        dense = self.is_dense(self.step + 1)
        parts: list[torch.Tensor | None] = [None] * len(params_to_reduce)
        sparse_at = [i for i, p in enumerate(params_to_reduce) if p.ds_id not in self.dense_ids]
        dense_at = [i for i, p in enumerate(params_to_reduce) if p.ds_id in self.dense_ids]
        for at, whole, tag in ((sparse_at, dense, "grad_rs"), (dense_at, True, "dense_rs")):
            if at:
                chosen = [params_to_reduce[i] for i in at]
                for i, part in zip(at, self._reduce_scatter(chosen, whole, tag)):
                    parts[i] = part
        return [part.narrow(0, 0, real_numel(p.ds_numel, self.piece(p), self.rank)).to(out_dtype)
                for p, part in zip(params_to_reduce, parts)]

    def _reduce_scatter(self, params: list, whole: bool, tag: str) -> list[torch.Tensor]:
        """One reduce-scatter of the mean of ``params``' gradients plus error feedback (a dense
        tensor has none: its gradient goes in a temporary); per parameter this rank's (P,) piece."""
        D, r = self.world_size, self.rank
        accs, pieces = [], []
        for p in params:
            P = self.piece(p)
            assert p.partition_numel() == P, (p.partition_numel(), P)
            if p.ds_id in self.dense_ids:  # a residual loaded from a checkpoint that exchanged it sparsely goes now
                err = self.error.pop(p.ds_id, None)
                err = torch.zeros(D * P, dtype=torch.float32, device=p.grad.device) if err is None else err
            else:
                err = self.error.get(p.ds_id)
                if err is None:
                    err = self.error[p.ds_id] = torch.zeros(D * P, dtype=torch.float32, device=p.grad.device)
            err[: p.ds_numel].add_(p.grad.reshape(-1).to(torch.float32))  # E += g
            accs.append(err.view(D, P))
            pieces.append(P)
        masks = None if whole else [self.masks[p.ds_id] for p in params]  # (D, k_p) each
        packed, widths = pack_for_reduce_scatter(accs, masks)  # (D * sum w,); what is sent leaves E
        packed.div_(D)  # the mean, pre-divided as DeepSpeed does
        out = torch.empty(packed.numel() // D, dtype=packed.dtype, device=packed.device)  # (sum w,)
        self.comm.reduce_scatter(out, packed, tag)
        return unpack_pieces(out, widths, pieces, None if whole else [m[r] for m in masks])

    # -------------------------------------------------------------- masks
    def select_masks(self, momenta: Iterable[tuple[torch.Tensor, int, Any]]) -> None:
        """Top-k of |momentum| over each of this rank's pieces; start the all-gather.

        Args:
            momenta: ``(flat fp32 momentum, offset of p's piece in it, p)`` for every parameter.
        """
        mine = {}
        for m, offset, p in momenta:
            if p.ds_id not in self.dense_ids:
                seg = m.narrow(0, offset, self.piece(p)).abs()
                mine[p.ds_id] = torch.topk(seg, self.k(p), sorted=False).indices.sort().values
        order = [(p.ds_id, self.k(p)) for p in self.params if p.ds_id not in self.dense_ids]
        if not order:  # every tensor dense: no masks, every step dense
            return
        local = torch.cat([mine[i] for i, _ in order]).to(torch.int32)  # (sum k,)
        self.pending.start(self.comm, local, lambda out: self._set_masks(out, order))

    def _set_masks(self, gathered: torch.Tensor, order: list[tuple[int, int]]) -> None:
        """(D * sum k,) int32 all-gathered masks -> ``masks``."""
        cols = split_rank_major(gathered.long(), [k for _, k in order], self.world_size)
        for (ds_id, _), c in zip(order, cols):
            self.masks[ds_id] = c.contiguous()  # (D, k)
        self._flat_index = self._replica_index = None

    def flat_indices(self, positions: Iterable[tuple[torch.Tensor, int, Any]]) -> dict[int, torch.Tensor]:
        """id(flat fp32 partition) -> this rank's mask in it (built once per mask).

        Args:
            positions: ``(flat fp32 partition, offset of p's piece in it, p)`` for every parameter.
        """
        if self._flat_index is None:
            self._flat_index = flat_indices((id(flat), offset, self.mask(p)[self.rank])
                                            for flat, offset, p in positions)
        return self._flat_index

    # -------------------------------------------------------------- parameter exchange (sparse_replica)
    def gather_partitions(self) -> list[torch.Tensor]:
        """Dense step: all-gather every compute-dtype partition; per parameter its full value,
        shaped ``ds_shape`` (a view into the gathered buffer)."""
        local = torch.cat([p.ds_tensor.reshape(-1) for p in self.params])  # (sum P,)
        rows = self._all_gather(local, [self.piece(p) for p in self.params])
        return [row.reshape(-1)[: p.ds_numel].view(p.ds_shape) for p, row in zip(self.params, rows)]

    def gather_at_masks(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Sparse step: all-gather the new values at every rank's mask; per parameter ``(flat
        positions, values)`` to write into its full copy."""
        r = self.rank
        local = torch.cat([p.ds_tensor.reshape(-1)[self.mask(p)[r]] for p in self.params])  # (sum k,)
        rows = self._all_gather(local, [self.k(p) for p in self.params])
        if self._replica_index is None:
            self._replica_index = [replica_positions(self.mask(p), self.piece(p), p.ds_numel)
                                   for p in self.params]
        return [(pos, row.reshape(-1)[valid]) for row, (pos, valid) in zip(rows, self._replica_index)]

    def param_buckets(self, bucket_numel: int) -> list[list[int]]:
        """``scape.overlap``: the parameters (indices into ``params``, ds_id order: about the order
        forward uses them) cut into runs of at most ``bucket_numel`` elements (one at least)."""
        buckets, size = [[]], 0
        for i, p in enumerate(self.params):
            if buckets[-1] and size + p.ds_numel > bucket_numel:
                buckets.append([])
                size = 0
            buckets[-1].append(i)
            size += p.ds_numel
        return buckets

    def start_gather_at_masks(self, buckets: list[list[int]]) -> list[tuple[Any, Any]]:
        """``scape.overlap``, sparse step: :meth:`gather_at_masks` as one asynchronous all-gather per
        bucket (the same bytes). Returns per bucket ``(work, finish)``; after ``work.wait()``,
        ``finish()`` gives ``[(parameter index, flat positions, values)]`` to write into the copies."""
        r, D = self.rank, self.world_size
        if self._replica_index is None:
            self._replica_index = [replica_positions(self.mask(p), self.piece(p), p.ds_numel)
                                   for p in self.params]
        index, started = self._replica_index, []  # this mask's positions, whatever the masks do next
        for bucket in buckets:
            params = [self.params[i] for i in bucket]
            local = torch.cat([p.ds_tensor.reshape(-1)[self.mask(p)[r]] for p in params])  # (sum k,)
            out = torch.empty(D * local.numel(), dtype=local.dtype, device=local.device)  # (D sum k,)
            work = self.comm.all_gather_async(out, local, "param_ag")

            def finish(bucket=bucket, out=out, widths=[self.k(p) for p in params]):
                rows = split_rank_major(out, widths, D)  # (D, k) per parameter
                return [(i, index[i][0], row.reshape(-1)[index[i][1]]) for i, row in zip(bucket, rows)]

            started.append((work, finish))
        return started

    def _all_gather(self, local: torch.Tensor, widths: list[int]) -> tuple[torch.Tensor, ...]:
        out = torch.empty(self.world_size * local.numel(), dtype=local.dtype, device=local.device)
        self.comm.all_gather(out, local, "param_ag")
        return split_rank_major(out, widths, self.world_size)  # (D, width) per parameter

    # -------------------------------------------------------------- memory and checkpoints
    def memory_bytes(self) -> dict[str, int]:
        """Error feedback, masks, and the sparse_replica full parameter copy (0 under "dense")."""
        return dict(
            error_feedback=sum(e.numel() * e.element_size() for e in self.error.values()),
            masks=sum(m.numel() * m.element_size() for m in self.masks.values()),
            replica=sum(p.data.numel() * p.data.element_size() for p in self.params) if self.replica else 0,
        )

    def state_dict(self) -> dict[str, Any]:
        """Step, layout, error feedback and masks, keyed by the parameter's place in ds_id order
        (ds_ids count up across engines in one process)."""
        self.pending.wait()
        return dict(step=self.step, rank=self.rank, world_size=self.world_size, refresh_next=self.refresh_next,
                    error={i: self.error[p.ds_id].clone() for i, p in enumerate(self.params) if p.ds_id in self.error},
                    masks={i: self.masks[p.ds_id].clone() for i, p in enumerate(self.params) if p.ds_id in self.masks})

    def check_loadable(self, saved: dict | None) -> None:
        """Raise ValueError unless ``saved`` (a :meth:`state_dict`) belongs to this basis, rank and world size."""
        if saved is None:
            raise ValueError("the checkpoint has no SCAPE ZeRO-3 state (saved by another optimizer)")
        basis = saved.get("basis", "coordinate")
        if basis != self.cfg.basis:
            raise ValueError(f"the checkpoint's SCAPE ZeRO-3 state was saved with scape.basis {basis!r}, this run has "
                             f"{self.cfg.basis!r}: their optimizer states differ; resume with the saved settings")
        check_same_layout(saved["rank"], saved["world_size"], self.rank, self.world_size, "SCAPE ZeRO-3")

    def load_state_dict(self, saved: dict, device: torch.device) -> None:
        ids = [p.ds_id for p in self.params]
        self.error = {ids[i]: v.to(device) for i, v in saved["error"].items()}
        self.masks = {ids[i]: v.to(device) for i, v in saved["masks"].items() if ids[i] not in self.dense_ids}
        self._flat_index = self._replica_index = None
        self.step = saved["step"]
        self.refresh_next = bool(saved.get("refresh_next", False))  # set by scape_ds.checkpoint.reshard
        if any(m.shape[-1] != self.k(p) for p in self.params if (m := self.masks.get(p.ds_id)) is not None):
            # saved at another sparsity: its masks have another k; the error feedback stays (one
            # gradient's size whatever the sparsity) and the next step, dense, chooses new masks
            self.masks, self.refresh_next = {}, True
        self.pending.drop()
