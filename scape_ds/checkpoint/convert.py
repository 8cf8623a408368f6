"""``python -m scape_ds.checkpoint convert``: a stage 0/1 checkpoint re-sharded offline for N ranks.

Offline, ``python -m scape_ds.checkpoint convert <dir> --to-dp N [--out DIR]`` writes the checkpoint
re-sharded for N data-parallel ranks as a new tag (:func:`convert_checkpoint`; stage 0/1 only: a
ZeRO-3 checkpoint is re-sharded when it is loaded on N ranks). One process, no engine.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

from .files import (
    LATEST,
    MANIFEST,
    atomic_torch_save,
    atomic_write_text,
    check_contents,
    check_manifest,
    read_latest_tag,
    refuse_load,
    write_manifest,
)
from .reshard import read_scape_states, reshard_scape_states

__all__ = ["convert_checkpoint", "main"]


def convert_checkpoint(load_dir: str, world_size: int, out_dir: str | None = None) -> str:
    """Write the checkpoint ``latest`` names, re-sharded for ``world_size`` data-parallel ranks, as tag
    ``<tag>_dp<world_size>`` in ``out_dir`` (default ``load_dir``), whose ``latest`` then names it.

    DeepSpeed's files are copied as they are (path A's model and scheduler state do not depend on
    the data-parallel size); the SCAPE files are re-sharded by :mod:`scape_ds.checkpoint.reshard`. Loading the
    result on ``world_size`` ranks is the same as loading the original there. Returns the new tag dir.

    Raises:
        ValueError: a bad ``world_size``, not a checkpoint, a file that fails the manifest check
            (as :func:`scape_ds.checkpoint.load_checkpoint`), missing rank files, or a ZeRO-3
            (re-sharded when loaded instead) or tensor/pipeline-parallel checkpoint (not supported).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"--to-dp must be an integer >= 1, got {world_size!r}")
    tag = read_latest_tag(load_dir)
    tag_dir = os.path.join(load_dir, tag)
    problems = check_manifest(tag_dir)
    problems = problems or check_contents(tag_dir)  # one process here: it checks every file
    if problems:
        refuse_load(load_dir, problems)
    out_dir = out_dir or load_dir
    new_tag = f"{tag}_dp{world_size}"
    new_dir = os.path.join(out_dir, new_tag)
    names = [n for n in sorted(os.listdir(tag_dir))
             if not n.startswith("scape_dp_rank_") and ".tmp." not in n and n != MANIFEST]
    # re-shard first: a refused checkpoint leaves nothing behind
    states = reshard_scape_states(read_scape_states(tag_dir), world_size)
    os.makedirs(new_dir, exist_ok=True)
    for n in names:
        src = os.path.join(tag_dir, n)
        if os.path.isdir(src):
            shutil.copytree(src, os.path.join(new_dir, n), dirs_exist_ok=True)
        else:
            shutil.copy2(src, os.path.join(new_dir, n))
    for r, state in enumerate(states):
        atomic_torch_save(state, os.path.join(new_dir, f"scape_dp_rank_{r:05d}.pt"))
    write_manifest(new_dir, collective=False)
    atomic_write_text(os.path.join(out_dir, LATEST), new_tag)
    return new_dir


def main(argv: list[str] | None = None) -> int:
    """``python -m scape_ds.checkpoint convert <dir> --to-dp N [--out DIR]``; errors: one line, exit 2."""
    parser = argparse.ArgumentParser(prog="python -m scape_ds.checkpoint",
                                     description="Offline tools for scape_ds checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="re-shard a stage 0/1 checkpoint for another data-parallel size "
                                          "(ZeRO-3 checkpoints are re-sharded when loaded)")
    conv.add_argument("dir", help="checkpoint directory (the one holding 'latest')")
    conv.add_argument("--to-dp", type=int, required=True, help="the new data-parallel size")
    conv.add_argument("--out", default=None, help="where to write the converted tag (default: dir)")
    args = parser.parse_args(argv)
    try:
        new_dir = convert_checkpoint(args.dir, args.to_dp, args.out)
    except ValueError as e:
        print(f"scape_ds.checkpoint convert: {e}", file=sys.stderr)
        return 2
    print(new_dir)
    return 0
