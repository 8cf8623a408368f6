"""The ``"scape"`` block of a DeepSpeed JSON config: every setting, documented and validated.

Example (inside a DeepSpeed config)::

    "optimizer": {"type": "ScapeAdamS", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "scape": {"sparsity": 0.99, "mask_refresh_interval": 100}

Invalid values raise ``ValueError`` naming the field, the value and what is allowed.
"""
from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

__all__ = ["ScapeConfig", "parse_scape_config", "zero_stage", "offload_enabled", "basis_mismatch"]


class ScapeConfig(BaseModel):
    """SCAPE settings (docs/design.md, The step). One spelling of each name in JSON, kwargs and logs."""

    # strict: a JSON string or float where a number, integer or bool is documented is an error, not
    # coerced ("0.99", 4096.0, "yes"); an integer is still accepted for a float field (sparsity: 0)
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    compressor: Literal["scape", "topk", "randk", "dense"] = "scape"
    """Who chooses the kept coordinates: ``scape`` from |momentum| at the shard owner; ``topk`` from
    |reduced gradient| on refresh steps (the raw-gradient baseline); ``randk`` a seeded random mask;
    ``dense`` sends everything every step (sharded dense AdamS)."""

    sparsity: float = 0.99
    """Fraction of coordinates *not* sent on a sparse step, in [0, 1). Density rho = 1 - sparsity.
    0.99 (2.5-2.8% of the dense bytes at T=100) is what gives the speed over slow links; in
    bench/RESULTS.md ("Each method at its best learning rate") it reaches 1.40x dense AdamW's
    validation loss at 0.45M parameters and 1.26x at 1.85M, each at its best lr; 0.9 (11-12% of the
    bytes) 1.04x and 1.02x. Learning rate: about 1.3-2x dense AdamW's (scan it)."""

    mask_refresh_interval: int = 100
    """T: a new mask every T steps; with ``dense_refresh`` that step is a dense exchange. 100 from the
    sweep in bench/RESULTS.md: at 0.99 the refreshes are then a third of the bytes (2.8% of dense);
    a shorter T lowers the loss smoothly but at a worse bytes-for-loss rate than a lower ``sparsity``
    (0.9 at T=100 beats 0.99 at T=10 at the same bytes)."""

    chunk_size: int = 4096
    """C: masks keep a fixed kc = round(rho * C) coordinates in every chunk of C elements; a power
    of two in [8, 65536] so offsets fit in 16 bits. On CUDA a chunk up to 16384 is selected by one
    Triton program; larger chunks fall back to the torch kernel (one warning; slower)."""

    dense_refresh: bool = True
    """Refresh steps exchange the whole error-feedback-corrected gradient (flushes all residuals)
    and select the next mask from the fresh momentum. False: sparse refresh with exploration (saves
    under 1% of the dense bytes at 0.99 and was worse at every T measured in bench/RESULTS.md)."""

    update_rule: Literal["lazy", "catchup", "sign_drift", "window_mean"] = "lazy"
    """How coordinates outside the mask learn (scape_ds/optim/update_rules.py, docs/design.md "Update
    rules"). ``lazy``: they wait; the dense refresh gives them one AdamS step for the whole window of
    accumulated gradient (AdamS's normalization makes that about 0.45 lr, whatever the window held).
    ``catchup``: the refresh also moves each of them by ``catchup_gain * lr * w * a / sqrt(v)``
    (``a`` the window's accumulated mean gradient, ``w`` the window's steps, ``v`` an EMA over
    refreshes of ``a^2``): a window-sized step, no extra bytes, 4 bytes per parameter / D more
    memory. ``sign_drift``: every replica moves each of them by ``lr * beta1 / sqrt(beta2) *
    sign(m)`` for ``drift_steps`` steps after a refresh (AdamS's own step with no new gradient),
    from one bit per coordinate all-gathered at the refresh. ``window_mean``: the refresh feeds AdamS
    each such coordinate's mean gradient per step (``a / w``) instead of the window's sum. The three
    act at dense refresh steps: they need ``dense_refresh``, the ``scape`` or ``topk`` compressor,
    ``hierarchy="flat"`` and ZeRO stage 0/1. Default ``lazy``: none of the three beat it in
    docs/results_history.md ("Update rules at 99% sparsity": 500 steps at 0.99, each at lazy's best lr
    and more; the more a rule moves the coordinates outside the mask, the worse; and "Each method
    at its best learning rate": 1500 steps at 0.99 and 0.9)."""

    catchup_gain: float = 0.3
    """``update_rule="catchup"``: gamma, the share of a window-sized step (``w * lr`` at a fully
    consistent gradient) a coordinate outside the mask takes at the refresh; > 0."""

    catchup_beta: float = 0.5
    """``update_rule="catchup"``: EMA factor over refreshes of the squared accumulated gradient, in
    [0, 1); 0 makes the catch-up ``catchup_gain * lr * w * sign(a)``."""

    drift_steps: int = 10
    """``update_rule="sign_drift"``: K, the steps after each refresh during which coordinates outside
    the mask drift; 1 <= K < mask_refresh_interval."""

    reselect_interval: int = 0
    """R: with R > 0, between dense refreshes each owner re-chooses its part of the mask every R steps
    from ``|beta1 * m + (1 - beta1) * e|`` on its shard (m its momentum, e its own unsent residual:
    the momentum a coordinate would have if its residual entered now), without a flush; the mask
    all-gather (2 bytes or less per kept coordinate) is the only extra traffic. Weight decay stays
    exact: each owned coordinate keeps an int32 mark of the step it was last decayed to (4 bytes per
    parameter / D). 0 (default): the mask changes at refreshes only (at sparsity 0.9, R=50 was worse
    over 1500 steps in bench/RESULTS.md).
    At sparsity 0.99, R=50 with T=100 and lr 6e-3 reached 2.2% lower validation loss than R=0 at the
    same bytes on the 0.45M-parameter GPT (1500 steps) but 2.8% higher at 4x the parameters (2000
    steps): not recommended yet. Needs update_rule "lazy", compressor
    "scape", dense_refresh, hierarchy "flat"; 0 or 1 <= R < mask_refresh_interval."""

    exploration: float = 0.1
    """With ``dense_refresh=false``: share of each chunk's kc chosen at random from a seed (so
    coordinates outside the mask still get fresh statistics), in [0, 1)."""

    dense_numel_threshold: int = 4096
    """Tensors with fewer elements, and all 1-D tensors (norms, biases), are exchanged densely: their
    gradients are reduced whole every step (no mask, no error feedback) and every rank applies the
    same update, on path A (all-reduce, tag ``dense_ar``) and under ZeRO-3 (a reduce-scatter of their
    pieces, tag ``dense_rs``)."""

    param_exchange: Literal["dense", "sparse_replica"] = "dense"
    """ZeRO-3 only: ``dense`` keeps ZeRO-3's own parameter all-gather; ``sparse_replica`` keeps a
    compute-dtype replica on every rank patched by a sparse all-gather of new values (basis "dct": moved
    by the decoded mean on every rank alike, no all-gather but the dense tensors'; fp32, ``dct_update``
    "sign" or "rms")."""

    comm_backend: Literal["torch", "mpi"] = "torch"
    """Collectives through torch.distributed (gloo/NCCL) or mpi4py."""

    kernels: Literal["auto", "triton", "torch"] = "auto"
    """``auto``: Triton for CUDA tensors when available, torch otherwise."""

    error_feedback_dtype: Literal["fp32", "bf16"] = "fp32"
    """dtype of the error-feedback buffer (N elements per rank, the largest SCAPE buffer): ``bf16``
    halves it. What is lost: each step rounds the accumulated ``e + g`` to bf16 (relative error up
    to 2^-9), and that rounding residual is not fed back; on dense refresh steps the sum is formed
    in the parameter dtype, so only residuals carried between refreshes are rounded. Measured in
    bench/RESULTS.md: after 100 steps sent + residual misses the accumulated gradient by 2.8% of its
    largest value (fp32: 5e-7); 200 steps of the small GPT ended at the same loss. Stage 0/1
    (ScapeAdamS) only."""

    hierarchy: Literal["flat", "node"] = "flat"
    """``flat``: one sparse exchange over the whole data-parallel group. ``node``: dense inside a node,
    sparse across nodes (docs/design.md, Hierarchical SCAPE): a dense reduce-scatter over the node's
    G ranks gives local rank l the node sum of slice l (N/G elements), SCAPE exchanges slice l over
    the group of local rank l on every node, and a packed all-gather inside the node restores every
    copy. Error feedback is then N/G per rank and inter-node bytes drop by G or more. ZeRO stage 0/1
    only (ScapeAdamS)."""

    intra_node_size: int | None = None
    """G, data-parallel ranks per node, for ``hierarchy="node"``: consecutive blocks of G ranks of the
    data-parallel group form a node. ``None``: from the launcher (ranks ``g`` and ``g'`` share a node
    when ``g // LOCAL_WORLD_SIZE`` agree, or DeepSpeed's ``LOCAL_SIZE``, or MPI's; under
    ``comm_backend="mpi"`` MPI's shared-memory split)."""

    basis: Literal["coordinate", "dct"] = "coordinate"
    """Where the sparse message lives. ``coordinate``: kept coordinates of the parameters themselves, chosen
    from the owner's momentum and held for ``mask_refresh_interval`` steps (SCAPE's own mode). ``dct``:
    coefficients of an orthonormal 2-D DCT-II of each weight matrix cut into square tiles of
    sqrt(``chunk_size``) x sqrt(``chunk_size``) (64 x 64 at the default 4096; weight edges padded with
    zeros inside their last tile), error feedback per rank in coefficients, a fresh mask every step
    (``mask``), and an update formed in real space from the decoded sparse mean (``dct_update``): every
    parameter moves every step although only k coefficients per tile travel (docs/design.md, "Transform
    basis"). ZeRO stage 0/1 and 3 (tiles over each parameter's full shape: docs/design.md, "Path B"),
    ``hierarchy "node"`` at stage 0/1 (each rank of a node exchanges its slice of the tiles across
    nodes: docs/design.md, "Hierarchical SCAPE"); ``mask_refresh_interval`` and ``dense_refresh`` apply
    only to ``mask_source "momentum"``. bench/RESULTS.md ("SCAPE in the DCT basis"): at sparsity 0.99
    with ds_configs/scape_dct.json (per_rank, sign, clip_local 1, ef_decay 0.999) 0.996x dense AdamW's
    validation loss with 2.3% of its bytes (0.45M parameters, 1500 steps, 2 ranks, lr 3e-3 as for
    AdamW), where the coordinate basis is 1.40x; at 0.9 1.013x. At 1.85M parameters (2000 steps, lr
    2.1e-3, 0.7x AdamW's) 0.997x with 2.05%, where the coordinate basis is 1.26x; at 0.9 1.036x, worse
    than the coordinate basis's 1.021x. The default stays "coordinate" because ZeRO-3's elastic resume
    runs only there (ZeRO-3, the hierarchy and stage 0/1's elastic resume run in both; neither basis
    resumes a hierarchy elastically); the recommended setting at ZeRO stage 0/1 is
    ds_configs/scape_dct.json (with ``overlap``: ds_configs/scape_dct_overlap.json)."""

    mask: Literal["per_rank", "shared"] = "per_rank"
    """``basis="dct"``: ``per_rank``: every rank sends its own top-kc coefficients of each tile with
    their 16-bit in-tile offsets in one all-gather (DeMo's exchange, arXiv 2411.19870): D k values and
    offsets received per rank. ``shared``: every rank nominates its top max(1, kc // D) coefficients
    of each tile from this step's error feedback, the offsets are all-gathered, and the union (padded
    to D * (kc // D) slots per tile) is one mask for every rank: its values are averaged by a packed
    reduce-scatter and all-gather, O(k) per rank whatever D. Measured at D = 2, sparsity 0.99: per_rank
    0.996x dense AdamW at 2.29% of the bytes, shared 1.011x at 2.01%; at D = 4, 1.005x at 3.78% and
    1.017x at 2.01%. per_rank's bytes grow as 0.75 D rho of dense, shared's stay at 1.25 rho
    (docs/design.md, "Transform basis"): per_rank (the default) for the loss up to D = 4, shared for the
    bytes. At D = 8 and 2% of the bytes the union was the better of the two (bf16 values at sparsity
    0.978: 1.024x dense AdamW's best at lr 4.5e-3, per_rank 1.0365x at its best; 4-bit values at 0.94
    with Elias-Fano offsets: 1.0088x at 4.5e-3, and 0.992x at D = 4; bench/RESULTS.md). That last is
    ds_configs/scape_dct_scale.json, the config for D >= 4."""

    mask_source: Literal["union", "owner", "momentum"] = "union"
    """``basis="dct"``, ``mask="shared"``: who chooses the one mask. ``union``: every rank nominates its
    top max(1, kc // D) of each tile from this step's error feedback and the union is the mask (above).
    ``owner``: the rank that owns a tile (shard r: tiles [r n / D, (r+1) n / D)) chooses its top kc from
    its own error feedback, this step, and the others send their values at those coefficients: the
    mask of SCAPE's coordinate basis (one owner decides), chosen fresh. ``momentum``: SCAPE's own
    source in coefficients: the owner keeps a first moment (beta1) of the reduced mean coefficients
    of its tiles, updated where they were sent and, on the dense steps every
    ``mask_refresh_interval`` (and the first), everywhere; after each step it chooses the next step's
    mask from it (one step early; ``mask_hold`` and ``mask_early`` do not apply), 4 bytes per
    coefficient of its shard more. Measured in
    bench/RESULTS.md ("Shared-mask sources")."""

    mask_hold: int = 1
    """``basis="dct"``, ``mask="shared"``: steps one chosen shared mask serves (>= 1); its offsets
    travel once per mask. 1 (default): a fresh mask every step, the setting measured best
    (bench/RESULTS.md, "Shared-mask sources")."""

    mask_early: bool = False
    """``basis="dct"``, ``mask="shared"``: choose the next mask on the last step of the current one,
    from that step's error feedback before its send (SCAPE's one-step-early mask, which would let the
    offsets travel under compute); false (default): from the error feedback of the step that uses it."""

    dct_update: Literal["sign", "rms", "signum", "adams", "adams_coef"] = "sign"
    """``basis="dct"``: how the decoded mean u (a dense real-space tensor every rank holds alike) moves the
    parameters: ``sign``: ``p -= lr * sign(u)`` after decoupled weight decay (DeMo's update; no
    optimizer state); ``rms``: ``p -= lr * u / rms(u)``, the RMS taken over each parameter tensor's part
    of u (a normalisation that keeps the relative sizes sign drops; no state); ``signum``: ``p -= lr *
    sign(m)``, m = beta1 m + (1 - beta1) u a momentum of the decoded mean kept on every rank (4 bytes
    per parameter; at sparsity 0 this is Signum on the mean gradient); ``adams``: one AdamS step on u
    with a momentum kept on every rank (4 bytes per parameter more than ``sign``; at sparsity 0 this is
    dense AdamS); ``adams_coef``: AdamS on the mean coefficients themselves (its momentum in
    coefficients, on every rank), its step decoded, weight decay in real space (at sparsity 0: dense
    AdamS on the DCT-rotated parameters). At 0.99 ``adams`` reached 1.73x dense AdamW and ``adams_coef``
    1.84x (bench/RESULTS.md), against 0.996x for ``sign``."""

    value_bits: Literal[32, 16, 8, 4] = 32
    """``basis="dct"``: bits per sent coefficient value on the wire. 16 (``mask="shared"``): the union's
    values are reduce-scattered and all-gathered as bf16, each rank keeping what rounding its own
    values lost in its error feedback (the bf16 sum's own rounding is not fed back); 6 bytes per slot
    with its offset instead of 10. With ``mask="per_rank"``: 32: fp32. 8 or
    4: each tile's kc values scaled by their absmax to signed integers (+-127, +-7), one fp32 scale per
    tile, in one uint8 all-gather; what the rounding loses stays in the error feedback (sent + kept ==
    accumulated, with the decoded value as what was sent). 8 or 4 with ``mask="shared"``: each rank codes
    the slots' values so per tile, an all-to-all takes each tile's D codes to its owner, which adds them
    and codes the sum again for the all-gather; each rank keeps what its coding lost, the owner also what
    the sum's lost (sent + kept == accumulated over the ranks together): about 4 bytes a slot with its
    offset at 8 bits and 3 at 4, against 6 at 16 (each times (D-1)/D, plus an fp32 scale per tile and
    leg; the tiles split evenly over the ranks; ``hierarchy "flat"``). per_rank's bytes per sent
    coefficient, its 16-bit offset included: 6 at 32 bits, 3 + 4/kc at 8, 2.5 + 4/kc at 4
    (scape_ds/exchange/quantize.py). On the bench at 2 ranks 8-bit values kept the default's loss (0.999x
    at 1.57% of the bytes). 4 bits with ``mask="shared"`` at sparsity 0.94, bf16 dense tensors and
    Elias-Fano offsets is ``scape_dct_scale.json``: at lr 4.5e-3, 0.992x dense AdamW's best at 4 ranks
    (1.92% of the bytes) and 1.0088x at 8 (1.96%), where per_rank's best at 2% was 1.0365x
    (bench/RESULTS.md, "sixth session" and "seventh session")."""

    tile_budget: int | None = None
    """``basis="dct"``, ``mask="per_rank"``: the coefficients per tile all the ranks of the exchange send
    together (None: off). Each rank sends max(1, tile_budget // D) of every tile, D the data-parallel
    ranks (the nodes under ``hierarchy "node"``; at most every coefficient of the tile), which sets
    ``sparsity`` (not given with it). per_rank's
    bytes, about 0.75 D rho, then stay about the same whatever D: 224 with ``value_bits`` 8,
    ``dense_wire "bf16"`` and ``index_code "elias_fano"`` (``scape_dct_scale.json`` until the coded union
    replaced it) is 1.82% and 1.94% of the dense bytes at D = 4 and 8 on the bench model (bench/RESULTS.md)."""

    decode: Literal["ranks", "senders"] = "ranks"
    """``basis="dct"``, ``mask="per_rank"``: how the received coefficients become the mean u decodes.
    ``ranks``: their sum / D, a coefficient one rank sent weighing 1/D of one all D sent (DeMo's paper).
    ``senders``: each coefficient's sum divided by the number of ranks that sent it (DeMo's reference
    code, ``scatter_reduce(..., "mean")``); the counts come from the offsets every rank already
    received, so no byte more travels. One suspect of per_rank's loss of quality as D grows
    (docs/design.md "Transform basis")."""

    index_code: Literal["int16", "elias_fano"] = "int16"
    """``basis="dct"``: how a rank's in-tile offsets travel (per_rank's, and the shared mask's
    nominations or owners' choices; not with ``mask_source "momentum"``). ``int16``: 2 bytes
    each. ``elias_fano``: each tile's kc ascending offsets in Elias-Fano code, kc l low bits and a
    bitmap of kc + (C >> l) bits, l = floor(log2(C / kc)), the same length for every tile so the
    ranks' codes go in one uint8 all-gather (:mod:`scape_ds.exchange.index_code`). Lossless: a run
    with it is bitwise the run with int16 offsets, at 43 bytes per tile of 4096 for kc = 40 (80 as
    int16) and 24 for kc = 20 (40)."""

    dense_wire: Literal["fp32", "bf16"] = "fp32"
    """``basis="dct"``, ZeRO stage 0/1: the dtype in which the dense-exchanged tensors' gradients (1-D
    tensors, tensors under ``dense_numel_threshold``; 35% of the bytes of the 0.45M bench model) are
    all-reduced every step. ``bf16`` halves those bytes: each rank adds its gradient to an error
    feedback of its own (fp32, one per dense element), sends that rounded to bf16 and keeps what the
    rounding lost; the all-reduce then sums bf16 values (its own rounding is not fed back). Measured on
    the bench only together with coded values (8 bits with ``tile_budget``; 4 bits with the shared mask,
    ``scape_dct_scale.json``; bench/RESULTS.md), not alone."""

    clip_local: float = 0.0
    """Clip each rank's own gradient to this global norm before it enters the error feedback (0: off).
    DeMo's reference runs clip so (1.0); ``gradient_clipping`` in the DeepSpeed config clips the
    reduced gradient instead (docs/design.md). >= 0. With basis "dct" at 0.99, 1.0 against off:
    0.996x against 1.060x dense AdamW's loss (bench/RESULTS.md)."""

    ef_decay: float = 1.0
    """``basis="dct"``: the error feedback is ``e = ef_decay * e + Q g`` (DeMo: 0.999); 1.0 keeps every
    unsent coefficient exactly (sent + kept == accumulated). In (0, 1]."""

    overlap: bool = False
    """Overlap the exchange with compute (docs/design.md, "Overlap"): the sparse-exchanged gradients
    are cut into buckets of ``bucket_mb`` that each lie in one owner's shard; on the micro-batch that
    ends the accumulation a bucket is packed at the mask with its error feedback and reduced to its
    owner (asynchronously) once backward has produced its last gradient and the buckets before it in
    the planned order have started; the step waits for them, updates, and starts one asynchronous
    broadcast of new values per bucket; the next forward waits per module (forward pre-hooks) for the
    buckets of its own parameters. Bytes equal the non-overlapped path's, parameters too (bitwise at
    2 ranks; at more ranks the order of the sum can differ in the last bit). Coordinate basis,
    hierarchy "flat", update_rule "lazy", no ``reselect_interval`` or ``clip_local``, ZeRO stage 0/1
    (with tensor parallelism, and pipeline stages as DeepSpeed's PipelineModule: buckets leave in the
    last backward of each ``train_batch``, the tied weights' group in the step), and ZeRO-3 with
    ``param_exchange "sparse_replica"`` (its all-gather of new values per bucket of parameters,
    waited for by the forward; ZeRO-3's gradient exchange runs in DeepSpeed's own bucket hooks).
    Basis "dct" (``mask "per_rank"``, ``dct_update`` "sign", "rms" or "signum", ``gradient_clipping``
    0; ``clip_local`` allowed): nothing can leave during backward (``clip_local`` needs the whole
    local norm first), so ``step()`` transforms each bucket of whole weights and starts its
    all-gathers, and each weight's decode and update wait for its module's forward; parameters,
    error feedback and bytes are bitwise the non-overlapped path's at any D (ds_configs/
    scape_dct_overlap.json). Refused in one line elsewhere. In the coordinate basis what the gradients
    are changed to between backward and ``step()`` (``clip_grad_norm_``, a ``GradScaler``'s unscale) is
    not seen: they left in backward. Parameters read outside a forward or the model's ``state_dict()`` need
    ``optimizer.synchronize()`` first (checkpoint saves and the model's state_dict call it). Off by
    default: measured on 4 emulated nodes it helps SCAPE 0.9 and not 0.99 (bench/RESULTS.md,
    "Overlap"), and it has no GPU measurement yet."""

    bucket_mb: float = 25.0
    """``overlap``: megabytes of gradient (in the compute dtype) per bucket, as DDP's ``bucket_cap_mb``;
    smaller buckets start sooner and cost more collectives. Rounded to whole chunks and cut at owner
    boundaries; basis "dct": runs of whole weights in forward order; under ZeRO-3 (``sparse_replica``)
    runs of whole parameters in ds_id order; a larger weight or parameter a bucket of its own. > 0."""

    buckets_in_flight: int = 8
    """``overlap`` (coordinate basis): the most gradient buckets whose reduce may be on the wire at
    once; starting one more first waits for the oldest (inside backward). Bounds what the backend
    queues (and, with bf16 parameters and fp32 error feedback, the per-bucket copies of the wire
    values). 0: no bound."""

    local_steps: int = 1
    """``basis="dct"``, ZeRO stage 0/1: H, the steps each rank takes with its own ``inner_optimizer``
    on its own data between exchanges (docs/design.md, "Local steps"; DiLoCo, arXiv 2311.08105). Every
    H steps the pseudo-gradient (synchronized minus local parameters) goes through the DCT exchange
    (error feedback in coefficients, ``mask``, ``value_bits``; the dense tensors' by a dense
    all-reduce) and the ``outer_update`` moves the synchronized parameters alike on every rank, which
    every rank then continues from. 1 (default): every step exchanges, as without this field. The
    mean bytes per step are the outer exchange's / H. >= 1."""

    inner_optimizer: Literal["adamw", "adams"] = "adamw"
    """``local_steps`` > 1: the local optimizer (its own state on every rank; the param group's lr,
    betas, eps, weight decay): ``adamw`` (torch.optim.AdamW, DiLoCo's) or ``adams`` (dense AdamS)."""

    outer_update: Literal["nesterov", "sign", "sign_lr"] = "nesterov"
    """``local_steps`` > 1: how the decoded mean pseudo-gradient u moves the synchronized parameters:
    ``nesterov`` (DiLoCo): ``b = outer_momentum b + u``, ``p -= outer_lr (u + outer_momentum b)``;
    ``sign``: ``p -= outer_lr sign(u)`` (``outer_lr`` then is a step in parameter units);
    ``sign_lr``: ``p -= outer_lr lr sign(u)``, lr the param group's learning rate at the outer step
    (``outer_lr`` a multiple of it, so the step follows the schedule: the every-step default's
    sign update, lr each step, moves at most H lr per H steps)."""

    outer_lr: float = 0.7
    """``local_steps`` > 1: the outer step size (DiLoCo: 0.7). > 0."""

    outer_momentum: float = 0.9
    """``local_steps`` > 1, ``outer_update "nesterov"``: the outer momentum (DiLoCo: 0.9). In [0, 1)."""

    seed: int = 1234
    """Seed of the exploration and random-k masks (identical on every rank)."""

    log_comm: bool = True
    """Record per-step bytes sent vs dense (read them from ``optimizer.comm_stats``)."""

    @field_validator("sparsity", "exploration", "catchup_beta", "outer_momentum")
    @classmethod
    def _check_unit_interval(cls, v: float) -> float:
        if not 0.0 <= v < 1.0:
            raise ValueError(f"must be in [0, 1), got {v}")
        return v

    @field_validator("clip_local")
    @classmethod
    def _check_clip(cls, v: float) -> float:
        if not v >= 0:
            raise ValueError(f"must be >= 0 (0: off), got {v}")
        return v

    @field_validator("ef_decay")
    @classmethod
    def _check_ef_decay(cls, v: float) -> float:
        if not 0.0 < v <= 1.0:
            raise ValueError(f"must be in (0, 1], got {v}")
        return v

    @field_validator("catchup_gain", "bucket_mb", "outer_lr")
    @classmethod
    def _check_positive(cls, v: float) -> float:
        if not v > 0:
            raise ValueError(f"must be > 0, got {v}")
        return v

    @field_validator("mask_refresh_interval", "drift_steps", "local_steps")
    @classmethod
    def _check_interval(cls, v: int) -> int:
        if v < 1:
            raise ValueError(f"must be an integer >= 1, got {v}")
        return v

    @field_validator("chunk_size")
    @classmethod
    def _check_chunk(cls, v: int) -> int:
        if v < 8 or v > 65536 or v & (v - 1):
            raise ValueError(f"must be a power of two in [8, 65536], got {v}")
        return v

    @field_validator("dense_numel_threshold", "reselect_interval", "buckets_in_flight")
    @classmethod
    def _check_threshold(cls, v: int) -> int:
        if v < 0:
            raise ValueError(f"must be >= 0, got {v}")
        return v

    @field_validator("intra_node_size")
    @classmethod
    def _check_intra_node_size(cls, v: int | None) -> int | None:
        if v is not None and v < 1:
            raise ValueError(f"must be an integer >= 1 (or null: from the launcher), got {v}")
        return v

    @model_validator(mode="after")
    def _check_combination(self) -> "ScapeConfig":
        if self.intra_node_size is not None and self.hierarchy == "flat":
            raise ValueError("intra_node_size is for hierarchy='node'; set hierarchy to 'node' or drop it")
        if self.compressor == "topk" and not self.dense_refresh:
            raise ValueError(
                "compressor='topk' selects from the reduced gradient of a dense refresh step: "
                "it needs dense_refresh=true"
            )
        if self.update_rule != "lazy":
            where = f"update_rule={self.update_rule!r}"
            if self.compressor not in ("scape", "topk") or not self.dense_refresh:
                raise ValueError(f"{where} acts at dense refresh steps: it needs compressor 'scape' or 'topk' and "
                                 f"dense_refresh=true, got compressor {self.compressor!r}, "
                                 f"dense_refresh={self.dense_refresh}")
            if self.hierarchy != "flat":
                raise ValueError(f"{where} is built for hierarchy 'flat' only, got {self.hierarchy!r}")
        if self.reselect_interval:
            if not 1 <= self.reselect_interval < self.mask_refresh_interval:
                raise ValueError(f"reselect_interval must be 0 or in [1, mask_refresh_interval="
                                 f"{self.mask_refresh_interval}), got {self.reselect_interval}")
            settings = (self.update_rule, self.compressor, self.dense_refresh, self.hierarchy)
            if settings != ("lazy", "scape", True, "flat"):
                raise ValueError("reselect_interval needs update_rule 'lazy', compressor 'scape', dense_refresh=true "
                                 "and hierarchy 'flat'")
        if self.basis == "dct":
            side = math.isqrt(self.chunk_size)
            if side * side != self.chunk_size:
                raise ValueError(f"basis 'dct' cuts weights into square tiles of chunk_size elements: chunk_size must "
                                 f"be a power of 4 (16 ... 65536; 4096 = 64 x 64 tiles), got {self.chunk_size}")
            settings = dict(compressor=(self.compressor, "scape"), update_rule=(self.update_rule, "lazy"),
                            reselect_interval=(self.reselect_interval, 0),
                            error_feedback_dtype=(self.error_feedback_dtype, "fp32"))
            bad = _unmet(settings)
            if bad:
                raise ValueError("basis 'dct' is built for the default exchange settings only: " + ", ".join(bad))
            if self.hierarchy == "node" and self.mask_source == "momentum":
                raise ValueError("mask_source 'momentum' is built for hierarchy 'flat' (its owners' first moment "
                                 "lives on the flat shards); use mask_source 'union' or 'owner' with hierarchy 'node'")
        if self.value_bits != 32:
            settings = dict(basis=(self.basis, "dct"), overlap=(self.overlap, False))
            if self.value_bits == 16:
                settings["mask"] = (self.mask, "shared")
            elif self.mask == "shared":  # the coded union's all-to-all is built for the flat group
                settings["hierarchy"] = (self.hierarchy, "flat")
            bad = _unmet(settings)
            if bad:
                what = ("sends the values of basis 'dct''s shared-mask exchange as bf16" if self.value_bits == 16
                        else "codes the values of basis 'dct''s exchange")
                raise ValueError(f"value_bits {self.value_bits} {what}: " + ", ".join(bad))
        if self.tile_budget is not None:
            if self.tile_budget < 1:
                raise ValueError(f"scape.tile_budget must be >= 1 coefficient per tile, got {self.tile_budget}")
            settings = dict(basis=(self.basis, "dct"), mask=(self.mask, "per_rank"))
            bad = _unmet(settings)
            if "sparsity" in self.model_fields_set:
                bad.append(f"sparsity {self.sparsity} (set by tile_budget // D: give one of the two)")
            if bad:
                raise ValueError(f"tile_budget {self.tile_budget} sets basis 'dct''s per-rank sparsity by the "
                                 f"number of ranks: " + ", ".join(bad))
        per_rank_only = dict(basis=(self.basis, "dct"), mask=(self.mask, "per_rank"), overlap=(self.overlap, False))
        offsets_coded = dict(basis=(self.basis, "dct"), overlap=(self.overlap, False))
        if self.mask_source == "momentum":  # its masks are chosen after the step, their offsets as int16
            offsets_coded["mask_source"] = (self.mask_source, "union")
        for name, default, what, needs in (
                ("index_code", "int16", "codes the offsets of basis 'dct''s exchange", offsets_coded),
                ("decode", "ranks", "averages basis 'dct''s per-rank messages over their senders", per_rank_only)):
            bad = _unmet(needs) if getattr(self, name) != default else []
            if bad:
                raise ValueError(f"{name} {getattr(self, name)!r} {what}: " + ", ".join(bad))
        if self.comm_backend == "mpi" and (self.value_bits == 16 or self.dense_wire == "bf16"):
            raise ValueError("comm_backend 'mpi' reduces fp32 and fp64 only: value_bits 16 and dense_wire 'bf16' "
                             "sum bf16 values; use comm_backend 'torch' or fp32 on the wire")
        if self.dense_wire != "fp32" and self.basis != "dct":
            raise ValueError(f"dense_wire {self.dense_wire!r} is built for basis 'dct' (its dense tensors' "
                             f"all-reduce); got basis {self.basis!r}")
        if self.outer_update == "sign" and "outer_lr" not in self.model_fields_set:
            raise ValueError("outer_update 'sign' moves every synchronized parameter by outer_lr each outer step (a "
                             "step in parameter units, not DiLoCo's 0.7): set outer_lr, e.g. H x the inner lr")
        if self.outer_update == "sign_lr" and "outer_lr" not in self.model_fields_set:
            raise ValueError("outer_update 'sign_lr' moves every synchronized parameter by outer_lr x the lr each "
                             "outer step (a multiple of the lr, not DiLoCo's 0.7): set outer_lr, e.g. H / 2")
        if self.local_steps > 1:
            settings = dict(basis=(self.basis, "dct"), overlap=(self.overlap, False),
                            hierarchy=(self.hierarchy, "flat"), mask_source=(self.mask_source, "union"),
                            mask_hold=(self.mask_hold, 1), mask_early=(self.mask_early, False))
            bad = _unmet(settings)
            if bad:
                raise ValueError(f"local_steps {self.local_steps} exchanges pseudo-gradients through basis 'dct', "
                                 f"built for: " + ", ".join(bad))
        if self.mask_hold < 1:
            raise ValueError(f"mask_hold must be >= 1 (steps one shared mask serves), got {self.mask_hold}")
        if self.mask_source == "momentum" and (self.mask_hold != 1 or self.mask_early):
            raise ValueError("mask_source 'momentum' chooses each step's mask one step early by itself: "
                             f"mask_hold must be 1 and mask_early false, got {self.mask_hold}, {self.mask_early}")
        for name, value, default in (("mask_source", self.mask_source, "union"), ("mask_hold", self.mask_hold, 1),
                                     ("mask_early", self.mask_early, False)):
            if value != default and (self.basis, self.mask) != ("dct", "shared"):
                raise ValueError(f"{name} {value!r} applies to the shared mask of basis 'dct': it needs basis 'dct' "
                                 f"and mask 'shared', got basis {self.basis!r}, mask {self.mask!r}")
        if self.overlap and self.basis == "dct":  # the exchange runs in step(), the update under the next forward
            allowed = dict(mask=(self.mask, ("per_rank",)), dct_update=(self.dct_update, ("sign", "rms", "signum")),
                           hierarchy=(self.hierarchy, ("flat",)))
            bad = [f"{k} {v!r} (needs one of {', '.join(want)})" for k, (v, want) in allowed.items() if v not in want]
            if bad:
                raise ValueError("scape.overlap with basis 'dct' is built for: " + ", ".join(bad))
        elif self.overlap:
            settings = dict(hierarchy=(self.hierarchy, "flat"), update_rule=(self.update_rule, "lazy"),
                            reselect_interval=(self.reselect_interval, 0), clip_local=(self.clip_local, 0.0))
            bad = _unmet(settings)
            if self.clip_local:  # why it cannot be built, not only that it is not yet
                bad[-1] += (": clip_local scales by the norm of the whole local gradient, known only when "
                            "backward ends, before any bucket may enter error feedback (basis 'dct' overlaps "
                            "with it: its update waits for the next forward instead)")
            if bad:
                raise ValueError("scape.overlap in the coordinate basis is built for: " + ", ".join(bad))
        if self.update_rule == "sign_drift" and not 1 <= self.drift_steps < self.mask_refresh_interval:
            raise ValueError(f"drift_steps must be in [1, mask_refresh_interval={self.mask_refresh_interval}), "
                             f"got {self.drift_steps}")
        return self

    def for_ranks(self, world_size: int) -> "ScapeConfig":
        """This config for an exchange over ``world_size`` ranks: with ``tile_budget``, ``sparsity`` set
        to send max(1, tile_budget // world_size) of every tile; otherwise itself."""
        if self.tile_budget is None:
            return self
        kc = max(1, min(self.chunk_size, self.tile_budget // world_size))
        return self.model_copy(update=dict(sparsity=1.0 - kc / self.chunk_size))

    @property
    def density(self) -> float:
        """rho = 1 - sparsity."""
        return 1.0 - self.sparsity

    @property
    def tile_size(self) -> int:
        """``basis="dct"``: the side of a square tile, sqrt(chunk_size)."""
        return math.isqrt(self.chunk_size)

    @property
    def k_per_chunk(self) -> int:
        """kc: kept coordinates in every chunk (at least 1)."""
        return max(1, min(self.chunk_size, round(self.density * self.chunk_size)))


def _unmet(settings: dict[str, tuple[Any, Any]]) -> list[str]:
    """``name value (needs wanted)`` for each of ``settings`` (name: (value, wanted)) not as wanted."""
    return [f"{k} {v!r} (needs {want!r})" for k, (v, want) in settings.items() if v != want]


_STRICT_TYPES = {"float_type": "a number without quotes", "int_type": "an integer without quotes or a decimal point",
                 "bool_type": "true or false without quotes"}


def _json_type(value: Any) -> str:
    return {str: "string", bool: "bool", int: "integer", float: "number", list: "list", dict: "object"}.get(
        type(value), type(value).__name__)


def _as_json(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _format_error(err: ValidationError, prefix: str) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(x) for x in e["loc"]) or "(block)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(ScapeConfig.model_fields)
            msg = f"unknown field; allowed fields: {allowed}"
        elif e["type"] == "literal_error":
            msg = f"{msg} (got {e.get('input')!r})"
        elif e["type"] in _STRICT_TYPES:  # strict mode: no coercion from strings, floats or numbers
            got = e.get("input")
            msg = f"{msg}, got {_as_json(got)} (a JSON {_json_type(got)}): write {_STRICT_TYPES[e['type']]}"
        lines.append(f"{prefix}{field}: {msg}")
    return "invalid scape config: " + "; ".join(lines)


def parse_scape_config(block: ScapeConfig | dict[str, Any] | None) -> ScapeConfig:
    """Validate a ``"scape"`` block (dict or ScapeConfig) into a :class:`ScapeConfig`.

    Raises:
        ValueError: with one clause per bad field, e.g. ``scape.sparsity: must be in [0, 1), got 1.5``.
    """
    if isinstance(block, ScapeConfig):
        return block
    if block is None:
        return ScapeConfig()
    if not isinstance(block, dict):
        raise TypeError(f"the scape config must be a dict, got {type(block).__name__}")
    try:
        return ScapeConfig(**block)
    except ValidationError as err:
        raise ValueError(_format_error(err, "scape.")) from None


def basis_mismatch(saved: dict, cfg: ScapeConfig) -> str:
    """``"scape.basis 'dct', this run has 'coordinate'"``: a setting of the transform basis in which a
    saved ScapeAdamS config (``state_dict()["scape"]["config"]``) differs from ``cfg`` and that no
    re-layout converts (the basis; under basis "dct" also ``dct_update``, whose momentum, and
    ``chunk_size``, whose tiles, the state holds); empty if none does. Other settings (sparsity, mask)
    may change: dct masks are chosen every step."""
    keys = [("basis", "coordinate")]
    if cfg.basis == "dct" and saved.get("basis", "coordinate") == "dct":
        keys += [("dct_update", "sign"), ("chunk_size", 4096)]
    for name, default in keys:
        if saved.get(name, default) != getattr(cfg, name):
            return f"scape.{name} {saved.get(name, default)!r}, this run has {getattr(cfg, name)!r}"
    return ""


def zero_stage(ds_config: dict) -> int:
    """The ZeRO stage a DeepSpeed config asks for (0 without a ``zero_optimization`` block)."""
    return int((ds_config.get("zero_optimization") or {}).get("stage", 0))


def offload_enabled(block) -> bool:
    """Whether a ``zero_optimization.offload_*`` block (dict, or a bare device name) offloads."""
    if not block:
        return False
    return (block.get("device", "none") if isinstance(block, dict) else block) != "none"
