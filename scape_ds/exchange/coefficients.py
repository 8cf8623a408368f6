"""The exchange of ``scape.basis = "dct"``: error feedback, masks and the decoded mean in DCT coefficients.

On data-parallel rank r, per step (docs/design.md, "Transform basis"; :mod:`scape_ds.exchange.basis`
has the tiles):

  1. ``e_r = ef_decay * e_r + Q g_r``: the local gradient's tile coefficients enter the error feedback.
  2. the mask, by default chosen from this step's ``e`` (a mask chosen before the send points at the
     coefficients the last send emptied: 1.34x dense AdamW's loss in the reference harness, 1.27x
     DeMo's at 500 steps here with ``mask_early``):
     - ``mask="per_rank"`` (DeMo, arXiv 2411.19870): rank r's own top-kc ``|e_r|`` of each tile; its
       values and 16-bit in-tile offsets go out in two all-gathers (D k values and offsets received);
     - ``mask="shared"`` (the nominated union): rank r nominates its top max(1, kc // D) of each tile,
       the offsets are all-gathered, and the union of every rank's nominations is the mask for every
       rank; the values travel packed (D * (kc // D) slots per tile, a repeated offset counted once
       and sent as 0) in a reduce-scatter and an all-gather: O(k) per rank whatever D (``value_bits``
       8 or 4: coded per tile in an all-to-all to each tile's owner, which sums them and codes the sum
       for the all-gather).
       ``mask_source="owner"``: the owner of each tile alone chooses its top kc from its own ``e_r``
       and the offsets are all-gathered; then the same reduce-scatter and all-gather of values.
       ``mask_source="momentum"`` (SCAPE's own source, in coefficients): each tile's owner keeps a
       first moment m of the reduced mean coefficients of its tiles (lazy: updated where they were
       sent; every coefficient on the dense steps of ``mask_refresh_interval``) and after each step
       chooses the next step's mask as its top kc of ``|m|`` (one step early), offsets all-gathered.
       ``mask_hold=T``: a shared mask, once chosen, serves T steps (its offsets travel once);
       ``mask_early``: the mask of the next T steps is chosen on the last step of these, from that
       step's ``e`` before its send (SCAPE's delay: the offsets could travel under compute). Both are
       there to be measured (bench/RESULTS.md, "Shared-mask sources"), off by default.
  3. what was sent leaves ``e_r`` (``e_r[mask] = 0``): sent + kept == accumulated, coefficient by
     coefficient.
  4. every rank sums the received values in the same order into a (numel,) coefficient vector, divides
     by D and decodes it tile by tile (``Q^T Y Q``) into u, the same dense tensor on every rank.

The caller moves the parameters by u (:mod:`scape_ds.optim.dct_step`: sign, rms, signum or AdamS),
alike on every rank, so replicas stay bitwise equal without a parameter all-gather. Stage 0/1
(:class:`~scape_ds.optim.ScapeAdamS`, flat or under ``hierarchy "node"``), ZeRO-3
(:mod:`scape_ds.optim.stage3_dct`) and the overlapped exchange (:mod:`scape_ds.optim.dct_overlap`)
all call this one exchange.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm import Communicator, all_gather_int16
from .basis import TileLayout, from_coefficients
from .index_code import code_bytes, decode_offsets, encode_offsets
from .masks import offsets_to_index
from .node import FlatStage, NodeStage
from .quantize import decode_values, encode_values

__all__ = ["HeldMask", "exchange_dct", "decode_dct", "union_slots", "next_mask_from_momentum", "pick_per_rank",
           "add_per_rank", "square_norm_fp64", "all_gather_offsets"]


@dataclass
class HeldMask:
    """A shared mask kept for later steps (``mask_hold`` > 1 or ``mask_early``)."""

    index: torch.Tensor  # (n_chunks * slots,) int64 coefficient indices, chunk-major
    repeated: torch.Tensor | None  # (n_chunks * slots,) bool, slots that repeat an offset (sent as 0)
    uses_left: int  # steps this mask still serves

    def state(self) -> dict:
        return dict(index=self.index.clone(), repeated=None if self.repeated is None else self.repeated.clone(),
                    uses_left=self.uses_left)

    @classmethod
    def from_state(cls, saved: dict, device) -> "HeldMask":
        repeated = saved["repeated"]
        return cls(saved["index"].to(device), None if repeated is None else repeated.to(device), saved["uses_left"])


def union_slots(nominated: torch.Tensor, n_chunks: int, world_size: int, per_rank: int,
                chunk_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The shared mask from every rank's nominations.

    Args:
        nominated: (D * n_chunks * K,) int16 in-chunk offsets, rank-major (the all-gather's output).

    Returns:
        index: (n_chunks, D * K) int64 coefficient indices, chunk-major (slot j of a chunk: rank j // K's
            nomination j % K);
        repeated: (n_chunks, D * K) bool, True where a slot repeats an offset an earlier slot of its
            chunk already holds (sent as 0, so the union's values are counted once).
    """
    local = nominated.view(world_size, n_chunks, per_rank).permute(1, 0, 2).reshape(n_chunks, -1)
    local = local.to(torch.int64).contiguous() & 0xFFFF  # (n_chunks, D K) offsets in 0..C-1
    ordered, order = local.sort(dim=1, stable=True)  # equal offsets: the earliest slot first
    later = torch.zeros_like(local, dtype=torch.bool)
    later[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
    repeated = torch.zeros_like(later).scatter_(1, order, later)  # back to slot order
    base = torch.arange(n_chunks, dtype=torch.int64, device=local.device).unsqueeze(1) * chunk_size
    return local + base, repeated


def pick_per_rank(kernels, error: torch.Tensor, chunk_size: int, k_per_chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``mask="per_rank"``: this rank's top-kc ``|error|`` of each tile of ``error`` (a view of whole
    tiles), taken out of it (``error[mask] = 0``). Returns (k,) int16 in-tile offsets and (k,) values."""
    offsets = kernels.chunk_topk(error, chunk_size, k_per_chunk)  # (n_chunks kc,) int16
    index = offsets_to_index(offsets, chunk_size, k_per_chunk)  # (k,) int64
    values = error.index_select(0, index)  # (k,) fp32: what this rank sends
    error.index_fill_(0, index, 0.0)
    return offsets, values


def add_per_rank(mean: torch.Tensor, all_values: torch.Tensor, all_offsets: torch.Tensor, world_size: int,
                 chunk_size: int, k_per_chunk: int, count: torch.Tensor | None = None) -> None:
    """``mask="per_rank"``: add every rank's sent values (``all_values`` (D k,), ``all_offsets`` (D k,)
    int16, rank-major, of the tiles ``mean`` covers) into ``mean``, in rank order: the same sum on every
    rank (no offset repeats inside one rank's part). ``count`` (like ``mean``; ``decode="senders"``):
    1 added at every coefficient for each rank that sent it."""
    k = all_values.numel() // world_size
    ones = None if count is None else torch.ones(k, dtype=count.dtype, device=count.device)
    for r in range(world_size):
        part = slice(r * k, (r + 1) * k)
        index = offsets_to_index(all_offsets[part], chunk_size, k_per_chunk)
        mean.index_add_(0, index, all_values[part])
        if count is not None:
            count.index_add_(0, index, ones)


def square_norm_fp64(t: torch.Tensor, block: int = 1 << 20) -> torch.Tensor:
    """||t||^2 summed in fp64, a block at a time (no fp64 copy of a whole gradient buffer: N elements,
    8 N bytes and a pass over them), as a 0-d fp64 tensor on ``t``'s device: the caller syncs once."""
    norms = [torch.linalg.vector_norm(part, dtype=torch.float64) for part in t.reshape(-1).split(block)]
    return torch.stack(norms).square().sum()


def _all_gather_decoded(comm: Communicator, payload: torch.Tensor, n: int, k_per_chunk: int, bits: int,
                        dtype: torch.dtype) -> torch.Tensor:
    """All-gather this rank's (L,) uint8 ``payload`` of ``n`` coded values and decode every rank's:
    (D n,) in ``dtype``, rank-major, the same bits on every rank."""
    every = torch.empty(comm.world_size * payload.numel(), dtype=torch.uint8, device=payload.device)  # (D L,)
    comm.all_gather(every, payload, "grad_ag")
    return torch.cat([decode_values(part, n, k_per_chunk, bits) for part in every.view(comm.world_size, -1)]).to(dtype)


def _all_gather_coded(comm: Communicator, error: torch.Tensor, offsets: torch.Tensor, values: torch.Tensor,
                      chunk_size: int, k_per_chunk: int, bits: int) -> torch.Tensor:
    """``value_bits`` < 32: code this rank's (k,) ``values`` per tile, keep what the coding loses in
    ``error`` at their ``offsets`` (emptied by :func:`pick_per_rank`), all-gather the uint8 payloads
    and return every rank's decoded values, (D k,) fp32, the same bits on every rank."""
    payload = encode_values(values, k_per_chunk, bits)  # (L,) uint8
    sent = decode_values(payload, values.numel(), k_per_chunk, bits).to(values.dtype)  # (k,) what every rank adds
    error.index_copy_(0, offsets_to_index(offsets, chunk_size, k_per_chunk), values - sent)
    return _all_gather_decoded(comm, payload, values.numel(), k_per_chunk, bits, values.dtype)


def _reduce_coded(comm: Communicator, error: torch.Tensor, index: torch.Tensor, values: torch.Tensor,
                  slots: int, bits: int) -> torch.Tensor:
    """``value_bits`` 8 or 4 with mask "shared": the sum over ranks of ``values`` ((n_chunks slots,) fp32 at
    the chunk-major ``index``, this rank's part; a repeated slot holds 0), coded per tile. Each rank codes
    each owner's block of tiles and keeps what its coding lost in ``error`` (emptied at ``index``); an
    all-to-all brings every owner the D codes of its block, which it decodes and adds in rank order,
    codes the sum and keeps what that coding lost in its own ``error``; an all-gather of the coded sums
    gives every rank the same (n_chunks slots,) fp32 sums. Sent + kept == accumulated over the ranks
    together: what the sum's coding loses is sent later by its owner."""
    D = comm.world_size
    blocks = values.view(D, -1)  # (D, n_chunks / D * slots): owner r's tiles in row r
    n = blocks.shape[1]
    payload = torch.cat([encode_values(b, slots, bits) for b in blocks])  # (D L,) uint8, owner-major
    L = payload.numel() // D
    sent = torch.cat([decode_values(p, n, slots, bits) for p in payload.view(D, L)]).to(values.dtype)
    error.index_add_(0, index, values - sent)  # a repeated slot adds 0 (a tile of zeros codes to 0)
    received = torch.empty_like(payload)  # (D L,): every rank's codes of this rank's block
    comm.all_to_all(received, payload, "grad_a2a")
    total = torch.zeros(n, dtype=values.dtype, device=values.device)
    for part in received.view(D, L):  # in rank order: the same sum on every owner for the same codes
        total += decode_values(part, n, slots, bits).to(values.dtype)
    coded = encode_values(total, slots, bits)  # (L,) uint8
    mine = index.view(D, -1)[comm.rank]  # (n,) this owner's slots
    error.index_add_(0, mine, total - decode_values(coded, n, slots, bits).to(values.dtype))
    return _all_gather_decoded(comm, coded, n, slots, bits, values.dtype)  # every owner's coded sums


def _owners_choice(comm: Communicator, kernels, chunk_size: int, scores: torch.Tensor, k_per_chunk: int,
                   uses: int, index_code: str = "int16") -> HeldMask:
    """Each owner's top kc of ``|scores|`` ((S,), its own shard of coefficients) per tile, offsets
    all-gathered (:func:`all_gather_offsets`): one shared mask, kc slots per tile."""
    chosen = kernels.chunk_topk(scores, chunk_size, k_per_chunk)  # (S/C kc,) int16
    all_chosen = all_gather_offsets(comm, chosen, chunk_size, k_per_chunk, index_code)  # rank-major, so chunk-major
    return HeldMask(offsets_to_index(all_chosen, chunk_size, k_per_chunk), None, uses)  # (n_chunks kc,) int64


def _choose_shared(comm: Communicator, kernels, tiles: TileLayout, error: torch.Tensor, k_per_chunk: int,
                   mask_source: str, uses: int, index_code: str = "int16") -> HeldMask:
    """The one shared mask from this rank's ``error`` as it is now (its offsets all-gathered, as
    ``index_code`` says)."""
    C, D, n_chunks = tiles.chunk_size, comm.world_size, tiles.n_chunks
    if mask_source == "owner":  # each tile's owner chooses from its own accumulator
        own = error[comm.rank * tiles.shard_numel : (comm.rank + 1) * tiles.shard_numel]  # (S,) view
        return _owners_choice(comm, kernels, C, own, k_per_chunk, uses, index_code)
    K = max(1, k_per_chunk // D)
    nominated = kernels.chunk_topk(error, C, K)  # (n_chunks K,) int16, ascending in each tile
    all_nominated = all_gather_offsets(comm, nominated, C, K, index_code)  # (D n_chunks K,) int16
    index, repeated = union_slots(all_nominated, n_chunks, D, K, C)  # (n_chunks, D K)
    return HeldMask(index.view(-1), repeated.view(-1), uses)  # chunk-major, so shard-major


def next_mask_from_momentum(comm: Communicator, kernels, tiles: TileLayout, momentum: torch.Tensor,
                            mean: torch.Tensor, sent: HeldMask | None, beta: float, k_per_chunk: int) -> HeldMask:
    """``mask_source="momentum"``, after a step: the owner's first moment ``momentum`` ((S,) fp32, its
    shard of coefficients) takes this step's ``mean`` ((numel,), the same on every rank) where it was
    sent (``sent``'s indices; every coefficient when ``sent`` is None, a dense step), and each owner's
    top kc of ``|momentum|`` per tile, all-gathered, is the mask of the next step."""
    S, lo = tiles.shard_numel, comm.rank * tiles.shard_numel
    mine = mean[lo : lo + S]  # (S,) view
    if sent is None:
        momentum.lerp_(mine, 1.0 - beta)
    else:
        local = sent.index[(sent.index >= lo) & (sent.index < lo + S)] - lo  # (slots,) this shard's
        momentum.index_copy_(0, local, torch.lerp(momentum[local], mine[local], 1.0 - beta))
    return _owners_choice(comm, kernels, tiles.chunk_size, momentum, k_per_chunk, 1)


def all_gather_offsets(comm: Communicator, offsets: torch.Tensor, chunk_size: int, k_per_chunk: int,
                       index_code: str = "int16") -> torch.Tensor:
    """All-gather this rank's (k,) int16 in-tile offsets (ascending in each tile) over ``comm``: (D k,)
    int16, rank-major. ``index_code`` "elias_fano": they travel as one fixed-length Elias-Fano code
    per tile (:mod:`scape_ds.exchange.index_code`) in a uint8 all-gather and every rank decodes the
    D codes alike; "int16": as they are."""
    if index_code == "int16":
        return all_gather_int16(comm, offsets, "index_ag")
    code = encode_offsets(offsets, chunk_size, k_per_chunk)  # (n_chunks B,) uint8
    assert code.numel() == code_bytes(offsets.numel() // k_per_chunk, chunk_size, k_per_chunk)
    every = torch.empty(comm.world_size * code.numel(), dtype=torch.uint8, device=code.device)  # (D n_chunks B,)
    comm.all_gather(every, code, "index_ag")
    return decode_offsets(every, chunk_size, k_per_chunk)  # the D codes are D n_chunks tiles' codes


def exchange_dct(comm: Communicator, kernels, tiles: TileLayout, error: torch.Tensor, grad: torch.Tensor,
                 q: torch.Tensor, *, mask: str, k_per_chunk: int, ef_decay: float,
                 mask_source: str = "union", mask_hold: int = 1, mask_early: bool = False,
                 held: HeldMask | None = None, dense: bool = False, node: FlatStage | NodeStage | None = None,
                 value_bits: int = 32, decode: str = "ranks",
                 index_code: str = "int16") -> tuple[torch.Tensor, HeldMask | None]:
    """Steps 1-3 and the sum of step 4 for one param group: takes ``grad`` ((N_pad,), this rank's
    gradient), updates ``error`` ((numel,) fp32) and returns the mean over the ranks of what they sent,
    (numel,) fp32 coefficients, the same bits on every rank (:func:`decode_dct` turns it into u), and the
    shared mask to keep for the next step (None when the next step chooses afresh).

    ``held``: the shared mask kept by the last step (mask "shared" with ``mask_hold`` > 1,
    ``mask_early`` or ``mask_source="momentum"``, which must have one unless ``dense``). ``dense``
    (mask "shared"): every coefficient is sent, as at sparsity 0. Allocates that (numel,) vector (the
    one buffer of the model's size a step needs) and the packed values and offsets (O(D k)).

    ``node`` (hierarchy "node", :class:`~scape_ds.exchange.node.NodeStage`): ``error`` is this rank's
    slice of the coefficients ((numel/G,)); the node sum of the slice's coefficients enters it, ``comm``
    (the cross-node group of M ranks) exchanges the slice, the mean is over all G M ranks, and every
    slice's received values (per_rank) or mean (shared) are gathered over the node into the (numel,)
    mean returned.

    ``value_bits`` 8 or 4 (mask "per_rank"): the values travel coded per tile
    (:mod:`scape_ds.exchange.quantize`); what the coding loses stays in ``error``. 8 or 4 with mask
    "shared": coded per tile, an all-to-all to each tile's owner, which sums and codes the sum for the
    all-gather (:func:`_reduce_coded`); what either coding loses stays in an ``error``. 16 (mask "shared"):
    the slots' values are reduce-scattered and all-gathered as bf16; what rounding this rank's values
    lost stays in ``error`` (the bf16 sums' own rounding is not fed back). ``decode`` "senders"
    (mask "per_rank"): each coefficient's sum is divided by the number of ranks that sent it, not by D.
    ``index_code`` "elias_fano": the offsets (per_rank's, or the shared mask's nominations or owners'
    choices) travel Elias-Fano coded (:func:`all_gather_offsets`); the same offsets arrive, in fewer bytes.
    """
    node = node or FlatStage()
    tiles_all, tiles = tiles, node.coefficient_layout(tiles)  # the whole buffer, and what comm exchanges
    C, D = tiles.chunk_size, comm.world_size
    node.accumulate_coefficients(tiles_all, grad, error, q, kernels, ef_decay)  # e = decay * e + Q g
    mean = torch.zeros(tiles.numel, dtype=error.dtype, device=error.device)  # (numel,) fp32
    keep = count = None  # count: decode "senders", the senders of each coefficient
    if mask == "per_rank":
        offsets, values = pick_per_rank(kernels, error, C, k_per_chunk)  # (k,) int16, (k,) fp32
        if value_bits == 32:
            all_values = torch.empty(D * values.numel(), dtype=values.dtype, device=values.device)  # (D k,)
            comm.all_gather(all_values, values, "grad_ag")
        else:
            all_values = _all_gather_coded(comm, error, offsets, values, C, k_per_chunk, value_bits)  # (D k,)
        all_offsets = all_gather_offsets(comm, offsets, C, k_per_chunk, index_code)  # (D k,) int16
        if node.size > 1:  # every slice's received values gathered in the node: the whole mean from them
            every_values, every_offsets = node.gather_received(all_values, all_offsets)  # (G, D k) each
            whole = torch.zeros(tiles_all.numel, dtype=error.dtype, device=error.device)  # (numel,)
            count = torch.zeros_like(whole) if decode == "senders" else None  # (numel,) senders per coefficient
            for sl, (v, o) in enumerate(zip(every_values, every_offsets)):
                part = slice(sl * tiles.numel, (sl + 1) * tiles.numel)
                add_per_rank(whole[part], v, o, D, C, k_per_chunk, None if count is None else count[part])
            return _divide(whole, count, D, node.size), None
        if decode == "senders":
            count = torch.zeros_like(mean)  # (numel,) how many ranks sent each coefficient
        add_per_rank(mean, all_values, all_offsets, D, C, k_per_chunk, count)
    elif mask == "shared":
        if k_per_chunk == C or dense:  # every coefficient (sparsity 0, a dense step): no offsets travel
            index = torch.arange(tiles.numel, device=error.device)  # (numel,) int64
            values = error.clone()  # (numel,)
        else:
            fresh = held is None or held.uses_left <= 0
            if fresh and mask_source == "momentum":
                raise RuntimeError("mask_source 'momentum': a sparse step without the mask chosen after the "
                                   "last one")
            choose = (comm, kernels, tiles, error, k_per_chunk, mask_source, mask_hold, index_code)
            now = _choose_shared(*choose) if fresh else held
            if mask_early and now.uses_left == 1:  # the next mask, from e before this step's send
                keep = (HeldMask(now.index, now.repeated, mask_hold) if fresh  # chosen from this same e
                        else _choose_shared(*choose))
            now.uses_left -= 1
            if keep is None and now.uses_left > 0:
                keep = now
            index = now.index  # (n_chunks slots,) int64
            values = error.index_select(0, index)  # (n_chunks slots,)
            if now.repeated is not None:
                values.masked_fill_(now.repeated, 0.0)
        error.index_fill_(0, index, 0.0)
        if value_bits in (8, 4):  # coded per tile, summed at each tile's owner
            if tiles.n_chunks % D:
                raise ValueError(f"value_bits {value_bits} with mask 'shared' needs whole tiles per owner: "
                                 f"{tiles.n_chunks} tiles over {D} ranks")
            values = _reduce_coded(comm, error, index, values, values.numel() // tiles.n_chunks, value_bits)
        else:
            if value_bits == 16:  # bf16 on the wire: this rank keeps what rounding its values lost
                wire = values.to(torch.bfloat16)  # (slots,)
                error.index_add_(0, index, values - wire.to(values.dtype))  # a repeated slot adds 0
                values = wire
            owned = torch.empty(values.numel() // D, dtype=values.dtype, device=values.device)  # this shard's slots
            comm.reduce_scatter(owned, values, "grad_rs")
            comm.all_gather(values, owned, "grad_ag")  # every shard's sums, the same bits on every rank
        mean.index_add_(0, index, values.to(mean.dtype))  # a repeated slot adds 0
    else:
        raise ValueError(f"scape.mask must be 'per_rank' or 'shared', got {mask!r}")
    return node.gather_coefficients(_divide(mean, count, D, node.size)), keep


def _divide(total: torch.Tensor, count: torch.Tensor | None, world: int, node_size: int) -> torch.Tensor:
    """The mean of ``total`` (sums over ``world`` senders of node sums of ``node_size`` ranks) in place:
    / (``world`` ``node_size``) (decode "ranks", ``count`` None), or / (each coefficient's senders x
    ``node_size``) (decode "senders"; a coefficient nobody sent is 0 and stays 0)."""
    if count is None:
        return total.div_(world * node_size)
    return total.div_(count.clamp_(min=1).mul_(node_size))


def decode_dct(tiles: TileLayout, coef: torch.Tensor, out: torch.Tensor, q: torch.Tensor, kernels) -> torch.Tensor:
    """Step 4's decode: ``coef`` ((numel,) coefficients) to parameter space, written into ``out``
    ((N_pad,), e.g. the consumed gradient buffer) and returned."""
    from_coefficients(tiles, coef, out, q, kernels)
    return out
