"""Lost peers: turn a collective that failed because a rank went away into one line, and bound the wait.

When a node's link drops, its peers' collectives wait for bytes that never come. gloo ends such a wait
after the process group's timeout (``--dist-timeout``, which :func:`scape_ds.train.init_distributed`
passes to ``init_process_group``) with a ``RuntimeError`` like ``[.../unbound_buffer.cc:78] Timed out
waiting 20000ms for recv operation to complete``, or sooner with ``Connection reset by peer`` when the
peer's process died. The training loop (:func:`scape_ds.train.main`) turns that into one line on
stderr and exit code 3:

    rank 1: lost contact with rank 0 (collective 'grad_rs' in step 61 timed out after 20 s; the
    rendezvous store at 10.77.0.1:29600 does not answer either); the last complete checkpoint is
    global_step60 in /ckpt: resume with --load /ckpt

Steps:

1. :func:`bound_group_timeouts` gives every process group the configured timeout. Groups made with
   ``new_group`` after start-up (DeepSpeed clones the world group; megatron-core passes its own 30
   minutes) would otherwise wait up to 30 minutes, not ``--dist-timeout``.
2. :func:`is_peer_lost` recognises the backend's timeout and connection errors (torch's
   ``DistError`` family, or gloo's ``RuntimeError`` messages).
3. :func:`probe_peers` asks the rendezvous store which ranks still answer: each rank that failed
   posts a key and waits a few seconds for the others', so the line names the rank that went silent
   (a rank that cannot reach the store either names the store's host, rank 0's node).
4. :func:`describe_lost_peer` writes the line: the rank, the silent ranks, the collective (its SCAPE
   tag where the traceback passes through :class:`scape_ds.comm.TorchCommunicator`), the phase
   (``step 61``, ``saving global_step60``), and the last complete checkpoint, which
   :func:`scape_ds.checkpoint.save_checkpoint`'s atomic ``latest`` guarantees still loads.

A rank that has lost a peer exits; nothing here retries (a resumed run on the healthy nodes does).
"""
from __future__ import annotations

import datetime
import os
import re
import threading
import time
from dataclasses import dataclass

__all__ = ["PeerWatch", "is_peer_lost", "bound_group_timeouts", "probe_peers",
           "describe_lost_peer", "report_lost_peer", "last_checkpoint"]

# gloo's and c10d's messages for a peer that stopped answering or went away (gloo/transport/tcp)
_LOST = re.compile(r"timed out waiting|socket timeout|connection (reset|closed|refused|timed out)|broken pipe|"
                   r"(read|write) error \[|no route to host|network is unreachable|connectfullmesh|socket closed",
                   re.IGNORECASE)
_WAITED_MS = re.compile(r"waiting (\d+)\s*ms", re.IGNORECASE)
_KEY = "scape_lost_peer/{}"
_COMM_METHODS = {"all_gather", "all_gather_async", "reduce_scatter", "all_reduce", "broadcast"}


@dataclass
class PeerWatch:
    """Where the training loop is, for the report: set ``phase`` as the loop goes."""

    phase: str = "start-up"
    """What the rank was doing: ``start-up``, ``step 61``, ``validation at step 60``, ``saving global_step60``."""


