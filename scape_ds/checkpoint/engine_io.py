"""Save and load a DeepSpeed engine with every rank's SCAPE state (the top of :mod:`scape_ds.checkpoint`).

This module adapts an engine built by ``scape_ds.initialize`` (or plain DeepSpeed) to the file
format of :mod:`scape_ds.checkpoint.files` and the re-sharding of :mod:`scape_ds.checkpoint.reshard`.

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
engine, whose ``load`` is :func:`~scape_ds.checkpoint.files.safe_load`; (5) the SCAPE state read in
(2) is loaded into the optimizer. A stage 0/1 checkpoint saved on another data-parallel size is
re-sharded in (2) (:mod:`scape_ds.checkpoint.reshard`: every rank reads every old rank's file); so
is a ZeRO-3 one (every old rank's DeepSpeed optimizer file), which is then loaded by
:func:`_load_zero3_resharded` in place of DeepSpeed's loader in (4) and (5), since DeepSpeed refuses
another data-parallel size under ZeRO-3.
"""
from __future__ import annotations

import inspect
import os

import torch.distributed as dist

from ..config import basis_mismatch
from ..faults import is_peer_lost
from ..optim.lookup import is_scape_stage3, scape_optimizer, synchronized_optimizer
from .files import (
    LATEST,
    atomic_torch_save,
    atomic_write_text,
    check_contents,
    check_manifest,
    discard_partial_tag,
    gather_problems,
    one_line,
    read_latest_tag,
    refuse_load,
    resolve_load,
    safe_load,
    safe_loading,
    saved_dp_size,
    saved_zero3_dp_size,
    scape_rank_files,
    write_manifest,
)
from .reshard import load_resharded_state, load_resharded_zero3

__all__ = ["CheckpointSaveError", "save_checkpoint", "load_checkpoint", "estimate_checkpoint_bytes",
           "changed_settings"]


def _scape_file(tag_dir: str, opt) -> str:
    name = f"scape_dp_rank_{opt.comm.rank:05d}"
    if dist.is_initialized() and dist.get_world_size() > opt.comm.world_size:  # model parallel: one file per rank
        name += f"_global_rank_{dist.get_rank():05d}"
    return os.path.join(tag_dir, name + ".pt")


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
    opt = synchronized_optimizer(engine)  # scape.overlap: the model's new values may still be in flight
    try:
        inspect.unwrap(engine.save_checkpoint)(save_dir, tag=tag, client_state=client_state or {}, save_latest=False,
                                               exclude_frozen_parameters=exclude_frozen_parameters)
        if opt is not None and not is_scape_stage3(opt):  # ZeRO-3: in DeepSpeed's optimizer files
            os.makedirs(tag_dir, exist_ok=True)
            atomic_torch_save(opt.state_dict(), _scape_file(tag_dir, opt))
        if dist.is_initialized():
            dist.barrier()
        write_manifest(tag_dir)
        if save_latest and (not dist.is_initialized() or dist.get_rank() == 0):
            atomic_write_text(os.path.join(save_dir, LATEST), tag)
    except (OSError, RuntimeError) as e:  # torch.save's zip writer raises RuntimeError on a full disk
        if is_peer_lost(e):  # gloo's timeouts are plain RuntimeErrors: scape_ds.faults reports them
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        try:
            previous = f"still names {read_latest_tag(save_dir)}"
        except ValueError:
            previous = "names no checkpoint yet"
        removed = f"; the partial {tag} was removed" if discard_partial_tag(save_dir, tag) else ""
        raise CheckpointSaveError(f"rank {rank}: saving {tag} in {save_dir} failed ({one_line(e)}); "
                                  f"{os.path.join(save_dir, LATEST)} {previous}{removed}") from None
    if dist.is_initialized():
        dist.barrier()
    return tag_dir


