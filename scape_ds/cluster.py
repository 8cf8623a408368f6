"""Emulate an N-node cluster on one Linux machine: network namespaces, a bridge, shaped links.

    sudo python launch/cluster.py --nodes 4 --rate 1gbit --delay 0.5ms -- \\
        python launch/pretrain.py --deepspeed_config ds_configs/scape_dct.json --train-iters 50
    sudo python launch/cluster.py --nodes 2 --rate 10gbit --ranks-per-node 2 -- python my_script.py
    sudo python launch/cluster.py --cleanup-stale        # remove namespaces left by a killed run

Each node is a network namespace ``scape<pid>n<i>`` whose ``eth0`` (10.77.0.<i+1>/24) is one end
of a veth pair; the other ends hang on a bridge in a hub namespace ``scape<pid>hub``, so nothing
touches the host's own network. Both directions of every node's link are shaped with ``tc``: a
token bucket (``tbf``) at --rate, and on the node's egress a ``netem`` one-way --delay (where the
kernel has sch_netem; otherwise a warning, and bandwidth shaping only). Traffic between nodes
therefore crosses two shaped links, like two NICs through a switch.

The command runs once per rank, inside its node's namespace, with the torch.distributed variables
set (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR = node 0, MASTER_PORT) and
GLOO_SOCKET_IFNAME=eth0, so gloo binds to the shaped interface. With ``--ranks-per-node G`` the G
ranks of a node share its namespace and its address: traffic between them takes the namespace's
local route, unshaped (a node's fast interconnect), and only traffic between nodes crosses the
shaped links; LOCAL_WORLD_SIZE = G tells ``scape.hierarchy "node"`` which ranks share a node.

With ``--mpi`` the ranks are MPI's instead: MPICH's ``mpiexec`` (hydra, from the ``mpi`` extra) runs
in node 0's namespace with the nodes' addresses as its hosts, and starts its proxy on every node
through a generated ``-launcher rsh -launcher-exec`` script that enters that node's namespace, so
every rank runs inside its node and finds its rank through MPI (``deepspeed.init_distributed``'s
MPI discovery). MPI's own traffic is pinned to TCP over ``eth0`` (``UCX_TLS=tcp``,
``UCX_NET_DEVICES=eth0``): the emulated nodes share one kernel, and UCX would otherwise move data
through shared memory and bypass the shaped links. ``Cluster.mpi_args()`` gives the same hydra
arguments to a launcher that builds its own ``mpirun`` line (``deepspeed --launcher mpich
--launcher_args ...``).

Everything created is removed on exit, on failure and on Ctrl-C/SIGTERM (a second one during the
clean-up is ignored): the processes started, and any process left inside the namespaces that carries
the cluster's ``SCAPE_CLUSTER_TAG`` (ranks whose mpiexec died, their children; other processes there
are named, not killed), the namespaces and the generated launcher script. Needs root (network
namespaces and tc); without it, it says so and exits 2.

``launch/cluster.py`` is the command line (:func:`main`); benchmarks and tests use :class:`Cluster`.
The rendezvous port (``master_port``, 29600 by default) is bound inside node 0's namespace, which the
cluster has just created, so no other process can hold it and a fixed number is safe there.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

SUBNET = "10.77.0"
_PREFIX = "scape"
MARKER = "SCAPE_CLUSTER_TAG"
"""Environment variable set to the cluster's tag in every process it starts (found again at close)."""
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(k|m|g)?bit$", re.IGNORECASE)
_DELAY = re.compile(r"^(\d+(?:\.\d+)?)(us|ms|s)$")

__all__ = ["Cluster", "parse_rate_bits", "need_root", "namespace_tag", "namespaces", "stale_namespaces",
           "find_mpiexec", "kill_marked", "main"]

# MPI traffic over the shaped interface only: UCX picks shared memory or CMA between processes of
# one kernel, which would bypass the links (MPICH's own shared memory is off: hydra places every
# node on its own host)
MPI_ENV = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "eth0"}


