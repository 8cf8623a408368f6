"""Megatron-core tensor/pipeline parallelism with SCAPE on the data-parallel group (docs/design.md, Megatron groups)."""
from .gpt import MegatronGPT, build_pipeline_gpt, gpt_loss, mark_replicated, megatron_config
from .parallel import (
    CPURNGTracker,
    MegatronMPU,
    check_topology,
    destroy_model_parallel,
    get_rng_tracker,
    init_model_parallel,
    model_parallel_seed,
)

__all__ = ["MegatronGPT", "build_pipeline_gpt", "gpt_loss", "mark_replicated", "megatron_config", "CPURNGTracker",
           "MegatronMPU", "check_topology", "destroy_model_parallel", "get_rng_tracker", "init_model_parallel",
           "model_parallel_seed"]
