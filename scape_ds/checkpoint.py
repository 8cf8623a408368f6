"""Atomic, verified checkpoints of a DeepSpeed engine with every rank's SCAPE state.

Layout of ``save_dir`` (DeepSpeed's, plus one file per data-parallel rank and a manifest)::

    latest                           the tag of the newest complete checkpoint, written last
    global_step<N>/                  DeepSpeed's model, scheduler and client state files
    global_step<N>/scape_dp_rank_<r>.pt   rank r's ScapeAdamS state: master weights, momentum,
                                     error feedback, masks, step counters (with tensor or pipeline
                                     parallelism several ranks share a data-parallel rank:
                                     scape_dp_rank_<r>_global_rank_<g>.pt)
    global_step<N>/manifest.json     every other file of the tag: name, size in bytes, sha256

Steps of :func:`save_checkpoint`: (1) DeepSpeed writes its files into the tag directory without
touching ``latest``; (2) every rank writes its SCAPE state to a temporary file and renames it into
place; (3) a barrier; (4) the ranks hash the tag's files (file i on rank i mod world size) and rank 0
writes the manifest; (5) rank 0 writes ``latest`` by rename. A run killed anywhere before (5)
leaves ``latest`` naming the previous complete checkpoint, which is what :func:`load_checkpoint`
loads. DeepSpeed's old 1-bit Adam dropped its error feedback on load; here it is part of the state.
The tag directory is assumed to be on storage every rank sees (as DeepSpeed's own loading assumes).

Steps of :func:`load_checkpoint`: (1) every rank checks the manifest against the directory (every
file there, with its size): a missing, truncated or extra file makes every rank raise the same
one-line ``ValueError`` without any communication; (2) every rank hashes its share of the files,
lists the objects in their pickles that ``weights_only`` loading would refuse, and reads its own SCAPE
file; (3) the ranks exchange what they found (one all-gather of short strings), so an altered file
or a file holding code makes every rank raise the same one-line ``ValueError`` naming it, before any
rank enters DeepSpeed's loading collectives; (4) DeepSpeed loads its files through its checkpoint
engine, whose ``load`` is :func:`safe_load`; (5) the SCAPE state read in (2) is loaded into the
optimizer. A stage 0/1 checkpoint saved on another data-parallel size is re-sharded in (2)
(:mod:`scape_ds.elastic`: every rank reads every old rank's file); so is a ZeRO-3 one (every old
rank's DeepSpeed optimizer file), which is then loaded by :func:`_load_zero3_resharded` in place of
DeepSpeed's loader in (4) and (5), since DeepSpeed refuses another data-parallel size under ZeRO-3.

Every checkpoint file is read with ``torch.load(weights_only=True)`` (:func:`safe_load`): tensors,
numbers, strings, lists and dicts, plus the two DeepSpeed classes its ZeRO files hold
(``SAFE_DEEPSPEED_GLOBALS``). A pickled callable is refused, never run.

Offline, ``python -m scape_ds.checkpoint convert <dir> --to-dp N [--out DIR]`` writes the checkpoint
re-sharded for N data-parallel ranks as a new tag (:func:`convert_checkpoint`; stage 0/1 only: a
ZeRO-3 checkpoint is re-sharded when it is loaded on N ranks).
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import pickle
import re
import shutil
import sys

import torch
import torch.distributed as dist

from .config import basis_mismatch
from .elastic import (
    load_resharded_state,
    load_resharded_zero3,
    read_scape_states,
    reshard_scape_states,
    saved_dp_size,
    saved_zero3_dp_size,
    scape_rank_files,
)
from .engine import is_scape_stage3, scape_optimizer
from .faults import is_peer_lost

__all__ = ["CheckpointSaveError", "save_checkpoint", "load_checkpoint", "read_latest_tag", "resolve_load", "check_load",
           "check_save_dir", "newest_intact_tag", "intact_tag_hint", "discard_partial_tag", "estimate_checkpoint_bytes",
           "free_bytes", "safe_load", "safe_loading", "write_manifest", "check_manifest", "convert_checkpoint"]

LATEST = "latest"
MANIFEST = "manifest.json"
# classes DeepSpeed pickles into its ZeRO optimizer files, allowed (as data, not code) when loading them
SAFE_DEEPSPEED_GLOBALS = ("deepspeed.runtime.zero.config.ZeroStageEnum",
                          "deepspeed.runtime.fp16.loss_scaler.LossScaler")


def _scape_file(tag_dir: str, opt) -> str:
    name = f"scape_dp_rank_{opt.comm.rank:05d}"
    if dist.is_initialized() and dist.get_world_size() > opt.comm.world_size:  # model parallel: one file per rank
        name += f"_global_rank_{dist.get_rank():05d}"
    return os.path.join(tag_dir, name + ".pt")


def _atomic_torch_save(obj, path: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except BaseException:
        _remove_quietly(tmp)  # a full disk: give back what the partial file took
        raise
    os.replace(tmp, path)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def _atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _remove_quietly(tmp)
        raise
    os.replace(tmp, path)


class CheckpointSaveError(RuntimeError):
    """A save that failed on this rank (disk full, a write error); ``latest`` is unchanged."""


def save_checkpoint(engine, save_dir: str, step: int | None = None, client_state: dict | None = None, *,
                    tag: str | None = None, save_latest: bool = True, exclude_frozen_parameters: bool = False) -> str:
    """Save the engine and every rank's SCAPE state as tag ``global_step<step>`` (or ``tag``); returns
    the tag dir. ``save_latest=False`` leaves ``latest`` as it is; ``exclude_frozen_parameters`` goes
    to DeepSpeed. A path-A engine's own ``engine.save_checkpoint`` comes here
    (:func:`scape_ds.engine.route_checkpoints`); this calls DeepSpeed's, unwrapped.

    Raises:
        CheckpointSaveError: a file could not be written on this rank (one line: the tag, the cause,
            and the tag ``latest`` still names). The other ranks wait in the save's next collective
            until the process group's timeout.
    """
    tag = f"global_step{step}" if tag is None else str(tag)
    tag_dir = os.path.join(save_dir, tag)
    try:
        inspect.unwrap(engine.save_checkpoint)(save_dir, tag=tag, client_state=client_state or {}, save_latest=False,
                                               exclude_frozen_parameters=exclude_frozen_parameters)
        opt = scape_optimizer(engine)
        if opt is not None and not is_scape_stage3(opt):  # ZeRO-3: in DeepSpeed's optimizer files
            os.makedirs(tag_dir, exist_ok=True)
            _atomic_torch_save(opt.state_dict(), _scape_file(tag_dir, opt))
        if dist.is_initialized():
            dist.barrier()
        write_manifest(tag_dir)
        if save_latest and (not dist.is_initialized() or dist.get_rank() == 0):
            _atomic_write_text(os.path.join(save_dir, LATEST), tag)
    except (OSError, RuntimeError) as e:  # torch.save's zip writer raises RuntimeError on a full disk
        if is_peer_lost(e):  # gloo's timeouts are plain RuntimeErrors: scape_ds.faults reports them
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        try:
            previous = f"still names {read_latest_tag(save_dir)}"
        except ValueError:
            previous = "names no checkpoint yet"
        removed = f"; the partial {tag} was removed" if discard_partial_tag(save_dir, tag) else ""
        raise CheckpointSaveError(f"rank {rank}: saving {tag} in {save_dir} failed ({_one_line(e)}); "
                                  f"{os.path.join(save_dir, LATEST)} {previous}{removed}") from None
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


def resolve_load(path: str) -> tuple[str, str]:
    """``(load_dir, tag)`` for ``--load PATH``: PATH a checkpoint directory (the tag its ``latest``
    names) or a tag directory ``DIR/TAG`` (an older tag, say the newest intact one).

    Raises:
        ValueError: PATH is neither.
    """
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, LATEST)) and (
            os.path.isfile(os.path.join(path, MANIFEST)) or any(n.endswith(".pt") for n in os.listdir(path))):
        load_dir, tag = os.path.split(os.path.normpath(path))
        return load_dir or ".", tag
    return path, read_latest_tag(path)


def _tag_order(tag: str) -> tuple[int, str]:
    digits = re.search(r"\d+", tag)
    return (int(digits.group()) if digits else -1, tag)


def newest_intact_tag(load_dir: str, skip: tuple[str, ...] = ()) -> str | None:
    """The tag in ``load_dir`` with the highest step whose files all match its manifest (names,
    sizes and sha256, every file hashed by this process), other than those in ``skip``; None if none."""
    try:
        names = os.listdir(load_dir)
    except OSError:
        return None
    tags = [n for n in names if n not in skip and os.path.isfile(os.path.join(load_dir, n, MANIFEST))]
    for tag in sorted(tags, key=_tag_order, reverse=True):
        tag_dir = os.path.join(load_dir, tag)
        if not check_manifest(tag_dir) and not _check_contents(tag_dir, share=False):
            return tag
    return None


def intact_tag_hint(load_dir: str, refused: str) -> str:
    """What to resume from when tag ``refused`` of ``load_dir`` is damaged: the newest intact tag
    and the ``--load DIR/TAG`` that loads it, or that there is none."""
    tag = newest_intact_tag(load_dir, skip=(refused,))
    if tag is None:
        return f"{load_dir} holds no other intact tag"
    return f"the newest intact tag is {tag}: resume from it with --load {os.path.join(load_dir, tag)}"


def check_load(path: str) -> tuple[str, str]:
    """Check ``--load PATH`` before any process group exists: a tag is named (by ``latest`` or as
    ``DIR/TAG``) and its files match its manifest's names and sizes; returns ``(load_dir, tag)``.

    Raises:
        ValueError: one line naming the problem and, for a damaged tag, the newest intact one.
    """
    load_dir, tag = resolve_load(path)
    problems = check_manifest(os.path.join(load_dir, tag))
    if problems:
        _refuse(path, problems, load_dir, tag)
    return load_dir, tag


def check_save_dir(save_dir: str) -> None:
    """Make sure ``--save DIR`` is, or can be created as, a folder this process can write: it is
    created and a probe file is written and removed in it (before the first step, not at the first save).

    Raises:
        ValueError: one line naming the folder and the reason.
    """
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise ValueError(f"--save {save_dir}: exists and is not a folder")
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--save {save_dir}: cannot create the folder ({_one_line(e)})") from None
    probe = os.path.join(save_dir, f".scape_write_probe.{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"probe")
    except OSError as e:
        raise ValueError(f"--save {save_dir}: the folder is not writable ({_one_line(e)})") from None
    finally:
        _remove_quietly(probe)


def estimate_checkpoint_bytes(engine) -> int:
    """About how many bytes one checkpoint of ``engine`` takes (all ranks' files together).

    ScapeAdamS (stage 0/1): DeepSpeed's model file (the parameters, plus data-parallel rank 0's
    optimizer state, which DeepSpeed stores there too) and one SCAPE file per data-parallel rank
    (an fp32 master and momentum shard, 8 N / D bytes, and the whole error-feedback buffer, N
    elements). Any other optimizer: the parameters plus 16 bytes per parameter (fp32 master and two
    moments), generous for Adam.
    """
    n = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    param_bytes = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in engine.module.parameters())
    opt = scape_optimizer(engine)
    if opt is None or is_scape_stage3(opt):
        return param_bytes + 16 * n
    d = opt.dp_world_size
    ef_bytes = 2 if opt.cfg.error_feedback_dtype == "bf16" else 4
    per_rank = 8 * n // d + ef_bytes * n
    return param_bytes + (d + 1) * per_rank


def free_bytes(save_dir: str) -> int:
    """Free bytes on the file system holding ``save_dir`` (for this user)."""
    return shutil.disk_usage(save_dir).free


def discard_partial_tag(save_dir: str, tag: str) -> bool:
    """Remove ``save_dir/tag`` after a failed save, unless ``latest`` names it; returns whether it did."""
    tag_dir = os.path.join(save_dir, tag)
    try:
        if read_latest_tag(save_dir) == tag:
            return False
    except ValueError:
        pass
    if not os.path.isdir(tag_dir):
        return False
    shutil.rmtree(tag_dir, ignore_errors=True)
    return not os.path.exists(tag_dir)


def load_checkpoint(engine, load_dir: str, load_module_strict: bool = True) -> tuple[str, dict]:
    """Load the checkpoint ``latest`` names (or the tag ``DIR/TAG`` names, :func:`resolve_load`):
    model, scheduler, client state and this rank's SCAPE state. A path-A engine's own
    ``engine.load_checkpoint`` comes here (:func:`scape_ds.engine.route_checkpoints`); this calls
    DeepSpeed's, unwrapped. ``load_module_strict`` goes to DeepSpeed.

    A checkpoint saved on another number of data-parallel ranks is re-sharded in memory
    (:mod:`scape_ds.elastic`; every rank reads every old rank's SCAPE file, under ZeRO-3 every old
    rank's DeepSpeed optimizer file) and the first step after it is a dense refresh.

    Returns:
        ``(tag, client_state)``.

    Raises:
        ValueError: not a checkpoint, a missing rank file, a checkpoint of another optimizer, a file
            missing from, added to, truncated or altered against the tag's manifest, a file holding
            objects other than plain data (on every rank, one line naming the file), or another
            data-parallel size with tensor/pipeline parallelism or (ZeRO-3) frozen parameters or
            another model (not supported).
    """
    given = load_dir
    load_dir, tag = resolve_load(given)
    tag_dir = os.path.join(load_dir, tag)
    problems = check_manifest(tag_dir)  # the same answer on every rank, without communication
    if problems:
        _refuse(given, problems, load_dir, tag)
    opt = scape_optimizer(engine)
    damaged, problems, scape_state, zero3 = _check_contents(tag_dir), [], None, None
    zopt = _zero3_optimizer(engine)
    if zopt is not None:  # under ZeRO-3 the SCAPE state is part of DeepSpeed's per-rank optimizer files
        from .zero3 import zero3_layout

        rank, world = dist.get_rank(group=zopt.dp_process_group), dist.get_world_size(group=zopt.dp_process_group)
        try:
            saved_dp = saved_zero3_dp_size(tag_dir)
            if saved_dp is not None and saved_dp != world:  # elastic: re-shard in memory
                zero3 = load_resharded_zero3(tag_dir, zero3_layout(zopt), rank, world)
        except ValueError as e:  # the same on every rank, reported once (_gather_problems)
            problems.append(str(e))
        opt = None
    saved_dp = _saved_dp_size(tag_dir, problems) if opt is not None else None
    if saved_dp is not None and saved_dp != opt.comm.world_size and opt.cfg.hierarchy != "flat":
        problems.append(f"{tag} was saved on {saved_dp} data-parallel (cross-node) ranks and this run has "
                        f"{opt.comm.world_size}: elastic resume is not supported with scape.hierarchy "
                        f"{opt.cfg.hierarchy!r}")
    elif saved_dp is not None and saved_dp != opt.comm.world_size:  # elastic: re-shard in memory
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
                scape_state = safe_load(scape_path)
            except ValueError as e:
                problems.append(str(e))
        saved_cfg = ((scape_state or {}).get("scape") or {}).get("config") or {}
        mismatch = basis_mismatch(saved_cfg, opt.cfg) if scape_state is not None and not problems else ""
        if mismatch:
            problems.append(f"{tag} was saved with {mismatch}: their optimizer states differ; resume with the "
                            f"saved settings")
        changed = changed_settings(scape_state, opt.cfg) if scape_state is not None and not problems else ""
        if changed:  # the masks index the old settings: re-laid out as an elastic resume on the same size
            try:
                scape_state = load_resharded_state(tag_dir, opt.comm.rank, opt.comm.world_size, opt.cfg.chunk_size)
            except ValueError as e:
                problems.append(f"{tag} was saved with other SCAPE settings ({changed}) and cannot be re-laid "
                                f"out for them: {e}; resume with the saved settings")
    elif zopt is None and scape_rank_files(tag_dir):
        problems.append(f"{tag} was saved by ScapeAdamS (its SCAPE state files are there) and this run's optimizer is "
                        f"{type(engine.optimizer).__name__}: resume with the config it was saved with "
                        "(optimizer.type ScapeAdamS and its scape block)")
    damaged = _gather_problems(damaged)
    problems = _gather_problems(problems)
    if damaged:
        _refuse(given, damaged + problems, load_dir, tag)
    if problems:
        _refuse(given, problems)
    safe_loading(engine)  # DeepSpeed reads every file through its checkpoint engine
    if zero3 is not None:
        return tag, _load_zero3_resharded(engine, *zero3)
    path, client_state = inspect.unwrap(engine.load_checkpoint)(load_dir, tag=tag, load_optimizer_states=opt is None,
                                                                load_lr_scheduler_states=True,
                                                                load_module_strict=load_module_strict)
    if path is None:
        raise ValueError(f"--load {given}: DeepSpeed found no model state in {tag}")
    if opt is not None:
        opt.load_state_dict(scape_state)
    return tag, client_state or {}


# what DeepSpeed's _load_checkpoint keeps out of the client state (optimizer and scheduler states loaded)
_DEEPSPEED_STATES = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler",
                     "random_ltd", "lr_scheduler", "optimizer")


# settings that choose the masks (their number per chunk, their layout, when they change): a change
# between save and load drops the saved masks and makes the first step a dense refresh
_MASK_SETTINGS = ("sparsity", "chunk_size", "mask_refresh_interval")


def changed_settings(scape_state: dict, cfg) -> str:
    """``"sparsity 0.99 -> 0.9, chunk_size 4096 -> 1024"``: the mask settings in which the saved
    ScapeAdamS state (``state_dict()``) differs from ``cfg``; empty if none do. Under basis "dct" none
    matter: its masks are chosen afresh every step (``basis_mismatch`` covers its tiles)."""
    saved = (scape_state.get("scape") or {}).get("config") or {}
    if cfg.basis == "dct":
        return ""
    return ", ".join(f"{name} {saved[name]} -> {getattr(cfg, name)}" for name in _MASK_SETTINGS
                     if name in saved and saved[name] != getattr(cfg, name))


def _load_zero3_resharded(engine, optim_state: dict, model_state: dict) -> dict:
    """Load a ZeRO-3 checkpoint re-sharded by :func:`scape_ds.elastic.load_resharded_zero3` as
    DeepSpeed's ``load_checkpoint`` loads one of the same size (its module, optimizer, scheduler and
    step counters, in its order); returns the client state."""
    zopt = engine.optimizer
    zopt.checkpoint_event_prologue()  # every parameter partitioned
    engine.load_module_state_dict(checkpoint=model_state, strict=True)  # buffers (parameters are partitioned)
    states = [None] * dist.get_world_size(group=zopt.dp_process_group)
    states[dist.get_rank(group=zopt.dp_process_group)] = optim_state
    zopt.load_state_dict(states, load_optimizer_states=True)  # fp32 and compute-dtype partitions, momentum, SCAPE
    if engine.lr_scheduler is not None:
        engine.lr_scheduler.load_state_dict(model_state["lr_scheduler"])
    if engine.random_ltd_enabled() and engine.random_ltd_scheduler is not None and "random_ltd" in model_state:
        engine.random_ltd_scheduler.load_state_dict(model_state["random_ltd"])
    if engine.training_dataloader is not None and engine.curriculum_learning_enabled() \
            and "data_sampler" in model_state:
        engine.training_dataloader.data_sampler.load_state_dict(model_state["data_sampler"])
    engine.global_steps = model_state["global_steps"]
    engine.global_samples = model_state.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = model_state["skipped_steps"]
    engine.loaded_checkpoint_dp_world_size = model_state["dp_world_size"]
    engine.loaded_checkpoint_mp_world_size = model_state["mp_world_size"]
    zopt.checkpoint_event_epilogue()  # persistent parameters gathered from the new partitions
    return {k: v for k, v in model_state.items() if k not in _DEEPSPEED_STATES}


def _zero3_optimizer(engine):
    """``engine``'s ZeRO-3 optimizer (SCAPE's or DeepSpeed's own), or None."""
    if not engine.zero_optimization_partition_weights():
        return None
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    return engine.optimizer if isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3) else None


