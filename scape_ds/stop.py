"""Stopping a run on request: SIGTERM or SIGINT, or the launcher gone, ends every rank after a checkpoint.

DeepSpeed's single-node ``deepspeed`` command (deepspeed/launcher/runner.py) starts
``python -m deepspeed.launcher.launch`` and waits for it; it installs no signal handler there, so
``kill <deepspeed pid>`` ends the runner alone (exit 143) and launch.py and the ranks keep training,
orphaned. launch.py itself turns SIGINT/SIGTERM into a SIGTERM to each rank's process tree, one rank
at a time, killing what is left after 30 s. So a rank can be asked to stop by its own signal, by
launch.py's, or only by its launcher's disappearance. :func:`scape_ds.train.main` handles all three:

1. :meth:`StopRequest.install` catches SIGTERM and SIGINT (the handler only records the request),
   asks Linux to send SIGTERM to the rank when its parent dies (``prctl(PR_SET_PDEATHSIG)``), and,
   under a launcher, starts a daemon thread that polls the launcher processes (launch.py and the
   ``deepspeed`` runner above it) twice a second and records a request when one of them is gone.
2. After every step the training loop calls :meth:`StopRequest.agreed`: one all-reduce (MAX) of a
   small code over the world group, so every rank stops after the same step even when only one of
   them was signalled.
3. The ranks save that step with ``--save`` (the normal atomic save), rank 0 prints one line naming
   the tag, and every rank exits with :data:`STOP_EXIT_CODE` (143, 128 + SIGTERM, whichever request
   it was). The time to stop is the rest of the current step plus one save (launch.py kills after 30 s).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

__all__ = ["STOP_EXIT_CODE", "StopRequest", "Stopped", "launcher_processes", "set_parent_death_signal"]

STOP_EXIT_CODE = 143
"""Exit code of a rank that stopped on request (after saving with ``--save``)."""

# request codes, all-reduced with MAX: the line names the highest one any rank saw
_REASONS = {1: "SIGINT", 2: "SIGTERM", 3: "the launcher ended"}
_CODES = {signal.SIGINT: 1, signal.SIGTERM: 2}
_POLL_S = 0.5


class Stopped(Exception):
    """Raised by the training loop once the ranks agreed to stop after ``step``."""

    def __init__(self, step: int, reason: str, tag_dir: str | None):
        super().__init__(f"stopped after step {step} ({reason})")
        self.step, self.reason, self.tag_dir = step, reason, tag_dir


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Have Linux send ``sig`` to this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``);
    False off Linux or when the call fails."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(sig), 0, 0, 0) == 0  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


def launcher_processes() -> list:
    """The launcher processes whose end should stop this rank (``psutil.Process`` objects): the
    parent when the rank was started by a launcher (``RANK`` and ``LOCAL_RANK`` set), and above
    DeepSpeed's launch.py also the ``deepspeed`` runner that started it. Empty for a plain
    ``python launch/pretrain.py`` (its parent is a shell)."""
    if "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
        return []
    import psutil

    try:
        parent = psutil.Process(os.getppid())
        found = [parent]
        if "deepspeed.launcher.launch" in " ".join(parent.cmdline()):
            runner = parent.parent()
            if runner is not None and any("deepspeed" in os.path.basename(a) for a in runner.cmdline()[:2]):
                found.append(runner)
        return found
    except (psutil.Error, OSError):
        return []


def _gone(proc) -> bool:
    import psutil

    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE  # ended, not yet reaped
    except psutil.Error:
        return True


class StopRequest:
    """Whether this rank was asked to stop, and (:meth:`agreed`) whether any rank was."""

    def __init__(self):
        self.code = 0
        """The highest request code seen on this rank (0: none; see ``_REASONS``)."""
        self.launcher_pids: list[int] = []

    def request(self, code: int) -> None:
        self.code = max(self.code, code)

    def _on_signal(self, signum, frame) -> None:
        self.request(_CODES.get(signum, 2))

    def install(self) -> None:
        """Catch SIGTERM and SIGINT, and watch the launcher (see the module docstring)."""
        for sig in _CODES:
            signal.signal(sig, self._on_signal)
        procs = launcher_processes()
        if not procs:
            return
        set_parent_death_signal()
        self.launcher_pids = [p.pid for p in procs]
        parent = os.getppid()

        def poll():
            while self.code < 3:
                if os.getppid() != parent or any(_gone(p) for p in procs):
                    self.request(3)
                    return
                time.sleep(_POLL_S)

        threading.Thread(target=poll, name="scape-watch-launcher", daemon=True).start()

    def agreed(self) -> str | None:
        """Every rank's request, combined (one all-reduce over the world group; call it on every rank
        at the same point): the reason to stop (the same text on every rank), or None."""
        import torch
        import torch.distributed as dist

        code = self.code
        if dist.is_initialized() and dist.get_world_size() > 1:
            from .comm import collective_device

            flag = torch.tensor([code], dtype=torch.int32, device=collective_device(None))
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            code = int(flag.item())
        return _REASONS.get(code) if code else None
