"""ScapeAdamS: AdamS with SCAPE's sharded, sparse, error-compensated data-parallel exchange.

SCAPE (Zheng, Chen, Xie, Zhang, arXiv 2607.01678) on the AdamS base optimizer; docs/design.md section 1.
The parameters are replicated on every data-parallel rank (compute dtype); the optimizer state is
sharded like ZeRO-1: rank r owns shard r of a flat buffer of the sparse parameters and keeps its
fp32 master weights and momentum. One step, after backward, on rank r (mask M shared by all ranks):

  1. error feedback: ``a = e + g``; send ``a[M]`` packed (k values); keep ``e = a`` with M zeroed.
  2. one reduce-scatter of the packed values: the owner of each shard gets the mean at its part of M.
  3. the owner applies AdamS at its part of M (fp32 master, momentum) and packs the new values.
  4. one all-gather of the new values; every rank writes them into its flat parameter copy
     (values, not deltas, so replicas cannot drift).
  5. every ``mask_refresh_interval`` (T) steps: the step is a dense exchange (``dense_refresh``:
     the whole ``a`` is sent, which flushes every residual) and afterwards each owner selects its
     part of the next mask chunk-wise from |m|; the masks travel in an asynchronous all-gather that
     runs while the next step computes forward/backward, and are used from the next step on.
  6. ``reselect_interval`` R > 0: every R steps inside a window each owner also re-chooses its part of
     the mask from ``|beta1 m + (1 - beta1) e_r|`` on its shard (the momentum each coordinate would
     have if its unsent residual entered now; no flush; weight decay then kept per coordinate with an
     int32 mark, so it stays exact). ``update_rule`` (``update_rules.py``): what else a refresh or a
     sparse step does for the coordinates outside the mask.

Small and 1-D tensors are all-reduced densely and updated by every rank alike. The baselines share
this code: ``compressor="topk"`` (mask from |reduced gradient| of the refresh step), ``"randk"``
(a seeded random mask), ``"dense"`` (every step dense: sharded dense AdamS).

Memory per rank, for N sparse parameter elements over D ranks (``memory_bytes()``; the formulas and
the table against AdamW are in ``scape_ds.optim.memory`` and docs/memory.md): the parameters and
their gradients are views into two flat buffers of N (compute dtype; backward accumulates straight
into the gradient buffer, as DDP's ``gradient_as_bucket_view``, so there is no staging copy);
momentum 4*N/D; the fp32 master shard is a view of the flat parameters when they are fp32 (a
4*N/D copy otherwise); error feedback 4*N (2*N with ``error_feedback_dtype="bf16"``). A sparse step
allocates nothing that grows with N beyond the k packed values; a dense step at most one N-sized
buffer (none for fp32 parameters with fp32 error feedback).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from ..comm import Communicator, build_dp_communicators, collective_bytes, collective_device
from ..config import ScapeConfig, basis_mismatch, parse_scape_config
from ..exchange.basis import TileLayout, dct_matrix
from ..exchange.coefficients import HeldMask, decode_dct, exchange_dct, next_mask_from_momentum, square_norm_fp64
from ..exchange.core import MaskSchedule, PendingMasks, check_same_layout, owe_decay, settle_decay, step_comm_stats
from ..exchange.layout import FlatLayout, split_dense_sparse
from ..exchange.masks import offsets_to_index, random_offsets, select_mask
from ..exchange.node import FlatStage, NodeStage
from ..kernels import get_kernels
from .adams import adams, check_adams_hyperparameters
from .dct_overlap import DctOverlap
from .dct_step import dct_update, dense_square_norm, replicated_clip_coefficient
from .local_steps import LocalSteps, check_local_settings
from .overlap import OverlapExchange
from .update_rules import catchup_step, drift_coefficient, pack_signs, unpack_signs, window_mean

__all__ = ["ScapeAdamS"]


@dataclass
class _GroupState:
    """Flat buffers and mask state of one param group (internal)."""

    layout: FlatLayout
    sparse_params: list[torch.Tensor]
    dense_params: list[torch.Tensor]
    flat_param: torch.Tensor | None  # (N_pad,) compute dtype; sparse params are views into it
    master: torch.Tensor | None  # (S,) fp32, this rank's shard (a view of flat_param when that is fp32)
    momentum: torch.Tensor | None  # (S,) fp32
    error: torch.Tensor | None  # (N_pad/G,) fp32/bf16 error feedback of the slice (None for compressor "dense")
    flat_grad: torch.Tensor | None  # (N_pad,) compute dtype; the sparse params' .grad are views into it
    param_slice: torch.Tensor | None = None  # (N_pad/G,) view of flat_param: the slice exchanged across nodes
    grad_slice: torch.Tensor | None = None  # (N_pad/G,) the node sum of that slice (flat: flat_grad itself)
    dense_momenta: list[torch.Tensor] = field(default_factory=list)
    dense_error: torch.Tensor | None = None  # (M,) fp32 dense_wire "bf16": what rounding to bf16 kept back
    grad_views: list[torch.Tensor] = field(default_factory=list)  # each sparse param's .grad in flat_grad
    grad_divisor: float = 1.0  # this step's reduced sparse gradient is a sum over this many ranks (1: a mean)
    active_offsets: torch.Tensor | None = None  # (K,) int16, every shard's mask, chunk-major
    active_index: torch.Tensor | None = None  # (K,) int64 flat indices of active_offsets
    active_local: torch.Tensor | None = None  # (k,) int64 this rank's part of active_index, shard-local
    node_index: torch.Tensor | None = None  # (G K,) int64 every slice's mask in flat_param (flat: active_index)
    pending: PendingMasks = field(default_factory=PendingMasks)  # (D*L,) uint8 encoded masks in flight
    decay_debt: float = 1.0  # weight decay owed by coordinates outside the mask since the refresh
    norm_skip: bool = False  # a copy counted in the gradient norm by another model-parallel rank
    catchup_second: torch.Tensor | None = None  # (S,) fp32 update_rule "catchup": EMA of a^2 / w
    drift_sign: torch.Tensor | None = None  # (N_pad,) int8 update_rule "sign_drift": +-1, 0 at the mask
    decay_mark: torch.Tensor | None = None  # (S,) int32 reselect: the window step each coordinate is decayed to
    window_decay: list[float] = field(default_factory=lambda: [1.0])  # reselect: prod of 1 - lr*wd in the window
    tiles: TileLayout | None = None  # basis "dct": where each weight's tiles lie in the coefficient buffer
    dct_q: torch.Tensor | None = None  # basis "dct": (t, t) fp32 the DCT-II matrix
    held_mask: HeldMask | None = None  # basis "dct", mask "shared": the mask kept for the next step
    coef_momentum: torch.Tensor | None = None  # basis "dct", mask_source "momentum": (S,) the owner's m
    overlap: OverlapExchange | DctOverlap | None = None  # scape.overlap: the bucketed exchange of the sparse params


class ScapeAdamS(Optimizer):
    """AdamS with SCAPE sparse communication over a data-parallel group (flat, or split by node).

    Args:
        params: parameters or param groups (hyperparameters per group, as in torch.optim).
        lr, betas, eps, weight_decay, bias_correction: AdamS hyperparameters (see ``AdamS``).
        scape: the ``"scape"`` settings (:class:`ScapeConfig` or dict).
        comm: the data-parallel :class:`Communicator` (default: ``scape.comm_backend`` over the
            default process group, split by ``scape.hierarchy``); with ``intra_comm``, the
            cross-node group of this rank's local rank.
        intra_comm: ``scape.hierarchy="node"``: the communicator over this node's data-parallel
            ranks (docs/design.md, Hierarchical SCAPE; ``build_dp_communicators`` makes both).
        max_grad_norm: clip the global norm of the reduced gradient to this (0: off).
        norm_group: the torch.distributed group of the other model-parallel ranks of this replica
            (tensor x pipeline parallel), over which the squared norm is summed; parameters marked
            ``scape_norm_skip`` (copies replicated across those ranks) are counted on one rank only;
            the sparse-exchanged parameters of one param group must agree on that mark.

    Raises:
        ValueError: bad hyperparameter or scape setting.
    """

    def __init__(
        self,
        params,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.1,
        bias_correction: bool = True,
        *,
        scape: ScapeConfig | dict | None = None,
        comm: Communicator | None = None,
        max_grad_norm: float = 0.0,
        norm_group=None,
        intra_comm: Communicator | None = None,
    ):
        betas = tuple(betas)
        check_adams_hyperparameters(lr, betas, eps, weight_decay)
        if max_grad_norm < 0:
            raise ValueError(f"max_grad_norm (gradient_clipping) must be >= 0, got {max_grad_norm}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))
        # user settings
        # scape_ds.initialize hands over the block it parsed; a dict (or None) from a direct caller is parsed here
        self.cfg = scape if isinstance(scape, ScapeConfig) else parse_scape_config(scape)
        if comm is None:
            comm, intra_comm = build_dp_communicators(self.cfg)
        if (intra_comm is not None) != (self.cfg.hierarchy == "node"):
            raise ValueError(f"scape.hierarchy {self.cfg.hierarchy!r} with intra_comm "
                             f"{'given' if intra_comm is not None else 'None'}: 'node' needs the node's "
                             f"communicator (build_dp_communicators), 'flat' none")
        self.comm = comm  # data-parallel, or cross-node under hierarchy "node"
        self.cfg = self.cfg.for_ranks(comm.world_size)  # scape.tile_budget: the sparsity of this many ranks
        self.intra_comm = intra_comm
        # the node stage around the exchange, chosen once: nothing for a flat group
        self._node = NodeStage(intra_comm) if intra_comm is not None else FlatStage()
        self.max_grad_norm = float(max_grad_norm)
        if self.cfg.overlap and self.cfg.basis == "dct" and self.max_grad_norm > 0:
            raise ValueError(f"scape.overlap with basis 'dct' needs gradient_clipping 0 (got {max_grad_norm:g}; "
                             f"DeepSpeed's default is 1.0): its factor needs the norm of the whole decoded mean, "
                             f"known only after the last bucket; clip_local clips each rank's gradient instead")
        self.norm_group = norm_group
        self.schedule = MaskSchedule(self.cfg.mask_refresh_interval, self.cfg.dense_refresh,
                                     always_dense=self.cfg.compressor == "dense")
        # internal state, built on the first step (after an engine has moved and cast the model)
        self._groups: list[_GroupState] | None = None
        self._step = 0
        self._kernels = None
        self._refresh_next = False  # the next step is a dense refresh (no mask: after an elastic load)
        self._last_dense = 0  # the step of the last dense exchange (update rules: the window it closes)
        self._dense_steps = 0  # dense exchanges so far
        self._model = None  # scape.overlap: the model whose forward waits for new values (attach_model)
        self._is_boundary = None  # scape.overlap: whether a backward ends the gradient accumulation
        self._at_step: set[int] = set()  # scape.overlap: ids of parameters whose gradient changes after backward
        self._local: LocalSteps | None = None  # scape.local_steps > 1: the inner/outer step (built with the buffers)
        # statistics
        self.comm_stats: dict[str, Any] = {}
        self.last_grad_norm: float | None = None
        self.grad_copies = 0  # gradients found outside the flat buffer and copied in (.grad replaced)
        self.last_selected_offsets: torch.Tensor | None = None  # this rank's part of the newest mask

    # ------------------------------------------------------------------ build
    def _lazy_init(self) -> None:
        if self._groups is not None:
            return
        r, node = self.comm.rank, self._node
        self._groups = []
        for group in self.param_groups:
            sparse, dense = split_dense_sparse(list(group["params"]), self.cfg.dense_numel_threshold)
            # G slices of M shards: shard r of slice l belongs to local rank l of node r
            layout = FlatLayout.build(sparse, self.dp_world_size, self.cfg.chunk_size)
            gs = _GroupState(layout, sparse, dense, None, None, None, None, None)
            skips = {bool(getattr(p, "scape_norm_skip", False)) for p in sparse}
            if len(skips) > 1:
                raise ValueError("a param group mixes parameters marked scape_norm_skip with unmarked ones: "
                                 "put model-parallel replicas in a param group of their own")
            gs.norm_skip = skips.pop() if skips else False
            if sparse:
                dtypes = {p.dtype for p in sparse}
                devices = {p.device for p in sparse}
                if len(dtypes) > 1 or len(devices) > 1:
                    raise ValueError(f"ScapeAdamS needs one dtype and device per param group, "
                                     f"got {dtypes} on {devices}")
                dtype, device = dtypes.pop(), devices.pop()
                flat = torch.zeros(layout.padded_numel, dtype=dtype, device=device)  # (N_pad,)
                for p, off, n in zip(sparse, layout.offsets, layout.numels):
                    flat[off : off + n].copy_(p.detach().reshape(-1))
                # one source of truth for the replicas: rank 0's initial values (across nodes, then inside)
                self.comm.broadcast(flat, 0, "init")
                node.broadcast(flat, "init")
                for p, off, n in zip(sparse, layout.offsets, layout.numels):
                    p.data = flat[off : off + n].view_as(p)
                gs.flat_param = flat
                gs.param_slice = node.slice_of(flat)  # (N_pad/G,) view
                state_dtype = _state_dtype(dtype)  # fp32, or fp64 for fp64 parameters
                shard = gs.param_slice[layout.shard_slice(r)]  # (S,) view
                # fp32 parameters: the master shard is the parameters' own shard, not a copy
                gs.master = shard if dtype == state_dtype else shard.to(state_dtype)  # (S,) fp32
                gs.momentum = torch.zeros_like(gs.master)  # (S,) fp32
                gs.flat_grad = torch.zeros_like(flat)  # (N_pad,) compute dtype
                # (N_pad/G,) hierarchy "node", coordinate basis: N/G more per rank (basis dct sums coefficients)
                gs.grad_slice = gs.flat_grad if self.cfg.basis == "dct" else node.grad_buffer(gs.flat_grad)
                gs.grad_views = [gs.flat_grad[off : off + n].view_as(p) for p, off, n in
                                 zip(sparse, layout.offsets, layout.numels)]
                self._attach_grads(gs, count=False)  # the first backward's gradients are copied in once
                if self.cfg.compressor != "dense":
                    ef_dtype = torch.bfloat16 if self.cfg.error_feedback_dtype == "bf16" else state_dtype
                    gs.error = torch.zeros(gs.param_slice.numel(), dtype=ef_dtype, device=device)  # (N_pad/G,)
                if self.cfg.basis == "dct":  # error feedback in coefficients; no sharded master or momentum
                    gs.tiles = TileLayout.build(sparse, layout.offsets, self.dp_world_size, self.cfg.tile_size)
                    gs.dct_q = dct_matrix(self.cfg.tile_size, state_dtype, device)  # (t, t)
                    # (tiles t t,), or under hierarchy "node" this rank's slice of it (tiles t t / G,)
                    gs.error = torch.zeros(gs.tiles.numel // node.size, dtype=state_dtype, device=device)
                    gs.master = None
                    # dct_update "adams": AdamS on the decoded mean, its momentum on every rank (N_pad,);
                    # "adams_coef": AdamS on the mean coefficients, its momentum in coefficients (tiles t t,)
                    # "signum": the sign of a momentum of the decoded mean, on every rank (N_pad,)
                    gs.momentum = {"sign": None, "adams": torch.zeros_like(flat, dtype=state_dtype),
                                   "signum": torch.zeros_like(flat, dtype=state_dtype), "rms": None,
                                   "adams_coef": torch.zeros(gs.tiles.numel, dtype=state_dtype, device=device),
                                   }[self.cfg.dct_update]  # adams_coef: every coefficient, under a hierarchy too
                    if self.cfg.mask == "shared" and self.cfg.mask_source == "momentum":
                        gs.coef_momentum = torch.zeros(gs.tiles.shard_numel, dtype=state_dtype, device=device)
                if self.cfg.reselect_interval:
                    gs.decay_mark = torch.zeros(layout.shard_numel, dtype=torch.int32, device=device)  # (S,)
                if self.cfg.update_rule == "catchup":
                    gs.catchup_second = torch.zeros_like(gs.momentum)  # (S,) fp32
                elif self.cfg.update_rule == "sign_drift":
                    gs.drift_sign = torch.zeros(layout.padded_numel, dtype=torch.int8, device=device)  # (N_pad,)
                self._kernels = self._kernels or get_kernels(device, self.cfg.kernels)
                if self.cfg.overlap and not any(id(p) in self._at_step for p in sparse):  # bucket_mb, compute dtype
                    kind = DctOverlap if self.cfg.basis == "dct" else OverlapExchange
                    gs.overlap = kind(self, gs, int(self.cfg.bucket_mb * 2**20) // flat.element_size())
            for p in dense:
                self.comm.broadcast(p.data, 0, "init")
                node.broadcast(p.data, "init")
                state = self.state[p]
                state["momentum"] = torch.zeros_like(p, dtype=_state_dtype(p.dtype))
                gs.dense_momenta.append(state["momentum"])
            if dense and self.cfg.dense_wire == "bf16":  # (M,) what rounding the dense gradients to bf16 kept
                gs.dense_error = torch.zeros(sum(p.numel() for p in dense), dtype=_state_dtype(dense[0].dtype),
                                             device=dense[0].device)
            self._groups.append(gs)
        if self.cfg.local_steps > 1:
            self._local = LocalSteps(self)
        self._install_overlap()

    def attach_model(self, model: torch.nn.Module, is_boundary=None, exchange_at_step=()) -> None:
        """``scape.overlap``: let ``model``'s forward wait per module for the new values of its own
        parameters (otherwise ``step()`` waits for all of them), and ``is_boundary()`` say whether the
        backward under way ends the gradient accumulation (DeepSpeed's
        ``engine.is_gradient_accumulation_boundary``; default: every backward does). A parameter used
        in the forward of a module that does not hold it (a parametrization such as ``weight_norm``
        keeps it in a container whose forward never runs) must be waited for with :meth:`synchronize`;
        the model's ``state_dict()``/``load_state_dict()`` wait by themselves. Gradients changed
        between backward and ``step()`` are not seen (they were sent during backward), except those of
        ``exchange_at_step`` (parameters, e.g. a pipeline's tied weights, whose gradient is summed
        across stages after backward): their param groups exchange inside ``step()``, as without
        overlap."""
        self._model, self._is_boundary = model, is_boundary
        self._at_step = {id(p) for p in exchange_at_step}
        for gs in self._groups or []:
            if gs.overlap is not None and any(id(p) in self._at_step for p in gs.sparse_params):
                gs.overlap.check_idle("attach_model()")
                gs.overlap.wait_params()  # what is in flight lands before the group exchanges in step()
                gs.overlap.remove()
                gs.overlap = None
        self._install_overlap()

    def _install_overlap(self) -> None:
        for overlap in self._overlaps():
            overlap.remove()
            overlap.install(self._model)
            if self._is_boundary is not None:
                overlap.is_boundary = self._is_boundary

    def _overlaps(self):
        """``scape.overlap``: the bucketed exchange of each param group that has one, in group order."""
        return [gs.overlap for gs in self._groups or [] if gs.overlap is not None]

    def next_step_dense(self) -> bool:
        """Whether the next ``step()`` exchanges densely (a refresh, or the first step after an
        elastic load)."""
        return self._refresh_next or self.schedule.is_dense(self._step + 1)

    def start_ready_buckets(self) -> None:
        """``scape.overlap``: start the complete buckets, group after group (every rank issues the same
        collectives in the same order)."""
        for overlap in self._overlaps():
            if not overlap.start_ready():
                return

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self, closure=None):
        """One SCAPE step: exchange gradients, update the owned shard, exchange new values."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._lazy_init()
        for overlap in self._overlaps():  # the last step's broadcasts a forward did not wait for
            overlap.wait_params()
        self._step += 1
        t = self._step
        if self._local is not None:  # H local steps, then the pseudo-gradient's exchange (local_steps.py)
            self._local.step(t)
            return loss
        if self.cfg.clip_local > 0:
            self._clip_local()
        if self.cfg.basis == "dct":
            self._step_dct(t)
            return loss
        forced, self._refresh_next = self._refresh_next, False
        dense_step = forced or self.schedule.is_dense(t)
        refresh = forced or self.schedule.is_refresh(t)
        R = self.cfg.reselect_interval
        reselect = R > 0 and not dense_step and (t - self._last_dense) % R == 0 and not self.schedule.is_dense(t + 1)
        meter = self.comm.meter
        if self.cfg.overlap:  # what backward did not start starts now, before any other collective
            for overlap in self._overlaps():
                overlap.complete(dense_step)
            self.start_ready_buckets()
        reduced = [self._exchange_grads(gs, dense_step) for gs in self._groups]
        scale = self._clip_coefficient(reduced)
        for group, gs, (sparse_g, dense_g) in zip(self.param_groups, self._groups, reduced):
            self._update_group(group, gs, sparse_g, dense_g, scale, dense_step)
            if refresh and gs.flat_param is not None and self.cfg.compressor != "dense":
                self._select_next_mask(gs, sparse_g if dense_step else None)
            elif reselect and gs.flat_param is not None:  # no flush: from m and the owner's unsent residual
                beta1 = group["betas"][0]
                pending = gs.error[gs.layout.shard_slice(self.comm.rank)].to(gs.momentum.dtype)  # (S,)
                self._select_next_mask(gs, None, scores=gs.momentum * beta1 + pending * (1 - beta1))  # (S,) new
            inter, intra = self._dense_bytes(gs)
            meter.record_dense(inter)
            if self._node.meter is not None:
                self._node.meter.record_dense(intra)
        for overlap in self._overlaps():
            overlap.end_grads()
        if dense_step:
            self._last_dense, self._dense_steps = t, self._dense_steps + 1
        stats = step_comm_stats(meter, t, dense_step, self._node.meter)
        if self.cfg.log_comm:
            self.comm_stats = stats
        return loss

    def _step_dct(self, t: int) -> None:
        """basis "dct" (the exchange: ``exchange/coefficients.py``; the update: ``dct_step.py``): every
        step exchanges this step's top coefficients; every rank holds the same mean coefficients and
        moves every parameter by them (``dct_update``); the dense tensors take AdamS on their
        all-reduced mean, as in the coordinate basis."""
        meter, cfg = self.comm.meter, self.cfg
        by_momentum = cfg.mask == "shared" and cfg.mask_source == "momentum"
        # mask_source "momentum": its refresh steps, and a step with no mask kept (resumed from another source)
        dense_step = by_momentum and (self.schedule.is_dense(t) or any(
            gs.held_mask is None for gs in self._groups if gs.flat_param is not None))
        signals = []  # per group: what the update consumes (the decoded mean, or for adams_coef the
        for group, gs in zip(self.param_groups, self._groups):  # coefficients), the dense tensors' mean
            dense_g = self._reduce_dense(gs)
            signal = None
            if gs.flat_param is not None:
                self._attach_grads(gs)
            if gs.overlap is not None:  # applied when the next forward needs it
                gs.overlap.start(group)
            elif gs.flat_param is not None:
                sent = None if dense_step else gs.held_mask
                signal, gs.held_mask = exchange_dct(
                    self.comm, self._kernels, gs.tiles, gs.error, gs.flat_grad, gs.dct_q, mask=cfg.mask,
                    k_per_chunk=cfg.k_per_chunk, ef_decay=cfg.ef_decay, mask_source=cfg.mask_source,
                    mask_hold=cfg.mask_hold, mask_early=cfg.mask_early, held=gs.held_mask,
                    dense=dense_step, node=self._node, value_bits=cfg.value_bits, decode=cfg.decode,
                    index_code=cfg.index_code)  # (numel,)
                if by_momentum:  # the owner's first moment, and from it the next step's mask
                    gs.held_mask = next_mask_from_momentum(self.comm, self._kernels, gs.tiles, gs.coef_momentum,
                                                           signal, sent, group["betas"][0], cfg.k_per_chunk)
                if cfg.dct_update != "adams_coef":
                    signal = decode_dct(gs.tiles, signal, gs.flat_grad, gs.dct_q, self._kernels)  # (N_pad,) u
            signals.append((signal, dense_g))
        scale, self.last_grad_norm = replicated_clip_coefficient(self._groups, signals, self.max_grad_norm,
                                                                 self._sum_over_norm_group)
        for group, gs, (signal, dense_g) in zip(self.param_groups, self._groups, signals):
            self._update_group(group, gs, None, dense_g, scale, False)  # the dense tensors
            if signal is not None:
                dct_update(self.cfg.dct_update, self._kernels, group, gs, signal, scale, t)
            inter, intra = self._dense_bytes(gs)
            meter.record_dense(inter)
            if self._node.meter is not None:
                self._node.meter.record_dense(intra)
        stats = step_comm_stats(meter, t, False, self._node.meter)
        if cfg.log_comm:
            self.comm_stats = stats

    def _clip_local(self) -> None:
        """``scape.clip_local``: scale this rank's own gradients (every param group, before error
        feedback) so their global norm is at most ``clip_local``; the norm is summed over the other
        model-parallel ranks of this replica (``norm_group``), copies marked ``scape_norm_skip`` once."""
        grads, counted = [], []
        for gs in self._groups:
            if gs.flat_grad is not None:
                self._attach_grads(gs)
                grads.append(gs.flat_grad)
                if not gs.norm_skip:
                    counted.append(gs.flat_grad)
            for p in gs.dense_params:
                if p.grad is not None:
                    grads.append(p.grad)
                    if not getattr(p, "scape_norm_skip", False):
                        counted.append(p.grad)
        squares = [square_norm_fp64(g) for g in counted]
        total = self._sum_over_norm_group(float(torch.stack(squares).sum()) if squares else 0.0)  # one sync
        scale = self.cfg.clip_local / (math.sqrt(total) + 1e-6)
        if scale < 1.0:
            for g in grads:
                g.mul_(scale)

    def _sum_over_norm_group(self, value: float) -> float:
        """``value`` summed over the other model-parallel ranks of this replica (``norm_group``: one
        fp64 scalar all-reduce, model-parallel, not data-parallel, traffic), or itself without them."""
        if self.norm_group is None or dist.get_world_size(self.norm_group) <= 1:
            return value
        total = torch.tensor([value], dtype=torch.float64, device=collective_device(self.norm_group))
        dist.all_reduce(total, group=self.norm_group)
        return float(total)


    def _attach_grads(self, gs: _GroupState, count: bool = True) -> None:
        """Make every sparse parameter's ``.grad`` its view into ``flat_grad`` again. A gradient that is
        None (zeroed by someone else's ``zero_grad``) is zero; one that was replaced by another tensor
        is copied in (counted in ``grad_copies``: the staging copy the views exist to avoid)."""
        for p, view in zip(gs.sparse_params, gs.grad_views):
            g = p.grad
            if g is not None and g.data_ptr() == view.data_ptr():
                continue
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
                self.grad_copies += int(count)
            p.grad = view

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients. The sparse parameters' ``.grad`` stay views into the flat gradient
        buffer, which is zeroed in place whatever ``set_to_none`` says (backward then accumulates
        straight into it); other parameters as ``torch.optim.Optimizer.zero_grad``."""
        if self._groups is None:
            return super().zero_grad(set_to_none)
        flat = set()
        for gs in self._groups:
            if gs.overlap is not None:
                gs.overlap.check_idle("zero_grad()")
            if gs.flat_grad is not None:
                gs.flat_grad.zero_()
                self._attach_grads(gs)
                flat.update(id(p) for p in gs.sparse_params)
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) in flat or p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().requires_grad_(False)
                    p.grad.zero_()

    def _exchange_grads(self, gs: _GroupState, dense_step: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Steps 1-2: returns (this shard's reduced gradient at its mask or whole shard, dense grads).

        The sparse part is the mean on sparse steps; on dense steps it is the sum over the D ranks
        (``gs.grad_divisor`` = D), read in place where it landed, and the update divides. Under
        hierarchy "node" the exchange runs on the node sum of this rank's slice, across nodes.
        """
        D = self.dp_world_size
        sparse_g = None
        dense_g = self._reduce_dense(gs)
        if gs.flat_param is None:
            return sparse_g, dense_g
        if gs.overlap is not None:  # the reduces to the owners, started in backward
            gs.grad_divisor = float(D) if dense_step else 1.0
            sparse_g = gs.overlap.wait_grads()  # (S,) sum, or (k,) sum at the mask
            return (sparse_g if dense_step else sparse_g.to(gs.master.dtype).div_(D)), dense_g
        kern = self._kernels
        self._attach_grads(gs)  # normally a no-op: backward accumulated into the views
        self._node.reduce_grads(gs.flat_grad, gs.grad_slice)  # node sum of this rank's slice (flat: nothing)
        if dense_step:
            gs.grad_divisor = float(D)
            return self._reduce_scatter_dense(gs), dense_g
        else:
            gs.pending.wait()
            k = gs.active_index.numel() // self.comm.world_size
            packed = torch.empty(gs.active_index.numel(), dtype=gs.flat_param.dtype, device=gs.flat_param.device)
            kern.ef_accumulate_pack(gs.error, gs.grad_slice, gs.active_index, packed)  # (K,)
            sparse_g = torch.empty(k, dtype=packed.dtype, device=packed.device)  # (k,)
            self.comm.reduce_scatter(sparse_g, packed, "grad_rs")
        gs.grad_divisor = 1.0
        sparse_g = sparse_g.to(gs.master.dtype).div_(D)  # (k,) fp32 mean
        return sparse_g, dense_g

    def _reduce_dense(self, gs: _GroupState) -> torch.Tensor | None:
        """The mean over every data-parallel rank of the dense-exchanged tensors' gradients, (M,) fp32
        (one all-reduce; under hierarchy "node" each rank of a node carries 1/G of it across nodes), or
        None without such tensors."""
        if not gs.dense_params:
            return None
        dense_g = torch.cat([_grad_or_zeros(p).reshape(-1).to(_state_dtype(p.dtype))
                             for p in gs.dense_params])  # (M,) fp32
        return self._dense_mean(gs, dense_g)

    def _dense_mean(self, gs: _GroupState, dense_g: torch.Tensor) -> torch.Tensor:
        """The mean over every data-parallel rank of ``dense_g`` ((M,) fp32, this rank's dense-exchanged
        values, consumed), by one all-reduce, in bf16 on the wire under ``dense_wire "bf16"`` (what the
        rounding lost kept in ``gs.dense_error`` for the next exchange)."""
        if self.cfg.dense_wire == "bf16":  # rounded to bf16 for the wire, the rounding kept for the next step
            dense_g.add_(gs.dense_error)
            wire = dense_g.to(torch.bfloat16)  # (M,) bf16
            torch.sub(dense_g, wire.to(dense_g.dtype), out=gs.dense_error)
            self._node.all_reduce_across(wire, self.comm, "dense_ar")
            return wire.to(dense_g.dtype).div_(self.dp_world_size)
        self._node.all_reduce_across(dense_g, self.comm, "dense_ar")
        return dense_g.div_(self.dp_world_size)

    def _reduce_scatter_dense(self, gs: _GroupState) -> torch.Tensor:
        """Dense step: reduce-scatter ``a = e + g`` (the whole buffer) and empty the error feedback.

        Returns this shard's sum over ranks, (S,) in the wire (compute) dtype. Where it can, ``a`` is
        formed in a buffer that exists anyway and the result lands in this rank's shard of the
        gradient buffer (consumed by then), so the usual case allocates nothing of size N.
        """
        r, wire, grad = self.comm.rank, gs.flat_param.dtype, gs.grad_slice
        shard = grad[gs.layout.shard_slice(r)]  # (S,) view
        error = gs.error
        if error is None:  # compressor "dense": the gradient as it is
            send, out = grad, torch.empty_like(shard)  # (S,)
        elif error.dtype == wire:  # a = e + g in the error buffer, sent from there, then emptied
            error.add_(grad)
            send, out = error, shard
        elif error.itemsize < grad.itemsize:  # bf16 error, fp32 wire: a formed in fp32 in the gradient buffer
            grad.add_(error)
            error.zero_()
            send, out = grad, torch.empty_like(shard)  # (S,)
        else:  # fp32 error, bf16 wire: a rounded to the wire dtype; the rounding residual stays
            error.add_(grad)
            send = error.to(wire)  # (N_pad,) the one N-sized buffer of this case
            error.sub_(send)
            out = shard
        self.comm.reduce_scatter(out, send, "grad_rs")
        if send is error:
            error.zero_()  # everything was sent
        return out

    def _clip_coefficient(self, reduced) -> float:
        """Global-norm clipping factor over every shard's reduced gradient (one scalar all-reduce)."""
        if self.max_grad_norm <= 0:
            self.last_grad_norm = None
            return 1.0
        sharded = torch.zeros(1, dtype=torch.float64, device=self.comm.device)  # on the communicator's device
        replicated = 0.0
        for gs, (sparse_g, dense_g) in zip(self._groups, reduced):
            if sparse_g is not None and not gs.norm_skip:
                # a reduction, no copy of the shard; a dense step's sum over ranks is divided here
                norm = torch.linalg.vector_norm(sparse_g, dtype=torch.float64) / gs.grad_divisor
                sharded += norm.square().to(sharded.device)
            replicated += dense_square_norm(gs.dense_params, dense_g)
        self.comm.all_reduce(sharded, "norm_ar")
        self._node.all_reduce(sharded, "norm_ar")  # hierarchy "node": the other slices
        norm = math.sqrt(self._sum_over_norm_group(float(sharded) + replicated))
        self.last_grad_norm = norm
        return min(1.0, self.max_grad_norm / (norm + 1e-6))

    def _update_group(self, group, gs: _GroupState, sparse_g, dense_g, scale: float, dense_step: bool) -> None:
        """Steps 3-4: AdamS on the owned shard (at the mask) and the all-gather of new values."""
        t, D = self._step, self.comm.world_size  # D: the ranks sharing this slice's shards
        beta1, beta2 = group["betas"]
        lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
        hyper = dict(lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=wd)
        if dense_g is not None:
            if scale != 1.0:
                dense_g.mul_(scale)
            grads = list(torch.split(dense_g, [p.numel() for p in gs.dense_params]))
            grads = [g.view_as(p) for g, p in zip(grads, gs.dense_params)]
            adams(gs.dense_params, grads, gs.dense_momenta, step=t, bias_correction=group["bias_correction"], **hyper)
        if sparse_g is None:
            return
        c = 1.0 - beta1**t if group["bias_correction"] else 1.0
        if dense_step:
            # lazy weight decay: coordinates outside the old mask missed it on the sparse steps
            if gs.decay_mark is not None:  # reselect: each coordinate's decay since its own last update
                self._catch_up_decay(gs, None)
                gs.decay_mark.zero_()
                gs.window_decay = [1.0]
            else:
                gs.decay_debt = settle_decay(gs.master, gs.decay_debt, gs.active_local)
            shard = gs.param_slice[gs.layout.shard_slice(self.comm.rank)]  # (S,) view
            out = None if gs.master.data_ptr() == shard.data_ptr() else shard  # bf16: round into the parameters
            # one fused in-place pass; the 1/D of the mean and the clipping factor folded in
            if self.cfg.update_rule == "window_mean":  # AdamS sees each coordinate's mean gradient per step
                window_mean(sparse_g, gs.active_local, t - self._last_dense)
            self._kernels.dense_adams_update(gs.master, gs.momentum, sparse_g, out, grad_scale=scale / gs.grad_divisor,
                                             bias_correction=c, **hyper)
            if gs.catchup_second is not None:  # update_rule "catchup": a window-sized step outside the old mask
                catchup_step(gs.master, gs.catchup_second, sparse_g, gs.active_local,
                             grad_scale=scale / gs.grad_divisor, window=t - self._last_dense,
                             refreshes=self._dense_steps + 1, lr=lr, gain=self.cfg.catchup_gain,
                             beta=self.cfg.catchup_beta, eps=eps)
                if out is not None:
                    out.copy_(gs.master)
            # every rank's new shard, gathered in place: this rank's is already where it belongs
            if gs.overlap is not None:
                gs.overlap.start_params(dense=True)  # a broadcast per bucket, waited for by the forward
            else:
                self.comm.all_gather(gs.param_slice, shard, "param_ag")
            self._node.gather_params(gs.flat_param, gs.param_slice)  # then every slice inside the node
            if gs.drift_sign is not None:  # update_rule "sign_drift": every rank gets sign(m), one bit each
                self._gather_signs(gs)
        else:
            if scale != 1.0:
                sparse_g.mul_(scale)
            if gs.drift_sign is not None and t - self._last_dense <= self.cfg.drift_steps:
                self._drift(gs, drift_coefficient(lr, beta1, beta2))
            K = gs.active_index.numel()
            k = K // D
            if gs.overlap is not None:  # (k,) this rank's part of the buffer the broadcasts send
                new = gs.overlap.new_values()
            else:
                new = torch.empty(k, dtype=gs.flat_param.dtype, device=gs.flat_param.device)  # (k,)
            if gs.decay_mark is not None:  # reselect: the mask's decay since each coordinate's last update
                gs.window_decay.append(gs.window_decay[-1] * (1.0 - lr * wd))
                self._catch_up_decay(gs, gs.active_local)
                hyper = dict(hyper, weight_decay=0.0)
            self._kernels.masked_adams_update(gs.master, gs.momentum, gs.active_local, sparse_g, new, bias_correction=c,
                                              **hyper)
            if gs.overlap is not None:
                gs.overlap.start_params(dense=False)  # a broadcast per bucket, scattered when waited for
            else:
                values = torch.empty(K, dtype=new.dtype, device=new.device)  # (K,)
                self.comm.all_gather(values, new, "param_ag")
                values = self._node.gather_values(values)  # (G K,) every slice's, in the node
                self._kernels.scatter_values(gs.flat_param, gs.node_index, values)
            if gs.decay_mark is None:  # reselect keeps its decay in the marks, not in one debt
                gs.decay_debt = owe_decay(gs.decay_debt, lr, wd)

    def _catch_up_decay(self, gs: _GroupState, index: torch.Tensor | None) -> None:
        """reselect: multiply the master at ``index`` (every coordinate when None: a refresh, whose own
        step's decay the dense update applies) by the decay of the window steps since its mark, and
        mark it decayed to the newest of them. Masks that change inside a window leave each
        coordinate a different debt; this pays exactly that (the decay a dense run applies)."""
        prod = torch.tensor(gs.window_decay, dtype=torch.float64, device=gs.master.device)  # (j+1,)
        marks = gs.decay_mark if index is None else gs.decay_mark.index_select(0, index)  # (S,) or (k,) int32
        factor = (prod[-1] / prod[marks.long()]).to(gs.master.dtype)  # (S,) or (k,)
        if index is None:
            gs.master.mul_(factor)
        else:
            gs.master.index_copy_(0, index, gs.master.index_select(0, index).mul_(factor))
            gs.decay_mark.index_fill_(0, index, len(gs.window_decay) - 1)

    def _gather_signs(self, gs: _GroupState) -> None:
        """"sign_drift" at a refresh: all-gather sign(m) of every shard as bits (N/8 bytes) into
        ``drift_sign``; the padding does not drift, and the next mask is zeroed when it arrives."""
        bits = pack_signs(gs.momentum)  # (S/8,) uint8
        gathered = torch.empty(bits.numel() * self.comm.world_size, dtype=torch.uint8,
                               device=gs.flat_param.device)  # (N_pad/8,) on the communicator's device
        self.comm.all_gather(gathered, bits, "sign_ag")
        unpack_signs(gathered, gs.drift_sign)
        gs.drift_sign[gs.layout.numel:] = 0

    def _drift(self, gs: _GroupState, coefficient: float) -> None:
        """"sign_drift" on a sparse step: every coordinate outside the mask moves by ``-coefficient *
        sign``, on every replica alike, and on the owner's master when it is a separate copy."""
        step = gs.drift_sign.to(gs.flat_param.dtype)  # (N_pad,) 0 at the mask and the padding
        gs.flat_param.sub_(step, alpha=coefficient)
        shard = gs.flat_param[gs.layout.shard_slice(self.comm.rank)]  # (S,) view
        if gs.master.data_ptr() != shard.data_ptr():
            gs.master.sub_(step[gs.layout.shard_slice(self.comm.rank)].to(gs.master.dtype), alpha=coefficient)

    # ------------------------------------------------------------------ masks
    def _select_next_mask(self, gs: _GroupState, reduced_grad: torch.Tensor | None,
                          scores: torch.Tensor | None = None) -> None:
        """Step 5: choose the next mask; SCAPE/top-k start its all-gather, used from the next step."""
        cfg, layout, t = self.cfg, gs.layout, self._step
        gs.pending.wait()  # a refresh that follows a refresh (T=1) supersedes the older mask
        C, kc = cfg.chunk_size, cfg.k_per_chunk
        if cfg.compressor == "randk":
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + t)  # same draw on every rank
            offsets = random_offsets(layout.chunks_per_shard * self.comm.world_size, C, kc, gen)
            self._set_active(gs, offsets.to(gs.flat_param.device))
            return
        if scores is None:
            scores = reduced_grad if cfg.compressor == "topk" else gs.momentum
        gen = None
        exploration = 0.0 if cfg.dense_refresh else cfg.exploration
        if exploration > 0:
            gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + t * 1009 + self.comm.rank)
        offsets = select_mask(scores, C, kc, self._kernels, exploration, gen)  # (k,) int16
        self.last_selected_offsets = offsets
        encoded = self._kernels.encode_mask(offsets, C, kc)  # (L,) uint8
        gs.pending.start(self.comm, encoded, lambda out: self._set_active(gs, self._kernels.decode_mask(out, C, kc)))

    def _set_active(self, gs: _GroupState, offsets: torch.Tensor) -> None:
        gs.active_offsets = offsets  # (K,) int16
        gs.active_index = offsets_to_index(offsets, self.cfg.chunk_size, self.cfg.k_per_chunk)  # (K,) int64
        D, r = self.comm.world_size, self.comm.rank
        k = gs.active_index.numel() // D
        gs.active_local = gs.active_index[r * k : (r + 1) * k] - r * gs.layout.shard_numel  # (k,) int64
        gs.node_index = self._node.node_index(offsets, gs.active_index, self.cfg.chunk_size, self.cfg.k_per_chunk,
                                              self._kernels)  # (G K,) int64
        if gs.drift_sign is not None:
            gs.drift_sign.index_fill_(0, gs.active_index, 0)  # the mask's coordinates take AdamS steps

    # ------------------------------------------------------------------ accounting
    def _dense_bytes(self, gs: _GroupState) -> tuple[int, int]:
        """What a dense ZeRO-1 step sends for this group, (inter-node, intra-node): RS of grads + AG of
        params + dense AR over the (cross-node) group; with hierarchy "node" the same split by node."""
        D = self.comm.world_size
        total = sum(collective_bytes("all_reduce", p.numel() * 4, D) for p in gs.dense_params)
        padded = b = 0
        if gs.flat_param is not None:
            b, padded = gs.flat_param.element_size(), gs.layout.padded_numel
            total += collective_bytes("reduce_scatter", gs.param_slice.numel() * b, D)
            total += collective_bytes("all_gather", gs.layout.shard_numel * b, D)
        return total, self._node.dense_bytes(padded, b, sum(p.numel() for p in gs.dense_params))

    def synchronize(self) -> None:
        """Wait for every collective still in flight (mask all-gathers; under ``scape.overlap`` the
        broadcasts of new values); call before reading parameters outside a forward, saving, or
        destroying the process group."""
        for gs in self._groups or []:
            gs.pending.wait()
            if gs.overlap is not None:
                gs.overlap.wait_params()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds, by buffer, summed over param groups (``scape_ds.optim.memory`` has the
        formulas): ``params`` and ``grads`` (the flat buffers and the dense-exchanged tensors),
        ``master`` (0 when it is a view of the fp32 parameters), ``momentum``, ``error_feedback``,
        ``masks``, ``rule_state`` (the buffers of a non-lazy ``scape.update_rule``, of
        ``scape.reselect_interval`` and of ``scape.local_steps``). Transient buffers of a step are not counted."""
        self._lazy_init()
        total = dict(params=0, grads=0, master=0, momentum=0, error_feedback=0, masks=0, rule_state=0)

        def nbytes(t):
            return 0 if t is None else t.numel() * t.element_size()

        for gs in self._groups:
            total["params"] += nbytes(gs.flat_param) + sum(nbytes(p) for p in gs.dense_params)
            total["grads"] += nbytes(gs.flat_grad) + sum(nbytes(p.grad) for p in gs.dense_params)
            if gs.grad_slice is not gs.flat_grad:  # hierarchy "node": the node sum of the slice
                total["grads"] += nbytes(gs.grad_slice)
            shard = gs.param_slice[gs.layout.shard_slice(self.comm.rank)] if gs.flat_param is not None else None
            if gs.master is not None and gs.master.data_ptr() != shard.data_ptr():
                total["master"] += nbytes(gs.master)
            total["momentum"] += nbytes(gs.momentum) + sum(nbytes(m) for m in gs.dense_momenta)
            total["error_feedback"] += nbytes(gs.error) + nbytes(gs.dense_error)
            total["rule_state"] += nbytes(gs.catchup_second) + nbytes(gs.drift_sign) + nbytes(gs.decay_mark)
            total["masks"] += nbytes(gs.active_offsets) + nbytes(gs.active_index) + nbytes(gs.active_local)
            if gs.node_index is not gs.active_index:
                total["masks"] += nbytes(gs.node_index)
        if self._local is not None:  # local_steps: the synchronized copy, outer momentum, inner state
            total["rule_state"] += self._local.memory_bytes()
        return total

    def mask_offsets(self, group_index: int = 0) -> torch.Tensor | None:
        """The mask (every shard's, (K,) int16 chunk offsets) the next sparse step will use; under
        hierarchy "node" every cross-node shard of this rank's slice."""
        self._lazy_init()
        gs = self._groups[group_index]
        gs.pending.wait()
        return None if gs.active_offsets is None else gs.active_offsets.clone()

    def error_feedback(self, group_index: int = 0) -> torch.Tensor | None:
        """This rank's error-feedback buffer of a param group, (N_pad,) fp32, or (N_pad/G,) for its slice
        under hierarchy "node" (read-only view)."""
        self._lazy_init()
        return self._groups[group_index].error

    @property
    def step_count(self) -> int:
        return self._step

    @property
    def dp_world_size(self) -> int:
        """D, the data-parallel ranks: G M under hierarchy "node" (G per node, M nodes)."""
        return self.comm.world_size * self._node.size

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Per-rank state: hyperparameters, step, every shard buffer, error feedback and masks.

        The state is sharded: each data-parallel rank saves and loads its own.
        """
        self._lazy_init()
        for overlap in self._overlaps():
            overlap.check_idle("state_dict()")
        self.synchronize()  # masks and (scape.overlap) new values in flight
        groups = []
        for gs in self._groups:
            groups.append(dict(
                master=_clone(gs.master), momentum=_clone(gs.momentum), error=_clone(gs.error),
                active_offsets=_clone(gs.active_offsets), decay_debt=gs.decay_debt,
                dense_momenta=[m.clone() for m in gs.dense_momenta], dense_error=_clone(gs.dense_error),
                catchup_second=_clone(gs.catchup_second), drift_sign=_clone(gs.drift_sign),
                decay_mark=_clone(gs.decay_mark), window_decay=list(gs.window_decay),
                held_mask=None if gs.held_mask is None else gs.held_mask.state(),
                coef_momentum=_clone(gs.coef_momentum),
                numel=gs.layout.numel, padded_numel=gs.layout.padded_numel,
                # basis "dct": the coefficients of the weights' tiles, without the padding tiles (elastic resume)
                coef_numel=None if gs.tiles is None else gs.tiles.tiles_numel,
            ))
        param_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups]
        return dict(param_groups=param_groups, scape=dict(
            step=self._step, rank=self.comm.rank, world_size=self.comm.world_size,
            node_rank=self._node.rank, node_size=self._node.size,
            config=self.cfg.model_dump(exclude={"tile_budget"}),  # as run: a tile_budget is its sparsity here
            groups=groups, refresh_next=self._refresh_next,
            last_dense=self._last_dense, dense_steps=self._dense_steps,
            local=None if self._local is None else self._local.state_dict(),
        ))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state saved by :meth:`state_dict` on the same data-parallel rank and world size,
        or one re-sharded for this rank by :mod:`scape_ds.checkpoint.reshard` (then the parameters are rebuilt
        from the loaded master shards, one all-gather, and the next step is a dense refresh; basis "dct"
        has no master and keeps the parameters as loaded).

        Raises:
            ValueError: saved with another world size, rank or parameter layout.
        """
        if "scape" not in state_dict:
            raise ValueError("not a ScapeAdamS state dict (no 'scape' entry)")
        sc = state_dict["scape"]
        check_same_layout(sc["rank"], sc["world_size"], self.comm.rank, self.comm.world_size, "ScapeAdamS")
        check_same_layout(sc.get("node_rank", 0), sc.get("node_size", 1), self._node.rank, self._node.size,
                          "ScapeAdamS (node group)")
        mismatch = basis_mismatch(sc.get("config", {}), self.cfg)
        if mismatch:
            raise ValueError(f"checkpoint was saved with {mismatch}: their optimizer states differ; resume with "
                             f"the saved settings")
        check_local_settings(sc.get("config", {}), self.cfg, sc.get("resharded_from") is not None)
        saved_rule = sc.get("config", {}).get("update_rule", "lazy")
        if saved_rule != self.cfg.update_rule:
            raise ValueError(f"checkpoint was saved with scape.update_rule {saved_rule!r}, this run has "
                             f"{self.cfg.update_rule!r}: their optimizer states differ; resume with {saved_rule!r}")
        saved_reselect = bool(sc.get("config", {}).get("reselect_interval", 0))
        if saved_reselect != bool(self.cfg.reselect_interval):
            raise ValueError(f"checkpoint was saved with scape.reselect_interval "
                             f"{sc['config'].get('reselect_interval', 0)}, this run has {self.cfg.reselect_interval}: "
                             f"their weight-decay states differ; resume with both 0 or both > 0")
        self._lazy_init()
        for overlap in self._overlaps():  # nothing of the old state stays in flight
            overlap.check_idle("load_state_dict()")
            overlap.wait_params()
        if len(sc["groups"]) != len(self._groups):
            raise ValueError(f"checkpoint has {len(sc['groups'])} param groups, optimizer has {len(self._groups)}")
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
        for gs, saved in zip(self._groups, sc["groups"]):
            if saved["numel"] != gs.layout.numel:
                raise ValueError(f"checkpoint param group has {saved['numel']} sparse elements, "
                                 f"model has {gs.layout.numel}")
            _copy_into(gs.master, saved["master"])
            _copy_into(gs.momentum, saved["momentum"])
            _copy_into(gs.error, saved["error"])
            _copy_into(gs.catchup_second, saved.get("catchup_second"))
            _copy_into(gs.drift_sign, saved.get("drift_sign"))
            _copy_into(gs.decay_mark, saved.get("decay_mark"))
            gs.window_decay = list(saved.get("window_decay", [1.0]))
            if gs.coef_momentum is not None and saved.get("coef_momentum") is not None:  # else it starts at 0
                gs.coef_momentum.copy_(saved["coef_momentum"])  # (and the next step, with no mask kept, is dense)
            gs.held_mask = None  # basis "dct", mask "shared": the mask of the next steps, if one was kept
            if saved.get("held_mask") is not None:
                gs.held_mask = HeldMask.from_state(saved["held_mask"], gs.flat_param.device)
            for m, s in zip(gs.dense_momenta, saved["dense_momenta"]):
                m.copy_(s)
            if gs.dense_error is not None:  # dense_wire "bf16" (a state saved without it: from 0)
                gs.dense_error.zero_()
                if saved.get("dense_error") is not None:
                    gs.dense_error.copy_(saved["dense_error"])
            gs.pending.drop()
            gs.decay_debt = saved["decay_debt"]
            if saved["active_offsets"] is None:
                gs.active_offsets = gs.active_index = gs.active_local = None
            else:
                self._set_active(gs, saved["active_offsets"].to(gs.flat_param.device))
            if sc.get("resharded_from") is not None and gs.master is not None:
                # the master shards are the truth (the decay debt was settled into them): every
                # replica takes them, as at the end of a dense step (basis "dct" has no master: the
                # replicated parameters DeepSpeed loaded are the truth, as saved)
                shard = gs.flat_param[gs.layout.shard_slice(self.comm.rank)]  # (S,) view
                if gs.master.data_ptr() != shard.data_ptr():
                    shard.copy_(gs.master)
                self.comm.all_gather(gs.flat_param, shard, "init")
        if self._local is not None:
            self._local.load_state_dict(sc["local"])
        self._step = sc["step"]
        self._refresh_next = bool(sc.get("refresh_next", False))
        self._last_dense, self._dense_steps = sc.get("last_dense", 0), sc.get("dense_steps", 0)


def _state_dtype(dtype: torch.dtype) -> torch.dtype:
    """Optimizer state (master, momentum, error feedback) is fp32, or fp64 for fp64 parameters."""
    return torch.promote_types(dtype, torch.float32)


def _grad_or_zeros(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def _copy_into(dst: torch.Tensor | None, src: torch.Tensor | None) -> None:
    if dst is None or src is None:
        assert dst is None and src is None, "buffer present on one side only"
        return
    dst.copy_(src)
