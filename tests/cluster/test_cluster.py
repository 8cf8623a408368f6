"""launch/cluster.py: namespaces on a bridge with tc-shaped links (needs root; skips without it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "launch"))

from cluster import Cluster, main, namespaces, need_root, parse_rate_bits  # noqa: E402

NO_ROOT = need_root()
pytestmark = pytest.mark.timeout(300)


def test_rate_parsing_and_bad_values():
    assert parse_rate_bits("1gbit") == 1e9 and parse_rate_bits("100mbit") == 1e8
    with pytest.raises(ValueError, match="--rate must look like"):
        parse_rate_bits("1GB/s")
    with pytest.raises(ValueError, match="delay must look like"):
        Cluster(2, "1gbit", "fast")


@pytest.mark.skipif(NO_ROOT is not None, reason=str(NO_ROOT))
def test_two_node_allreduce_crosses_shaped_link_at_set_bandwidth_and_cleans_up():
    before = set(namespaces())
    with Cluster(2, "1gbit", "0.5ms", master_port=29671) as c:
        mine = set(namespaces()) - before
        assert mine == {c.hub, c.node(0), c.node(1)}
        procs = c.launch([sys.executable, os.path.join(REPO, "tests", "cluster", "allreduce_bw.py"), "64", "3"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        assert c.wait(procs, 180) == [0, 0]
        line = [l for l in procs[0].stdout.read().splitlines() if l.startswith("BW ")]
    res = json.loads(line[0][3:])
    assert res["world"] == 2 and res["bytes_sent"] == 64 * 2**20
    assert 0.7e9 <= res["bits_per_s"] <= 1.3e9, res  # within 30% of the 1 Gbit/s link
    assert not (set(namespaces()) - before), "namespaces left behind"


@pytest.mark.skipif(NO_ROOT is not None, reason=str(NO_ROOT))
def test_failing_rank_ends_the_others_and_everything_is_removed():
    before = set(namespaces())
    code = main(["--nodes", "2", "--master-port", "29672", "--timeout", "120", "--", sys.executable, "-c",
                 "import os,sys,time; sys.exit(3) if os.environ['RANK']=='1' else time.sleep(100)"])
    assert code == 1
    assert set(namespaces()) == before


def test_without_root_says_so(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["--nodes", "2", "--", "true"]) == 2
    assert "needs root" in capsys.readouterr().err