def _refuse(given: str, problems: list[str], load_dir: str | None = None, tag: str | None = None):
    """Raise the one-line refusal of ``--load given``; with ``tag`` (a damaged tag of ``load_dir``)
    it ends with the newest intact tag there and the ``--load DIR/TAG`` that resumes from it."""
    more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
    hint = f"; {intact_tag_hint(load_dir, tag)}" if tag is not None else ""
    raise ValueError(f"--load {given}: " + "; ".join(problems[:3]) + more + hint)


# ---------------------------------------------------------------- safe loading
def _safe_globals() -> list:
    """The classes of ``SAFE_DEEPSPEED_GLOBALS`` (those this DeepSpeed version has)."""
    import importlib

    found = []
    for name in SAFE_DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            pass
    return found


def safe_load(path: str, map_location="cpu"):
    """``torch.load(path, weights_only=True)``, allowing only ``SAFE_DEEPSPEED_GLOBALS`` beyond torch's
    own list; nothing in the file is executed.

    Raises:
        ValueError: one line naming ``path``: it holds objects weights_only loading refuses (a
            pickled callable, say), or it is corrupt or truncated.
    """
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        unsafe = _unsafe_globals(path)
        what = ", ".join(unsafe[:3]) if unsafe else _one_line(e)
        raise ValueError(_not_plain_data(path, what)) from None
    except Exception as e:  # torch's zip reader raises many types for a damaged file
        raise ValueError(f"{path} is corrupt or truncated ({_one_line(e)})") from None


