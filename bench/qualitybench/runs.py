"""What a quality run is: its name in ``RUNS``, its settings (``DEFAULTS``), its id, its DeepSpeed config.

A run is a name of ``RUNS`` (label, base config in ds_configs/, overrides of the ``"scape"`` block and
of the optimizer params) plus the generic settings that differ from ``DEFAULTS``; ``run_id`` names
them: ``adamw`` at the defaults, ``scape99__L4_E192_steps2000_lr0.006`` at 4 layers x 192, 2000 steps,
lr 6e-3. Baselines from the papers (the DeMo recipe) are runs like any other: a config of the product.
"""
from __future__ import annotations

import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# name -> (label, base config in ds_configs/, overrides of the "scape" block[, of the optimizer params])
COORD = "scape_coordinate.json"  # SCAPE in the coordinate basis (ds_configs/scape.json before 2026-12-07)
# scape_local.json's settings before it moved to H = 100 (the first local-steps rows ran with them), and the
# bytes levers of the rows after
LOCAL30 = dict(local_steps=30, sparsity=0.99, outer_update="nesterov", outer_lr=0.7, outer_momentum=0.9, ef_decay=0.999,
               value_bits=32, dense_wire="fp32", index_code="int16")
LOCAL_LEVERS = dict(outer_update="nesterov", outer_lr=1.0, outer_momentum=0.0, ef_decay=0.8, value_bits=8,
                    dense_wire="bf16", index_code="elias_fano")
