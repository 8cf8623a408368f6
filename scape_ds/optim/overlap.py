"""The bucketed exchange of ``scape.overlap``: gradients sent during backward, new values received
during the next forward (docs/design.md, "Overlap").

Path A's non-overlapped step moves every byte inside ``optimizer.step()``: one packed reduce-scatter
after backward, one all-gather of new values before the next forward. The mask of a step is known
one step early, so nothing stops a bucket of gradients from being packed and sent while backward is
still producing the rest. The reduce-scatter then becomes one reduce per bucket, to the bucket's
owner, and the all-gather one broadcast per bucket, from it:

1. :func:`plan_buckets` cuts the flat buffer [0, N_pad) into buckets of at most ``bucket_mb``,
   whole chunks each, never crossing an owner's shard, listed from the end of the buffer (the
   order in which autograd produces gradients: the last layers first).
2. A post-accumulate-grad hook on every sparse parameter counts the parameters of each bucket that
   are ready, on the micro-batch that ends the accumulation. When a bucket is complete it is
   packed at the mask with its error feedback (``ef_accumulate_pack`` on its slice; a dense step
   forms ``a = e + g`` on its slice) and reduced, asynchronously, to its owner. Buckets start in the
   planned order only, so every rank issues the same collectives in the same order whatever order
   its hooks fire in; a bucket whose parameter got no gradient starts in ``step()``.
3. ``step()`` waits for the reduces (the owner then holds the sum of its shard at the mask, where
   the reduce-scatter would have put it), clips and updates as before, and starts one asynchronous
   broadcast of new values per bucket, in forward order.
4. A forward pre-hook on every module with sparse parameters waits for the broadcasts of the
   buckets holding its own parameters (and scatters their values into the flat buffer). Without a
   model to hook (:meth:`ScapeAdamS.attach_model` not called), ``step()`` waits for them itself.

Bytes: a reduce costs each non-owner its part once, a broadcast costs the owner its part once per
receiver; summed over the owners' buckets that is exactly the reduce-scatter's and the all-gather's
count. Parameters: the update is the same arithmetic on the same sums; at D = 2 a sum of two terms
does not depend on the algorithm, so the result is bitwise that of the non-overlapped path.
Memory: one (K,) packed buffer and one (K,) buffer of new values per group, as the non-overlapped
step allocates; a dense step sends from the error-feedback or gradient buffer in place (with fp32
error feedback and a bf16 wire, a rounded copy per bucket, N_pad in all, as the non-overlapped
step's one copy). What changes the gradients between backward and ``step()`` (``clip_grad_norm_``,
a ``GradScaler``'s unscale) is not seen: they left during backward.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..exchange.core import ValuesInFlight
from ..exchange.layout import FlatLayout

__all__ = ["Bucket", "plan_buckets", "OverlapExchange"]


@dataclass(frozen=True)
class Bucket:
    """A range [lo, hi) of the flat buffer, whole chunks, inside the shard of ``owner``.

    Attributes:
        owner: the data-parallel rank whose shard holds the range (the reduce's root).
        lo, hi: flat offsets, multiples of the chunk size.
        params: indices of the sparse parameters that overlap the range.
    """

    owner: int
    lo: int
    hi: int
    params: tuple[int, ...]

    def packed(self, chunk_size: int, k_per_chunk: int) -> slice:
        """The bucket's slice of the packed (K,) values: its chunks' kc values each (chunk-major)."""
        return slice(self.lo // chunk_size * k_per_chunk, self.hi // chunk_size * k_per_chunk)


def plan_buckets(layout: FlatLayout, bucket_numel: int) -> list[Bucket]:
    """The buckets of a flat layout, from the end of the buffer to its start (backward's order).

    Args:
        layout: the group's flat layout (D shards of S elements, chunks of C).
        bucket_numel: the most elements per bucket; rounded down to whole chunks (at least one).

    Returns:
        Buckets that cover [0, N_pad) exactly once, each inside one shard.
    """
    C, S = layout.chunk_size, layout.shard_numel
    per = max(C, bucket_numel // C * C)
    spans = [(off, off + n) for off, n in zip(layout.offsets, layout.numels)]
    buckets = []
    for owner in reversed(range(layout.world_size)):
        lo_shard, hi = owner * S, (owner + 1) * S
        while hi > lo_shard:
            lo = max(lo_shard, hi - per)
            params = tuple(i for i, (a, b) in enumerate(spans) if a < hi and b > lo)
            buckets.append(Bucket(owner, lo, hi, params))
            hi = lo
    return buckets


class OverlapExchange:
    """One param group's bucketed exchange on path A (see the module docstring).

    Args:
        opt: the :class:`~scape_ds.optim.ScapeAdamS` that owns it (its communicator, kernels,
            config, schedule and ``_attach_grads``).
        gs: the group's state (flat buffers, mask, error feedback).
        bucket_numel: the most elements per bucket.
    """

    def __init__(self, opt, gs, bucket_numel: int):
        self.opt, self.gs = opt, gs
        self.buckets = plan_buckets(gs.layout, bucket_numel)
        self._buckets_of = [[] for _ in gs.sparse_params]  # parameter -> the buckets it overlaps
        for b, bucket in enumerate(self.buckets):
            for i in bucket.params:
                self._buckets_of[i].append(b)
        self._hooks: list = []
        self.forward_hooked = False  # a module's forward waits for its buckets (else step() waits)
        # internal state of the step being exchanged
        self.dense: bool | None = None  # the kind of the exchange under way (None: none begun)
        self._missing: list[int] = []  # per bucket: parameters whose gradient has not arrived
        self._arrived: list[bool] = []  # per parameter: its gradient has arrived in this exchange
        self._cursor = 0  # the next bucket to start
        self._grad_works: list = []  # per started bucket: the reduce in flight
        self._waited = 0  # the reduces of _grad_works[:_waited] are done (waited for to bound those in flight)
        self.most_in_flight = 0  # statistics: the most reduces started and not yet waited for, this exchange
        self._sends: list[tuple[torch.Tensor, bool]] = []  # dense step: what each bucket sent, and whether
        # that was its slice of the error feedback (emptied once the reduce is done)
        self._packed: torch.Tensor | None = None  # (K,) sparse step: packed values, reduced in place
        self._index: list[torch.Tensor] = []  # per bucket: its mask's offsets inside [lo, hi), int64
        self._index_for: torch.Tensor | None = None  # the mask ``_index`` was cut from
        self.values: torch.Tensor | None = None  # (K,) sparse step: every shard's new values
        self._in_flight = ValuesInFlight()  # bucket -> its broadcast of new values
        self.is_boundary: Callable[[], bool] = lambda: True  # the micro-batch that ends the accumulation
        # statistics
        self.started_in_backward = 0  # buckets of the last exchange started by backward's hooks

    # ------------------------------------------------------------------ hooks
    def install(self, model: torch.nn.Module | None) -> None:
        """Hook every sparse parameter's gradient, and with ``model`` every module's forward."""
        for i, p in enumerate(self.gs.sparse_params):
            self._hooks.append(p.register_post_accumulate_grad_hook(lambda p, i=i: self._on_grad(i)))
        self.forward_hooked = False
        if model is None:
            return
        buckets_of = {id(p): self._buckets_of[i] for i, p in enumerate(self.gs.sparse_params)}
        handles, self.forward_hooked = self._in_flight.hook(model, buckets_of)
        self._hooks += handles

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self.forward_hooked = [], False

    def _on_grad(self, i: int) -> None:
        if not self.is_boundary():
            return
        p, view = self.gs.sparse_params[i], self.gs.grad_views[i]
        if p.grad is not None and p.grad.data_ptr() != view.data_ptr():  # someone replaced .grad
            view.copy_(p.grad)
            p.grad = view
            self.opt.grad_copies += 1
        if self.dense is None:
            self.begin(self.opt.next_step_dense())
        if self._arrived[i]:  # its buckets may be on the wire already: this gradient would be lost
            raise RuntimeError(f"scape.overlap: sparse parameter {i} of its param group got a second gradient in "
                               f"the backward that ends the accumulation, after its bucket was sent; run one "
                               f"backward per micro-batch (engine.is_gradient_accumulation_boundary decides), or "
                               f"set overlap false")
        self._arrived[i] = True
        for b in self._buckets_of[i]:
            self._missing[b] -= 1
        self.opt.start_ready_buckets()

    # ------------------------------------------------------------------ gradients
    def begin(self, dense: bool) -> None:
        """Begin the exchange of the coming step: its kind, and for a sparse step its mask."""
        opt, gs = self.opt, self.gs
        self.dense = dense
        self._missing = [len(b.params) for b in self.buckets]
        self._arrived = [False] * len(self.gs.sparse_params)
        self._cursor, self._grad_works, self._sends, self._waited, self.most_in_flight = 0, [], [], 0, 0
        if not self.dense:
            gs.pending.wait()  # the mask chosen at the last refresh
            if self._index_for is not gs.active_index:
                C, kc = opt.cfg.chunk_size, opt.cfg.k_per_chunk
                self._index = [gs.active_index[b.packed(C, kc)] - b.lo for b in self.buckets]  # int64 each
                self._index_for = gs.active_index
            self._packed = torch.empty(gs.active_index.numel(), dtype=gs.flat_param.dtype,
                                       device=gs.flat_param.device)  # (K,) wire dtype

    def start_ready(self) -> bool:
        """Start the complete buckets, in the planned order; True once every bucket has started."""
        if self.dense is None:
            return False
        while self._cursor < len(self.buckets) and self._missing[self._cursor] <= 0:
            self._start(self._cursor)
            self._cursor += 1
        return self._cursor == len(self.buckets)

    def complete(self, dense: bool) -> None:
        """The step is here: treat every bucket as complete (a parameter without a gradient, or none
        hooked yet, as on the first step), copying in gradients that are not views of the buffer."""
        if self.dense is None:
            self.begin(dense)
        assert self.dense == dense, "the exchange began for another kind of step"
        self.started_in_backward = self._cursor
        self.opt._attach_grads(self.gs)
        self._missing = [0] * len(self.buckets)

    def _start(self, b: int) -> None:
        """Pack bucket ``b`` and start its reduce to the owner (first waiting for the oldest reduce when
        ``buckets_in_flight`` are on the wire)."""
        bucket, gs, comm = self.buckets[b], self.gs, self.opt.comm
        limit = self.opt.cfg.buckets_in_flight
        if limit and len(self._grad_works) - self._waited >= limit:
            self._grad_works[self._waited].wait()
            self._waited += 1
        grad = gs.grad_slice[bucket.lo : bucket.hi]  # view
        error = None if gs.error is None else gs.error[bucket.lo : bucket.hi]  # view
        from_error = False  # the send is this bucket's slice of the error feedback, emptied after the step
        if not self.dense:
            send = self._packed[bucket.packed(self.opt.cfg.chunk_size, self.opt.cfg.k_per_chunk)]  # view
            self.opt._kernels.ef_accumulate_pack(error, grad, self._index[b], send)
        elif error is None:  # compressor "dense": the gradient as it is, reduced in place
            send = grad
        elif error.dtype == grad.dtype:  # a = e + g formed in the error buffer, emptied after the step
            send, from_error = error.add_(grad), True
        elif error.itemsize < grad.itemsize:  # bf16 error, fp32 wire: a formed in the gradient buffer
            send = grad.add_(error)
            error.zero_()
        else:  # fp32 error, bf16 wire: a rounded to the wire; the rounding residual stays
            error.add_(grad)
            send = error.to(grad.dtype)  # (hi - lo,) the only copy of this case
            error.sub_(send)
        self._sends.append((send, from_error))
        self._grad_works.append(comm.reduce_async(send, bucket.owner, "grad_rs"))
        self.most_in_flight = max(self.most_in_flight, len(self._grad_works) - self._waited)

    def wait_grads(self) -> torch.Tensor:
        """Wait for every reduce (all started: :meth:`complete`, then the optimizer's
        ``start_ready_buckets``). Returns this rank's reduced shard: (k,) the sum at its mask on a
        sparse step, or (S,) the sum of the whole shard on a dense step (in the gradient buffer)."""
        opt, gs = self.opt, self.gs
        assert self._cursor == len(self.buckets), "a bucket was not started"
        for work in self._grad_works[self._waited :]:
            work.wait()
        r, D = opt.comm.rank, opt.comm.world_size
        if not self.dense:
            k = self._packed.numel() // D
            return self._packed[r * k : (r + 1) * k]  # (k,) the sum over ranks at this shard's mask
        for bucket, (send, is_error) in zip(self.buckets, self._sends):
            grad = gs.grad_slice[bucket.lo : bucket.hi]
            if bucket.owner == r and send.data_ptr() != grad.data_ptr():
                grad.copy_(send)  # the owner's sum, where the non-overlapped step puts it
            if is_error:
                send.zero_()  # everything was sent
        return gs.grad_slice[gs.layout.shard_slice(r)]  # (S,)

    def check_idle(self, what: str) -> None:
        """Refuse ``what`` while this step's exchange has begun in backward (buckets may be on the wire,
        error feedback already holds this step's gradient): ``step()`` must come first."""
        if self.dense is not None:
            raise RuntimeError(f"scape.overlap: {what} between the backward that ends the accumulation and "
                               f"step(): that backward has started sending its buckets; call step() first")

    def end_grads(self) -> None:
        """The step has consumed the reduced gradients: the next backward begins a new exchange."""
        self.dense, self._grad_works, self._sends, self._packed, self._waited = None, [], [], None, 0

    # ------------------------------------------------------------------ parameters
    def new_values(self) -> torch.Tensor:
        """Sparse step: this rank's (k,) part of the (K,) buffer of new values, for the update to fill."""
        gs, D, r = self.gs, self.opt.comm.world_size, self.opt.comm.rank
        self.values = torch.empty(gs.active_index.numel(), dtype=gs.flat_param.dtype, device=gs.flat_param.device)
        k = self.values.numel() // D
        return self.values[r * k : (r + 1) * k]

    def start_params(self, dense: bool) -> None:
        """Start one broadcast of new values per bucket from its owner, in forward order (the start of
        the buffer first); a dense step sends the owner's slice of the flat parameters in place."""
        gs, comm, kern = self.gs, self.opt.comm, self.opt._kernels
        C, kc = self.opt.cfg.chunk_size, self.opt.cfg.k_per_chunk
        for b in reversed(range(len(self.buckets))):
            bucket = self.buckets[b]
            if dense:
                self._in_flight.start(b, comm.broadcast_async(gs.flat_param[bucket.lo : bucket.hi], bucket.owner,
                                                                "param_ag"))
            else:
                part = bucket.packed(C, kc)
                values, index = self.values[part], gs.active_index[part]

                def scatter(values=values, index=index):
                    kern.scatter_values(gs.flat_param, index, values)

                self._in_flight.start(b, comm.broadcast_async(values, bucket.owner, "param_ag"), scatter)
        if not self.forward_hooked:
            self.wait_params()

    def wait_params(self, buckets=None) -> None:
        """Wait for the broadcasts of ``buckets`` (default: all) and write their values in place."""
        self._in_flight.wait(buckets)
        if not self._in_flight:
            self.values = None
