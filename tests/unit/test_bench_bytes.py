"""bench/bytes.py --configs: a config's bytes per step on the bench model, against counts by hand."""
import json
import os

import bytes as bench_bytes  # bench/ is on pytest's pythonpath (pytest.ini)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _scape(name: str, **changes) -> dict:
    with open(os.path.join(REPO, "ds_configs", name), encoding="utf-8") as f:
        return dict(json.load(f)["scape"], **changes)


def test_elias_fano_offsets_cost_43_bytes_a_tile_at_kc_40():
    # 4 ranks, tile_budget 160: 40 of each 4096-coefficient tile per rank; int16 offsets 80 bytes a tile,
    # Elias-Fano 40 x 6 low bits + a bitmap of 40 + 64 bits = 43 bytes; nothing else changes
    plain = bench_bytes.count_config(_scape("scape_dct_scale.json", index_code="int16", tile_budget=160), 4)
    coded = bench_bytes.count_config(_scape("scape_dct_scale.json", tile_budget=160), 4)
    tiles = plain["by_tag"]["index_ag"] / (3 * 40 * 2)
    assert tiles == int(tiles) > 0
    assert coded["by_tag"]["index_ag"] == 3 * tiles * 43
    assert {k: v for k, v in coded["by_tag"].items() if k != "index_ag"} == {
        k: v for k, v in plain["by_tag"].items() if k != "index_ag"}
    assert plain["by_tag"]["grad_ag"] == 3 * tiles * (40 + 4)  # 8-bit values and one fp32 scale a tile
    assert abs(coded["vs_dense"] - coded["bytes_per_step"] / coded["dense_per_step"]) < 1e-12


def test_local_steps_bytes_are_the_outer_exchange_over_h():
    every = bench_bytes.count_config(_scape("scape_dct.json"), 2)
    local = bench_bytes.count_config(_scape("scape_local.json", local_steps=5, sparsity=0.99, value_bits=32,
                                            dense_wire="fp32", index_code="int16"), 2)
    # the same exchange (sparsity 0.99, fp32, int16 offsets) once per 5 steps
    assert local["bytes_per_step"] * 5 == every["bytes_per_step"]
