"""The byte meter: exact bytes each collective sends from this rank, and their dense equivalent.

Counts follow the bandwidth-optimal algorithms (ring / pairwise exchange) that NCCL, gloo and MPI
use for large messages, per rank and per collective of D ranks:
  all_gather      (D - 1) * input bytes            (every other rank needs my part)
  reduce_scatter  (D - 1) * input bytes / D        (I send every part but my own)
  all_reduce      2 * (D - 1) * bytes / D          (a reduce-scatter then an all-gather)
  all_to_all      (D - 1) * input bytes / D
  broadcast       bytes on the root, 0 elsewhere (counted once, at the root)
  reduce          bytes on every rank but the root (each sends its part once), 0 on the root
  broadcast_all   (D - 1) * bytes on the root (each other rank receives them once, whatever the
                  tree), 0 elsewhere
The last two serve the bucketed exchange (``scape.overlap``), where every bucket lies in one owner's
shard: summed over the owners' buckets they equal the reduce-scatter's and all-gather's counts.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

__all__ = ["ByteMeter", "collective_bytes"]


def collective_bytes(kind: str, nbytes: int, world_size: int, is_root: bool = False) -> int:
    """Bytes one rank sends for a collective on ``nbytes`` of input (see module docstring)."""
    d = world_size
    if d <= 1:
        return 0
    if kind == "all_gather":
        return (d - 1) * nbytes
    if kind in ("reduce_scatter", "all_to_all"):
        return (d - 1) * nbytes // d
    if kind == "all_reduce":
        return 2 * (d - 1) * nbytes // d
    if kind == "broadcast":
        return nbytes if is_root else 0
    if kind == "reduce":
        return 0 if is_root else nbytes
    if kind == "broadcast_all":
        return (d - 1) * nbytes if is_root else 0
    raise ValueError(f"unknown collective {kind!r}")


@dataclass
class ByteMeter:
    """Per-tag byte counters for one communicator, with per-step snapshots.

    ``total[tag]`` accumulates over the run; ``step_bytes()`` returns and resets what was sent since
    the last call. ``dense_total`` is what a dense exchange of the same model would have sent,
    supplied by the optimizer that knows the shapes.
    """

    total: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    dense_total: int = 0
    _since_step: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    _dense_since_step: int = 0

    def record(self, tag: str, nbytes: int) -> None:
        """Add ``nbytes`` sent under ``tag`` (e.g. ``grad_rs``, ``param_ag``, ``mask_ag``)."""
        self.total[tag] += nbytes
        self._since_step[tag] += nbytes

    def record_dense(self, nbytes: int) -> None:
        """Add the bytes a dense exchange would have sent for the same step."""
        self.dense_total += nbytes
        self._dense_since_step += nbytes

    @property
    def sent_total(self) -> int:
        """All bytes sent so far, every tag but ``init`` (one-off start-up broadcasts)."""
        return sum(v for k, v in self.total.items() if k != "init")

    def step_bytes(self) -> tuple[dict[str, int], int]:
        """Return ``(bytes by tag, dense-equivalent bytes)`` since the last call, and reset them.

        One-off ``init`` broadcasts are left out of the per-step numbers (they stay in ``total``).
        """
        sent = {k: v for k, v in self._since_step.items() if k != "init"}
        dense = self._dense_since_step
        self._since_step = defaultdict(int)
        self._dense_since_step = 0
        return sent, dense