# the ceiling of compression: LOCAL_LEVERS' outer recipe at lr 1.3 with every coefficient sent in fp32
LOCAL_DENSE = dict(LOCAL_LEVERS, sparsity=0.0, value_bits=32, dense_wire="fp32", index_code="int16", outer_lr=1.3)
# scape_dct_scale.json until it moved to the coded union (issue 45, seventh session): per_rank, tile_budget // D
# per tile, 8-bit values, bf16 dense tensors, Elias-Fano offsets; the entries that ran on it pin it over scape_dct.json
PER_RANK_SCALE = dict(sparsity=None, value_bits=8, dense_wire="bf16", index_code="elias_fano")
# that config with 4-bit values spent on 312 // D per tile (39 at D = 8, within 2.0% of the bytes)
Q4_B312 = dict(PER_RANK_SCALE, tile_budget=312, value_bits=4)
# the inner lr scape_local.json carried before it moved to 4.5e-3: the local-steps rows ran at it unless --lr said
LOCAL_LR = dict(lr=3e-3)
RUNS: dict[str, tuple] = {
    "adamw": ("dense AdamW", "dense_adamw.json", {}),
    "adams": ("dense AdamS", "dense_adams.json", {}),
    "scape90": ("SCAPE 0.9, T=100", COORD, dict(sparsity=0.9, mask_refresh_interval=100)),
    "scape99": ("SCAPE 0.99, T=100", COORD, dict(sparsity=0.99, mask_refresh_interval=100)),
    "topk99": ("grad top-k + EF 0.99, T=100", "topk_coordinate.json", dict(sparsity=0.99)),
    "scape99_sparse": ("SCAPE 0.99, sparse refresh T=100", COORD, dict(dense_refresh=False)),
    "scape99_T10": ("SCAPE 0.99, T=10", COORD, dict(mask_refresh_interval=10)),
    "scape99_T50": ("SCAPE 0.99, T=50", COORD, dict(mask_refresh_interval=50)),
    "scape99_T200": ("SCAPE 0.99, T=200", COORD, dict(mask_refresh_interval=200)),
    "scape99_sparse_T1": ("SCAPE 0.99, sparse refresh T=1", COORD,
                          dict(dense_refresh=False, mask_refresh_interval=1)),
    "scape99_sparse_T10": ("SCAPE 0.99, sparse refresh T=10", COORD,
                           dict(dense_refresh=False, mask_refresh_interval=10)),
    # learning-rate check: AdamS's update is bounded near 1 per coordinate (sign-like), so it
    # wants a smaller lr than AdamW; SCAPE at a sparse step moves only the masked coordinates
    "adams_lr1e-3": ("dense AdamS, lr 1e-3", "dense_adams.json", {}, dict(lr=1e-3)),
    "scape99_lr1e-3": ("SCAPE 0.99, T=100, lr 1e-3", COORD, {}, dict(lr=1e-3)),
    "scape90_lr1e-3": ("SCAPE 0.9, T=100, lr 1e-3", COORD, dict(sparsity=0.9), dict(lr=1e-3)),
    "adamw_lr1e-3": ("dense AdamW, lr 1e-3", "dense_adamw.json", {}, dict(lr=1e-3)),
    "topk99_lr1e-3": ("grad top-k + EF 0.99, T=100, lr 1e-3", "topk_coordinate.json", {}, dict(lr=1e-3)),
    "scape99_T50_lr1e-3": ("SCAPE 0.99, T=50, lr 1e-3", COORD, dict(mask_refresh_interval=50), dict(lr=1e-3)),
    # the refresh sweep again at lr 1e-3, where dense AdamS is healthy (it stalls at 3e-3), and random-k
    "scape99_T10_lr1e-3": ("SCAPE 0.99, T=10, lr 1e-3", COORD, dict(mask_refresh_interval=10), dict(lr=1e-3)),
    "scape99_T25_lr1e-3": ("SCAPE 0.99, T=25, lr 1e-3", COORD, dict(mask_refresh_interval=25), dict(lr=1e-3)),
    "scape99_T200_lr1e-3": ("SCAPE 0.99, T=200, lr 1e-3", COORD, dict(mask_refresh_interval=200),
                            dict(lr=1e-3)),
    "scape99_sparse_T1_lr1e-3": ("SCAPE 0.99, sparse refresh T=1, lr 1e-3", COORD,
                                 dict(dense_refresh=False, mask_refresh_interval=1), dict(lr=1e-3)),
    "scape99_sparse_T10_lr1e-3": ("SCAPE 0.99, sparse refresh T=10, lr 1e-3", COORD,
                                  dict(dense_refresh=False, mask_refresh_interval=10), dict(lr=1e-3)),
    "randk99_lr1e-3": ("random-k + EF 0.99, T=100, lr 1e-3", COORD, dict(compressor="randk"), dict(lr=1e-3)),
    # bytes spent on density instead of refreshes: about the bytes of 0.99 at T=25
    "scape95_lr1e-3": ("SCAPE 0.95, T=100, lr 1e-3", COORD, dict(sparsity=0.95), dict(lr=1e-3)),
    # higher lrs: SCAPE did better at 3e-3 than at 1e-3; does it keep improving, and does AdamW?
    "adamw_lr6e-3": ("dense AdamW, lr 6e-3", "dense_adamw.json", {}, dict(lr=6e-3)),
    "scape90_lr6e-3": ("SCAPE 0.9, T=100, lr 6e-3", COORD, dict(sparsity=0.9), dict(lr=6e-3)),
    "scape99_lr6e-3": ("SCAPE 0.99, T=100, lr 6e-3", COORD, {}, dict(lr=6e-3)),
    "scape90_lr1e-2": ("SCAPE 0.9, T=100, lr 1e-2", COORD, dict(sparsity=0.9), dict(lr=1e-2)),
    "scape99_lr1e-2": ("SCAPE 0.99, T=100, lr 1e-2", COORD, {}, dict(lr=1e-2)),
    "scape90_lr4.5e-3": ("SCAPE 0.9, T=100, lr 4.5e-3", COORD, dict(sparsity=0.9), dict(lr=4.5e-3)),
    "scape99_lr4.5e-3": ("SCAPE 0.99, T=100, lr 4.5e-3", COORD, {}, dict(lr=4.5e-3)),
    "scape99_T50_lr6e-3": ("SCAPE 0.99, T=50, lr 6e-3", COORD, dict(mask_refresh_interval=50), dict(lr=6e-3)),
    # hierarchical SCAPE (dense inside a node of 2 ranks, sparse across nodes): run with --ranks 4 for
    # 2 nodes x 2, next to scape99 at --ranks 4
    "scape99_hier": ("SCAPE 0.99, T=100, hierarchy node (2 ranks per node)", COORD,
                     dict(hierarchy="node", intra_node_size=2)),
    # the same in basis dct (ds_configs/scape_hier.json = scape_dct.json + hierarchy node), beside dct99 --ranks 4
    "hier_dct99": ("SCAPE dct 0.99, hierarchy node (2 ranks per node)", "scape_dct.json",
                   dict(hierarchy="node", intra_node_size=2)),
    # update rules (scape_ds/optim/update_rules.py): how coordinates outside the mask learn
    "catchup99": ("SCAPE 0.99 catchup (gain 0.3), T=100", COORD, dict(update_rule="catchup")),
    "catchup99_g0.1": ("SCAPE 0.99 catchup gain 0.1, T=100", COORD,
                       dict(update_rule="catchup", catchup_gain=0.1)),
    "catchup99_g0.03": ("SCAPE 0.99 catchup gain 0.03, T=100", COORD,
                        dict(update_rule="catchup", catchup_gain=0.03)),
    "catchup99_g0.01": ("SCAPE 0.99 catchup gain 0.01, T=100", COORD,
                        dict(update_rule="catchup", catchup_gain=0.01)),
    "drift99_K1": ("SCAPE 0.99 sign_drift K=1, T=100", COORD, dict(update_rule="sign_drift", drift_steps=1)),
    "scape995_T50": ("SCAPE 0.995, T=50", COORD, dict(sparsity=0.995, mask_refresh_interval=50)),
    "reselect99_R25": ("SCAPE 0.99, T=100, masks re-chosen every 25 steps", COORD, dict(reselect_interval=25)),
    "reselect99_R50": ("SCAPE 0.99, T=100, masks re-chosen every 50 steps", COORD, dict(reselect_interval=50)),
    "reselect99_R10": ("SCAPE 0.99, T=100, masks re-chosen every 10 steps", COORD, dict(reselect_interval=10)),
    "reselect90_R50": ("SCAPE 0.9, T=100, masks re-chosen every 50 steps", COORD,
                       dict(sparsity=0.9, reselect_interval=50)),
    "wmean99": ("SCAPE 0.99 window_mean, T=100", COORD, dict(update_rule="window_mean")),
    "drift99": ("SCAPE 0.99 sign_drift K=10, T=100", COORD, dict(update_rule="sign_drift")),
    "drift99_K3": ("SCAPE 0.99 sign_drift K=3, T=100", COORD, dict(update_rule="sign_drift", drift_steps=3)),
    # the best setting of each rule at 0.99, at 0.9
    "catchup90_g0.01": ("SCAPE 0.9 catchup gain 0.01, T=100", COORD,
                        dict(sparsity=0.9, update_rule="catchup", catchup_gain=0.01)),
    "drift90_K1": ("SCAPE 0.9 sign_drift K=1, T=100", COORD,
                   dict(sparsity=0.9, update_rule="sign_drift", drift_steps=1)),
    "wmean90": ("SCAPE 0.9 window_mean, T=100", COORD, dict(sparsity=0.9, update_rule="window_mean")),
    # basis "dct" (ds_configs/scape_dct.json: per_rank mask, sign update, clip_local 1, ef_decay 0.999)
    "dct99": ("SCAPE dct 0.99, per-rank masks", "scape_dct.json", {}),
    "dct99_shared": ("SCAPE dct 0.99, shared mask (nominated union)", "scape_dct.json", dict(mask="shared")),
    "dct99_owner": ("SCAPE dct 0.99, shared mask chosen by each tile's owner", "scape_dct.json",
                    dict(mask="shared", mask_source="owner")),
    "dct99_hold10": ("SCAPE dct 0.99, shared union held 10 steps", "scape_dct.json",
                     dict(mask="shared", mask_hold=10)),
    "dct99_momentum": ("SCAPE dct 0.99, shared mask from the owner's first moment, dense every 100 steps",
                       "scape_dct.json", dict(mask="shared", mask_source="momentum", mask_refresh_interval=100)),
    "dct99_early": ("SCAPE dct 0.99, shared union chosen one step early", "scape_dct.json",
                    dict(mask="shared", mask_early=True)),
    "dct90": ("SCAPE dct 0.9, per-rank masks", "scape_dct.json", dict(sparsity=0.9)),
    "dct90_shared": ("SCAPE dct 0.9, shared mask (nominated union)", "scape_dct.json",
                     dict(sparsity=0.9, mask="shared")),
    # issue 45 item 2, the shared mask at equal bytes: bf16 values (16 bits) and bf16 dense tensors spent on 2.2x the
    # slots of dct99_shared (kc 90: 88 slots per tile at D = 4 and 8, 90 at D = 2), 1.99-2.04% of the bytes at any D
    "dct_shared16_s978": ("SCAPE dct 0.978, shared mask (nominated union), bf16 values, bf16 dense tensors",
                          "scape_dct.json", dict(mask="shared", sparsity=0.978, value_bits=16, dense_wire="bf16")),
    # the union's values coded per tile and summed at each tile's owner (an all-to-all): 4 bits buy 168 slots per
    # tile at D = 8 within 1.94% of the bytes
    "dct_shared4_s958": ("SCAPE dct 0.958, shared mask (nominated union), 4-bit values summed at the owner, "
                         "bf16 dense tensors", "scape_dct.json",
                         dict(mask="shared", sparsity=0.958, value_bits=4, dense_wire="bf16")),
    # the union's nominations in Elias-Fano code too: 240 slots per tile at D = 8 within 1.96% of the bytes
    "dct_shared4ef_s940": ("SCAPE dct 0.94, shared mask (nominated union), 4-bit values summed at the owner, "
                           "bf16 dense tensors, Elias-Fano offsets", "scape_dct.json",
                           dict(mask="shared", sparsity=0.94, value_bits=4, dense_wire="bf16",
                                index_code="elias_fano")),
    "dct90_signum": ("SCAPE dct 0.9, per-rank masks, sign of a momentum of the decoded mean", "scape_dct.json",
                     dict(sparsity=0.9, dct_update="signum")),
    "dct99_signum": ("SCAPE dct 0.99, per-rank masks, sign of a momentum of the decoded mean", "scape_dct.json",
                     dict(dct_update="signum")),
    "dct90_rms": ("SCAPE dct 0.9, per-rank masks, decoded mean / its RMS per tensor", "scape_dct.json",
                  dict(sparsity=0.9, dct_update="rms")),
    "dct99_rms": ("SCAPE dct 0.99, per-rank masks, decoded mean / its RMS per tensor", "scape_dct.json",
                  dict(dct_update="rms")),
    "dct90_adams": ("SCAPE dct 0.9, per-rank masks, AdamS on the decoded mean", "scape_dct.json",
                    dict(sparsity=0.9, dct_update="adams")),
    "dct99_noclip": ("SCAPE dct 0.99, per-rank masks, no clip_local", "scape_dct.json", dict(clip_local=0.0)),
    # ds_configs/scape_dct_overlap.json: scape_dct.json with scape.overlap and gradient_clipping 0 (the
    # overlap refuses the global clip; the update is bitwise the non-overlapped one, so this measures the clip)
    "dct99_overlap": ("SCAPE dct 0.99, per-rank masks, overlap, no gradient_clipping", "scape_dct_overlap.json", {}),
    "dct99_adams": ("SCAPE dct 0.99, per-rank masks, AdamS on the decoded mean", "scape_dct.json",
                    dict(dct_update="adams")),
    "dct99_adamscoef": ("SCAPE dct 0.99, per-rank masks, AdamS on the coefficients", "scape_dct.json",
                        dict(dct_update="adams_coef")),
    # the default (scape_dct.json) with 32 coefficients per tile instead of 41: DeMo's k, every other setting
    # ours (1-D tensors dense AdamS, sum / D). Named "demo" until the independent DeMo (demo.py) replaced it
    # issue 45's bytes lever: the default with 8-bit coded values (scape.value_bits, exchange/quantize.py)
    "dct99_q8": ("SCAPE dct 0.99, 8-bit values (per-tile absmax)", "scape_dct.json", dict(value_bits=8)),
    # issue 47: the default's exchange carrying DiLoCo's pseudo-gradients every 30 steps (scape.local_steps)
    # issue 45: per_rank with bytes flat in D (tile_budget 160: 160 // D per tile), 8-bit values, bf16 dense;
    # its rows ran before scape_dct_scale.json shipped Elias-Fano offsets, so it keeps int16 ones
    "dct_scale": ("SCAPE dct, per-rank masks, 160 // D per tile, 8-bit values, bf16 dense tensors "
                  "(scape_dct_scale.json until it moved to the union, int16 offsets)", "scape_dct.json",
                  dict(PER_RANK_SCALE, index_code="int16", tile_budget=160)),
    # issue 45: scape_dct_scale.json with Elias-Fano offsets (lossless: the same loss as dct_scale), at 160
    # and at 224 (shipped since)
    "dct_scale_ef": ("SCAPE dct, per-rank masks, 160 // D per tile, 8-bit values, bf16 dense tensors, "
                     "Elias-Fano offsets (scape_dct_scale.json until it moved to 224)", "scape_dct.json",
                     dict(PER_RANK_SCALE, tile_budget=160)),
    "dct_scale_ef_b224": ("SCAPE dct, per-rank masks, 224 // D per tile, 8-bit values, bf16 dense tensors, "
                          "Elias-Fano offsets (scape_dct_scale.json until it moved to the union)", "scape_dct.json",
                          dict(PER_RANK_SCALE, tile_budget=224)),
    # issue 45: scape_dct_scale.json decoding each coefficient over the ranks that sent it (decode "senders"), not
    # over D: the probe's direction gains with D (docs/design.md), no byte more
    "dct_scale_b224_senders": ("SCAPE dct, per-rank masks, 224 // D per tile, 8-bit values, bf16 dense tensors, "
                               "Elias-Fano offsets, mean over senders", "scape_dct.json",
                               dict(PER_RANK_SCALE, tile_budget=224, decode="senders")),
    # issue 45: does AdamS on the dense tensors keep the sign update from a higher lr? `dct_scale` (160 // D) with
    # them stepped by AdamW (ABLATIONS)
    "dct_scale_dense_adamw": ("SCAPE dct, per-rank masks, 160 // D per tile, 8-bit values, bf16 dense tensors, "
                              "int16 offsets, dense tensors by AdamW (ablation)", "scape_dct.json",
                              dict(PER_RANK_SCALE, index_code="int16", tile_budget=160)),
    # issue 45: 4-bit values (per-tile absmax) spent on more coefficients, 288 // D per tile: fewer bytes than 224 at
    # 8 bits (1.73% against 1.82% at D = 4, 1.89% against 1.94% at D = 8)
    "dct_scale_q4_b288": ("SCAPE dct, per-rank masks, 288 // D per tile, 4-bit values, bf16 dense tensors, "
                          "Elias-Fano offsets", "scape_dct.json", dict(PER_RANK_SCALE, tile_budget=288, value_bits=4)),
    "dct_scale_q4_b288_senders": ("SCAPE dct, per-rank masks, 288 // D per tile, 4-bit values, bf16 dense tensors, "
                                  "Elias-Fano offsets, mean over senders", "scape_dct.json",
                                  dict(PER_RANK_SCALE, tile_budget=288, value_bits=4, decode="senders")),
    # issue 45 at D = 8: per-rank count was the lever there (20 -> 28 per tile: 1.084x -> 1.044x); 4-bit values
    # buy 39 per tile at D = 8 within 2.0% of the bytes (1.999%)
    "dct_scale_q4_b312": ("SCAPE dct, per-rank masks, 312 // D per tile, 4-bit values, bf16 dense tensors, "
                          "Elias-Fano offsets", "scape_dct.json", Q4_B312),
    # issue 45 at D = 8: against AdamW at the same lr the sign update leads until step ~1000 and loses ground in the
    # cosine's tail, more so as D grows; is it the floor (0.1 x lr: every parameter still moves by +-3e-4 a step)?
    # Both sides annealed to 0 (SCHEDULES)
    "dct_scale_q4_b312_floor0": ("SCAPE dct, per-rank masks, 312 // D per tile, 4-bit values, bf16 dense tensors, "
                                 "Elias-Fano offsets, cosine to 0", "scape_dct.json", Q4_B312),
    "adamw_floor0": ("dense AdamW, cosine to 0", "dense_adamw.json", {}),
    # (until scape_local.json moved to the H = 100 recipe below: these rows ran its H = 30 settings, pinned here)
    "local30_dct99": ("SCAPE local steps H=30 (AdamW inner, Nesterov 0.7/0.9), dct 0.99", "scape_local.json",
                      dict(LOCAL30), LOCAL_LR),
    "local30_dct99_sgd": ("SCAPE local steps H=30, outer SGD lr 1 (no momentum), dct 0.99", "scape_local.json",
                          dict(LOCAL30, outer_lr=1.0, outer_momentum=0.0), LOCAL_LR),
    "local30_dct99_sgd_ef95": ("SCAPE local steps H=30, outer SGD lr 1, ef_decay 0.95, dct 0.99", "scape_local.json",
                               dict(LOCAL30, outer_lr=1.0, outer_momentum=0.0, ef_decay=0.95), LOCAL_LR),
    "local30_dct99_sgd_ef80": ("SCAPE local steps H=30, outer SGD lr 1, ef_decay 0.8, dct 0.99", "scape_local.json",
                               dict(LOCAL30, outer_lr=1.0, outer_momentum=0.0, ef_decay=0.8), LOCAL_LR),
    "local30_dct99_signlr15": ("SCAPE local steps H=30, outer sign, 15 x the lr a step, dct 0.99", "scape_local.json",
                               dict(LOCAL30, outer_update="sign_lr", outer_lr=15.0), LOCAL_LR),
    # issue 47 at <= 0.1% of the bytes: the ef 0.8 SGD recipe with the bytes levers (8-bit values, bf16 dense,
    # Elias-Fano offsets) spent on more coefficients (H 30, sparsity 0.95: 0.088%) or more exchanges
    # (H 10, 0.99: 0.094%), and H 100 at sparsity 0.8 (0.080%: scape_local.json since)
    "local30_s95_q8ef": ("SCAPE local steps H=30, outer SGD lr 1, ef_decay 0.8, dct 0.95, 8-bit values, bf16 dense, "
                         "Elias-Fano offsets", "scape_local.json", dict(LOCAL_LEVERS, local_steps=30, sparsity=0.95),
                         LOCAL_LR),
    "local10_q8ef": ("SCAPE local steps H=10, outer SGD lr 1, ef_decay 0.8, dct 0.99, 8-bit values, bf16 dense, "
                     "Elias-Fano offsets", "scape_local.json", dict(LOCAL_LEVERS, local_steps=10, sparsity=0.99),
                     LOCAL_LR),
    "local100_s80_q8ef": ("SCAPE local steps H=100, outer SGD lr 1, ef_decay 0.8, dct 0.8, 8-bit values, bf16 dense, "
                          "Elias-Fano offsets (scape_local.json at lr 3e-3, outer lr 1)", "scape_local.json",
                          dict(LOCAL_LEVERS, local_steps=100, sparsity=0.8), LOCAL_LR),
    # issue 47, toward 1.03x at <= 0.1%: an outer lr above 1 (15 outer steps in a run: the average lags), and 4-bit
    # values spent on 30% of the coefficients (0.076%)
    "local100_s70_q4ef_olr13": ("SCAPE local steps H=100, outer SGD lr 1.3, ef_decay 0.8, dct 0.7, 4-bit values, "
                                "bf16 dense, Elias-Fano offsets", "scape_local.json",
                                dict(LOCAL_LEVERS, local_steps=100, sparsity=0.7, value_bits=4, outer_lr=1.3),
                                LOCAL_LR),
    "local100_s80_q8ef_olr13": ("SCAPE local steps H=100, outer SGD lr 1.3, ef_decay 0.8, dct 0.8, 8-bit values, "
                                "bf16 dense, Elias-Fano offsets (scape_local.json at --lr 0.0045)", "scape_local.json",
                                dict(LOCAL_LEVERS, local_steps=100, sparsity=0.8, outer_lr=1.3), LOCAL_LR),
    "local100_s80_q8ef_olr16": ("SCAPE local steps H=100, outer SGD lr 1.6, ef_decay 0.8, dct 0.8, 8-bit values, "
                                "bf16 dense, Elias-Fano offsets", "scape_local.json",
                                dict(LOCAL_LEVERS, local_steps=100, sparsity=0.8, outer_lr=1.6), LOCAL_LR),
    # issue 47: fewer, denser outer exchanges at about the same bytes (10 and 5 outer steps in a run); and the
    # per-rank budget set per tile (tile_budget 1638: 20% of a tile at D = 2, 10% at D = 4) so that 4 ranks stay
    # under 0.1% of the bytes
    "local150_s65_q8ef_olr13": ("SCAPE local steps H=150, outer SGD lr 1.3, ef_decay 0.8, dct 0.65, 8-bit values, "
                                "bf16 dense, Elias-Fano offsets", "scape_local.json",
                                dict(LOCAL_LEVERS, local_steps=150, sparsity=0.65, outer_lr=1.3), LOCAL_LR),
    "local300_s30_q8ef_olr13": ("SCAPE local steps H=300, outer SGD lr 1.3, ef_decay 0.8, dct 0.3, 8-bit values, "
                                "bf16 dense, Elias-Fano offsets", "scape_local.json",
                                dict(LOCAL_LEVERS, local_steps=300, sparsity=0.3, outer_lr=1.3), LOCAL_LR),
    # issue 47, the ceiling of compression (LOCAL_DENSE: sparsity 0 sends the dense mean pseudo-gradient)
    "local100_dense_olr13": ("SCAPE local steps H=100, outer SGD lr 1.3, ef_decay 0.8, every coefficient, fp32",
                             "scape_local.json", dict(LOCAL_DENSE, local_steps=100), LOCAL_LR),
    "local30_dense_olr13": ("SCAPE local steps H=30, outer SGD lr 1.3, ef_decay 0.8, every coefficient, fp32",
                            "scape_local.json", dict(LOCAL_DENSE, local_steps=30), LOCAL_LR),
    "local100_tb1638_olr13": ("SCAPE local steps H=100, outer SGD lr 1.3, ef_decay 0.8, 1638 // D per tile, 8-bit "
                              "values, bf16 dense, Elias-Fano offsets", "scape_local.json",
                              dict(LOCAL_LEVERS, local_steps=100, sparsity=None, tile_budget=1638, outer_lr=1.3),
                              LOCAL_LR),
    "dct99_k32": ("SCAPE dct, 32 per tile (the default with DeMo's k)", "scape_dct.json", dict(sparsity=1 - 32 / 4096)),
    # ZeRO-3 (path B, coordinate basis: ds_configs/scape_zero3_coordinate.json, scape_zero3.json until it moved to
    # basis dct): norms, biases and tensors under dense_numel_threshold reduced densely as on path A, against every
    # tensor sparse with error feedback (ABLATIONS)
    "z3_99_dense_small": ("SCAPE ZeRO-3 0.99, T=100, small tensors dense", "scape_zero3_coordinate.json", {}),
    "z3_99_all_sparse": ("SCAPE ZeRO-3 0.99, T=100, every tensor sparse (ablation)", "scape_zero3_coordinate.json",
                         {}),
    # ZeRO-3 in basis dct (ds_configs/scape_zero3.json: scape_dct.json's exchange over each parameter's full shape)
    "z3dct99": ("SCAPE dct 0.99 under ZeRO-3, per-rank masks, sign of the decoded mean", "scape_zero3.json", {}),
    "z3dct99_shared": ("SCAPE dct 0.99 under ZeRO-3, shared mask (nominated union)", "scape_zero3.json",
                       dict(mask="shared")),
    # DiLoCo (arXiv 2311.08105): H local AdamW steps, then the outer Nesterov step (baselines.py)
    "diloco_H30": ("DiLoCo H=30 (outer Nesterov lr 0.7, momentum 0.9)", "dense_adamw.json", {}),
    "diloco_H100": ("DiLoCo H=100 (outer Nesterov lr 0.7, momentum 0.9)", "dense_adamw.json", {}),
    # SparseLoCo (arXiv 2508.15706): DiLoCo with top-64 of 4096 per chunk, 2-bit values, EF decay 0.95
    "sparseloco_H30": ("SparseLoCo H=30 (top-64 of 4096, 2-bit, EF 0.95, outer lr 1)", "dense_adamw.json", {}),
    # DeMo (arXiv 2411.19870) from the paper and its reference code (demo.py, no scape_ds optimizer): 64 x 64
    # tiles and 64-runs of 1-D tensors, top-32 each, accumulator decay 0.999, sign; lr and weight decay of
    # dense_adamw.json; each rank's gradient clipped to norm 1 before it enters the accumulator
    "demo": ("DeMo: top-32 of 64x64 tiles / 64-runs, += grad, sum / D, clip 1", "dense_adamw.json", {}),
    "demo_lrgrad": ("DeMo: top-32, += lr * grad, sum / D, clip 1", "dense_adamw.json", {}),
    "demo_noclip": ("DeMo: top-32, += grad, sum / D, no clip", "dense_adamw.json", {}),
    "demo_mean": ("DeMo: top-32, += grad, mean over senders, clip 1", "dense_adamw.json", {}),
    "demo_noclip_lrgrad": ("DeMo: top-32, += lr * grad, sum / D, no clip", "dense_adamw.json", {}),
}
def _zero3_every_tensor_sparse():
    """ZeRO-3 as it was before small tensors went dense (every tensor masked, with error feedback)."""
    from unittest import mock

    return mock.patch("scape_ds.exchange.stage3.dense_tensor_ids", lambda params, threshold: set())


