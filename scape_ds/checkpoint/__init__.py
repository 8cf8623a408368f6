"""Atomic, verified checkpoints of a DeepSpeed engine with every rank's SCAPE state.

Three modules, each importing only those above it in this list (docs/design.md, "Checkpoints"):

- :mod:`~scape_ds.checkpoint.files`: the file format: atomic writes, the manifest (each file's size
  and sha256), :func:`safe_load` (``torch.load(weights_only=True)`` plus two DeepSpeed classes),
  which files a tag holds; no scape_ds import;
- :mod:`~scape_ds.checkpoint.reshard`: elastic resume, pure functions re-sharding the optimizer
  states of D data-parallel ranks for D' (path A's ScapeAdamS states, path B's ZeRO-3 states against
  a :class:`~scape_ds.exchange.layout.Zero3Layout`); never imports the engine or ZeRO-3;
- :mod:`~scape_ds.checkpoint.engine_io`: :func:`save_checkpoint` and :func:`load_checkpoint`, which
  adapt a DeepSpeed engine (``scape_ds.initialize``'s, or plain DeepSpeed's) to the two above.

:mod:`~scape_ds.checkpoint.convert` is the offline ``python -m scape_ds.checkpoint convert <dir>
--to-dp N [--out DIR]`` (files and reshard only). Everything public is importable from here.
"""
from .convert import convert_checkpoint
from .engine_io import CheckpointSaveError, estimate_checkpoint_bytes, load_checkpoint, save_checkpoint
from .files import (
    LATEST,
    MANIFEST,
    SAFE_DEEPSPEED_GLOBALS,
    check_load,
    check_manifest,
    check_save_dir,
    discard_partial_tag,
    free_bytes,
    intact_tag_hint,
    newest_intact_tag,
    read_latest_tag,
    resolve_load,
    safe_load,
    safe_loading,
    write_manifest,
)

__all__ = ["CheckpointSaveError", "save_checkpoint", "load_checkpoint", "read_latest_tag", "resolve_load", "check_load",
           "check_save_dir", "newest_intact_tag", "intact_tag_hint", "discard_partial_tag", "estimate_checkpoint_bytes",
           "free_bytes", "safe_load", "safe_loading", "write_manifest", "check_manifest", "convert_checkpoint",
           "LATEST", "MANIFEST", "SAFE_DEEPSPEED_GLOBALS"]
