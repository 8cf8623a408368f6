"""Path B: SCAPE under DeepSpeed ZeRO stage 3 (docs/design.md, Path B).

:func:`scape_stage3_class` returns a subclass of DeepSpeed's ``DeepSpeedZeroOptimizer_Stage3``
that ``scape_ds.initialize`` has the engine build in place of its own (the engine looks the class
up in ``deepspeed.runtime.zero.stage3`` when it creates the optimizer). It changes three things:

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
   reduces every micro-batch; each adds to ``E``).
2. **Masks from the momentum, one step early**: after a refresh step the owner of each piece
   takes the top-``k_p`` of ``|m|`` over its piece of the flat fp32 partition that the optimizer
   sees, and an asynchronous all-gather sends every rank's masks while the next forward runs;
   the next reduce waits for it.
3. **The optimizer on the flat fp32 partitions** (:class:`Stage3AdamS`) applies AdamS at the
   mask only on sparse steps, everywhere on dense ones.

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

import inspect
import math
import re
import sys

import torch
import torch.distributed as dist

from .comm import TorchCommunicator, collective_bytes
from .config import ScapeConfig, offload_enabled
from .kernels import get_kernels
from .optim.adams import adams, check_adams_hyperparameters
from .optim.scape import is_refresh_step

__all__ = ["Stage3AdamS", "scape_stage3_class", "check_stage3_config", "check_deepspeed_internals",
           "replica_zero_config"]

_PRIVATE = "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"
_NEEDED = ("grad_position", "fp32_partitioned_groups_flat", "fp16_groups", "get_param_id",
           "_get_param_partition_group", "gradient_accumulation_dtype", "dp_process_group", "overflow",
           "persistent_parameters", "_post_step", "_partition_all_parameters", "communication_data_type")


def check_deepspeed_internals() -> None:
    """Fail with the DeepSpeed version and what is missing if the private stage-3 names moved."""
    import deepspeed
    from deepspeed.runtime.zero import stage3

    cls = stage3.DeepSpeedZeroOptimizer_Stage3
    missing = []
    src = inspect.getsource(cls)
    if getattr(cls, _PRIVATE, None) is None:
        missing.append(f"{cls.__name__}.__avg_scatter_grads")
    elif not re.search(r"def __avg_scatter_grads\(self,\s*params_to_reduce[^,]*,\s*communication_data_type", src):
        # decorated: read the source
        missing.append("__avg_scatter_grads(self, params_to_reduce, communication_data_type)")
    for name in _NEEDED:
        if f"self.{name}" not in src and f"def {name}" not in src:
            missing.append(f"{cls.__name__}.{name}")
    if missing:
        raise RuntimeError(f"scape_ds's ZeRO-3 path does not support DeepSpeed {deepspeed.__version__}: "
                           f"missing {', '.join(missing)} (written against 0.19.8)")


def check_stage3_config(cfg: dict) -> None:
    """Refuse, with a message, stage-3 settings the SCAPE stage 3 does not run."""
    zero = cfg.get("zero_optimization") or {}
    refused = [
        (zero.get("reduce_scatter", True) is False, "zero_optimization.reduce_scatter false"),
        (bool(zero.get("zero_quantized_gradients")), "zero_optimization.zero_quantized_gradients"),
        (bool(zero.get("zero_quantized_weights")), "zero_optimization.zero_quantized_weights"),
        (int(zero.get("zero_hpz_partition_size", 1) or 1) > 1, "zero_optimization.zero_hpz_partition_size > 1"),
        (offload_enabled(zero.get("offload_optimizer")), "zero_optimization.offload_optimizer"),
        (offload_enabled(zero.get("offload_param")), "zero_optimization.offload_param"),
        (float(cfg.get("gradient_predivide_factor", 1.0)) != 1.0, "gradient_predivide_factor != 1"),
        (cfg.get("prescale_gradients", False) is True, "prescale_gradients"),
        ((cfg.get("fp16") or {}).get("enabled", False), "fp16 (dynamic loss scaling with error feedback)"),
        ((cfg.get("torch_autocast") or {}).get("enabled", False), "torch_autocast"),
    ]
    bad = [what for cond, what in refused if cond]
    if bad:
        raise ValueError(f"ScapeAdamS under ZeRO stage 3 does not support {', '.join(bad)}: remove "
                         f"{'it' if len(bad) == 1 else 'them'} "
                         "(SCAPE would otherwise run dense or reduce the wrong values)")


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
    at the next dense step.
    """

    def __init__(self, params, lr: float = 3e-4, betas=(0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.1,
                 bias_correction: bool = True):
        betas = tuple(betas)
        check_adams_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction))
        self.active: dict[int, torch.Tensor] = {}

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
                index = self.active.get(id(p))
                if index is None:
                    last = state.pop("last_index", None)
                    if last is not None and state["decay_debt"] != 1.0:
                        # lazy weight decay, as on path A: coordinates outside the last mask missed it
                        kept = p[last]
                        p.mul_(state["decay_debt"])
                        p[last] = kept
                    state["decay_debt"] = 1.0
                    adams([p], [p.grad], [m], step=t, bias_correction=group["bias_correction"], **hyper)
                else:
                    c = 1.0 - beta1**t if group["bias_correction"] else 1.0
                    out = torch.empty(index.numel(), dtype=p.dtype, device=p.device)
                    get_kernels(p.device).masked_adams_update(p, m, index, p.grad[index], out, bias_correction=c,
                                                              **hyper)
                    state["decay_debt"] *= 1.0 - group["lr"] * group["weight_decay"]
                    state["last_index"] = index
        return None


