"""``scape.basis = "dct"`` under ZeRO-3: the DCT exchange of stage 0/1 on each parameter's full shape.

``scape_ds.zero3.ScapeStage3`` holds one :class:`Stage3DctExchange` (in place of the coordinate
basis's :class:`~scape_ds.exchange.stage3.Stage3Exchange`, which it extends) and dispatches to it; this
module imports nothing of DeepSpeed. The exchange is stage 0/1's (:mod:`scape_ds.exchange.coefficients`,
reused as it is, with the same communicator and byte meter); only where the gradients come from and
where the decoded mean goes differ (docs/design.md, "Transform basis" and "Path B").

Layout. Tiles follow each parameter's full shape (``ds_shape``), never ZeRO-3's flat partitions: the
sparse-exchanged parameters (ds_id order) lie end to end in one flat fp32 buffer laid out as stage
0/1 lays out its flat gradient buffer (:class:`~scape_ds.exchange.layout.FlatLayout`, chunk-aligned),
tiled by :class:`~scape_ds.exchange.basis.TileLayout` as there. ZeRO-3's partition r of a parameter
of ``numel`` elements is its flat elements ``[r P, r P + n_r)`` (P = ceil(numel / D), n_r of them real,
the rest padding): a contiguous piece of that parameter's range in the flat buffer.

One step on data-parallel rank r:

  1. backward (DeepSpeed's ``__avg_scatter_grads``, :meth:`Stage3DctExchange.reduce_scatter_grads`):
     each parameter's full local gradient is added (fp32) into ``local_grads`` (the sparse ones, at
     their place in the flat buffer) or into its own (D P,) buffer (the dense ones: 1-D, small, or
     marked ``scape_dense``), summed over the gradient-accumulation micro-steps; ZeRO-3 is handed
     zeros for every partition. Nothing leaves the rank: ``clip_local`` needs the norm of the whole
     local gradient before any coefficient enters the error feedback.
  2. ``step()`` (:meth:`Stage3DctExchange.exchange`): ``clip_local`` from the norm of every local
     gradient (sparse and dense, as stage 0/1 counts them); the dense tensors' (D P,) buffers in one
     reduce-scatter of their mean (tag ``dense_rs``), written into ZeRO-3's gradient partitions.
  3. ``exchange_dct`` on ``local_grads``: ``e = ef_decay e + Q g``, the mask (``per_rank`` or
     ``shared``), what was sent leaves ``e``, the mean coefficients; decoded into ``local_grads``
     (now u, the same (N_pad,) tensor on every rank).
  4. u's slice at each of this rank's pieces goes into ZeRO-3's gradient partition: DeepSpeed's
     ``gradient_clipping`` then sees the norm of u and of the dense tensors' mean, as stage 0/1's
     ``replicated_clip_coefficient`` (optim/dct_step.py) does. u is prepared in place for the rule (``sign``:
     sign(u); ``rms``: u / rms(u), the RMS over each whole tensor).
  5. DeepSpeed's step runs :class:`~scape_ds.zero3.Stage3AdamS` on each flat fp32 partition: with
     ``dct_update`` "sign", "rms" or "signum" a :class:`PartitionStep` moves the sparse pieces by the
     prepared u (unclipped, as stage 0/1) and runs AdamS at the dense pieces' positions; with
     "adams", AdamS on the whole partition (its gradient: u's slices and the dense mean, clipped).
     ZeRO-3 then copies the fp32 partitions into the compute-dtype ones (``param_exchange``
     "dense": and all-gathers them before each use, as without SCAPE).
  6. ``param_exchange`` "sparse_replica" (fp32, "sign" or "rms"): every rank moves its full copy
     of each sparse parameter by the same u, piece by piece (the owner's op on the same values, so
     the copy equals the partitions bitwise, with no all-gather); the dense tensors' new pieces are
     all-gathered (tag ``param_ag``).
  7. ``local_grads`` is zeroed for the next accumulation (:meth:`Stage3DctExchange.end_step`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

import torch

from ..config import ScapeConfig, basis_mismatch
from ..exchange.basis import TileLayout, dct_matrix
from ..exchange.coefficients import HeldMask, decode_dct, exchange_dct, next_mask_from_momentum, square_norm_fp64
from ..exchange.core import step_comm_stats
from ..exchange.layout import FlatLayout
from ..exchange.pieces import pack_for_reduce_scatter, real_numel
from ..exchange.stage3 import Stage3Exchange
from ..kernels import get_kernels

__all__ = ["Stage3DctExchange", "PartitionStep", "dct_stage3_refusal", "move_by_signal"]

_STATELESS = ("sign", "rms")  # rules that every rank can apply to its full copy alike


def dct_stage3_refusal(scape: ScapeConfig, bf16: bool) -> str:
    """The one-line reason basis "dct" under ZeRO-3 does not run with these settings, or ""."""
    if scape.dct_update == "adams_coef":
        return ("scape.dct_update 'adams_coef' is not built for ZeRO stage 3 (its momentum lives in DCT "
                "coefficients, a full-size copy on every rank, and its step is decoded from all of them): use "
                "'sign', 'rms', 'signum' or 'adams', or ZeRO stage 0/1")
    if scape.overlap:
        return ("scape.overlap with basis 'dct' is not built for ZeRO stage 3 (the exchange runs in step(), "
                "after the whole local gradient's clip_local): set overlap false")
    if scape.param_exchange == "sparse_replica" and scape.dct_update not in _STATELESS:
        return (f"scape.param_exchange 'sparse_replica' with basis 'dct' moves every rank's full copy by the "
                f"decoded mean, which needs a stateless dct_update ('sign' or 'rms'); {scape.dct_update!r} keeps "
                f"its momentum for each rank's partition only: use param_exchange 'dense'")
    if scape.param_exchange == "sparse_replica" and bf16:
        return ("scape.param_exchange 'sparse_replica' with basis 'dct' runs in fp32 only: a bf16 copy moved by "
                "the decoded mean would drift from the rounded fp32 partitions (every rank would need a full fp32 "
                "master); use param_exchange 'dense' under bf16")
    return ""


def move_by_signal(rule: str, param: torch.Tensor, signal: torch.Tensor, momentum: torch.Tensor | None,
                   lr: float, weight_decay: float, beta1: float) -> None:
    """Stage 0/1's ``apply_update`` on one contiguous piece: ``"sign"``/``"rms"``: ``p = (1 - lr wd) p
    - lr s`` with ``signal`` already sign(u) or u / rms(u); ``"signum"``: ``m = beta1 m + (1 - beta1) u``,
    ``p = (1 - lr wd) p - lr sign(m)``. ``param``, ``signal``, ``momentum``: (n,) views."""
    decay = 1.0 - lr * weight_decay
    if rule == "signum":
        momentum.lerp_(signal, 1.0 - beta1)
        param.mul_(decay).add_(torch.sign(momentum), alpha=-lr)
    else:
        param.mul_(decay).add_(signal, alpha=-lr)


@dataclass
class PartitionStep:
    """What :class:`~scape_ds.zero3.Stage3AdamS` does to one flat fp32 partition under basis "dct".

    Attributes:
        rule: ``dct_update`` ("sign", "rms" or "signum").
        dense_index: (M,) int64 positions of the dense tensors' whole pieces in the partition (AdamS
            on the reduced mean there), or None.
        pieces: per sparse piece ``(offset in the partition, real elements n, (n,) view of the prepared
            decoded mean)``.
    """

    rule: str
    dense_index: torch.Tensor | None
    pieces: list[tuple[int, int, torch.Tensor]]

    def __call__(self, flat: torch.Tensor, momentum: torch.Tensor, group: dict, bias_correction: float) -> None:
        """Step ``flat`` ((F,) fp32; ``flat.grad`` ZeRO-3's clipped gradient partition) and its
        ``momentum`` ((F,) fp32: AdamS's at the dense pieces, ``signum``'s at the sparse ones)."""
        lr, wd = group["lr"], group["weight_decay"]
        beta1, beta2 = group["betas"]
        if self.dense_index is not None:
            out = torch.empty(self.dense_index.numel(), dtype=flat.dtype, device=flat.device)  # (M,)
            get_kernels(flat.device).masked_adams_update(
                flat, momentum, self.dense_index, flat.grad[self.dense_index], out, bias_correction=bias_correction,
                lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=wd)
        for offset, n, signal in self.pieces:
            move_by_signal(self.rule, flat.narrow(0, offset, n), signal, momentum.narrow(0, offset, n), lr, wd, beta1)


class Stage3DctExchange(Stage3Exchange):
    """SCAPE's DCT-basis state and collectives for the parameters of one ZeRO-3 optimizer (module docstring).

    Args: as :class:`~scape_ds.exchange.stage3.Stage3Exchange` (``masked`` must be true: the inner
    optimizer is ``Stage3AdamS``).

    Buffers (per rank; N_pad: the sparse parameters' elements, chunk-padded as on stage 0/1):
    ``local_grads`` (N_pad,) fp32, the local gradient summed over micro-steps, then u; ``coef_error``
    (n_c C,) fp32 error feedback in coefficients; ``dense_grads`` ds_id -> (D P,) fp32 per dense tensor.
    """

    def __init__(self, cfg: ScapeConfig, comm, params: Iterable, masked: bool, grad_comm_dtype: torch.dtype):
        super().__init__(cfg, comm, params, masked, grad_comm_dtype)
        D = self.world_size
        self.sparse = [p for p in self.params if p.ds_id not in self.dense_ids]
        self.dense = [p for p in self.params if p.ds_id in self.dense_ids]
        device = self.params[0].ds_tensor.device if self.params else torch.device("cpu")
        full = [torch.empty(tuple(p.ds_shape), device="meta") for p in self.sparse]  # shapes only
        self.layout = FlatLayout.build(full, D, cfg.chunk_size)  # stage 0/1's flat gradient layout
        self.tiles = TileLayout.build(full, self.layout.offsets, D, cfg.tile_size)
        self.q = dct_matrix(cfg.tile_size, torch.float32, device)  # (t, t)
        self.kernels = get_kernels(device, cfg.kernels)
        self.local_grads = torch.zeros(self.layout.padded_numel, dtype=torch.float32, device=device)  # (N_pad,)
        self.coef_error = torch.zeros(self.tiles.numel, dtype=torch.float32, device=device)  # (n_c C,)
        self.dense_grads = {p.ds_id: torch.zeros(D * self.piece(p), dtype=torch.float32, device=device)
                            for p in self.dense}  # ds_id -> (D P,)
        self.held_mask: HeldMask | None = None  # mask "shared": the mask kept for the next step(s)
        self.coef_momentum = None  # mask_source "momentum": (S,) the owner's first moment of its coefficients
        if cfg.mask == "shared" and cfg.mask_source == "momentum":
            self.coef_momentum = torch.zeros(self.tiles.shard_numel, dtype=torch.float32, device=device)
        self.offset = dict(zip((p.ds_id for p in self.sparse), self.layout.offsets))  # ds_id -> start in N_pad
        self._steps: dict[int, PartitionStep] | None = None  # id(flat partition) -> its step, built once

    # -------------------------------------------------------------- schedule (no coordinate masks)
    def is_dense(self, t: int) -> bool:
        return False

    def begin_step(self) -> bool:
        self.step_dense = False
        return False

    def end_step(self, momenta=None) -> None:
        """After DeepSpeed's step (also one it skipped): empty ``local_grads``, count the step, fill
        ``comm_stats``."""
        self.local_grads.zero_()
        self.step += 1
        self.comm.meter.record_dense(self.dense_bytes)
        self.comm_stats = step_comm_stats(self.comm.meter, self.step, False)

    # -------------------------------------------------------------- step 1: backward
    def reduce_scatter_grads(self, params_to_reduce: list, out_dtype: torch.dtype) -> list[torch.Tensor]:
        """DeepSpeed's ``__avg_scatter_grads`` under basis "dct": add each full local gradient into its
        accumulator (fp32) and hand ZeRO-3 zeros (the exchange runs in :meth:`exchange`)."""
        out = []
        for p in params_to_reduce:
            g = p.grad.reshape(-1)  # (numel,) compute dtype
            if p.ds_id in self.dense_ids:
                acc = self.dense_grads[p.ds_id].narrow(0, 0, p.ds_numel)  # (numel,) fp32
            else:
                acc = self.local_grads.narrow(0, self.offset[p.ds_id], p.ds_numel)  # (numel,) fp32 view
            acc.add_(g)
            n = real_numel(p.ds_numel, self.piece(p), self.rank)
            out.append(torch.zeros(n, dtype=out_dtype, device=g.device))  # (n,) this rank's partition
        return out

    # -------------------------------------------------------------- steps 2-4: step()
    def exchange(self, grad_partitions: dict[int, torch.Tensor], beta1: float) -> None:
        """Steps 2-4 before DeepSpeed's step: ``clip_local``, the dense tensors' reduce-scatter, the
        DCT exchange and decode, u into the gradient partitions, u prepared for the rule.

        Args:
            grad_partitions: ds_id -> this rank's (P,) gradient partition that ZeRO-3's step reads.
            beta1: ``mask_source "momentum"``'s first-moment decay (the first param group's).
        """
        if self.cfg.clip_local > 0:
            self._clip_local()
        self._reduce_dense(grad_partitions)
        if not self.sparse:
            return
        self._exchange_sparse(self.step + 1, beta1)
        u, r = self.local_grads, self.rank  # (N_pad,) the decoded mean, the same on every rank
        for p in self.sparse:
            P = self.piece(p)
            n = real_numel(p.ds_numel, P, r)
            if n:
                grad_partitions[p.ds_id].narrow(0, 0, n).copy_(u.narrow(0, self.offset[p.ds_id] + r * P, n))
        if self.cfg.dct_update == "sign":
            torch.sign(u, out=u)
        elif self.cfg.dct_update == "rms":
            views = [u.narrow(0, self.offset[p.ds_id], p.ds_numel) for p in self.sparse]  # (numel,) each
            squares = torch.stack([square_norm_fp64(v) for v in views]).tolist()  # one host sync
            for view, square in zip(views, squares):
                rms = square**0.5 / view.numel() ** 0.5
                view.mul_(1.0 / rms if rms > 0 else 0.0)

    def _clip_local(self) -> None:
        """``scape.clip_local``: scale every local gradient so their global norm is at most ``clip_local``
        (stage 0/1's norm: the sparse buffer, then each dense tensor, squares summed in fp64)."""
        dense = [self.dense_grads[p.ds_id].narrow(0, 0, p.ds_numel) for p in self.dense]  # (numel,) each
        squares = [square_norm_fp64(self.local_grads)] if self.sparse else []
        squares += [square_norm_fp64(g) for g in dense]
        total = float(torch.stack(squares).sum()) if squares else 0.0  # one sync
        scale = self.cfg.clip_local / (math.sqrt(total) + 1e-6)
        if scale < 1.0:
            self.local_grads.mul_(scale)
            for g in dense:
                g.mul_(scale)

    def _reduce_dense(self, grad_partitions: dict[int, torch.Tensor]) -> None:
        """The dense tensors' mean, one reduce-scatter of their (D, P) buffers (emptied), into ZeRO-3's
        gradient partitions."""
        if not self.dense:
            return
        D, r = self.world_size, self.rank
        accs = [self.dense_grads[p.ds_id].view(D, self.piece(p)) for p in self.dense]  # (D, P) each
        packed, widths = pack_for_reduce_scatter(accs, None)  # (D sum P,) rank-major
        packed.div_(D)  # the mean, pre-divided as ZeRO-3 does
        out = torch.empty(packed.numel() // D, dtype=packed.dtype, device=packed.device)  # (sum P,)
        self.comm.reduce_scatter(out, packed, "dense_rs")
        for p, piece in zip(self.dense, torch.split(out, widths)):
            n = real_numel(p.ds_numel, self.piece(p), r)
            if n:
                grad_partitions[p.ds_id].narrow(0, 0, n).copy_(piece.narrow(0, 0, n))

    def _exchange_sparse(self, t: int, beta1: float) -> None:
        """Stage 0/1's ``_step_dct`` for the one flat buffer: exchange, (``mask_source "momentum"``) the
        next mask, decode into ``local_grads``."""
        cfg = self.cfg
        by_momentum = cfg.mask == "shared" and cfg.mask_source == "momentum"
        dense_step = by_momentum and (self.schedule.is_dense(t) or self.held_mask is None)
        sent = None if dense_step else self.held_mask
        mean, self.held_mask = exchange_dct(
            self.comm, self.kernels, self.tiles, self.coef_error, self.local_grads, self.q, mask=cfg.mask,
            k_per_chunk=cfg.k_per_chunk, ef_decay=cfg.ef_decay, mask_source=cfg.mask_source,
            mask_hold=cfg.mask_hold, mask_early=cfg.mask_early, held=self.held_mask, dense=dense_step,
            value_bits=cfg.value_bits, decode=cfg.decode, index_code=cfg.index_code)  # (n_c C,)
        if by_momentum:
            self.held_mask = next_mask_from_momentum(self.comm, self.kernels, self.tiles, self.coef_momentum, mean,
                                                     sent, beta1, cfg.k_per_chunk)
        decode_dct(self.tiles, mean, self.local_grads, self.q, self.kernels)  # (N_pad,) u

    # -------------------------------------------------------------- step 5: the optimizer
    def partition_steps(self, positions: Iterable[tuple[torch.Tensor, int, Any]]) -> dict[int, PartitionStep]:
        """id(flat fp32 partition) -> its :class:`PartitionStep` (empty for ``dct_update "adams"``:
        AdamS on the whole partition). Built once: the views into ``local_grads`` stay valid.

        Args:
            positions: ``(flat fp32 partition, offset of p's piece in it, p)`` for every parameter.
        """
        if self.cfg.dct_update == "adams":
            return {}
        if self._steps is None:
            dense: dict[int, list[torch.Tensor]] = {}
            pieces: dict[int, list] = {}
            flats = {}
            r = self.rank
            for flat, offset, p in positions:
                flats[id(flat)] = flat
                P = self.piece(p)
                if p.ds_id in self.dense_ids:
                    dense.setdefault(id(flat), []).append(torch.arange(offset, offset + P, device=flat.device))
                elif (n := real_numel(p.ds_numel, P, r)) > 0:
                    signal = self.local_grads.narrow(0, self.offset[p.ds_id] + r * P, n)  # (n,) view
                    pieces.setdefault(id(flat), []).append((offset, n, signal))
            self._steps = {key: PartitionStep(self.cfg.dct_update, torch.cat(dense[key]) if key in dense else None,
                                              pieces.get(key, [])) for key in flats}
        return self._steps

    # -------------------------------------------------------------- step 6: sparse_replica
    def move_replicas(self, groups: dict[int, dict], available: set[int]) -> None:
        """Move every rank's full copy of each sparse parameter by the prepared u, one piece at a time
        (the op each owner ran on its partition, on the same values: bitwise the same result).

        Args:
            groups: ds_id -> the optimizer's param group of that parameter (``lr``, ``weight_decay``).
            available: ds_ids whose copy is resident (one ZeRO-3 released is fetched from the
                partitions at its next use instead).
        """
        D, rule = self.world_size, self.cfg.dct_update
        for p in self.sparse:
            if p.ds_id not in available:
                continue
            group, full, P = groups[p.ds_id], p.data.view(-1), self.piece(p)  # (numel,) the copy
            start = self.offset[p.ds_id]
            for q in range(D):
                n = real_numel(p.ds_numel, P, q)
                if n:
                    move_by_signal(rule, full.narrow(0, q * P, n), self.local_grads.narrow(0, start + q * P, n), None,
                                   group["lr"], group["weight_decay"], group["betas"][0])

    def gather_dense(self) -> list[torch.Tensor]:
        """All-gather the dense tensors' new compute-dtype partitions (tag ``param_ag``); per dense
        tensor its full value, shaped ``ds_shape``."""
        if not self.dense:
            return []
        local = torch.cat([p.ds_tensor.reshape(-1) for p in self.dense])  # (sum P,)
        rows = self._all_gather(local, [self.piece(p) for p in self.dense])
        return [row.reshape(-1)[: p.ds_numel].view(p.ds_shape) for p, row in zip(self.dense, rows)]

    # -------------------------------------------------------------- memory and checkpoints
    def memory_bytes(self) -> dict[str, int]:
        """Error feedback (coefficients), the local gradient accumulators (4 bytes per sparse element,
        chunk-padded, and per dense element, piece-padded), a kept shared mask and ``mask_source
        "momentum"``'s first moment, and the sparse_replica full copy (0 under "dense")."""
        held = self.held_mask
        masks = 0 if held is None else held.index.numel() * 8 + (0 if held.repeated is None else held.repeated.numel())
        if self.coef_momentum is not None:
            masks += self.coef_momentum.numel() * 4
        return dict(
            error_feedback=self.coef_error.numel() * 4,
            local_grads=self.local_grads.numel() * 4 + sum(g.numel() * 4 for g in self.dense_grads.values()),
            masks=masks,
            replica=sum(p.data.numel() * p.data.element_size() for p in self.params) if self.replica else 0,
        )

    def state_dict(self) -> dict[str, Any]:
        """The coordinate state's keys (no coordinate error feedback or masks) plus ``basis``, the
        dct settings its tiles depend on, and ``dct``: the error feedback in coefficients, the kept
        mask and first moment, and the local gradient accumulators when a save falls between
        micro-steps (None between steps, where they are empty)."""
        sd = super().state_dict()
        busy = bool(self.local_grads.any()) or any(bool(g.any()) for g in self.dense_grads.values())
        sd.update(basis="dct", config=dict(basis="dct", dct_update=self.cfg.dct_update, chunk_size=self.cfg.chunk_size),
                  dct=dict(error=self.coef_error.clone(),
                           held_mask=None if self.held_mask is None else self.held_mask.state(),
                           coef_momentum=None if self.coef_momentum is None else self.coef_momentum.clone(),
                           local_grads=self.local_grads.clone() if busy else None,
                           dense_grads={i: self.dense_grads[p.ds_id].clone() for i, p in enumerate(self.params)
                                        if p.ds_id in self.dense_grads} if busy else None))
        return sd

    def check_loadable(self, saved: dict | None) -> None:
        """Raise ValueError unless ``saved`` is a basis "dct" state of this rank, world size and tiles."""
        super().check_loadable(saved)
        mismatch = basis_mismatch(saved.get("config", {}), self.cfg)
        if mismatch:
            raise ValueError(f"the checkpoint was saved with {mismatch}: their optimizer states differ; resume "
                             f"with the saved settings")
        error, used = saved["dct"]["error"], self.tiles.tiles_numel
        if saved.get("resharded_from") is not None:  # another D: only the padding tiles' count differs
            if error.numel() < used or error[used:].any():
                raise ValueError(f"the checkpoint's dct error feedback ({error.numel()} coefficients) does not hold "
                                 f"this model's {used} tile coefficients with zero padding")
        elif error.numel() != self.coef_error.numel():
            raise ValueError(f"the checkpoint's dct error feedback has {error.numel()} coefficients, "
                             f"this model {self.coef_error.numel()}")

    def load_state_dict(self, saved: dict, device: torch.device) -> None:
        dct = saved["dct"]
        if saved.get("resharded_from") is not None:  # elastic: the tiles' prefix, this D's padding zero
            used = self.tiles.tiles_numel
            self.coef_error.zero_()[:used].copy_(dct["error"][:used])
        else:
            self.coef_error.copy_(dct["error"])
        self.held_mask = None if dct["held_mask"] is None else HeldMask.from_state(dct["held_mask"], device)
        if self.coef_momentum is not None and dct.get("coef_momentum") is not None:  # else it starts at 0
            self.coef_momentum.copy_(dct["coef_momentum"])  # (and the next step, with no mask kept, is dense)
        self.local_grads.zero_()
        if dct["local_grads"] is not None:
            self.local_grads.copy_(dct["local_grads"])
        ids = [p.ds_id for p in self.params]
        for g in self.dense_grads.values():
            g.zero_()
        for i, g in (dct["dense_grads"] or {}).items():
            self.dense_grads[ids[i]].copy_(g)
        self.step = saved["step"]
        self._steps = None  # rebuilt from the partitions at the next step
        self.pending.drop()