def _dense_tensors_by_adamw():
    """The dense tensors (norms, biases) of ScapeAdamS stepped by AdamW (torch's, its second moment in a dict
    by tensor, not checkpointed: a resumed run restarts it) instead of AdamS: does AdamS on them limit the lr?"""
    from unittest import mock

    import torch

    second: dict[int, torch.Tensor] = {}

    def adamw(params, grads, momenta, *, step, lr, beta1, beta2, eps, weight_decay, bias_correction, foreach=None):
        vs = [second.setdefault(id(p), torch.zeros_like(p)) for p in params]
        torch.optim._functional.adamw(params, grads, momenta, vs, [], [torch.tensor(float(step - 1)) for _ in params],
                                      foreach=False, amsgrad=False, beta1=beta1, beta2=beta2, lr=lr,
                                      weight_decay=weight_decay, eps=eps, maximize=False)

    return mock.patch("scape_ds.optim.scape.adams", adamw)


# runs that differ by code, not by config: a context manager around their training, on every rank
ABLATIONS = {"z3_99_all_sparse": _zero3_every_tensor_sparse, "dct_scale_dense_adamw": _dense_tensors_by_adamw}
# runs that are not a config of the product alone: the loop calls a baseline object (baselines.py)
BASELINES: dict[str, dict] = {
    "diloco_H30": dict(kind="diloco", H=30),
    "diloco_H100": dict(kind="diloco", H=100),
    "sparseloco_H30": dict(kind="sparseloco", H=30, k=64, chunk=4096, beta=0.95, outer_lr=1.0),
    "demo": dict(kind="demo", accumulate="grad", average="sum", clip=1.0),
    "demo_lrgrad": dict(kind="demo", accumulate="lr_grad", average="sum", clip=1.0),
    "demo_noclip": dict(kind="demo", accumulate="grad", average="sum", clip=0.0),
    "demo_mean": dict(kind="demo", accumulate="grad", average="mean", clip=1.0),
    "demo_noclip_lrgrad": dict(kind="demo", accumulate="lr_grad", average="sum", clip=0.0),
}
COMPARISON = ["adamw", "adams", "scape90", "scape99", "topk99", "scape99_sparse"]
SWEEP = ["scape99_T10", "scape99_T50", "scape99_T200", "scape99_sparse_T1", "scape99_sparse_T10"]
LR_CHECK = ["adams_lr1e-3", "scape99_lr1e-3", "scape90_lr1e-3", "adamw_lr1e-3", "topk99_lr1e-3", "scape99_T50_lr1e-3"]
SWEEP_LR1E3 = ["scape99_T10_lr1e-3", "scape99_T25_lr1e-3", "scape99_T200_lr1e-3", "scape99_sparse_T1_lr1e-3",
               "scape99_sparse_T10_lr1e-3", "randk99_lr1e-3", "scape95_lr1e-3"]
