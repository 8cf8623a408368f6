"""``scape_ds.initialize``: ``deepspeed.initialize`` with the SCAPE optimizer and exchange (docs/design.md section 2).

Path A (ZeRO stage 0 or 1 in the config): DeepSpeed's engine runs forward, backward, gradient
accumulation, the learning-rate scheduler, checkpoints and logging; its dense gradient all-reduce
is switched off and :class:`~scape_ds.optim.ScapeAdamS` does the data-parallel exchange itself,
sharding the optimizer state like ZeRO-1. So the engine is built at DeepSpeed stage 0 whether the
config says 0 or 1 (stage 1's partitioning is what SCAPE does), and ``gradient_clipping`` moves to
the optimizer, which computes the global norm of the *reduced* gradient across shards (DeepSpeed
would clip each rank's local, unreduced gradient on this path).

Steps of :func:`initialize`:
  1. read the config (dict, path or ``args.deepspeed_config``), parse the ``"scape"`` block into a
     :class:`~scape_ds.config.ScapeConfig` (the one parse: the optimizers and checks get that object);
  2. ``optimizer.type`` ``"ScapeAdamS"``: check the combination (stage, precision, offload), build
     the optimizer as a callable DeepSpeed calls once ``torch.distributed`` is up, on the
     data-parallel group (``mpu.get_data_parallel_group()`` when an mpu is given);
     ``"AdamS"``: dense AdamS under DeepSpeed's own all-reduce; any other type: plain DeepSpeed;
  3. call ``deepspeed.initialize`` with the remaining config and switch the dense all-reduce off.

Unsupported combinations fail here with a one-line ``ValueError``.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import sys
from typing import Any

from .config import parse_scape_config, zero_stage
from .exchange.refused import refusal_message, refused_settings
from .optim import AdamS, ScapeAdamS
from .optim.lookup import is_scape_optimizer, is_scape_stage3, scape_optimizer, synchronized_optimizer

__all__ = ["initialize", "read_ds_config", "check_block_names", "auto_keys", "scape_optimizer", "is_scape_optimizer",
           "is_scape_stage3", "route_checkpoints", "check_checkpoint_engine", "SCAPE_OPTIMIZERS"]

SCAPE_OPTIMIZERS = ("ScapeAdamS", "AdamS")
_ADAMS_PARAMS = ("lr", "betas", "eps", "weight_decay", "bias_correction")


def skip_unused_cpu_ops() -> None:
    """On DeepSpeed's CPU accelerator, mark its shared-memory all-reduce op (``deepspeed_shm_comm``)
    as not buildable, so that starting DeepSpeed's comm backend does not JIT-compile it (1-3 minutes
    on a 2-core machine, on every fresh machine). Only DeepSpeed's ``inference_all_reduce`` uses that
    op, and without it that falls back to torch.distributed; training never calls it. No effect on
    other accelerators or once the backend has started."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # the dict DeepSpeed consults, kept per process


def read_ds_config(config: str | dict | None = None, args: Any = None) -> dict:
    """The DeepSpeed config as a dict, from ``config`` (dict or JSON path) or ``args.deepspeed_config``.

    Raises:
        ValueError: no config, both given, a missing file or invalid JSON.
    """
    from_args = getattr(args, "deepspeed_config", None) if args is not None else None
    if config is not None and from_args is not None:
        raise ValueError("give the DeepSpeed config either as config= or as --deepspeed_config, not both")
    config = config if config is not None else from_args
    if config is None:
        raise ValueError("no DeepSpeed config: pass --deepspeed_config FILE or config=")
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if not os.path.isfile(config):
        raise ValueError(f"DeepSpeed config file not found: {config}")
    try:
        with open(config, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"DeepSpeed config {config} is not valid JSON: {e}") from None


