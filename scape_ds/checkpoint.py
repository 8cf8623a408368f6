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
is loaded into the optimizer.
"""
from __future__ import annotations

import os
import zipfile

import torch
import torch.distributed as dist

from .engine import is_scape_stage3, scape_optimizer

__all__ = ["save_checkpoint", "load_checkpoint", "read_latest_tag", "check_archive"]

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

    Returns:
        ``(tag, client_state)``.

    Raises:
        ValueError: not a checkpoint, a missing rank file (saved with another data-parallel size),
            a checkpoint of another optimizer, or a truncated or corrupt file (on every rank, naming
            the file).
    """
    tag = read_latest_tag(load_dir)
    tag_dir = os.path.join(load_dir, tag)
    opt = scape_optimizer(engine)
    if is_scape_stage3(opt):
        opt = None  # under ZeRO-3 the SCAPE state is part of DeepSpeed's per-rank optimizer files
    problems, scape_state = [], None
    if opt is not None:
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