def scape_stage3_class(scape_cfg: ScapeConfig):
    """The ``DeepSpeedZeroOptimizer_Stage3`` subclass running SCAPE with ``scape_cfg``."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    check_deepspeed_internals()

    class ScapeStage3(DeepSpeedZeroOptimizer_Stage3):
        """ZeRO-3 with SCAPE's sparse, error-compensated gradient reduce-scatter (see the module docstring)."""

        cfg = scape_cfg
        scape_stage3 = True

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # another optimizer (DeepSpeed's own tests install this class under theirs) is only
            # exact at sparsity 0: every step is then SCAPE's dense exchange, with no masks to apply
            self.masked = isinstance(self.optimizer, Stage3AdamS)
            if not self.masked and self.cfg.sparsity > 0.0:
                raise ValueError(f"the SCAPE stage 3 steps Stage3AdamS at sparsity > 0, got "
                                 f"{type(self.optimizer).__name__}")
            group = self.dp_process_group
            self.comm = TorchCommunicator(group)
            self.D, self.r = self.comm.world_size, self.comm.rank
            self.scape_step = 0  # completed optimizer steps
            self.error: dict[int, torch.Tensor] = {}  # ds_id -> (D*P,) fp32 error feedback
            self.masks: dict[int, torch.Tensor] = {}  # ds_id -> (D, k_p) int64 offsets within each piece
            self._pending = None  # (work, (D * sum k,) int32 gathered masks, [(ds_id, k_p)])
            self._flat_index = None  # id(flat fp32 partition) -> this rank's mask in it, built once per mask
            self._params = sorted((p for g in self.fp16_groups for p in g), key=lambda p: p.ds_id)
            self.comm_stats: dict = {}
            # dense ZeRO-3 reduces in its communication dtype; SCAPE always sends fp32 (its error-feedback dtype)
            comm_size = torch.empty(0, dtype=self.communication_data_type).element_size()
            self._dense_rs = sum(collective_bytes("reduce_scatter", self.D * self._piece(p) * comm_size, self.D)
                                 for p in self._params)
            self.replica = self.cfg.param_exchange == "sparse_replica"
            self._dense_ag = 0  # a dense all-gather of the compute-dtype parameters (sparse_replica's dense step)
            self._replica_index = None  # [(flat positions in p, valid)] per parameter, built once per mask
            self._step_dense = True
            self._in_step = False
            if self.replica:
                partial = [p.ds_id for p in self._params if not getattr(p, "ds_persist", False)]
                if partial:
                    raise ValueError(f"param_exchange 'sparse_replica' needs every parameter persistent; "
                                     f"{len(partial)} are not (build the engine through scape_ds.initialize)")
                self._dense_ag = sum(collective_bytes("all_gather", self._piece(p) * p.ds_tensor.element_size(), self.D)
                                     for p in self._params)  # each rank's piece in, D pieces out

        # -------------------------------------------------------------- schedule
        def _piece(self, p) -> int:
            return math.ceil(p.ds_numel / self.D)

        def _k(self, p) -> int:
            return max(1, math.ceil((1.0 - self.cfg.sparsity) * self._piece(p)))

        def _is_refresh(self, t: int) -> bool:
            return is_refresh_step(t, self.cfg.mask_refresh_interval)

        def _is_dense(self, t: int) -> bool:
            return t == 1 or not self.masked or not self.masks or (self.cfg.dense_refresh and self._is_refresh(t))

        # -------------------------------------------------------------- gradient exchange
        def _DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads(self, params_to_reduce, communication_data_type):
            D, r = self.D, self.r
            self._wait_masks()
            dense = self._is_dense(self.scape_step + 1)
            accs, pieces = [], []
            for p in params_to_reduce:
                P = self._piece(p)
                assert p.partition_numel() == P, (p.partition_numel(), P)
                err = self.error.get(p.ds_id)
                if err is None:
                    err = self.error[p.ds_id] = torch.zeros(D * P, dtype=torch.float32, device=p.grad.device)
                err[: p.ds_numel].add_(p.grad.reshape(-1).to(torch.float32))  # E += g
                accs.append(err.view(D, P))
                pieces.append(P)
            if dense:
                packed = torch.cat(accs, dim=1).reshape(-1)  # (D * sum P,) rank-major
                for a in accs:
                    a.zero_()
                widths = pieces
            else:
                masks = [self.masks[p.ds_id] for p in params_to_reduce]  # (D, k_p) each
                vals = [a.gather(1, m) for a, m in zip(accs, masks)]  # (D, k_p)
                for a, m in zip(accs, masks):
                    a.scatter_(1, m, 0.0)  # what is sent leaves the error feedback
                packed = torch.cat(vals, dim=1).reshape(-1)  # (D * sum k,)
                widths = [m.shape[1] for m in masks]
            packed.div_(D)  # the mean, pre-divided as DeepSpeed does
            out = torch.empty(packed.numel() // D, dtype=packed.dtype, device=packed.device)
            self.comm.reduce_scatter(out, packed, "grad_rs")
            parts = []
            for i, (p, chunk) in enumerate(zip(params_to_reduce, torch.split(out, widths))):
                P = pieces[i]
                if dense:
                    part = chunk
                else:
                    part = torch.zeros(P, dtype=chunk.dtype, device=chunk.device)
                    part[masks[i][r]] = chunk
                real = max(0, min(P, p.ds_numel - r * P))  # the last piece is padded
                parts.append(part.narrow(0, 0, real).to(self.gradient_accumulation_dtype))
            return parts

        # -------------------------------------------------------------- step and masks
        def step(self, closure=None):
            t = self.scape_step + 1
            self._wait_masks()
            dense = self._is_dense(t)
            if self.masked:
                self.optimizer.active = {} if dense else self._flat_indices()
            self._step_dense = dense
            self._in_step = True
            try:
                super().step(closure)  # its _post_step patches the replica (sparse_replica)
            finally:
                self._in_step = False
            if self.overflow:
                return
            self.scape_step = t
            if self._is_refresh(t) and self.masked:
                self._select_masks()
            by_tag, _ = self.comm.meter.step_bytes()
            # bytes_dense: a dense ZeRO-3 step's gradient reduce-scatter, plus under sparse_replica its
            # parameter all-gather. Under "dense" the all-gather is ZeRO-3's own in both and counted in neither
            self.comm_stats = dict(step=t, dense_step=dense, bytes_sent=sum(by_tag.values()), by_tag=by_tag,
                                   bytes_dense=self._dense_rs + self._dense_ag)

        # -------------------------------------------------------------- parameter exchange (sparse_replica)
        def _partition_all_parameters(self):
            if not (self.replica and self._in_step):
                return super()._partition_all_parameters()
            # ZeRO-3 frees every parameter when a step starts, the persistent ones too, and all-gathers
            # those again in _post_step: the replica stays, and _post_step patches it instead
            for p in self._params:
                p.ds_active_sub_modules.clear()

        def _post_step(self, timer_names):
            if not self.replica:
                return super()._post_step(timer_names)
            persistent = self.persistent_parameters
            self.persistent_parameters = []  # ZeRO-3 would all-gather them densely here
            try:
                super()._post_step(timer_names)
            finally:
                self.persistent_parameters = persistent
            self._patch_replica(self._step_dense)

        def _patch_replica(self, dense: bool) -> None:
            """Bring every rank's full copy up to date from the compute-dtype partitions ZeRO-3 just wrote."""
            D, r, params = self.D, self.r, self._params
            if dense:
                local = torch.cat([p.ds_tensor.reshape(-1) for p in params])  # (sum P,)
                widths = [self._piece(p) for p in params]
            else:
                local = torch.cat([p.ds_tensor.reshape(-1)[self.masks[p.ds_id][r]] for p in params])  # (sum k,)
                widths = [self.masks[p.ds_id].shape[1] for p in params]
            out = torch.empty(D * local.numel(), dtype=local.dtype, device=local.device)
            self.comm.all_gather(out, local, "param_ag")
            rows = torch.split(out.view(D, -1), widths, dim=1)  # (D, width) per parameter
            if dense:
                for p, row in zip(params, rows):
                    full = row.reshape(-1)[: p.ds_numel].view(p.ds_shape)
                    if p.ds_status == ZeroParamStatus.AVAILABLE:
                        p.data.copy_(full)
                    else:  # released by ZeRO-3 while it traced the first step: as its own all-gather does
                        p.data = full.clone()
                        p.ds_status = ZeroParamStatus.AVAILABLE
                return
            for p, row, (pos, valid) in zip(params, rows, self._replica_positions()):
                # a parameter ZeRO-3 released (it does so while it retraces) is fetched from the
                # up-to-date partitions at its next use
                if p.ds_status == ZeroParamStatus.AVAILABLE:
                    p.data.view(-1)[pos] = row.reshape(-1)[valid]

        def _replica_positions(self):
            """Per parameter: where every rank's mask lands in the full tensor, and which mask entries are
            real (not the last piece's padding)."""
            if self._replica_index is None:
                self._replica_index = []
                for p in self._params:
                    m = self.masks[p.ds_id]  # (D, k)
                    flat = (torch.arange(self.D, device=m.device).unsqueeze(1) * self._piece(p) + m).reshape(-1)
                    valid = flat < p.ds_numel
                    self._replica_index.append((flat[valid], valid))
            return self._replica_index

        def _positions(self):
            """(flat tensor, offset in it, param) of every parameter's piece on this rank."""
            for i, group in enumerate(self.fp16_groups):
                flat = self.fp32_partitioned_groups_flat[i]
                for p in group:
                    _, offset, _ = self.grad_position[self.get_param_id(p)]
                    yield flat, int(offset), p

        def _flat_indices(self) -> dict[int, torch.Tensor]:
            if self._flat_index is None:  # the masks changed since the last sparse step
                index: dict[int, list] = {}
                for flat, offset, p in self._positions():
                    index.setdefault(id(flat), []).append(self.masks[p.ds_id][self.r] + offset)
                self._flat_index = {k: torch.cat(v) for k, v in index.items()}
            return self._flat_index

        def _select_masks(self) -> None:
            """Top-k of |momentum| over each of this rank's pieces; start the all-gather."""
            mine = {}
            for flat, offset, p in self._positions():
                m = self.optimizer.state[flat]["momentum"]
                seg = m.narrow(0, offset, self._piece(p)).abs()
                mine[p.ds_id] = torch.topk(seg, self._k(p), sorted=False).indices.sort().values
            order = [(p.ds_id, self._k(p)) for p in self._params]
            local = torch.cat([mine[i] for i, _ in order]).to(torch.int32)  # (sum k,)
            out = torch.empty(local.numel() * self.D, dtype=torch.int32, device=local.device)
            self._pending = (self.comm.all_gather_async(out, local, "mask_ag"), out, order)

        def _wait_masks(self) -> None:
            if self._pending is None:
                return
            work, out, order = self._pending
            work.wait()
            self._pending = None
            rows = out.view(self.D, -1).long()  # (D, sum k)
            for (ds_id, _), cols in zip(order, torch.split(rows, [k for _, k in order], dim=1)):
                self.masks[ds_id] = cols.contiguous()
            self._flat_index = self._replica_index = None

        def memory_bytes(self) -> dict[str, int]:
            """Bytes this rank holds for SCAPE beyond ZeRO-3's own buffers (error feedback, masks, the
            sparse_replica full parameter copy; 0 under "dense", where ZeRO-3 gathers a parameter only
            while a module runs), and ZeRO-3's partitioned state (compute-dtype parameter partitions,
            fp32 partitions, AdamS momentum)."""
            flats = self.fp32_partitioned_groups_flat
            return dict(
                error_feedback=sum(e.numel() * e.element_size() for e in self.error.values()),
                masks=sum(m.numel() * m.element_size() for m in self.masks.values()),
                replica=sum(p.data.numel() * p.data.element_size() for p in self._params) if self.replica else 0,
                param_partitions=sum(p.ds_tensor.numel() * p.ds_tensor.element_size() for p in self._params),
                fp32_partitions=sum(f.numel() * f.element_size() for f in flats),
                momentum=sum(self.optimizer.state[f]["momentum"].numel() * 4 for f in flats
                             if f in self.optimizer.state),
            )

        def synchronize(self) -> None:
            """Wait for the mask all-gather in flight (call before destroying the process group)."""
            self._wait_masks()

        # -------------------------------------------------------------- checkpoints
        def state_dict(self):
            """ZeRO-3's per-rank state (fp32 partitions, momentum) plus the error feedback, masks and step."""
            self._wait_masks()
            sd = super().state_dict()
            # keyed by the parameter's place in ds_id order: ds_ids count up across engines in one process
            order = list(enumerate(self._params))
            sd["scape"] = dict(step=self.scape_step, rank=self.r, world_size=self.D,
                               error={i: self.error[p.ds_id].clone() for i, p in order if p.ds_id in self.error},
                               masks={i: self.masks[p.ds_id].clone() for i, p in order if p.ds_id in self.masks})
            return sd

        def load_state_dict(self, state_dict_list, load_optimizer_states=True, *args, **kwargs):
            mine = state_dict_list[dist.get_rank(group=self.dp_process_group)]
            sc = mine.get("scape") if isinstance(mine, dict) else None
            if sc is None:
                raise ValueError("the checkpoint has no SCAPE ZeRO-3 state (saved by another optimizer)")
            if (sc["world_size"], sc["rank"]) != (self.D, self.r):
                raise ValueError(f"SCAPE ZeRO-3 state of rank {sc['rank']}/{sc['world_size']} cannot load on rank "
                                 f"{self.r}/{self.D}: resume with the same data-parallel size")
            super().load_state_dict(state_dict_list, load_optimizer_states, *args, **kwargs)
            device = self.fp32_partitioned_groups_flat[0].device
            ids = [p.ds_id for p in self._params]
            self.error = {ids[i]: v.to(device) for i, v in sc["error"].items()}
            self.masks = {ids[i]: v.to(device) for i, v in sc["masks"].items()}
            self._flat_index = self._replica_index = None
            self.scape_step = sc["step"]
            self._pending = None

    return ScapeStage3