LR_HIGH = ["adamw_lr6e-3", "scape90_lr6e-3", "scape99_lr6e-3", "scape90_lr1e-2", "scape99_lr1e-2", "scape90_lr4.5e-3",
           "scape99_lr4.5e-3", "scape99_T50_lr6e-3"]
# entries whose schedule differs from the shared one (WarmupCosineLR to 0.1 x lr), by name
SCHEDULES = {"dct_scale_q4_b312_floor0": dict(cos_min_ratio=0.0), "adamw_floor0": dict(cos_min_ratio=0.0)}
HIER = ["scape99_hier", "hier_dct99"]
DCT = [n for n in RUNS if n.startswith("dct")]
DEMO = [n for n in RUNS if n.startswith("demo")]
LOCAL_SGD = [n for n in BASELINES if n.startswith(("diloco", "sparseloco"))]
LOCAL_STEPS = [n for n in RUNS if n.startswith("local")]  # scape.local_steps (issue 47)
ZERO3 = [n for n in RUNS if n.startswith("z3")]
UPDATE_RULES = [n for n in RUNS if n.startswith(("catchup", "drift", "wmean", "reselect"))] + ["scape995_T50"]
GROUPS = {"comparison": COMPARISON, "sweep": SWEEP, "lr1e-3": LR_CHECK + SWEEP_LR1E3, "lr_high": LR_HIGH,
          "hier": HIER, "update_rules": UPDATE_RULES, "dct": DCT, "demos": DEMO, "local_sgd": LOCAL_SGD,
          "local_steps": LOCAL_STEPS, "zero3": ZERO3, "schedules": list(SCHEDULES),
          "all": list(RUNS)}

