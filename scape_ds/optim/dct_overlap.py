"""``scape.overlap`` with ``basis "dct"``: the exchange of the sent coefficients under the next forward
(docs/design.md, "Overlap").

Without overlap the DCT step (:func:`~scape_ds.exchange.coefficients.exchange_dct`) transforms the gradient,
takes each rank's top coefficients, all-gathers them, sums, decodes and moves every parameter, all
inside ``optimizer.step()``. Nothing of it can start in backward as ds_configs/scape_dct.json runs it:
``clip_local`` scales the local gradient by the norm of all of it, known only when backward ends,
before any of it may enter error feedback. What can move is the other half: the update is applied
alike on every rank from the all-gathered values (there is no owner and no all-gather of new
values), so each weight needs only its own coefficients before the next forward uses it.

1. :func:`plan_dct_buckets` cuts the sparse weights, in forward order, into buckets of whole weights
   of at most ``bucket_mb`` (a larger weight a bucket of its own); a bucket is a range of the flat
   parameter buffer and the range of the coefficient buffer its tiles fill (the last bucket keeps the
   padding of both).
2. ``step()`` (after ``clip_local`` and the dense tensors' all-reduce) runs, bucket after bucket,
   steps 1-3 of the DCT exchange on the bucket's weights (``e = decay e + Q g``, this rank's top-kc of
   each tile taken out of ``e``) and starts the two all-gathers of its values and offsets,
   asynchronously; the later buckets' transforms run while the earlier ones are on the wire. Then it
   updates the dense tensors.
3. A forward pre-hook on every module holding sparse weights waits for its buckets; then, under
   ``no_grad``, the bucket's received values are summed in rank order, divided by D, decoded into a
   temporary of the bucket's size and applied (``dct_update`` "sign", "rms" or "signum") with the
   learning rate and weight decay of the step that sent them, outside any autocast the forward runs
   under. ``step()``, ``synchronize()``, saves
   and loads wait for what no forward waited for; without an attached model ``step()`` waits itself.

Every weight's arithmetic is the non-overlapped step's, weight by weight and in the same order (the
transform, the top-k per tile, the rank-ordered sum, the decode, the update are all per element or
per tile), so parameters and error feedback are bitwise those of the non-overlapped path (tested);
bytes are the same (the all-gathers of a bucket carry its part of the values and offsets).
``gradient_clipping`` is refused with it: its factor needs the norm of the whole decoded mean, known
only after every bucket has arrived, and the dense tensors' update (in ``step()``) would wait for it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import all_gather_int16_async
from ..exchange.basis import TileLayout, from_coefficients, to_coefficients
from ..exchange.coefficients import add_per_rank, pick_per_rank
from ..exchange.core import ValuesInFlight
from .dct_step import apply_update

__all__ = ["DctBucket", "plan_dct_buckets", "DctOverlap"]


@dataclass(frozen=True)
class DctBucket:
    """Whole weights ``weights`` (indices of the group's sparse tensors): the flat range [lo, hi) of
    the parameter buffer and the range [coef_lo, coef_hi) of the coefficient buffer they occupy."""

    weights: range
    lo: int
    hi: int
    coef_lo: int
    coef_hi: int


def plan_dct_buckets(tiles: TileLayout, numels: tuple[int, ...], padded_numel: int,
                     bucket_numel: int) -> list[DctBucket]:
    """The buckets of a DCT-basis group in forward order (the start of the buffer first).

    Args:
        tiles: the group's tile layout.
        numels: each sparse tensor's element count (``FlatLayout.numels``).
        padded_numel: N_pad, the flat buffer's length.
        bucket_numel: the most parameter elements per bucket (a larger tensor: a bucket of its own).

    Returns:
        Buckets of whole tensors covering [0, N_pad) and [0, tiles.numel) exactly once.
    """
    buckets, first, size, n = [], 0, 0, len(numels)
    for w in range(n):
        size += numels[w]  # of the weights first..w
        last = w == n - 1
        if last or size + numels[w + 1] > bucket_numel:
            lo, coef_lo = tiles.offsets[first], tiles.coef_offsets[first]
            hi = padded_numel if last else tiles.offsets[w + 1]
            coef_hi = tiles.numel if last else tiles.coef_offsets[w + 1]
            buckets.append(DctBucket(range(first, w + 1), lo, hi, coef_lo, coef_hi))
            first, size = w + 1, 0
    return buckets


class _Both:
    """Two collectives waited for as one (a bucket's values and its offsets)."""

    def __init__(self, *works):
        self.works = works

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class DctOverlap:
    """One param group's exchange in the DCT basis with ``scape.overlap`` (see the module docstring).

    Args:
        opt: the :class:`~scape_ds.optim.ScapeAdamS` that owns it (communicator, kernels, config).
        gs: the group's state (flat buffers, tiles, error feedback in coefficients).
        bucket_numel: the most parameter elements per bucket.
    """

    def __init__(self, opt, gs, bucket_numel: int):
        self.opt, self.gs = opt, gs
        self.buckets = plan_dct_buckets(gs.tiles, gs.layout.numels, gs.layout.padded_numel, bucket_numel)
        self._in_flight = ValuesInFlight()  # bucket -> its two all-gathers, applied when waited for
        self._hooks: list = []
        self.forward_hooked = False
        self.is_boundary = lambda: True  # set by attach_model; nothing here runs in backward

    # ------------------------------------------------------------------ hooks
    def install(self, model: torch.nn.Module | None) -> None:
        """With ``model``, a forward pre-hook on every module holding sparse weights (waiting for their
        buckets) and state_dict/load_state_dict pre-hooks waiting for all."""
        self.forward_hooked = False
        if model is None:
            return
        buckets_of = {id(self.gs.sparse_params[w]): (b,) for b, bucket in enumerate(self.buckets)
                      for w in bucket.weights}
        self._hooks, self.forward_hooked = self._in_flight.hook(model, buckets_of)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self.forward_hooked = [], False

    def check_idle(self, what: str) -> None:
        """Nothing of a step begins in backward here: every call is allowed."""

    # ------------------------------------------------------------------ exchange
    def start(self, group: dict) -> None:
        """The step: steps 1-3 per bucket and its all-gathers started; the update is applied when the
        bucket is waited for, with ``group``'s learning rate and weight decay as they are now."""
        opt, gs, cfg, comm = self.opt, self.gs, self.opt.cfg, self.opt.comm
        C, kc, D = cfg.chunk_size, cfg.k_per_chunk, comm.world_size
        # floats now: a scheduler may change the group (even a tensor lr in place) before the update runs
        lr, wd, beta1 = float(group["lr"]), float(group["weight_decay"]), float(group["betas"][0])
        for b, bucket in enumerate(self.buckets):
            to_coefficients(gs.tiles, gs.flat_grad, gs.error, gs.dct_q, opt._kernels, decay=cfg.ef_decay,
                            weights=bucket.weights)  # e = decay * e + Q g on these weights' tiles
            offsets, values = pick_per_rank(opt._kernels, gs.error[bucket.coef_lo : bucket.coef_hi], C, kc)
            all_values = torch.empty(D * values.numel(), dtype=values.dtype, device=values.device)  # (D k_b,)
            values_work = comm.all_gather_async(all_values, values, "grad_ag")
            all_offsets, offsets_work = all_gather_int16_async(comm, offsets, "index_ag")  # (D k_b,) int16
            work = _Both(values_work, offsets_work)

            def apply(bucket=bucket, all_values=all_values, all_offsets=all_offsets):
                self._apply(bucket, all_values, all_offsets, lr, wd, beta1)

            self._in_flight.start(b, work, apply)
        if not self.forward_hooked:
            self.wait_params()

    def _apply(self, bucket: DctBucket, all_values: torch.Tensor, all_offsets: torch.Tensor, lr: float,
               wd: float, beta1: float) -> None:
        """Sum, decode and apply one bucket's received values (step 4 and the update, on its weights),
        as ``step()`` would: without autograd and outside the forward's autocast (whose lower-precision
        matmuls would change the decode)."""
        gs, cfg, D = self.gs, self.opt.cfg, self.opt.comm.world_size
        with torch.no_grad(), torch.autocast(gs.error.device.type, enabled=False):
            mean = torch.zeros(bucket.coef_hi - bucket.coef_lo, dtype=gs.error.dtype, device=gs.error.device)
            add_per_rank(mean, all_values, all_offsets, D, cfg.chunk_size, cfg.k_per_chunk)
            mean.div_(D)
            u = torch.zeros(bucket.hi - bucket.lo, dtype=gs.flat_grad.dtype, device=gs.flat_grad.device)  # (hi - lo,)
            from_coefficients(gs.tiles, mean, u, gs.dct_q, self.opt._kernels, weights=bucket.weights,
                              coef_base=bucket.coef_lo, out_base=bucket.lo)
            parts = [(gs.layout.offsets[w] - bucket.lo, gs.layout.numels[w]) for w in bucket.weights]
            momentum = None if gs.momentum is None else gs.momentum[bucket.lo : bucket.hi]
            apply_update(cfg.dct_update, gs.flat_param[bucket.lo : bucket.hi], u, momentum, parts, lr, wd, beta1)

    def wait_params(self, buckets=None) -> None:
        """Wait for ``buckets`` (default: all in flight) and apply their updates."""
        self._in_flight.wait(buckets)
