"""Path B: SCAPE under DeepSpeed ZeRO stage 3 (docs/design.md section 2).

:class:`ScapeStage3` subclasses DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3``;
:func:`scape_stage3_class` gives it a config, and ``scape_ds.initialize`` has the engine build that
class in place of its own (the engine looks the class up in ``deepspeed.runtime.zero.stage3`` when
it creates the optimizer). The subclass only overrides DeepSpeed's hooks; SCAPE's state and
collectives live in :class:`~scape_ds.exchange.stage3.Stage3Exchange` (``opt.scape``), its index
arithmetic in :mod:`scape_ds.exchange.pieces`. It changes three things:

1. **Gradient reduce-scatter** (``__avg_scatter_grads``: the per-parameter list of this rank's
   averaged partition). ZeRO-3 partitions every parameter ``p`` into ``D`` pieces of ``P``
   elements (the last padded). On a sparse step each rank ``r``'s piece keeps ``k_p =
   ceil((1 - sparsity) * P)`` coordinates, the mask ``M[p][r]`` chosen by ``r``. Every rank adds
   its gradient to its error feedback ``E[p]`` (a full-size fp32 buffer keyed by ``p.ds_id``),
   packs the values at every piece's mask, rank-major, and one dense reduce-scatter of ``D x
   sum(k_p)`` values delivers to each rank the mean at its own mask; what was sent leaves
   ``E``. The partition handed back to ZeRO-3 is zero outside the mask. On dense steps (the first
   and, with ``dense_refresh``, every refresh) the whole of ``g + E`` is reduce-scattered and
   ``E`` is emptied. The mask stays fixed across gradient-accumulation micro-steps (ZeRO-3
   reduces every micro-batch; each adds to ``E``). Dense tensors (1-D, under
   ``dense_numel_threshold``, marked ``scape_dense``) skip all of this: their whole pieces are
   reduce-scattered every step, with no mask and no error feedback, as on path A.
2. **Masks from the momentum, one step early**: after a refresh step the owner of each piece
   takes the top-``k_p`` of ``|m|`` over its piece of the flat fp32 partition that the optimizer
   sees, and an asynchronous all-gather sends every rank's masks while the next forward runs;
   the next reduce waits for it.
3. **The optimizer on the flat fp32 partitions** (:class:`Stage3AdamS`) applies AdamS at the
   mask only on sparse steps, everywhere on dense ones.

Basis "dct" (``scape.basis``) replaces 1-3 with stage 0/1's DCT exchange over each parameter's full
shape (:class:`~scape_ds.optim.stage3_dct.Stage3DctExchange`, whose docstring numbers the steps): the
hook only accumulates each full local gradient and hands ZeRO-3 zeros; ``step()`` clips locally,
reduce-scatters the dense tensors, exchanges and decodes the coefficients into u (the same on every
rank), writes u's slice at each of this rank's pieces into ZeRO-3's gradient partitions (so
``gradient_clipping`` sees the norm stage 0/1 clips by), and ``Stage3AdamS`` moves each piece by
``dct_update`` (``rules``). ``sparse_replica`` then moves every full copy by the same u.

Parameter exchange (``scape.param_exchange``):

- ``"dense"``: ZeRO-3's own. The updated fp32 partition is copied into the compute-dtype partition
  and all-gathered by ZeRO-3 before each use, as without SCAPE; ZeRO-3's memory.
- ``"sparse_replica"``: every rank keeps a full compute-dtype copy of every parameter (``initialize``
  makes them all ZeRO-3 *persistent*, so forward and backward fetch nothing). After a step the
  copy is patched by one all-gather of the new values at the masks: a sparse step changes a piece
  only at its mask (weight decay outside it is lazy, settled at the next dense step), so rank ``r``
  sends ``k_p`` values per parameter. Dense steps all-gather the whole partitions. Both go through
  SCAPE's metered communicator in place of ZeRO-3's persistent-parameter all-gather.

Precision: fp32 and bf16 (the compute-dtype partitions, the replica and the gradients are then
bf16; the fp32 partitions, momentum and error feedback stay fp32). The reduce-scatter always
carries fp32 values, so nothing of the error feedback is rounded away; dense ZeRO-3's bytes are
counted in its ``communication_data_type``. fp16 (dynamic loss scaling) is refused, and so is
everything else that would change what is reduced (:func:`check_stage3_config`).
"""
from __future__ import annotations