def _edit_distance(a: str, b: str) -> int:
    """Optimal-string-alignment distance: insertions, deletions, substitutions and adjacent swaps."""
    d = [[i + j if i * j == 0 else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[len(a)][len(b)]


def check_block_names(cfg: dict) -> None:
    """Refuse a top-level key that looks like a misspelled ``"scape"`` (edit distance 1-2, any case):
    DeepSpeed ignores unknown keys, so ``"scapee"`` would train at SCAPE's defaults without a word.

    Raises:
        ValueError: naming the key.
    """
    for key in cfg:
        if isinstance(key, str) and key != "scape" and _edit_distance(key.lower(), "scape") <= 2:
            raise ValueError(f"the DeepSpeed config has a top-level key {key!r}: did you mean \"scape\"? "
                             "(DeepSpeed ignores unknown keys, so SCAPE would run at its defaults)")


def auto_keys(cfg: Any, prefix: str = "") -> list[str]:
    """Dotted names of the values that are still ``"auto"`` (Hugging Face's placeholders, which the
    Trainer and accelerate replace with numbers before they call ``deepspeed.initialize``)."""
    if isinstance(cfg, dict):
        return [k for key, v in cfg.items() for k in auto_keys(v, f"{prefix}{key}.")]
    return [prefix[:-1]] if cfg == "auto" else []


def _optimizer_kwargs(params: dict, name: str) -> dict:
    unknown = sorted(set(params) - set(_ADAMS_PARAMS))
    if unknown:
        raise ValueError(f"optimizer.params for {name}: unknown {unknown}; allowed: {list(_ADAMS_PARAMS)}")
    kwargs = dict(params)
    if "betas" in kwargs:
        kwargs["betas"] = tuple(kwargs["betas"])
    return kwargs


def _check_path_a(cfg: dict) -> int:
    """Refuse what path A does not support (:mod:`scape_ds.exchange.refused`); return the ZeRO stage."""
    stage = zero_stage(cfg)
    if stage == 2:
        raise ValueError("ScapeAdamS does not run under ZeRO stage 2: use stage 0/1 (SCAPE shards the optimizer "
                         "state itself) or stage 3 with the SCAPE stage-3 optimizer")
    if stage not in (0, 1):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    refused = refused_settings(cfg, stage)
    if refused:
        raise ValueError(refusal_message(refused, stage))
    return stage


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               mpu=None, dist_init_required=None, collate_fn=None, config=None, config_params=None, **kwargs):
    """Like ``deepspeed.initialize``; builds SCAPE from ``optimizer.type`` and the ``"scape"`` block.

    Args: as ``deepspeed.initialize`` (``config_params`` is the old name of ``config``).

    Returns:
        ``(engine, optimizer, training_dataloader, lr_scheduler)`` as DeepSpeed returns them; for
        SCAPE, ``optimizer`` is the :class:`ScapeAdamS` (also ``engine.optimizer``).

    Raises:
        ValueError: bad config, bad scape block, or an unsupported combination.
    """
    import deepspeed

    skip_unused_cpu_ops()
    if config is None:
        config = config_params
    cfg = read_ds_config(config, args)
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        args = copy.copy(args)
        args.deepspeed_config = None  # we pass the edited config dict instead
    check_block_names(cfg)
    opt_block = cfg.get("optimizer") or {}
    opt_type = opt_block.get("type")
    if "scape" in cfg and opt_type != "ScapeAdamS":
        raise ValueError(f"the config has a 'scape' block but optimizer.type is {opt_type!r}: use \"ScapeAdamS\"")
    if opt_type not in SCAPE_OPTIMIZERS or optimizer is not None:
        if optimizer is not None and opt_type in SCAPE_OPTIMIZERS:
            raise ValueError(f"both an optimizer object and optimizer.type={opt_type!r} in the config: give one")
        return deepspeed.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                                    training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                                    dist_init_required=dist_init_required, collate_fn=collate_fn, config=cfg, **kwargs)
    unfilled = auto_keys(cfg)
    if unfilled:
        raise ValueError(f"config values still \"auto\": {', '.join(unfilled)}; the Hugging Face Trainer and "
                         "accelerate fill them in (with scape_ds.enable()), elsewhere give numbers")
    opt_kwargs = _optimizer_kwargs(opt_block.get("params", {}) or {}, opt_type)
    ds_cfg = {k: v for k, v in cfg.items() if k not in ("optimizer", "scape")}
    use_scape = opt_type == "ScapeAdamS"
    stage = zero_stage(cfg)
    stage3 = use_scape and stage == 3
    if stage > 0 and (stage3 or not use_scape):
        ds_cfg.setdefault("zero_allow_untested_optimizer", True)  # DeepSpeed's ZeRO wraps our AdamS
    build_as = contextlib.nullcontext()
    # the "scape" block, parsed here once; everything below gets the ScapeConfig, not the dict
    scape_cfg = parse_scape_config(cfg.get("scape")) if use_scape else None
    if stage3:  # path B: DeepSpeed's stage 3 with SCAPE's reduce-scatter (scape_ds/zero3.py)
        from .zero3 import Stage3AdamS, check_stage3_config, replica_zero_config, scape_stage3_class

        check_stage3_config(cfg, scape_cfg)
        if "scape" not in cfg:
            _say_defaults(scape_cfg)
        if scape_cfg.param_exchange == "sparse_replica":
            ds_cfg["zero_optimization"] = replica_zero_config(ds_cfg["zero_optimization"])
        stage3_cls = scape_stage3_class(scape_cfg)
        build_as = _stage3_class_swapped(stage3_cls)

        def build_optimizer(params):
            return Stage3AdamS(params, **opt_kwargs)
    elif use_scape:
        _check_path_a(cfg)
        if "scape" not in cfg:
            _say_defaults(scape_cfg)
        ds_cfg.pop("zero_optimization", None)  # stage 1 == SCAPE's own sharding; DeepSpeed runs stage 0
        # DeepSpeed would clip each rank's local gradient (its default is 1.0, not off): the
        # optimizer clips the reduced one instead, with the config's value or DeepSpeed's default
        from deepspeed.runtime.constants import GRADIENT_CLIPPING_DEFAULT

        max_grad_norm = float(ds_cfg.get("gradient_clipping", GRADIENT_CLIPPING_DEFAULT) or 0.0)
        ds_cfg["gradient_clipping"] = 0.0

        pipeline_module = _is_pipeline(model)
        grid = mpu if mpu is not None else (model.mpu() if pipeline_module else None)
        pipelined = pipeline_module or (
            grid is not None and getattr(grid, "get_pipeline_model_parallel_world_size", lambda: 1)() > 1)
        if scape_cfg.overlap and pipelined and not pipeline_module:
            raise ValueError("scape.overlap with pipeline stages is built for DeepSpeed's PipelineModule (its schedule "
                             "says which backward ends the batch and which gradients are summed across stages "
                             "afterwards): use a PipelineModule or set overlap false")

        def build_optimizer(params):
            # a PipelineModule brings its own grid (DeepSpeed uses it as the mpu)
            group = grid.get_data_parallel_group() if grid is not None else None
            norm_group = None
            if grid is not None:
                has_norm_group = hasattr(grid, "get_norm_group")
                norm_group = grid.get_norm_group() if has_norm_group else grid.get_model_parallel_group()
            from .comm import build_dp_communicators

            # flat: (data-parallel, None); hierarchy "node": (cross-node, node) groups of the data-parallel group
            comm, intra_comm = build_dp_communicators(scape_cfg, group)
            return ScapeAdamS(params, **opt_kwargs, scape=scape_cfg, comm=comm, max_grad_norm=max_grad_norm,
                              norm_group=norm_group, intra_comm=intra_comm)
    else:
        def build_optimizer(params):
            return AdamS(params, **opt_kwargs)

    if model_parameters is None and model is not None:
        model_parameters = _param_groups(model) if use_scape and not stage3 else \
            [p for p in model.parameters() if p.requires_grad]
    with build_as:
        engine, opt, loader, sched = deepspeed.initialize(
            args=args, model=model, optimizer=build_optimizer, model_parameters=model_parameters,
            training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu, dist_init_required=dist_init_required,
            collate_fn=collate_fn, config=ds_cfg, **kwargs)
    if stage3:
        if not isinstance(engine.optimizer, stage3_cls):
            raise RuntimeError(f"DeepSpeed built {type(engine.optimizer).__name__}, not the SCAPE stage 3")
    elif use_scape:
        if not isinstance(engine.optimizer, ScapeAdamS):
            raise RuntimeError(f"DeepSpeed wrapped ScapeAdamS in {type(engine.optimizer).__name__}; expected it bare")
        engine.enable_backward_allreduce = False  # SCAPE's sparse exchange replaces the dense all-reduce
        # DeepSpeed's zero_grad sets every .grad to None; ScapeAdamS's keeps them views into its flat
        # gradient buffer, so that backward accumulates there and no step copies gradients
        engine.zero_grad = engine.optimizer.zero_grad
        if hasattr(engine, "pipeline_enable_backward_allreduce"):
            engine.pipeline_enable_backward_allreduce = False  # the PipelineEngine's own data-parallel all-reduce
        route_checkpoints(engine)  # every rank's SCAPE state in DeepSpeed's own save/load (the HF Trainer's)
        if scape_cfg.overlap:  # the forward waits per module for new values; backward sends at the boundary
            if pipeline_module:  # the last backward of a train_batch; tied weights exchange in step()
                tied = [w for w, _ in engine.module.get_tied_weights_and_groups()]
                engine.optimizer.attach_model(engine.module, _last_backward_of_batch(engine), exchange_at_step=tied)
            else:
                engine.optimizer.attach_model(engine.module, engine.is_gradient_accumulation_boundary)
    from .checkpoint.files import safe_loading

    safe_loading(engine)  # DeepSpeed's own load_checkpoint (the HF Trainer's resume) reads with weights_only=True
    if use_scape:
        end_at_exit(engine.optimizer)
    return engine, opt, loader, sched


