"""Per-step training metrics: one JSON object per line (JSONL) and, optionally, TensorBoard scalars.

Only the rank that logs (rank 0) makes a writer. The JSONL file is flushed after every record, so a
run that is killed keeps every finished step; a resumed run appends to it.
"""
from __future__ import annotations

import json

__all__ = ["MetricsWriter", "TENSORBOARD_KEYS"]

TENSORBOARD_KEYS = ("loss", "lr", "step_time_s", "bytes_sent", "tokens_per_s", "val_loss")
"""Record fields written as TensorBoard scalars: ``train/<key>``, and ``val_loss`` as ``val/loss``."""


class MetricsWriter:
    """Writes step records (dicts with a ``step`` field) to a JSONL file and/or TensorBoard.

    Args:
        jsonl_path: JSONL file, one object per record (None: none).
        tensorboard_dir: TensorBoard log directory (None: none; needs the ``tensorboard`` package).
        append: append to ``jsonl_path`` (a resumed run) instead of starting it anew.
    """

    def __init__(self, jsonl_path: str | None = None, tensorboard_dir: str | None = None, append: bool = False):
        self._jsonl = open(jsonl_path, "a" if append else "w", encoding="utf-8") if jsonl_path else None
        self._tb = None
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(tensorboard_dir)

    def write(self, record: dict) -> None:
        """Add one record: a JSONL line, and each of :data:`TENSORBOARD_KEYS` it has at ``record["step"]``."""
        if self._jsonl:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._tb:
            for key in TENSORBOARD_KEYS:
                if key in record:
                    name = "val/loss" if key == "val_loss" else f"train/{key}"
                    self._tb.add_scalar(name, record[key], record["step"])

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
            self._jsonl = None
        if self._tb:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