import functools
import inspect
import re
import sys
from typing import Callable

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

from .comm import TorchCommunicator
from .config import ScapeConfig
from .exchange.core import ValuesInFlight, owe_decay, settle_decay
from .exchange.layout import Zero3Layout
from .exchange.refused import refusal_message, refused_settings
from .exchange.stage3 import Stage3Exchange
from .kernels import get_kernels
from .optim.adams import check_adams_hyperparameters
from .optim.stage3_dct import Stage3DctExchange, dct_stage3_refusal

__all__ = ["ScapeStage3", "Stage3AdamS", "scape_stage3_class", "check_stage3_config", "check_deepspeed_internals",
           "replica_zero_config", "zero3_layout"]

_PRIVATE = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
_NEEDED = ("grad_position", "fp32_partitioned_groups_flat", "fp16_groups", "get_param_id",
           "_get_param_partition_group", "gradient_accumulation_dtype", "dp_process_group", "overflow",
           "persistent_parameters", "_post_step", "_partition_all_parameters", "communication_data_type",
           "sub_group_to_group_id")


def check_deepspeed_internals() -> None:
    """Fail with the DeepSpeed version and what is missing if the private stage-3 names moved."""
    cls = DeepSpeedZeroOptimizer_Stage3  # the class imported here, not what the module holds now (it may be swapped)
    missing = []
    src = inspect.getsource(cls)
    if getattr(cls, _PRIVATE, None) is None:
        missing.append(f"{cls.__name__}.__avg_scatter_grads")
    elif not re.search(r"def __avg_scatter_grads\(self,\s*params_to_reduce[^,]*,\s*communication_data_type", src):
        # decorated, so the signature is read from the source
        missing.append("__avg_scatter_grads(self, params_to_reduce, communication_data_type)")
    for name in _NEEDED:
        if f"self.{name}" not in src and f"def {name}" not in src:
            missing.append(f"{cls.__name__}.{name}")
    if missing:
        raise RuntimeError(f"scape_ds's ZeRO-3 path does not support DeepSpeed {deepspeed.__version__}: "
                           f"missing {', '.join(missing)} (written against 0.19.8)")


def check_stage3_config(cfg: dict, scape: ScapeConfig) -> None:
    """Refuse, with a message, stage-3 settings the SCAPE stage 3 does not run: DeepSpeed's
    (:mod:`scape_ds.exchange.refused`, from the config dict ``cfg``) and SCAPE's (from ``scape``,
    the parsed ``"scape"`` block)."""
    refused = refused_settings(cfg, 3)
    if refused:
        raise ValueError(refusal_message(refused, 3))
    if scape.hierarchy != "flat":
        raise ValueError(f"scape.hierarchy {scape.hierarchy!r} is not built for ZeRO stage 3: use ZeRO stage 0/1 "
                         f"(ScapeAdamS) for the hierarchical exchange, or hierarchy 'flat' under stage 3")
    if scape.dense_wire != "fp32":
        raise ValueError(f"scape.dense_wire {scape.dense_wire!r} is not built for ZeRO stage 3 (its dense tensors "
                         f"travel in a reduce-scatter of their own): use ZeRO stage 0/1, or dense_wire 'fp32'")
    if scape.local_steps > 1:
        raise ValueError(f"scape.local_steps {scape.local_steps} is not built for ZeRO stage 3 (every rank would "
                         f"need its own full local copy of the parameters, which ZeRO-3 partitions): use ZeRO stage "
                         f"0/1, or local_steps 1 under stage 3")
    if scape.update_rule != "lazy":
        raise ValueError(f"scape.update_rule {scape.update_rule!r} is not built for ZeRO stage 3: use ZeRO stage 0/1 "
                         f"(ScapeAdamS), or update_rule 'lazy' under stage 3")
    if scape.basis == "dct":  # tiles follow each parameter's full shape (scape_ds/optim/stage3_dct.py)
        bf16 = bool((cfg.get("bf16") or {}).get("enabled") or (cfg.get("bfloat16") or {}).get("enabled"))
        refusal = dct_stage3_refusal(scape, bf16)
        if refusal:
            raise ValueError(refusal)
    elif scape.clip_local:
        raise ValueError("scape.clip_local is not built for the coordinate basis under ZeRO stage 3 (its gradients "
                         "leave in backward, bucket by bucket, before the whole local norm is known): use basis "
                         "'dct', ZeRO stage 0/1, or clip_local 0")
    if scape.reselect_interval:
        raise ValueError("scape.reselect_interval is not built for ZeRO stage 3: use ZeRO stage 0/1 (ScapeAdamS), "
                         "or reselect_interval 0 under stage 3")
    if scape.compressor != "scape" or scape.comm_backend != "torch":
        raise ValueError("under ZeRO stage 3 SCAPE runs compressor 'scape' over comm_backend 'torch' in this version")
    if scape.error_feedback_dtype != "fp32":
        raise ValueError(f"scape.error_feedback_dtype {scape.error_feedback_dtype!r} is for ZeRO stage 0/1; "
                         f"under ZeRO stage 3 it must be 'fp32'")
    if scape.overlap and scape.param_exchange != "sparse_replica":
        raise ValueError("scape.overlap under ZeRO stage 3 overlaps param_exchange 'sparse_replica''s all-gather of "
                         "new values; with 'dense' set overlap false: SCAPE's gradient exchange already runs in "
                         "DeepSpeed's bucket hooks during backward (on its reduce stream on GPUs with "
                         "zero_optimization.overlap_comm, true by default at stage 3) and the parameters are "
                         "ZeRO-3's own prefetched all-gathers")