def parse_rate_bits(rate: str) -> float:
    """``"1gbit"`` -> 1e9 (bits per second); raises ValueError naming the accepted forms."""
    m = _RATE.match(rate.strip())
    if not m:
        raise ValueError(f"--rate must look like 100mbit, 1gbit or 10gbit, got {rate!r}")
    return float(m.group(1)) * {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}[(m.group(2) or "").lower() or None]


def need_root() -> str | None:
    """``None`` when this process can build the cluster, else why not."""
    if os.geteuid() != 0:
        return "launch/cluster.py needs root (network namespaces and tc); run it with sudo"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"launch/cluster.py needs the '{tool}' command (Debian: apt-get install iproute2)"
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.strip()}")
    return proc


def find_mpiexec() -> str | None:
    """MPICH's ``mpiexec`` next to this Python (the ``mpi`` extra), else on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    return here if os.access(here, os.X_OK) else shutil.which("mpiexec")


def namespaces() -> list[str]:
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def namespace_tag(ns: str) -> str | None:
    """The tag of the cluster that made namespace ``ns`` (``scape<creator pid>``), or None if none did."""
    m = re.fullmatch(rf"({_PREFIX}\d+)(?:n\d+|hub)", ns)
    return m.group(1) if m else None


def stale_namespaces() -> list[str]:
    """Namespaces of this tool whose creating process is gone."""
    return [ns for ns in namespaces()
            if (tag := namespace_tag(ns)) and not os.path.exists(f"/proc/{tag[len(_PREFIX):]}")]


def _marked(pid: str, tag: str) -> bool:
    """Whether process ``pid`` carries ``SCAPE_CLUSTER_TAG=<tag>`` in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{MARKER}={tag}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def kill_marked(namespaces: list[str], tag: str, timeout: float = 5.0) -> list[int]:
    """SIGKILL every process in ``namespaces`` whose environment carries the cluster's marker,
    again until none is left (children forked meanwhile) or ``timeout``; returns the PIDs there
    without the marker, which are not touched."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [pid for ns in namespaces for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split()]
        ours = [pid for pid in pids if _marked(pid, tag)]
        for pid in ours:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        if not ours or time.monotonic() > deadline:
            return sorted(int(pid) for pid in pids if pid not in ours)
        time.sleep(0.1)


@dataclass
class Cluster:
    """``nodes`` namespaces on a bridge, each link shaped to ``rate`` with one-way ``delay``.

    Use as a context manager (the namespaces exist inside the ``with`` and are gone after it)::

        with Cluster(2, "1gbit", "0.5ms") as c:
            procs = c.launch(["python", "x.py"])
            c.wait(procs, timeout=600)

    Faults while ranks run: :meth:`link_down`, :meth:`link_up`, :meth:`set_rate`.
    """

    nodes: int
    rate: str = "1gbit"
    delay: str = "0.5ms"
    ranks_per_node: int = 1
    master_port: int = 29600
    mtu: int = 1500
    """MTU of every link (9000: the jumbo frames of a datacenter network, far fewer packets per byte)."""
    tag: str = field(default_factory=lambda: f"{_PREFIX}{os.getpid()}")
    created: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    scratch: str | None = None
    """Directory of the generated MPI launcher script (made by :meth:`mpi_args`)."""
    delay_applied: bool | None = None
    """Whether netem added --delay (None before build; False where the kernel lacks sch_netem)."""

    def __post_init__(self):
        if self.nodes < 1 or self.nodes > 200:
            raise ValueError(f"nodes must be in [1, 200], got {self.nodes}")
        if self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be >= 1, got {self.ranks_per_node}")
        self.rate_bits = parse_rate_bits(self.rate)
        if not _DELAY.match(self.delay):
            raise ValueError(f"delay must look like 0.5ms or 100us, got {self.delay!r}")
        if not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be in [576, 65535], got {self.mtu}")

    # -- names ---------------------------------------------------------------------------------
    @property
    def hub(self) -> str:
        return f"{self.tag}hub"

    def node(self, i: int) -> str:
        return f"{self.tag}n{i}"

    def ip(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    # -- build and tear down ------------------------------------------------------------------
    def __enter__(self) -> "Cluster":
        reason = need_root()
        if reason:
            raise PermissionError(reason)
        self._old_handlers = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _on_signal(self, signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    def _ns(self, ns: str, *cmd: str) -> None:
        _sh("ip", "netns", "exec", ns, *cmd)

    @staticmethod
    def _tbf(rate_bits: float) -> list[str]:
        burst = max(64 * 1024, int(rate_bits / 8 * 0.002))  # 2 ms of line rate, at least one GSO packet
        return ["tbf", "rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", "50ms"]

    def _shape(self, ns: str, dev: str, delay: bool) -> None:
        self._ns(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *self._tbf(self.rate_bits))
        if delay and self.delay_applied is not False and not re.match(r"^0+(\.0+)?(us|ms|s)$", self.delay):
            proc = _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:",
                       "netem", "delay", self.delay, "limit", "100000", check=False)
            self.delay_applied = proc.returncode == 0
            if not self.delay_applied:  # e.g. a kernel built without sch_netem: bandwidth only
                print(f"cluster: warning: no added latency, tc netem is unavailable here ({proc.stderr.strip()})",
                      file=sys.stderr, flush=True)

    def _build(self) -> None:
        _sh("ip", "netns", "add", self.hub)
        self.created.append(self.hub)
        self._ns(self.hub, "ip", "link", "set", "lo", "up")
        self._ns(self.hub, "ip", "link", "add", "br0", "type", "bridge")
        self._ns(self.hub, "ip", "link", "set", "br0", "up")
        for i in range(self.nodes):
            ns = self.node(i)
            _sh("ip", "netns", "add", ns)
            self.created.append(ns)
            _sh("ip", "link", "add", f"h{i}", "netns", self.hub, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ns(self.hub, "ip", "link", "set", f"h{i}", "master", "br0")
            self._ns(self.hub, "ip", "link", "set", f"h{i}", "mtu", str(self.mtu), "up")
            self._ns(ns, "ip", "link", "set", "eth0", "mtu", str(self.mtu))
            self._ns(ns, "ip", "link", "set", "lo", "up")
            self._ns(ns, "ip", "addr", "add", f"{self.ip(i)}/24", "dev", "eth0")
            self._ns(ns, "ip", "link", "set", "eth0", "up")
            self._shape(ns, "eth0", delay=True)       # node -> switch
            self._shape(self.hub, f"h{i}", delay=False)  # switch -> node
        self._wait_links()

    def _wait_links(self, timeout: float = 10.0) -> None:
        """Wait until every node's eth0 and its bridge port are up (the bridge has no STP delay)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [_sh("ip", "netns", "exec", self.node(i), "cat", "/sys/class/net/eth0/operstate").stdout.strip()
                      for i in range(self.nodes)]
            if all(s == "up" for s in states):
                return
            time.sleep(0.1)
        raise RuntimeError(f"links did not come up within {timeout} s: {states}")

    # -- faults (tests: tests/cluster/test_faults.py) ------------------------------------------
    def link_down(self, i: int) -> None:
        """Cut node ``i`` off: its port on the bridge goes down, so its ``eth0`` loses carrier (a
        pulled cable). Packets either way are dropped; open connections just stop hearing back."""
        self._ns(self.hub, "ip", "link", "set", f"h{i}", "down")

    def link_up(self, i: int) -> None:
        """Plug node ``i`` back in (:meth:`link_down` undone) and wait until its link is up."""
        self._ns(self.hub, "ip", "link", "set", f"h{i}", "up")
        self._wait_links()

    def set_rate(self, i: int, rate: str) -> None:
        """Reshape node ``i``'s link to ``rate`` both ways (e.g. ``"1mbit"``) while ranks run; the
        other nodes' links keep theirs. Raises ValueError for a rate :func:`parse_rate_bits` refuses."""
        tbf = self._tbf(parse_rate_bits(rate))
        self._ns(self.node(i), "tc", "qdisc", "change", "dev", "eth0", "root", "handle", "1:", *tbf)
        self._ns(self.hub, "tc", "qdisc", "change", "dev", f"h{i}", "root", "handle", "1:", *tbf)

    def close(self) -> None:
        """End the processes this cluster started and delete every namespace it made. Ctrl-C,
        SIGTERM and SIGHUP are ignored until that is done, so a second one cannot cut it short."""
        main = threading.current_thread() is threading.main_thread()
        signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        held = {s: signal.signal(s, signal.SIG_IGN) for s in signals} if main else {}
        try:
            self._teardown()
        finally:
            for s, h in held.items():
                signal.signal(s, h)
            if main:
                for s, h in getattr(self, "_old_handlers", {}).items():
                    signal.signal(s, h)
            self._old_handlers = {}

    def _teardown(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
                p.wait()
        self._kill_namespace_pids()
        for ns in reversed(self.created):
            _sh("ip", "netns", "del", ns, check=False)
        self.created.clear()
        if self.scratch:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None

    def _kill_namespace_pids(self) -> None:
        """SIGKILL what this cluster started that still runs in its namespaces (e.g. MPI ranks whose
        mpiexec died); other processes there (a debugging shell) are left and named."""
        left = kill_marked(self.created, self.tag)
        if left:
            print(f"cluster: warning: processes not started by this cluster still run in its namespaces: {left}",
                  file=sys.stderr, flush=True)

    # -- running ranks ------------------------------------------------------------------------
    def rank_env(self, rank: int, extra: dict | None = None) -> dict:
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(self.world_size),
                   LOCAL_RANK=str(rank % self.ranks_per_node), LOCAL_WORLD_SIZE=str(self.ranks_per_node),
                   MASTER_ADDR=self.ip(0),
                   MASTER_PORT=str(self.master_port), GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1",
                   SCAPE_CLUSTER_NODE=str(rank // self.ranks_per_node), **{MARKER: self.tag})
        env.update(extra or {})
        return env

    def launch(self, cmd: list[str], env: dict | None = None, **popen) -> list[subprocess.Popen]:
        """Start ``cmd`` for every rank (rank r on node r // ranks_per_node); returns the processes."""
        procs = []
        for rank in range(self.world_size):
            ns = self.node(rank // self.ranks_per_node)
            p = subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=self.rank_env(rank, env), **popen)
            procs.append(p)
            self.procs.append(p)
        return procs

    def mpi_args(self, hosts: bool = True) -> list[str]:
        """Hydra arguments that start one proxy per node inside its namespace (``mpiexec`` must run in
        node 0's namespace): ``-launcher rsh -launcher-exec <script> -iface eth0 [-hosts <node IPs>]``.
        ``hosts=False`` for a launcher that writes its own ``-hosts`` (DeepSpeed's, from a hostfile)."""
        if self.scratch is None:
            self.scratch = tempfile.mkdtemp(prefix=f"{self.tag}-")
        script = os.path.join(self.scratch, "enter_node.sh")
        cases = "\n".join(f"  {self.ip(i)}) ns={self.node(i)} ;;" for i in range(self.nodes))
        with open(script, "w") as f:  # hydra calls: <script> <host> <proxy command line>
            f.write(f"#!/bin/sh\nhost=$1; shift\ncase $host in\n{cases}\n"
                    f"  *) echo \"enter_node.sh: unknown node $host\" >&2; exit 2 ;;\nesac\n"
                    f"exec {shlex.quote(shutil.which('ip') or 'ip')} netns exec \"$ns\" sh -c \"$*\"\n")
        os.chmod(script, 0o700)
        args = ["-launcher", "rsh", "-launcher-exec", script, "-iface", "eth0"]
        return args + (["-hosts", ",".join(self.ip(i) for i in range(self.nodes))] if hosts else [])

    def mpi_env(self, extra: dict | None = None) -> dict:
        """Environment of an MPI job in this cluster: MASTER_PORT, gloo and MPI on ``eth0``."""
        env = dict(os.environ, MASTER_PORT=str(self.master_port), GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1",
                   **MPI_ENV, **{MARKER: self.tag})
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"):  # MPI decides these
            env.pop(key, None)
        env.update(extra or {})
        return env

    def launch_mpi(self, cmd: list[str], env: dict | None = None, mpiexec: str | None = None,
                   **popen) -> subprocess.Popen:
        """Start ``cmd`` on every rank with MPICH's ``mpiexec`` (hydra) across the nodes, each rank
        inside its node's namespace (``ranks_per_node`` per node); returns the mpiexec process.

        Raises:
            RuntimeError: no ``mpiexec`` (install the ``mpi`` extra).
        """
        mpiexec = mpiexec or find_mpiexec()
        if mpiexec is None:
            raise RuntimeError("no mpiexec found: pip install 'scape_ds[mpi]' (MPICH and mpi4py)")
        full = ["ip", "netns", "exec", self.node(0), mpiexec, *self.mpi_args(), "-ppn", str(self.ranks_per_node),
                "-n", str(self.world_size), *cmd]
        p = subprocess.Popen(full, env=self.mpi_env(env), **popen)
        self.procs.append(p)
        return p

    def wait(self, procs: list[subprocess.Popen], timeout: float) -> list[int]:
        """Wait for every process; if one fails, end the rest; return the exit codes."""
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
                for p in procs:
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        p.wait(timeout=10)
                    if p.poll() is None:
                        p.kill()
                        p.wait()
                break
            time.sleep(0.2)
        return [p.returncode for p in procs]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=1)
    ap.add_argument("--rate", default="1gbit", help="link bandwidth each way (tc tbf), e.g. 1gbit, 10gbit")
    ap.add_argument("--delay", default="0.5ms", help="one-way latency added on each node's egress (tc netem)")
    ap.add_argument("--master-port", type=int, default=29600)
    ap.add_argument("--mtu", type=int, default=1500, help="link MTU (9000 for jumbo frames)")
    ap.add_argument("--mpi", action="store_true",
                    help="start the ranks with MPICH's mpiexec across the nodes (ranks from MPI) instead of one "
                         "process per rank with RANK/WORLD_SIZE set")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before the ranks are ended")
    ap.add_argument("--cleanup-stale", action="store_true",
                    help="delete namespaces left by killed runs (after killing the processes those runs left in them), "
                         "then exit")
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="-- command to run on every rank")
    args = ap.parse_args(argv)
    reason = need_root()
    if reason:
        print(f"cluster.py: error: {reason}", file=sys.stderr)
        return 2
    if args.cleanup_stale:
        for ns in stale_namespaces():
            left = kill_marked([ns], namespace_tag(ns))
            if left:
                print(f"{ns}: left running (not started by a cluster): {left}")
            _sh("ip", "netns", "del", ns, check=False)
            print(f"deleted {ns}")
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        print("cluster.py: error: give the command to run after --", file=sys.stderr)
        return 2
    try:
        with Cluster(args.nodes, args.rate, args.delay, args.ranks_per_node, args.master_port, args.mtu) as c:
            print(f"cluster: {args.nodes} nodes x {args.ranks_per_node} ranks, links {args.rate} each way, "
                  f"{args.delay} one-way delay; node 0 at {c.ip(0)}{'; ranks started by mpiexec' if args.mpi else ''}",
                  flush=True)
            codes = c.wait([c.launch_mpi(cmd)] if args.mpi else c.launch(cmd), args.timeout)
    except (ValueError, PermissionError, RuntimeError) as e:
        print(f"cluster.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("cluster: interrupted; namespaces removed", file=sys.stderr)
        return 130
    bad = [(r, c) for r, c in enumerate(codes) if c != 0]
    if bad:
        what = f"mpiexec exited {bad[0][1]}" if args.mpi else f"ranks failed (rank, exit code): {bad}"
        print(f"cluster: {what}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