def route_checkpoints(engine) -> None:
    """Path A: ``engine.save_checkpoint`` and ``engine.load_checkpoint`` (what the Hugging Face
    Trainer's ``save_strategy`` and ``resume_from_checkpoint``, accelerate's ``save_state`` and
    Lightning call) save and load every data-parallel rank's SCAPE state, through
    :func:`scape_ds.checkpoint.save_checkpoint` and :func:`scape_ds.checkpoint.load_checkpoint`.

    Why: the engine runs at DeepSpeed stage 0 here, where DeepSpeed keeps the optimizer state in its
    model file, written by data-parallel rank 0 alone, and on load hands that one state to every
    rank; but ScapeAdamS is sharded like ZeRO-1, each rank holding its own master and momentum
    shard, error feedback and masks. Telling DeepSpeed the optimizer is sharded instead (its
    ``zero_enabled``, so that it writes ``zero_pp_rank_*_optim_states.pt`` per rank) would also
    switch on its ZeRO code in backward, step and clipping, which path A replaces. So the two
    methods of this engine instance are wrapped (``functools.wraps``: ``inspect.signature`` shows
    DeepSpeed's parameters, which the Trainer inspects; ``inspect.unwrap`` gives DeepSpeed's
    methods back, which scape_ds.checkpoint calls). Saved checkpoints hold one
    ``scape_dp_rank_<r>.pt`` per rank and a manifest, load as ``--load`` does (verified, re-sharded
    for another data-parallel size) and resume exactly.

    A load that does not ask for the optimizer state (``load_optimizer_states=False``,
    ``load_module_only``) goes to DeepSpeed unchanged; one that does, with a ``custom_load_fn`` or
    without the scheduler, is refused. A save that cannot put every rank's file in one folder every
    rank sees is refused at save time (:func:`check_checkpoint_engine`). The wrappers hold the
    engine (a reference cycle, freed by the garbage collector, as DeepSpeed's module hooks are).
    """
    ds_save, ds_load = engine.save_checkpoint, engine.load_checkpoint

    @functools.wraps(ds_save)
    def save_checkpoint(save_dir, tag=None, client_state=None, save_latest=True, exclude_frozen_parameters=False):
        from . import checkpoint

        check_checkpoint_engine(engine)
        tag = f"global_step{engine.global_steps}" if tag is None else str(tag)  # DeepSpeed's default tag
        checkpoint.save_checkpoint(engine, save_dir, client_state=client_state, tag=tag, save_latest=save_latest,
                                   exclude_frozen_parameters=exclude_frozen_parameters)
        return True

    @functools.wraps(ds_load)
    def load_checkpoint(load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        if not load_optimizer_states or load_module_only:  # no optimizer state wanted: DeepSpeed's own
            synchronized_optimizer(engine)  # scape.overlap: no update in flight may land on the loaded weights
            return ds_load(load_dir, tag=tag, load_module_strict=load_module_strict,
                           load_optimizer_states=load_optimizer_states,
                           load_lr_scheduler_states=load_lr_scheduler_states, load_module_only=load_module_only,
                           custom_load_fn=custom_load_fn)
        if custom_load_fn is not None or not load_lr_scheduler_states:
            raise ValueError("load_checkpoint with ScapeAdamS's optimizer state loads the model, scheduler and every "
                             "rank's SCAPE state together: custom_load_fn and load_lr_scheduler_states=False are "
                             "not supported with it")
        from . import checkpoint

        path = load_dir if tag is None else os.path.join(load_dir, str(tag))
        tag, client_state = checkpoint.load_checkpoint(engine, path, load_module_strict=load_module_strict)
        return os.path.join(checkpoint.resolve_load(path)[0], tag), client_state

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint


def check_checkpoint_engine(engine) -> None:
    """Refuse, at save time, a path-A checkpoint that could not hold every rank's SCAPE state in
    one folder every rank sees: DeepSpeed's node-local storage (a folder per node) or another
    checkpoint writer than its torch.save one (the fast, decoupled or DataStates writers stage the
    files themselves, and SCAPE's files would bypass them).

    Raises:
        ValueError: one line naming the setting.
    """
    if engine.use_node_local_storage():
        raise ValueError("checkpoint.use_node_local_storage is on: ScapeAdamS writes one state file per "
                         "data-parallel rank into one folder every rank sees; turn it off to save")
    writer = getattr(engine.checkpoint_engine, "_inner", engine.checkpoint_engine)  # scape_ds.checkpoint.safe_loading
    if type(writer).__name__ != "TorchCheckpointEngine":
        raise ValueError(f"DeepSpeed's checkpoint writer is {type(writer).__name__}: ScapeAdamS saves its per-rank "
                         "state with torch.save next to DeepSpeed's files; remove checkpoint.writer / "
                         "datastates from the config to save")


_AT_EXIT: list = []  # weak references to the SCAPE optimizers to settle at interpreter exit


def end_at_exit(opt) -> None:
    """At interpreter exit, wait for ``opt``'s collectives in flight, then destroy the default process
    group if the script left it up.

    Gloo's worker threads can still hold asynchronous work when the interpreter is torn down, and the
    process then aborts (``terminate called without an active exception``, SIGABRT, exit -6) after it
    trained to the end: upstream pytorch/pytorch#190489. Scripts that end with
    ``dist.destroy_process_group()`` are not safe either: a gloo worker thread can still be waiting for
    the GIL to destroy the last collective's work (``_WORKER_GRACE_S``). The Hugging Face Trainer and
    accelerate do not call it, so SCAPE destroys the group for them (a no-op once the script did),
    then lets go of the GIL for ``_WORKER_GRACE_S`` in either case."""
    import atexit
    import weakref

    if not _AT_EXIT:
        atexit.register(_end_now)
    _AT_EXIT.append(weakref.ref(opt))


# How long the main thread lets go of the GIL at exit. A gloo worker thread destroys a finished
# collective's work after the waiter has returned (the script's last all-gather, say), and that
# needs the GIL (its tensors' Python objects); if the interpreter is finalizing by then, the thread
# exits inside that destructor and the process aborts (seen in a core dump: ProcessGroupGloo::runLoop
# -> ~AsyncAllgatherWork -> take_gil during Py_FinalizeEx -> std::terminate).
_WORKER_GRACE_S = 0.2


def _end_now() -> None:
    import time

    import torch.distributed as dist

    try:
        if dist.is_initialized():
            try:
                for ref in _AT_EXIT:
                    opt = ref()
                    if opt is not None:
                        opt.synchronize()
            finally:
                dist.destroy_process_group()
    finally:
        _AT_EXIT.clear()
        # also after a script destroyed the group itself: its workers may still hold the last work
        time.sleep(_WORKER_GRACE_S)


def _say_defaults(scape_cfg) -> None:
    """One line (rank 0) that ScapeAdamS runs without a ``"scape"`` block, at the defaults."""
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_rank() != 0:
        return
    print(f"scape_ds: optimizer.type ScapeAdamS and no \"scape\" block in the config: SCAPE's defaults are in use "
          f"(sparsity {scape_cfg.sparsity}, mask_refresh_interval {scape_cfg.mask_refresh_interval}, "
          f"chunk_size {scape_cfg.chunk_size}; scape_ds/config.py)", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _stage3_class_swapped(cls):
    """DeepSpeed's engine looks its stage-3 optimizer class up in its module when it builds one:
    while this is open, that class is ``cls``."""
    from deepspeed.runtime.zero import stage3 as ds_stage3

    original = ds_stage3.DeepSpeedZeroOptimizer_Stage3
    ds_stage3.DeepSpeedZeroOptimizer_Stage3 = cls
    try:
        yield
    finally:
        ds_stage3.DeepSpeedZeroOptimizer_Stage3 = original


def _param_groups(model) -> list:
    """One param group per ``scape_group`` mark (model-parallel replicas of a tensor: TP-replicated,
    pipeline-tied), the unmarked parameters first: a group's SCAPE state is then identical on every
    rank holding a copy, so the copies stay equal."""
    groups: dict[str | None, list] = {}
    for p in model.parameters():
        if p.requires_grad:
            groups.setdefault(getattr(p, "scape_group", None), []).append(p)
    ordered = sorted(groups.items(), key=lambda kv: "" if kv[0] is None else kv[0])
    return [{"params": ps} for _, ps in ordered]


def _last_backward_of_batch(engine):
    """A PipelineEngine's answer to "does the backward under way end the batch": its own
    ``is_gradient_accumulation_boundary`` is true only inside its ReduceGrads and OptimizerStep
    instructions, after every backward. Counts the BackwardPass instructions of each ``train_batch``
    (this engine's instruction map, wrapped) and answers True during the ``micro_batches``-th."""
    from deepspeed.runtime.pipe import schedule

    state = dict(count=0, last=False)
    base = type(engine)._INSTRUCTION_MAP
    backward_pass, train_batch = base[schedule.BackwardPass], engine.train_batch

    def counted_backward_pass(self, buffer_id):
        state["count"] += 1
        state["last"] = state["count"] == self.micro_batches
        try:
            backward_pass(self, buffer_id)
        finally:
            state["last"] = False

    @functools.wraps(train_batch)
    def counted_train_batch(*args, **kwargs):
        state["count"] = 0
        return train_batch(*args, **kwargs)

    engine._INSTRUCTION_MAP = {**base, schedule.BackwardPass: counted_backward_pass}  # this engine only
    engine.train_batch = counted_train_batch
    return lambda: state["last"]


def _is_pipeline(model) -> bool:
    from deepspeed.pipe import PipelineModule

    return isinstance(model, PipelineModule)