def _not_plain_data(path: str, what: str) -> str:
    return f"{path} holds objects that are not plain data ({what}): refused, not loaded"


def _unsafe_globals(path: str) -> list[str]:
    """The classes and functions named in ``path``'s pickle that weights_only loading refuses
    (the pickle is scanned, not run; the tensors are not read)."""
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip archive, or damaged: judged by the loader
        return []


class _SafeLoading:
    """DeepSpeed's checkpoint engine with :func:`safe_load` as its ``load``."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path: str, map_location=None):
        return safe_load(path, map_location)


def safe_loading(engine) -> None:
    """Make ``engine``'s checkpoint engine read every file with :func:`safe_load` (``scape_ds.initialize``
    does this for SCAPE engines; :func:`load_checkpoint` for any engine). Saving is unchanged."""
    inner = getattr(engine, "checkpoint_engine", None)
    if inner is not None and not isinstance(inner, _SafeLoading):
        engine.checkpoint_engine = _SafeLoading(inner)


# ---------------------------------------------------------------- manifest
def _tag_files(tag_dir: str) -> list[str]:
    """The files of a tag that the manifest covers (not itself, not temporary files)."""
    return sorted(n for n in os.listdir(tag_dir) if n != MANIFEST and ".tmp." not in n
                  and os.path.isfile(os.path.join(tag_dir, n)))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def write_manifest(tag_dir: str, collective: bool = True) -> None:
    """Write ``tag_dir/manifest.json``: each file's size and sha256; call after every file is in place.
    ``collective``: when torch.distributed is initialized every rank hashes its share and rank 0
    writes; otherwise (or when False) this process hashes every file and writes."""
    names = _tag_files(tag_dir)
    rank, world = _rank_world() if collective else (0, 1)
    mine = {n: dict(bytes=os.path.getsize(os.path.join(tag_dir, n)), sha256=_sha256(os.path.join(tag_dir, n)))
            for n in names[rank::world]}
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        mine = {n: e for part in gathered for n, e in part.items()}
    if rank == 0:
        text = json.dumps(dict(version=1, files=dict(sorted(mine.items()))), indent=1) + "\n"
        _atomic_write_text(os.path.join(tag_dir, MANIFEST), text)


def _read_manifest(tag_dir: str) -> dict:
    with open(os.path.join(tag_dir, MANIFEST), encoding="utf-8") as f:
        return json.load(f)["files"]


def check_manifest(tag_dir: str) -> list[str]:
    """What is wrong with ``tag_dir`` against its manifest, by name and size (no hashing, no
    communication): a missing manifest, a missing, extra or resized file. Empty if nothing is."""
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        return [f"{tag_dir} has no {MANIFEST} (an incomplete save, or saved by an older scape_ds)"]
    try:
        files = _read_manifest(tag_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{path} is unreadable ({_one_line(e)})"]
    problems = []
    present = set(_tag_files(tag_dir))
    for name, entry in files.items():
        full = os.path.join(tag_dir, name)
        if name not in present:
            problems.append(f"{full} is missing")
        elif os.path.getsize(full) != entry["bytes"]:
            problems.append(f"{full} is truncated or altered ({os.path.getsize(full)} bytes, "
                            f"the manifest says {entry['bytes']})")
    problems += [f"{os.path.join(tag_dir, n)} is not in the manifest" for n in sorted(present - set(files))]
    return problems


def _check_contents(tag_dir: str, share: bool = True) -> list[str]:
    """This rank's share of the tag's files (file i on rank i mod world size; every file when not
    ``share``): sha256 against the manifest, and the pickle scanned for objects weights_only loading refuses."""
    files = _read_manifest(tag_dir)
    rank, world = _rank_world() if share else (0, 1)
    problems = []
    for name in sorted(files)[rank::world]:
        full = os.path.join(tag_dir, name)
        if _sha256(full) != files[name]["sha256"]:
            problems.append(f"{full} is altered (its sha256 differs from the manifest's)")
        elif name.endswith(".pt") and (unsafe := _unsafe_globals(full)):
            problems.append(_not_plain_data(full, ", ".join(unsafe[:3])))
    return problems


def _saved_dp_size(tag_dir: str, problems: list[str]) -> int | None:
    try:
        return saved_dp_size(tag_dir)
    except ValueError as e:
        problems.append(str(e))
        return None


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or "no message"
    return f"{type(err).__name__}: {text[:200]}"


def _gather_problems(problems: list[str]) -> list[str]:
    """Every rank's problems, in rank order, each distinct one once, on every rank (one all-gather of
    short strings); the ranks agree on whether to load before any of them enters DeepSpeed's loading
    collectives."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problems
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)  # pickled; placed on the current device by torch
    return list(dict.fromkeys(p for rank_problems in gathered for p in rank_problems))