# Settings of a run. The generic ones (GENERIC, with their short form in a run id) may differ per
# invocation; a run id names every generic setting that differs from here. lr None: the run's own lr.
DEFAULTS = dict(steps=1500, seed=1234, n_layer=2, n_embd=128, ranks=2, lr=None, val_fraction=0.05, test_fraction=0.0,
                micro_batch=16, warmup=50, eval_interval=100, eval_iters=8, log_interval=250, seq_len=128,
                n_head=4, timeout=300.0, ckpt_interval=250, diag_window=100)
GENERIC = {"seed": "s", "n_layer": "L", "n_embd": "E", "steps": "steps", "ranks": "r", "lr": "lr",
           "val_fraction": "vf", "test_fraction": "tf"}
SUMMARY_COLUMNS = ["run", "method", "basis", "mask", "update_rule", "sparsity", "mask_refresh_interval",
                   "local_steps", "dense_refresh", "lr", "n_params", "n_layer", "n_embd", "steps", "seed", "ranks",
                   "val_fraction", "test_fraction", "val_loss", "test_loss", "bytes_frac", "wall_s",
                   "frac_updated_last_window", "mean_step_frac_last_window",
                   "mean_abs_displacement", "displacement_vs_adams", "label", "git_rev", "git_diff_sha256", "torch",
                   "deepspeed", "command"]
