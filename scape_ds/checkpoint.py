"""Atomic checkpoints of a DeepSpeed engine with every rank's SCAPE state.

Layout of ``save_dir`` (DeepSpeed's, plus one file per data-parallel rank)::

    latest                           the tag of the newest complete checkpoint, written last
    global_step<N>/                  DeepSpeed's model, scheduler and client state files
    global_step<N>/scape_dp_rank_<r>.pt   rank r's ScapeAdamS state: master weights, momentum,
                                     error feedback, masks, step counters (with tensor or pipeline
                                     parallelism several ranks share a data-parallel rank:
                                     scape_dp_rank_<r>_global_rank_<g>.pt)

Steps of :func:`save_checkpoint`: (1) DeepSpeed writes its files into the tag directory without
touching ``latest``; (2) every rank writes its SCAPE state to a temporary file and renames it into
place; (3) a barrier; (4) rank 0 writes ``latest`` by rename. A run killed anywhere before (4)
leaves ``latest`` naming the previous complete checkpoint, which is what :func:`load_checkpoint`
loads. DeepSpeed's old 1-bit Adam dropped its error feedback on load; here it is part of the state.

Steps of :func:`load_checkpoint`: (1) every rank reads its own SCAPE file in full and checks that
each of DeepSpeed's archives in the tag directory it is given (file i to rank i mod world size) is
complete; (2) the ranks exchange what they found (one all-gather of short strings), so a truncated or
corrupt file makes every rank raise the same one-line ``ValueError`` naming it, before any rank
enters DeepSpeed's loading collectives; (3) DeepSpeed loads its files; (4) the SCAPE state read in (1)
is loaded into the optimizer. A stage 0/1 checkpoint saved on another data-parallel size is
re-sharded in (1) (:mod:`scape_ds.elastic`: every rank reads every old rank's file).

Offline, ``python -m scape_ds.checkpoint convert <dir> --to-dp N [--out DIR]`` writes the checkpoint
re-sharded for N data-parallel ranks as a new tag (:func:`convert_checkpoint`).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import zipfile

import torch
import torch.distributed as dist

from .elastic import check_zero3_dp_size, load_resharded_state, read_scape_states, reshard_scape_states, saved_dp_size
from .engine import is_scape_stage3, scape_optimizer

__all__ = ["save_checkpoint", "load_checkpoint", "read_latest_tag", "check_archive", "convert_checkpoint"]

LATEST = "latest"


def _scape_file(tag_dir: str, opt) -> str:
    name = f"scape_dp_rank_{opt.comm.rank:05d}"
    if dist.is_initialized() and dist.get_world_size() > opt.comm.world_size:  # model parallel: one file per rank
        name += f"_global_rank_{dist.get_rank():05d}"
    return os.path.join(tag_dir, name + ".pt")


def _atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(engine, save_dir: str, step: int, client_state: dict | None = None) -> str:
    """Save the engine and every rank's SCAPE state as tag ``global_step<step>``; returns the tag dir."""
    tag = f"global_step{step}"
    engine.save_checkpoint(save_dir, tag=tag, client_state=client_state or {}, save_latest=False)
    tag_dir = os.path.join(save_dir, tag)
    opt = scape_optimizer(engine)
    if opt is not None and not is_scape_stage3(opt):  # ZeRO-3: in DeepSpeed's optimizer files
        os.makedirs(tag_dir, exist_ok=True)
        _atomic_torch_save(opt.state_dict(), _scape_file(tag_dir, opt))
    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        _atomic_write_text(os.path.join(save_dir, LATEST), tag)
    if dist.is_initialized():
        dist.barrier()
    return tag_dir


def read_latest_tag(load_dir: str) -> str:
    """The tag named by ``load_dir/latest``.

    Raises:
        ValueError: ``load_dir`` is not a directory holding a complete checkpoint.
    """
    if not os.path.isdir(load_dir):
        raise ValueError(f"--load {load_dir}: no such directory")
    latest = os.path.join(load_dir, LATEST)
    if not os.path.isfile(latest):
        raise ValueError(f"--load {load_dir}: not a checkpoint directory (no '{LATEST}' file)")
    with open(latest, encoding="utf-8") as f:
        tag = f.read().strip()
    if not tag or not os.path.isdir(os.path.join(load_dir, tag)):
        raise ValueError(f"--load {load_dir}: '{LATEST}' names {tag!r}, which is not a directory there")
    return tag


