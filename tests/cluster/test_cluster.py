"""launch/cluster.py (scape_ds.cluster): namespaces on a bridge with tc-shaped links (needs root; skips without it).

The clusters use their default master port: it is bound inside namespaces each cluster has just made.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time

import pytest

from scape_ds.cluster import Cluster, find_mpiexec, main, namespace_tag, namespaces, need_root, parse_rate_bits

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NO_ROOT = need_root()
NO_MPI = None if find_mpiexec() else "no mpiexec: install the mpi extra (pip install -e '.[mpi]')"
pytestmark = pytest.mark.timeout(300)
BW_SCRIPT = os.path.join(REPO, "tests", "cluster", "allreduce_bw.py")


def _ours() -> set[str]:
    """This test process's namespaces (a Cluster's default tag is scape<pid>); others' are not ours."""
    return {n for n in namespaces() if namespace_tag(n) == f"scape{os.getpid()}"}


def _wait_for_pids(ns: str, n: int, timeout: float = 10.0) -> None:
    """Wait until ``ip netns pids`` lists at least ``n`` processes in ``ns`` (they were just started)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if len(subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()) >= n:
            return
        time.sleep(0.05)


def _bw_lines(stdout: str) -> dict:
    return {r["backend"]: r for r in (json.loads(line[3:]) for line in stdout.splitlines() if line.startswith("BW "))}


def test_rate_parsing_and_bad_values():
    assert parse_rate_bits("1gbit") == 1e9 and parse_rate_bits("100mbit") == 1e8
    with pytest.raises(ValueError, match="--rate must look like"):
        parse_rate_bits("1GB/s")
    with pytest.raises(ValueError, match="delay must look like"):
        Cluster(2, "1gbit", "fast")
    with pytest.raises(ValueError, match="mtu must be in"):
        Cluster(2, "1gbit", mtu=100)


@pytest.mark.skipif(NO_ROOT is not None, reason=str(NO_ROOT))
def test_two_node_allreduce_crosses_shaped_link_at_set_bandwidth_and_cleans_up():
    assert not _ours()
    with Cluster(2, "1gbit", "0.5ms") as c:
        assert _ours() == {c.hub, c.node(0), c.node(1)}
        procs = c.launch([sys.executable, BW_SCRIPT, "64", "3"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         text=True)
        assert c.wait(procs, 180) == [0, 0]
        res = _bw_lines(procs[0].stdout.read())["gloo"]
    assert res["world"] == 2 and res["bytes_sent"] == 64 * 2**20 and res["addrs"] == [c.ip(0)]
    assert 0.7e9 <= res["bits_per_s"] <= 1.3e9, res  # within 30% of the 1 Gbit/s link
    assert not _ours(), "namespaces left behind"


@pytest.mark.skipif(NO_ROOT is not None, reason=str(NO_ROOT))
def test_ranks_of_one_node_talk_unshaped_and_only_across_nodes_cross_the_link():
    with Cluster(2, "100mbit", "0.5ms", ranks_per_node=2) as c:
        procs = c.launch([sys.executable, BW_SCRIPT, "4", "2", "--intra"], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
        assert c.wait(procs, 180) == [0] * 4
        res = _bw_lines(procs[0].stdout.read())
    assert res["gloo"]["world"] == 4 and res["gloo"]["bits_per_s"] <= 2 * 100e6, res  # the 100 Mbit/s links
    assert res["gloo-intra"]["world"] == 2 and res["gloo-intra"]["bits_per_s"] >= 10 * 100e6, res  # not shaped
    assert not _ours(), "namespaces left behind"


@pytest.mark.skipif(NO_ROOT is not None, reason=str(NO_ROOT))
def test_failing_rank_ends_the_others_and_everything_is_removed(capsys):
    assert not _ours()
    t0 = time.monotonic()
    code = main(["--nodes", "2", "--timeout", "120", "--", sys.executable, "-c",
                 "import os,sys,time; sys.exit(3) if os.environ['RANK']=='1' else time.sleep(100)"])
    elapsed = time.monotonic() - t0
    # rank 1's exit 3 ended rank 0 (SIGTERM) at once: not its 100 s sleep, nor the 120 s timeout
    assert code == 1
    assert "cluster: ranks failed (rank, exit code): [(0, -15), (1, 3)]" in capsys.readouterr().err
    assert elapsed < 60, elapsed
    assert not _ours(), "namespaces left behind"


def test_without_root_says_so(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["--nodes", "2", "--", "true"]) == 2
    assert "needs root" in capsys.readouterr().err


@pytest.mark.skipif(NO_ROOT is not None, reason=str(NO_ROOT))
def test_close_kills_what_the_cluster_started_and_leaves_other_processes(capsys):
    """Processes carrying the cluster's marker (every rank it starts, and their children) die on
    close even when the cluster lost track of them (e.g. ranks whose mpiexec was killed); a process
    someone else started in a node (a debugging shell) is left alone and named."""
    with Cluster(2, "1gbit", "0.5ms") as c:
        ours = subprocess.Popen(["ip", "netns", "exec", c.node(1), "sleep", "300"], env=c.rank_env(1))
        other = subprocess.Popen(["ip", "netns", "exec", c.node(1), "sleep", "300"])
        _wait_for_pids(c.node(1), 2)
    try:
        assert ours.wait(timeout=10) == -signal.SIGKILL
        assert other.poll() is None, "a process the cluster did not start was killed"
        assert str(other.pid) in capsys.readouterr().err
        assert not _ours(), "namespaces left behind"
    finally:
        other.kill()
        other.wait()
        ours.kill()
        ours.wait()


@pytest.mark.skipif(NO_ROOT is not None, reason=str(NO_ROOT))
def test_cleanup_stale_removes_a_killed_runs_namespaces_and_its_processes(capsys):
    """--cleanup-stale: namespaces whose creator (the pid in the name) is gone are deleted, after the
    processes that run carried in them are killed; a live cluster's namespaces are not touched."""
    dead = 4_000_000  # above pid_max's default range: no such process
    assert not os.path.exists(f"/proc/{dead}")
    ns = f"scape{dead}n0"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    rank = None
    try:
        rank = subprocess.Popen(["ip", "netns", "exec", ns, "sleep", "300"],
                                env=dict(os.environ, SCAPE_CLUSTER_TAG=f"scape{dead}"))
        _wait_for_pids(ns, 1)
        with Cluster(2, "1gbit", "0.5ms") as c:
            assert main(["--cleanup-stale"]) == 0
            assert _ours() == {c.hub, c.node(0), c.node(1)}, "a live cluster's namespaces were removed"
        assert rank.wait(timeout=10) == -signal.SIGKILL
        assert ns not in namespaces() and f"deleted {ns}" in capsys.readouterr().out
    finally:
        if rank is not None and rank.poll() is None:
            rank.kill()
            rank.wait()
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.skipif(NO_ROOT is not None or NO_MPI is not None, reason=str(NO_ROOT or NO_MPI))
def test_mpiexec_starts_every_rank_inside_its_node_and_mpi_crosses_the_shaped_link():
    assert not _ours()
    with Cluster(2, "1gbit", "0.5ms") as c:
        proc = c.launch_mpi([sys.executable, BW_SCRIPT, "32", "3", "--mpi"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
        assert c.wait([proc], 180) == [0]
        res = _bw_lines(proc.stdout.read())
        script_dir = c.scratch
    assert set(res) == {"mpi", "gloo"}
    for backend in ("mpi", "gloo"):
        # each rank reports its own node's address: hydra's proxies ran inside the namespaces
        assert res[backend]["world"] == 2 and res[backend]["addrs"] == [c.ip(0), c.ip(1)], res
        # MPI's data crossed the 1 Gbit/s links (shared memory between the ranks would be ~10x faster)
        assert 0.7e9 <= res[backend]["bits_per_s"] <= 1.3e9, res
    assert not _ours(), "namespaces left behind"
    assert not os.path.exists(script_dir), "launcher script left behind"


@pytest.mark.skipif(NO_ROOT is not None or NO_MPI is not None, reason=str(NO_ROOT or NO_MPI))
def test_killed_rank_ends_an_mpi_job_and_everything_is_removed(capsys):
    assert not _ours()
    t0 = time.monotonic()
    code = main(["--nodes", "2", "--mpi", "--timeout", "120", "--", sys.executable, "-c",
                 "from mpi4py import MPI; import os,time; "
                 "os.kill(os.getpid(), 9) if MPI.COMM_WORLD.rank == 1 else time.sleep(100)"])
    assert code == 1
    # hydra ended the job itself for the killed rank: exit code 9 (the rank's signal), or 255 when its
    # proxy on the dead rank's node saw the connection close first (both seen in 4 runs); the
    # cluster's timeout would end it with SIGTERM (-15)
    err = capsys.readouterr().err
    assert re.search(r"^cluster: mpiexec exited (9|255)$", err, re.MULTILINE), err
    assert time.monotonic() - t0 < 60, "mpiexec waited for the sleeping rank instead of ending the job"
    assert not _ours(), "namespaces left behind"


@pytest.mark.timeout(420)
@pytest.mark.skipif(NO_ROOT is not None or NO_MPI is not None, reason=str(NO_ROOT or NO_MPI))
def test_deepspeed_launcher_with_mpich_trains_across_emulated_nodes(tmp_path):
    """``deepspeed --launcher mpich`` (DeepSpeed's own launcher, hydra under it) over two emulated
    nodes, with SCAPE's exchange over the mpi4py backend."""
    bin_dir = os.path.dirname(sys.executable)
    metrics = tmp_path / "m.jsonl"
    with Cluster(2, "1gbit", "0.5ms") as c:
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("".join(f"{c.ip(i)} slots=1\n" for i in range(c.nodes)))
        cmd = ["ip", "netns", "exec", c.node(0), os.path.join(bin_dir, "deepspeed"), "--hostfile", str(hostfile),
               "--launcher", "mpich", "--launcher_args", shlex.join(c.mpi_args(hosts=False)), "--master_addr", c.ip(0),
               "--master_port", str(c.master_port), "--no_ssh_check", "launch/pretrain.py",
               "--deepspeed_config", "ds_configs/scape_mpi.json", "--train-iters", "12", "--log-interval", "6",
               "--eval-interval", "12", "--metrics-out", str(metrics), "--no-progress"]
        env = c.mpi_env(dict(PATH=bin_dir + os.pathsep + os.environ.get("PATH", ""), DS_ACCELERATOR="cpu"))
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        c.procs.append(proc)
        out = proc.communicate(timeout=360)[0]
    assert proc.returncode == 0, out[-4000:]
    assert "mpirun -n 2 -ppn 1 -launcher rsh" in out  # DeepSpeed's MPICH runner built the job
    assert "| 2 ranks: TP1 x PP1 x DP2 (GPT) |" in out
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
    assert all(r["bytes_sent"] <= 0.03 * r["bytes_dense"] for r in rows[1:])


@pytest.mark.skipif(NO_ROOT is not None, reason=str(NO_ROOT))
def test_dct_hierarchy_across_two_emulated_nodes_of_two_sends_under_half_of_flat(tmp_path):
    """ds_configs/scape_dct.json with one field changed (``"hierarchy": "node"``) on 2 nodes x 2 ranks
    (LOCAL_WORLD_SIZE = 2 from the cluster), through launch/pretrain.py, beside the flat config: both
    learn, and every step the hierarchy sends at most nodes / ranks of flat's bytes across nodes."""
    with open(os.path.join(REPO, "ds_configs", "scape_dct.json")) as f:
        cfg = json.load(f)
    rows = {}
    for hierarchy in ("flat", "node"):
        cfg["scape"]["hierarchy"] = hierarchy
        path, metrics = tmp_path / f"{hierarchy}.json", tmp_path / f"{hierarchy}.jsonl"
        path.write_text(json.dumps(cfg))
        cmd = [sys.executable, "launch/pretrain.py", "--deepspeed_config", str(path), "--train-iters", "12",
               "--log-interval", "6", "--eval-interval", "12", "--metrics-out", str(metrics), "--no-progress"]
        with Cluster(2, "1gbit", "0.5ms", ranks_per_node=2) as c:
            procs = c.launch(cmd, env=dict(DS_ACCELERATOR="cpu"), cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
            codes = c.wait(procs, 300)
            out = procs[0].stdout.read()
        assert codes == [0] * 4, out[-4000:]
        if hierarchy == "node":
            assert "hierarchy node (2 ranks per node x 2 nodes)" in out, out[-4000:]
        rows[hierarchy] = [json.loads(line) for line in metrics.read_text().splitlines()]
    for h, f in zip(rows["node"], rows["flat"], strict=True):
        assert h["bytes_intra"] > 0 and f["bytes_intra"] == 0
        assert h["bytes_inter"] <= f["bytes_inter"] * 2 / 4, (h["step"], h["bytes_inter"], f["bytes_inter"])
    for run in rows.values():
        assert run[-1]["loss"] < run[0]["loss"] - 0.5, [r["loss"] for r in run]
    assert not _ours(), "namespaces left behind"