CURVE_COLUMNS = ["run", "step", "val_loss"]
SUMMARY_CSV, CURVES_CSV, PLOT_PNG = "quality_summary.csv", "quality_curves.csv", "quality_val_loss.png"
BEST_PNG = "quality_best_lr.png"  # each configuration at its best lr, per size: the targets
SEEDS_PNG = "quality_seeds.png"  # configurations run at several seeds: test loss / AdamW's, mean and spread
BYTES_PNG = "quality_loss_vs_bytes.png"  # the plot of record: loss against bytes per step, each at its best lr
CKPT_STATE = "quality_state.pt"  # the diagnostics' state, saved inside each checkpoint tag directory


def expand_runs(spec: str) -> list[str]:
    """``--runs``: comma-separated run names and names of ``GROUPS``, in order, without repeats. An
    unknown name raises ``ValueError``."""
    names: list[str] = []
    for item in (x.strip() for x in spec.split(",")):
        for n in GROUPS.get(item, [item] if item else []):
            if n not in RUNS:
                raise ValueError(f"unknown run {n!r}; choose from the groups {', '.join(GROUPS)} or {', '.join(RUNS)}")
            if n not in names:
                names.append(n)
    return names


def resolve_opts(**opts) -> dict:
    """``DEFAULTS`` updated by ``opts`` (``train_iters`` is an alias of ``steps``), checked."""
    if "train_iters" in opts:
        opts["steps"] = opts.pop("train_iters")
    unknown = set(opts) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown options {sorted(unknown)}; known: {', '.join(DEFAULTS)}")
    opts = {**DEFAULTS, **opts}
    for key in ("steps", "seed", "n_layer", "n_embd", "ranks", "micro_batch", "eval_interval", "eval_iters",
                "seq_len", "n_head", "diag_window"):
        if not isinstance(opts[key], int) or opts[key] < (0 if key == "seed" else 1):
            low = 0 if key == "seed" else 1
            raise ValueError(f"--{key.replace('_', '-')} must be an int >= {low}, got {opts[key]!r}")
    if opts["n_embd"] % opts["n_head"]:
        raise ValueError(f"--n-embd {opts['n_embd']} must be divisible by the {opts['n_head']} heads")
    if opts["lr"] is not None and not opts["lr"] > 0:
        raise ValueError(f"--lr must be > 0, got {opts['lr']!r}")
    if not 0 < opts["val_fraction"] <= 0.5:
        raise ValueError(f"--val-fraction must be in (0, 0.5], got {opts['val_fraction']!r}")
    if not 0 <= opts["test_fraction"] <= 0.5 - opts["val_fraction"]:
        raise ValueError(f"--test-fraction must be in [0, 0.5 - --val-fraction], got {opts['test_fraction']!r}")
    if opts["ckpt_interval"] < 0:
        raise ValueError(f"--ckpt-interval must be >= 0 (0: no checkpoints), got {opts['ckpt_interval']!r}")
    return opts