_EVERYTHING = sys.maxsize


def replica_zero_config(zero: dict) -> dict:
    """``zero_optimization`` for ``param_exchange: "sparse_replica"``: every parameter persistent
    (a full copy on every rank, never released after use)."""
    zero = dict(zero)
    for key in ("stage3_param_persistence_threshold", "stage3_model_persistence_threshold"):
        if key in zero and int(zero[key]) < _EVERYTHING:
            raise ValueError(f"zero_optimization.{key} = {zero[key]} with scape.param_exchange 'sparse_replica': "
                             f"the replica keeps every parameter on every rank; remove {key}")
        zero[key] = _EVERYTHING
    return zero


class Stage3AdamS(torch.optim.Optimizer):
    """AdamS on ZeRO-3's flat fp32 partitions; on sparse steps only at ``active[id(flat)]``.

    ZeRO-3 steps it once per sub-group with that sub-group's flat fp32 partition as the only
    parameter; :class:`ScapeStage3` sets ``active`` before each step (empty: dense step). Weight
    decay is lazy as on path A: coordinates outside the mask are decayed by the accumulated factor
    at the next dense step. Basis "dct": ``rules[id(flat)]`` (a
    :class:`~scape_ds.optim.stage3_dct.PartitionStep`), where set, steps that partition instead.
    """

    def __init__(self, params, lr: float = 3e-4, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 bias_correction: bool = True):
        betas = tuple(betas)
        check_adams_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))
        self.active: dict[int, torch.Tensor] = {}
        self.rules: dict[int, Callable] = {}  # basis "dct": id(flat) -> its step (sign/rms/signum pieces, AdamS)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum" not in state:
                    state["momentum"] = torch.zeros_like(p)
                    state["step"] = 0
                    state["decay_debt"] = 1.0
                state["step"] += 1
                t, m = state["step"], state["momentum"]
                rule = self.rules.get(id(p))
                if rule is not None:
                    rule(p, m, group, 1.0 - beta1**t if group["bias_correction"] else 1.0)
                    continue
                index = self.active.get(id(p))
                if index is None:
                    # lazy weight decay, as on path A: coordinates outside the last mask missed it
                    state["decay_debt"] = settle_decay(p, state["decay_debt"], state.pop("last_index", None))
                    c = 1.0 - beta1**t if group["bias_correction"] else 1.0
                    get_kernels(p.device).dense_adams_update(p, m, p.grad, grad_scale=1.0, bias_correction=c, **hyper)
                else:
                    c = 1.0 - beta1**t if group["bias_correction"] else 1.0
                    out = torch.empty(index.numel(), dtype=p.dtype, device=p.device)
                    get_kernels(p.device).masked_adams_update(p, m, index, p.grad[index], out, bias_correction=c,
                                                              **hyper)
                    state["decay_debt"] = owe_decay(state["decay_debt"], group["lr"], group["weight_decay"])
                    state["last_index"] = index
        return None

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``, keeping ``last_index`` (the last mask, int64) an index: torch
        casts every non-``step`` state tensor to its parameter's dtype, which would make it fp32 (a
        dense step after the resume then fails to index with it, and fp32 holds only indices below
        2**24 exactly)."""
        kept = {i: s["last_index"] for i, s in state_dict["state"].items() if "last_index" in s}
        state = {i: {k: v for k, v in s.items() if k != "last_index"} for i, s in state_dict["state"].items()}
        super().load_state_dict(dict(state_dict, state=state))
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]  # saved ids, in param order
        params = [p for g in self.param_groups for p in g["params"]]
        for i, p in zip(ids, params):
            if i in kept:
                self.state[p]["last_index"] = kept[i].to(p.device)


class ScapeStage3(DeepSpeedZeroOptimizer_Stage3):
    """ZeRO-3 with SCAPE's sparse, error-compensated gradient reduce-scatter (see the module docstring).

    DeepSpeed builds it in place of its own stage-3 optimizer (``scape_ds.initialize`` swaps the
    class :func:`scape_stage3_class` returns in). It overrides four of DeepSpeed's hooks (the
    gradient reduce-scatter, ``step``, and, for ``sparse_replica``, the parameter release and
    re-gather around a step) plus the checkpoint methods, and delegates to ``self.scape``, a
    :class:`~scape_ds.exchange.stage3.Stage3Exchange` holding every piece of SCAPE's state; no
    other attribute of ours is written into DeepSpeed's object.
    """

    scape_config: ScapeConfig | None = None  # set by scape_stage3_class

    def __init__(self, *args, **kwargs):
        if self.scape_config is None:
            raise TypeError("ScapeStage3 needs a SCAPE config: build the class with scape_stage3_class(cfg)")
        super().__init__(*args, **kwargs)
        # another optimizer (DeepSpeed's own tests install this class under theirs) is only
        # exact at sparsity 0: every step is then SCAPE's dense exchange, with no masks to apply
        masked = isinstance(self.optimizer, Stage3AdamS)
        dct = self.scape_config.basis == "dct"
        if not masked and (self.scape_config.sparsity > 0.0 or dct):
            raise ValueError(f"the SCAPE stage 3 steps Stage3AdamS at sparsity > 0 and in basis 'dct', got "
                             f"{type(self.optimizer).__name__}")
        exchange = Stage3DctExchange if dct else Stage3Exchange  # basis "dct": scape_ds/optim/stage3_dct.py
        self.scape = exchange(self.scape_config, TorchCommunicator(self.dp_process_group),
                              [p for g in self.fp16_groups for p in g], masked, self.communication_data_type)
        # scape.overlap (sparse_replica): the new values travel in buckets, waited for by each module's forward
        self._value_buckets: list[list[int]] = []
        self._values_in_flight = ValuesInFlight()  # bucket -> its all-gather of new values
        if self.scape_config.overlap and self.scape.params:
            size = self.scape.params[0].ds_tensor.element_size()
            self._value_buckets = self.scape.param_buckets(int(self.scape_config.bucket_mb * 2**20) // size)
            self._hook_forward()

    # -------------------------------------------------------------- what callers read
    @property
    def cfg(self) -> ScapeConfig:
        """The config the exchange runs (``scape.tile_budget`` resolved for this many ranks)."""
        return self.scape.cfg if getattr(self, "scape", None) is not None else self.scape_config

    @property
    def comm(self):
        return self.scape.comm

    @property
    def comm_stats(self) -> dict:
        """This step's bytes: ``step``, ``dense_step``, ``bytes_sent``, ``bytes_dense``, ``by_tag``."""
        return self.scape.comm_stats

    @property
    def replica(self) -> bool:
        """``param_exchange`` is ``"sparse_replica"``."""
        return self.scape.replica

    @property
    def error(self) -> dict[int, torch.Tensor]:
        """ds_id -> (D*P,) fp32 error feedback."""
        return self.scape.error

    @property
    def masks(self) -> dict[int, torch.Tensor]:
        """ds_id -> (D, k) int64 mask offsets within each rank's piece."""
        return self.scape.masks

    # -------------------------------------------------------------- DeepSpeed's hooks
    def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params_to_reduce, communication_data_type):
        return self.scape.reduce_scatter_grads(params_to_reduce, self.gradient_accumulation_dtype)

    def step(self, closure=None):
        self.wait_values()  # the last step's, where no forward waited (a module that did not run)
        if isinstance(self.scape, Stage3DctExchange):
            return self._step_dct(closure)
        dense = self.scape.begin_step()
        if self.scape.masked:
            self.optimizer.active = {} if dense else self.scape.flat_indices(self._positions())
        self.scape.in_step = True
        try:
            super().step(closure)  # its _post_step patches the replica (sparse_replica)
        finally:
            self.scape.in_step = False
        if self.overflow:
            return
        momenta = ((self.optimizer.state[flat]["momentum"], offset, p) for flat, offset, p in self._positions())
        self.scape.end_step(momenta)

    def _step_dct(self, closure) -> None:
        """Basis "dct": the exchange and decode (:meth:`Stage3DctExchange.exchange`), then ZeRO-3's step,
        whose ``Stage3AdamS`` moves each partition by the decoded mean (``rules``)."""
        grads = {p.ds_id: g for i, group in enumerate(self.fp16_groups)  # the partitions its step reads
                 for p, g in zip(group, self.averaged_gradients[i])}
        self.scape.exchange(grads, self.optimizer.param_groups[0]["betas"][0])
        self.optimizer.active = {}
        self.optimizer.rules = self.scape.partition_steps(self._positions())
        self.scape.in_step = True
        try:
            super().step(closure)  # its _post_step moves the replica (sparse_replica)
        finally:
            self.scape.in_step = False
        self.scape.end_step()

    def _partition_all_parameters(self):
        if not (self.scape.replica and self.scape.in_step):
            return super()._partition_all_parameters()
        # ZeRO-3 frees every parameter when a step starts, the persistent ones too, and all-gathers
        # those again in _post_step: the replica stays, and _post_step patches it instead
        for p in self.scape.params:
            p.ds_active_sub_modules.clear()

    def _post_step(self, timer_names):
        if not self.scape.replica:
            return super()._post_step(timer_names)
        persistent = self.persistent_parameters
        self.persistent_parameters = []  # ZeRO-3 would all-gather them densely here
        try:
            super()._post_step(timer_names)
        finally:
            self.persistent_parameters = persistent
        self._patch_replica()

    def _patch_replica(self) -> None:
        """Bring every rank's full copy up to date from the compute-dtype partitions ZeRO-3 just wrote."""
        if isinstance(self.scape, Stage3DctExchange):
            if self.scape.step == 0:  # ZeRO-3 released some copies while it traced the first step: all gathered
                fulls = zip(self.scape.params, self.scape.gather_partitions())
            else:  # the sparse copies moved by the decoded mean, the dense tensors gathered
                groups = {p.ds_id: self.optimizer.param_groups[self.sub_group_to_group_id[i]]
                          for i, group in enumerate(self.fp16_groups) for p in group}
                self.scape.move_replicas(groups, {p.ds_id for p in self.scape.sparse
                                                  if p.ds_status == ZeroParamStatus.AVAILABLE})
                fulls = zip(self.scape.dense, self.scape.gather_dense())
            for p, full in fulls:
                _set_full(p, full)
            return
        if self.scape.step_dense:
            for p, full in zip(self.scape.params, self.scape.gather_partitions()):
                _set_full(p, full)
            return
        if self._value_buckets:  # scape.overlap: started here, written in by the next forward's hooks
            for b, (work, gathered) in enumerate(self.scape.start_gather_at_masks(self._value_buckets)):
                self._values_in_flight.start(b, work, functools.partial(self._write_in, gathered))
            return
        for p, (pos, values) in zip(self.scape.params, self.scape.gather_at_masks()):
            _write_values(p, pos, values)

    def _hook_forward(self) -> None:
        """A forward pre-hook on every module holding SCAPE parameters: wait for their buckets."""
        buckets_of = {id(self.scape.params[i]): [b] for b, bucket in enumerate(self._value_buckets) for i in bucket}
        self._values_in_flight.hook(self.module, buckets_of)

    def _write_in(self, gathered) -> None:
        """Write a bucket's values into the replicas; ``gathered()`` (``start_gather_at_masks``'s
        ``finish``) lists them per parameter."""
        for i, pos, values in gathered():
            _write_values(self.scape.params[i], pos, values)

    def wait_values(self, buckets=None) -> None:
        """``scape.overlap``: wait for the new values of ``buckets`` (default: all) and write them in."""
        self._values_in_flight.wait(buckets)

    def _positions(self):
        """(flat fp32 partition, offset in it, param) of every parameter's piece on this rank."""
        for i, group in enumerate(self.fp16_groups):
            flat = self.fp32_partitioned_groups_flat[i]
            for p in group:
                _, offset, _ = self.grad_position[self.get_param_id(p)]
                yield flat, int(offset), p

    # -------------------------------------------------------------- memory, shutdown, checkpoints
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds for SCAPE beyond ZeRO-3's own buffers (error feedback, masks, the
        sparse_replica full parameter copy; 0 under "dense", where ZeRO-3 gathers a parameter only
        while a module runs), and ZeRO-3's partitioned state (compute-dtype parameter partitions,
        fp32 partitions, AdamS momentum)."""
        flats = self.fp32_partitioned_groups_flat
        return dict(
            **self.scape.memory_bytes(),
            param_partitions=sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in self.scape.params),
            fp32_partitions=sum(f.numel() * f.element_size() for f in flats),
            momentum=sum(self.optimizer.state[f]["momentum"].numel() * 4 for f in flats if f in self.optimizer.state),
        )

    def synchronize(self) -> None:
        """Wait for the mask all-gather and (``scape.overlap``) the new values in flight (call before
        reading parameters outside a forward or destroying the process group)."""
        self.scape.pending.wait()
        self.wait_values()

    def state_dict(self):
        """ZeRO-3's per-rank state (fp32 partitions, momentum) plus the error feedback, masks and step."""
        self.synchronize()
        sd = super().state_dict()
        sd["scape"] = self.scape.state_dict()
        return sd

    def load_state_dict(self, state_dict_list, load_optimizer_states=True, *args, **kwargs):
        self.wait_values()
        mine = state_dict_list[dist.get_rank(group=self.dp_process_group)]
        self.scape.check_loadable(mine.get("scape") if isinstance(mine, dict) else None)
        super().load_state_dict(state_dict_list, load_optimizer_states, *args, **kwargs)
        self.scape.load_state_dict(mine["scape"], self.fp32_partitioned_groups_flat[0].device)