def estimate_checkpoint_bytes(engine) -> int:
    """About how many bytes one checkpoint of ``engine`` takes (all ranks' files together).

    ScapeAdamS (stage 0/1): DeepSpeed's model file (the parameters, plus data-parallel rank 0's
    optimizer state, which DeepSpeed stores there too) and one SCAPE file per data-parallel rank
    (an fp32 master and momentum shard, 8 N / D bytes, and the whole error-feedback buffer, N
    elements; with ``scape.local_steps`` also the synchronized copy, the outer momentum, the inner
    optimizer's state and this rank's own local parameters). Any other optimizer: the parameters plus
    16 bytes per parameter (fp32 master and two moments), generous for Adam.
    """
    n = sum(getattr(p, "ds_numel", p.numel()) for p in engine.module.parameters())
    param_bytes = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in engine.module.parameters())
    opt = scape_optimizer(engine)
    if opt is None or is_scape_stage3(opt):
        return param_bytes + 16 * n
    d = opt.dp_world_size
    ef_bytes = 2 if opt.cfg.error_feedback_dtype == "bf16" else 4
    per_rank = 8 * n // d + ef_bytes * n
    cfg = opt.cfg
    if cfg.local_steps > 1:  # what every rank saves of local steps (optim/local_steps.py), known before step 1:
        outer = 2 if cfg.outer_update == "nesterov" else 1  # theta_s, and b for Nesterov, fp32
        inner = 8 if cfg.inner_optimizer == "adamw" else 4  # AdamW's two moments, AdamS's one, fp32
        per_rank += (4 * outer + inner) * n + param_bytes  # and this rank's own local parameters
    return param_bytes + (d + 1) * per_rank


def load_checkpoint(engine, load_dir: str, load_module_strict: bool = True) -> tuple[str, dict]:
    """Load the checkpoint ``latest`` names (or the tag ``DIR/TAG`` names, :func:`resolve_load`):
    model, scheduler, client state and this rank's SCAPE state. A path-A engine's own
    ``engine.load_checkpoint`` comes here (:func:`scape_ds.engine.route_checkpoints`); this calls
    DeepSpeed's, unwrapped. ``load_module_strict`` goes to DeepSpeed.

    A checkpoint saved on another number of data-parallel ranks is re-sharded in memory
    (:mod:`scape_ds.checkpoint.reshard`; every rank reads every old rank's SCAPE file, under ZeRO-3 every old
    rank's DeepSpeed optimizer file) and, in the coordinate basis, the first step after it is a dense
    refresh (basis "dct": the error feedback's sum is kept on rank 0 and the masks are chosen as usual).

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
        refuse_load(given, problems, load_dir, tag)
    opt = synchronized_optimizer(engine)  # scape.overlap: no old value may land on the loaded weights
    damaged, problems, scape_state, zero3 = check_contents(tag_dir), [], None, None
    zopt = _zero3_optimizer(engine)
    if zopt is not None:  # under ZeRO-3 the SCAPE state is part of DeepSpeed's per-rank optimizer files
        from ..zero3 import zero3_layout

        rank, world = dist.get_rank(group=zopt.dp_process_group), dist.get_world_size(group=zopt.dp_process_group)
        try:
            saved_dp = saved_zero3_dp_size(tag_dir)
            if saved_dp is not None and saved_dp != world:  # elastic: re-shard in memory
                zero3 = load_resharded_zero3(tag_dir, zero3_layout(zopt), rank, world)
        except ValueError as e:  # the same on every rank, reported once (gather_problems)
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
    damaged = gather_problems(damaged)
    problems = gather_problems(problems)
    if damaged:
        refuse_load(given, damaged + problems, load_dir, tag)
    if problems:
        refuse_load(given, problems)
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
    """Load a ZeRO-3 checkpoint re-sharded by :func:`~scape_ds.checkpoint.reshard.load_resharded_zero3` as
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


def _saved_dp_size(tag_dir: str, problems: list[str]) -> int | None:
    try:
        return saved_dp_size(tag_dir)
    except ValueError as e:
        problems.append(str(e))
        return None