def convert_checkpoint(load_dir: str, world_size: int, out_dir: str | None = None) -> str:
    """Write the checkpoint ``latest`` names, re-sharded for ``world_size`` data-parallel ranks, as tag
    ``<tag>_dp<world_size>`` in ``out_dir`` (default ``load_dir``), whose ``latest`` then names it.

    DeepSpeed's files are copied as they are (path A's model and scheduler state do not depend on
    the data-parallel size); the SCAPE files are re-sharded by :mod:`scape_ds.elastic`. Loading the
    result on ``world_size`` ranks is the same as loading the original there. Returns the new tag dir.

    Raises:
        ValueError: a bad ``world_size``, not a checkpoint, a file that fails the manifest check
            (as :func:`load_checkpoint`), missing rank files, or a ZeRO-3 (re-sharded when loaded
            instead) or tensor/pipeline-parallel checkpoint (not supported).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"--to-dp must be an integer >= 1, got {world_size!r}")
    tag = read_latest_tag(load_dir)
    tag_dir = os.path.join(load_dir, tag)
    problems = check_manifest(tag_dir)
    problems = problems or _check_contents(tag_dir)  # one process here: it checks every file
    if problems:
        _refuse(load_dir, problems)
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
        _atomic_torch_save(state, os.path.join(new_dir, f"scape_dp_rank_{r:05d}.pt"))
    write_manifest(new_dir, collective=False)
    _atomic_write_text(os.path.join(out_dir, LATEST), new_tag)
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


if __name__ == "__main__":
    sys.exit(main())