def run_lr(name: str, opts: dict | None = None) -> float:
    """The learning rate run ``name`` trains at: ``opts["lr"]`` if set, else its override, else its base's."""
    if opts and opts.get("lr") is not None:
        return float(opts["lr"])
    _, base, _, *opt_overrides = RUNS[name]
    for o in opt_overrides:
        if "lr" in o:
            return o["lr"]
    with open(os.path.join(REPO, "ds_configs", base), encoding="utf-8") as f:
        return json.load(f)["optimizer"]["params"]["lr"]


def run_id(name: str, opts: dict) -> str:
    """``name`` plus the generic settings of ``opts`` that differ from ``DEFAULTS`` (lr: from the run's own)."""
    parts = []
    for key, short in GENERIC.items():
        value = opts[key]
        if key == "lr":
            if value is None or float(value) == run_lr(name):
                continue
        elif value == DEFAULTS[key]:
            continue
        parts.append(f"{short}{value:g}" if isinstance(value, float) else f"{short}{value}")
    return name + ("__" + "_".join(parts) if parts else "")


def make_config(name: str, steps: int, micro_batch: int, warmup: int, lr: float | None = None) -> dict:
    """The DeepSpeed config of run ``name``: its ds_configs/ base, the shared schedule, its overrides, ``lr``."""
    if name not in RUNS:
        raise ValueError(f"unknown run {name!r}; choose from {', '.join(RUNS)}")
    _, base, overrides, *opt_overrides = RUNS[name]
    with open(os.path.join(REPO, "ds_configs", base), encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = 1
    cfg["scheduler"] = {"type": "WarmupCosineLR", "params": {
        "total_num_steps": steps, "warmup_num_steps": warmup, "warmup_min_ratio": 0.0, "cos_min_ratio": 0.1,
        **SCHEDULES.get(name, {})}}
    if overrides:  # an override of None drops the base's field (tile_budget in place of sparsity)
        cfg["scape"] = {k: v for k, v in {**cfg["scape"], **overrides}.items() if v is not None}
    for o in opt_overrides:
        cfg["optimizer"]["params"].update(o)
    if lr is not None:
        cfg["optimizer"]["params"]["lr"] = float(lr)
    return cfg


def describe(name: str, cfg: dict, ranks: int = DEFAULTS["ranks"]) -> dict:
    """The method columns of a run: method (adamw | adams | scape | topk | randk | demo | diloco), basis,
    mask, update_rule, sparsity, mask_refresh_interval (DiLoCo: H), local_steps (H of DiLoCo, SparseLoCo
    and ``scape.local_steps``; 1 for a method that exchanges every step), dense_refresh, lr."""
    return dict(_describe(name, cfg, ranks), local_steps=_local_steps(name, cfg))


def _local_steps(name: str, cfg: dict) -> int:
    if name in BASELINES:
        return BASELINES[name].get("H", 1)
    return cfg.get("scape", {}).get("local_steps", 1)


def _describe(name: str, cfg: dict, ranks: int) -> dict:
    lr = cfg["optimizer"]["params"]["lr"]
    if name in BASELINES:
        spec = BASELINES[name]
        if spec["kind"] == "demo":
            return dict(method="demo", basis="dct", mask="per_rank", update_rule="sign", sparsity=1 - 32 / 4096,
                        mask_refresh_interval="", dense_refresh="", lr=lr)
        return dict(method=spec["kind"], basis="", mask="", update_rule="", sparsity="",
                    mask_refresh_interval=spec.get("H", ""), dense_refresh="", lr=lr)
    if "scape" not in cfg:
        method = "adamw" if cfg["optimizer"]["type"].lower() == "adamw" else "adams"
        return dict(method=method, basis="", mask="", update_rule="", sparsity=0.0, mask_refresh_interval="",
                    dense_refresh="", lr=lr)
    sc = cfg["scape"]
    if sc.get("basis") == "dct":  # masks every step: no refresh interval
        method = "scape"
        mask = sc.get("mask", "per_rank")
        if mask == "shared" and sc.get("mask_source", "union") != "union":
            mask = f"shared/{sc['mask_source']}"  # the column says who chose the shared mask
        if mask.startswith("shared") and sc.get("mask_hold", 1) > 1:
            mask += f"/hold{sc['mask_hold']}"  # and for how long, and when
        if mask.startswith("shared") and sc.get("mask_early"):
            mask += "/early"
        refresh = sc.get("mask_refresh_interval", 100) if sc.get("mask_source") == "momentum" else ""
        if "tile_budget" in sc:  # the sparsity the optimizer resolves for the ranks of its exchange
            from scape_ds.config import parse_scape_config

            parsed = parse_scape_config(sc)
            exchange_ranks = ranks // (parsed.intra_node_size or 1) if parsed.hierarchy == "node" else ranks
            sparsity = parsed.for_ranks(exchange_ranks).sparsity
        else:
            sparsity = sc["sparsity"]
        return dict(method=method, basis="dct", mask=mask,
                    update_rule=sc.get("dct_update", "sign"), sparsity=sparsity, mask_refresh_interval=refresh,
                    dense_refresh="", lr=lr)
    return dict(method=sc.get("compressor", "scape"), basis="coordinate", mask="shared",
                update_rule=sc.get("update_rule", "lazy"), sparsity=sc["sparsity"],
                mask_refresh_interval=sc["mask_refresh_interval"], dense_refresh=sc.get("dense_refresh", True), lr=lr)


def rerun_command(name: str, opts: dict) -> str:
    """The command that reruns the row of ``name`` at ``opts``."""
    cmd = ["python bench/quality.py", f"--runs {name}"]
    for key in GENERIC:
        if opts[key] is not None and opts[key] != DEFAULTS[key]:
            cmd.append(f"--{key.replace('_', '-')} {opts[key]}")
    return " ".join(cmd)




def initial_params(opts: dict):
    """The flat fp32 parameters before step 1, rebuilt as the training loop builds the model
    (``torch.manual_seed(seed)`` then ``GPT(...)``), without touching the global RNG: (N,) float32."""
    import torch

    from scape_ds.models import GPT, GPTConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(opts["seed"])
        model = GPT(GPTConfig(vocab_size=256, seq_len=opts["seq_len"], n_layer=opts["n_layer"], n_head=opts["n_head"],
                              n_embd=opts["n_embd"]))
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])  # (N,)