def _set_full(p, full: torch.Tensor) -> None:
    """Write ``p``'s full new value into its copy."""
    if p.ds_status == ZeroParamStatus.AVAILABLE:
        p.data.copy_(full)
    else:  # released by ZeRO-3 while it traced the first step: as its own all-gather does
        p.data = full.clone()
        p.ds_status = ZeroParamStatus.AVAILABLE


def _write_values(p, pos: torch.Tensor, values: torch.Tensor) -> None:
    """Write a sparse step's new values into ``p``'s full copy; a parameter ZeRO-3 released (it does so
    while it retraces) is fetched from the up-to-date partitions at its next use instead."""
    if p.ds_status == ZeroParamStatus.AVAILABLE:
        p.data.view(-1)[pos] = values


def zero3_layout(zopt: DeepSpeedZeroOptimizer_Stage3) -> Zero3Layout:
    """The ZeRO-3 layout of ``zopt`` (SCAPE's or DeepSpeed's own), for re-sharding a checkpoint
    saved on another data-parallel size (:func:`scape_ds.checkpoint.reshard.reshard_zero3_state`)."""
    flat = [p for group in zopt.fp16_groups for p in group]
    place = {id(p): i for i, p in enumerate(flat)}
    return Zero3Layout(numels=tuple(int(p.ds_numel) for p in flat),
                       sub_groups=tuple(len(group) for group in zopt.fp16_groups),
                       param_group_of=tuple(int(zopt.sub_group_to_group_id[i]) for i in range(len(zopt.fp16_groups))),
                       ds_order=tuple(place[id(p)] for p in sorted(flat, key=lambda p: p.ds_id)))


def scape_stage3_class(scape_cfg: ScapeConfig) -> type[ScapeStage3]:
    """The :class:`ScapeStage3` subclass running SCAPE with ``scape_cfg``, after checking that the
    installed DeepSpeed still has the private names it overrides."""
    check_deepspeed_internals()
    return type("ScapeStage3", (ScapeStage3,), {"scape_config": scape_cfg})