def _causes(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def is_peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) is the backend saying a peer timed out or went away."""
    try:
        from torch.distributed import DistError
    except ImportError:  # older torch: the messages alone
        DistError = ()
    for e in _causes(exc):
        if DistError and isinstance(e, DistError):
            return True
        if isinstance(e, RuntimeError) and _LOST.search(str(e)):
            return True
    return False


def bound_group_timeouts(timeout_s: float) -> int:
    """Give every existing process group the collective timeout ``timeout_s``; returns how many.

    Uses ``torch.distributed.distributed_c10d._set_pg_timeout`` (private, present since torch 2.2);
    without it the groups keep their own timeouts and one warning says so.
    """
    import warnings

    from torch.distributed import distributed_c10d as c10d

    set_timeout, world = getattr(c10d, "_set_pg_timeout", None), getattr(c10d, "_world", None)
    if set_timeout is None or world is None:
        warnings.warn("this torch cannot change a process group's timeout: groups made after start-up keep "
                      "their own (30 min for gloo), not --dist-timeout", stacklevel=2)
        return 0
    groups = list(world.pg_map)
    for pg in groups:
        set_timeout(datetime.timedelta(seconds=timeout_s), pg)
    return len(groups)


def _accepts_connections(addr: tuple[str, int], timeout_s: float) -> bool:
    """Whether a TCP connection to ``addr`` opens within ``timeout_s`` (closed at once)."""
    import socket

    try:
        socket.create_connection(addr, timeout=timeout_s).close()
        return True
    except OSError:
        return False


def probe_peers(rank: int, world_size: int, wait_s: float, store_addr: tuple[str, int] | None = None
                ) -> list[int] | None:
    """The ranks that did not post to the rendezvous store within ``wait_s`` seconds of this one.

    Every rank that lost a peer calls this: it posts its own key and waits for the others'. Returns
    None when the store itself does not answer (it lives in rank 0's process, on ``MASTER_ADDR``).
    With ``store_addr`` (host, port) a plain TCP connection is tried first: a closed port (rank 0's
    process has ended) answers None at once, without the store client's C++ warning and stack
    frames on stderr ahead of the one line. The store calls run in a daemon thread joined with a
    deadline (a store call to an unreachable host can block past the store's own timeout), so the
    probe costs ``wait_s`` and no more.
    """
    from torch.distributed import distributed_c10d as c10d

    if store_addr is not None and not _accepts_connections(store_addr, wait_s):
        return None
    found: dict = {}
    deadline = time.monotonic() + wait_s

    def run():
        try:
            ask()
        except Exception:  # noqa: BLE001 (DistNetworkError, DistStoreError...): the store did not answer
            pass  # no "answered": reported as None, without a thread traceback ahead of the one line

    def ask():
        store = c10d._get_default_store()
        store.set_timeout(datetime.timedelta(seconds=wait_s))
        store.add(_KEY.format(rank), 1)  # a round trip: raises (or blocks) if the store does not answer
        keys = [_KEY.format(r) for r in range(world_size)]
        while True:
            answered = [r for r, k in enumerate(keys) if store.check([k])]
            if len(answered) == world_size or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        found["answered"] = answered

    thread = threading.Thread(target=run, name="scape-probe-peers", daemon=True)
    # the store client logs a failed call with a C++ warning and stack frames on stderr (fd 2), which
    # the port check above misses when rank 0's port still accepts while its process dies: fd 2 goes
    # to /dev/null for the probe (this is the error path; the one line comes after)
    saved_fd, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        thread.start()
        thread.join(wait_s + 0.5)
    finally:
        os.dup2(saved_fd, 2)
        os.close(saved_fd)
        os.close(devnull)
    if "answered" not in found:
        return None
    return [r for r in range(world_size) if r not in found["answered"]]


def last_checkpoint(save_dir: str | None) -> str:
    """The sentence about what to resume from: the tag ``save_dir/latest`` names, or why there is none."""
    if not save_dir:
        return "nothing was saved (no --save)"
    try:
        with open(os.path.join(save_dir, "latest"), encoding="utf-8") as f:
            tag = f.read().strip()
    except OSError:
        tag = ""
    if not tag:
        return f"no checkpoint was completed in {save_dir} yet"
    return f"the last complete checkpoint is {tag} in {save_dir}: resume with --load {save_dir}"


def _collective(exc: BaseException) -> str:
    """The collective that failed: the SCAPE tag when a TorchCommunicator call is on the traceback,
    else the innermost ``torch.distributed`` function, else 'a collective'."""
    from .comm.torch_comm import TorchCommunicator

    tag = c10d_name = None
    for e in _causes(exc):
        tb = e.__traceback__
        while tb is not None:
            code, local = tb.tb_frame.f_code, tb.tb_frame.f_locals
            if code.co_name in _COMM_METHODS and isinstance(local.get("self"), TorchCommunicator):
                tag = local.get("tag", tag)
            elif code.co_filename.endswith(os.path.join("distributed", "distributed_c10d.py")):
                c10d_name = code.co_name
            tb = tb.tb_next
        if tag or c10d_name:
            break
    if tag:
        return f"collective {tag!r}"
    return f"torch.distributed.{c10d_name}" if c10d_name else "a collective"


def _reason(exc: BaseException, timeout_s: float) -> str:
    """'timed out after 20 s', or 'failed: Connection reset by peer' (the backend's words, shortened)."""
    text = " ".join(str(next((e for e in _causes(exc) if _LOST.search(str(e))), exc)).split())
    waited = _WAITED_MS.search(text)
    if waited:
        return f"timed out after {int(waited.group(1)) / 1000:g} s"
    if re.search(r"timed out|timeout", text, re.IGNORECASE):
        return f"timed out after {timeout_s:g} s"
    text = re.sub(r"^\[[^\]]*\]\s*", "", text).split(". ")[0]  # without gloo's [file.cc:line] and its advice
    return f"failed: {text[:160]}"


def describe_lost_peer(rank: int, exc: BaseException, silent: list[int] | None, *, phase: str, timeout_s: float,
                       save_dir: str | None, store_addr: str = "") -> str:
    """The one-line report of a lost peer.

    Args:
        rank: this rank.
        exc: the backend's error.
        silent: the ranks that did not answer :func:`probe_peers` (empty: all answered, the link between
            them failed); None: the rendezvous store did not answer either.
        phase: what the rank was doing (:class:`PeerWatch`).
        timeout_s: the configured ``--dist-timeout``.
        save_dir: ``--save`` (where the last checkpoint is), or None.
        store_addr: ``MASTER_ADDR:MASTER_PORT``, for the message when the store does not answer.
    """
    if silent is None:
        where = f" at {store_addr}" if store_addr else ""
        who, extra = "rank 0", f"; the rendezvous store{where} does not answer either"
    elif silent:
        who, extra = ", ".join(f"rank {r}" for r in silent), ""
    else:
        who, extra = "a peer", "; every rank still answers the rendezvous store"
    return (f"rank {rank}: lost contact with {who} ({_collective(exc)} in {phase} {_reason(exc, timeout_s)}{extra}); "
            f"{last_checkpoint(save_dir)}")


def report_lost_peer(exc: BaseException, watch: PeerWatch, timeout_s: float, save_dir: str | None) -> str:
    """:func:`describe_lost_peer` for this rank of the running job, after :func:`probe_peers`
    (which waits ``timeout_s / 4`` seconds, 1 to 3, for the other ranks to post)."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT", "")
    addr = (host, int(port)) if host and port.isdigit() else None
    silent = probe_peers(rank, world, min(3.0, max(1.0, timeout_s / 4)), addr) if world > 1 else []
    store_addr = f"{host or '?'}:{port or '?'}"
    return describe_lost_peer(rank, exc, silent, phase=watch.phase, timeout_s=timeout_s, save_dir=save_dir,
                              store_addr=store_addr)
