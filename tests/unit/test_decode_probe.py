"""bench/decode_probe.py runs, and its counts obey the exchanges' bounds (a short run)."""
from __future__ import annotations

import json

import decode_probe  # bench/ is on pytest's pythonpath (pytest.ini)


def test_probe_runs_and_its_counts_obey_the_bounds(tmp_path):
    out = tmp_path / "probe.json"
    decode_probe.main(["--ranks", "2", "4", "--warm", "2", "--steps", "3", "--skip", "1", "--ref-batches", "1",
                       "--out", str(out)])
    results = json.loads(out.read_text())["results"]
    for D, r in ((int(d), r) for d, r in results.items()):
        for kind in ("dense", "per_rank", "per_rank/senders", "shared", "shared/equal", "per_rank/2%", "per_rank/q4",
                     "shared/2%", "shared/oracle", "shared/2%/oracle"):
            assert 0.0 < r[kind] <= 1.0, (D, kind, r[kind])
        kc, K = decode_probe.KC, max(1, decode_probe.KC // D)
        assert kc <= r["coefficients_per_tile/per_rank"] <= D * kc  # the union of D top-kc sets
        assert K <= r["coefficients_per_tile/shared"] <= D * K  # the union of D nominations of K
        assert 25 <= r["coefficients_per_tile/shared/equal"] <= D * 25
        assert 160 // D <= r["coefficients_per_tile/per_rank/2%"] <= 160
        assert 312 // D <= r["coefficients_per_tile/per_rank/q4"] <= D * (312 // D)
        assert 90 // D <= r["coefficients_per_tile/shared/2%"] <= D * (90 // D)
        # the oracle takes exactly the union's slots, each a distinct coefficient of the tile
        assert r["coefficients_per_tile/shared/oracle"] == D * K
        assert r["coefficients_per_tile/shared/2%/oracle"] == D * (90 // D)