def load_checkpoint(engine, load_dir: str) -> tuple[str, dict]:
    """Load the checkpoint ``latest`` names: model, scheduler, client state and this rank's SCAPE state.

    A stage 0/1 checkpoint saved on another number of data-parallel ranks is re-sharded in memory
    (:mod:`scape_ds.elastic`; every rank reads every old rank's SCAPE file) and the first step after
    it is a dense refresh.

    Returns:
        ``(tag, client_state)``.

    Raises:
        ValueError: not a checkpoint, a missing rank file, a checkpoint of another optimizer, a
            truncated or corrupt file (on every rank, naming the file), or another data-parallel
            size under ZeRO-3 or with tensor/pipeline parallelism (not supported).
    """
    tag = read_latest_tag(load_dir)
    tag_dir = os.path.join(load_dir, tag)
    opt = scape_optimizer(engine)
    problems, scape_state = [], None
    if is_scape_stage3(opt):  # under ZeRO-3 the SCAPE state is part of DeepSpeed's per-rank optimizer files
        if opt.comm.rank == 0:  # one report, not one per rank
            problems += check_zero3_dp_size(tag_dir, opt.comm.world_size)
        opt = None
    saved_dp = _saved_dp_size(tag_dir, problems) if opt is not None else None
    if saved_dp is not None and saved_dp != opt.comm.world_size:  # elastic: re-shard in memory
        try:
            scape_state = load_resharded_state(tag_dir, opt.comm.rank, opt.comm.world_size, opt.cfg.chunk_size)
        except ValueError as e:
            problems.append(str(e))
    elif opt is not None:
        scape_path = _scape_file(tag_dir, opt)
        if not os.path.isfile(scape_path):
            problems.append(f"{tag} has no SCAPE state for data-parallel rank {opt.comm.rank} "
                            "(saved by another optimizer or data-parallel size)")
        else:
            try:  # held until DeepSpeed has loaded its files: one rank's SCAPE state in memory twice at most
                scape_state = torch.load(scape_path, map_location="cpu", weights_only=False)
            except Exception as e:  # torch's zip reader and unpickler raise many types for a damaged file
                problems.append(f"{scape_path} is corrupt or truncated ({_one_line(e)})")
    problems += _check_deepspeed_files(tag_dir)
    problems = _gather_problems(problems)
    if problems:
        more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
        raise ValueError(f"--load {load_dir}: " + "; ".join(problems[:3]) + more)
    path, client_state = engine.load_checkpoint(load_dir, tag=tag, load_optimizer_states=opt is None,
                                                load_lr_scheduler_states=True)
    if path is None:
        raise ValueError(f"--load {load_dir}: DeepSpeed found no model state in {tag}")
    if opt is not None:
        opt.load_state_dict(scape_state)
    return tag, client_state or {}


def _saved_dp_size(tag_dir: str, problems: list[str]) -> int | None:
    try:
        return saved_dp_size(tag_dir)
    except ValueError as e:
        problems.append(str(e))
        return None


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or "no message"
    return f"{type(err).__name__}: {text[:200]}"


def check_archive(path: str) -> str | None:
    """What is wrong with ``path`` as a ``torch.save`` zip archive, or None if it looks complete.

    Reads the archive's central directory (at the end of the file) and checks that every member
    lies inside the file: a truncated copy fails, without reading the tensors. Files that are not
    zip archives (torch's legacy format) are not judged.
    """
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic != b"PK\x03\x04":
            return None
        size = os.path.getsize(path)
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.header_offset + info.compress_size > size:
                    return f"{path} is truncated ({info.filename} ends past the end of the file)"
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as e:
        return f"{path} is corrupt or truncated ({_one_line(e)})"
    return None


def _check_deepspeed_files(tag_dir: str) -> list[str]:
    """Problems with DeepSpeed's ``*.pt`` files in ``tag_dir``; each rank checks its share."""
    names = sorted(n for n in os.listdir(tag_dir) if n.endswith(".pt") and not n.startswith("scape_dp_rank_"))
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    found = (check_archive(os.path.join(tag_dir, n)) for n in names[rank::world])
    return [p for p in found if p is not None]


def _gather_problems(problems: list[str]) -> list[str]:
    """Every rank's problems, in rank order, on every rank (one all-gather of short strings); the
    ranks agree on whether to load before any of them enters DeepSpeed's loading collectives."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problems
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)  # pickled; placed on the current device by torch
    return [p for rank_problems in gathered for p in rank_problems]


def convert_checkpoint(load_dir: str, world_size: int, out_dir: str | None = None) -> str:
    """Write the checkpoint ``latest`` names, re-sharded for ``world_size`` data-parallel ranks, as tag
    ``<tag>_dp<world_size>`` in ``out_dir`` (default ``load_dir``), whose ``latest`` then names it.

    DeepSpeed's files are copied as they are (path A's model and scheduler state do not depend on
    the data-parallel size); the SCAPE files are re-sharded by :mod:`scape_ds.elastic`. Loading the
    result on ``world_size`` ranks is the same as loading the original there. Returns the new tag dir.

    Raises:
        ValueError: a bad ``world_size``, not a checkpoint, missing or corrupt rank files, or a
            ZeRO-3 or tensor/pipeline-parallel checkpoint (not supported).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"--to-dp must be an integer >= 1, got {world_size!r}")
    tag = read_latest_tag(load_dir)
    tag_dir = os.path.join(load_dir, tag)
    out_dir = out_dir or load_dir
    new_tag = f"{tag}_dp{world_size}"
    new_dir = os.path.join(out_dir, new_tag)
    names = [n for n in sorted(os.listdir(tag_dir)) if not n.startswith("scape_dp_rank_") and ".tmp." not in n]
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
        _atomic_torch_save(state, os.path.join(new_dir, f"scape_dp_rank_{r:05d}.pt"))
    _atomic_write_text(os.path.join(out_dir, LATEST), new_tag)
    return new_dir


def main(argv: list[str] | None = None) -> int:
    """``python -m scape_ds.checkpoint convert <dir> --to-dp N [--out DIR]``; errors: one line, exit 2."""
    parser = argparse.ArgumentParser(prog="python -m scape_ds.checkpoint",
                                     description="Offline tools for scape_ds checkpoints.")
    sub = parser.add_subparsers(dest="command", required=True)
    conv = sub.add_parser("convert", help="re-shard a stage 0/1 checkpoint for another data-parallel size")
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


if __name__ == "__main__":
    sys.exit(main())
