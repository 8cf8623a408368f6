"""Megatron-core process groups for SCAPE, and the ``mpu`` object DeepSpeed is given.

``init_model_parallel(tp, pp)`` checks the topology and has megatron-core's ``parallel_state``
build the tensor-, pipeline- and data-parallel groups (order tp-dp-pp: tensor-parallel ranks are
adjacent, the pipeline stage is the slowest index, which is also DeepSpeed's pipeline topology
order ``pipe, data, model``). :class:`MegatronMPU` answers the calls DeepSpeed makes on an mpu;
"model parallel" means the tensor-parallel group there (DeepSpeed names checkpoints and picks
broadcast sources by it), while the gradient-norm group of SCAPE is megatron's whole
model-parallel group (TP x PP).
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

__all__ = ["init_model_parallel", "destroy_model_parallel", "MegatronMPU", "CPURNGTracker", "get_rng_tracker",
           "model_parallel_seed", "check_topology"]


def check_topology(world_size: int, tp: int, pp: int, zero_stage: int = 0) -> int:
    """Return the data-parallel size of ``world_size`` ranks split as TP x PP x DP.

    Raises:
        ValueError: a size below 1, a world size not divisible by TP x PP, or PP with ZeRO-2/3.
    """
    for name, v in (("tensor-model-parallel-size", tp), ("pipeline-model-parallel-size", pp)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"--{name} must be an int >= 1, got {v!r}")
    if world_size % (tp * pp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by tensor-model-parallel-size {tp} x "
                         f"pipeline-model-parallel-size {pp} = {tp * pp}")
    if pp > 1 and zero_stage >= 2:
        raise ValueError(f"pipeline parallelism (pipeline-model-parallel-size {pp}) runs with ZeRO stage 0 or 1 "
                         f"only (DeepSpeed's PipelineEngine), the config has stage {zero_stage}")
    return world_size // (tp * pp)


def init_model_parallel(tp: int = 1, pp: int = 1, zero_stage: int = 0) -> "MegatronMPU":
    """Build megatron-core's TP/PP/DP groups over the running torch.distributed world."""
    from megatron.core import parallel_state

    if not dist.is_initialized():
        raise RuntimeError("init_model_parallel needs torch.distributed initialized first")
    check_topology(dist.get_world_size(), tp, pp, zero_stage)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             order="tp-cp-ep-dp-pp", create_gloo_process_groups=False)
    return MegatronMPU()


def destroy_model_parallel() -> None:
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()


class MegatronMPU:
    """The ``mpu`` DeepSpeed expects, over megatron-core's ``parallel_state``.

    DeepSpeed calls ``get_model_parallel_*`` (checkpoint names, broadcast of replicated
    parameters), ``get_data_parallel_*`` (data loader, dense all-reduce, SCAPE's group) and
    ``get_tensor_model_parallel_*``; parallel_state lacks the first family and
    ``get_data_parallel_group_ranks``.
    """

    def __init__(self):
        from megatron.core import parallel_state

        self._ps = parallel_state

    def get_tensor_model_parallel_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_world_size(self) -> int:
        return self._ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_group(self):
        return self._ps.get_tensor_model_parallel_group()

    # model parallel == tensor parallel for DeepSpeed
    get_model_parallel_rank = get_tensor_model_parallel_rank
    get_model_parallel_world_size = get_tensor_model_parallel_world_size
    get_model_parallel_group = get_tensor_model_parallel_group

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self._ps.get_tensor_model_parallel_src_rank()

    def get_data_parallel_rank(self) -> int:
        return self._ps.get_data_parallel_rank()

    def get_data_parallel_world_size(self) -> int:
        return self._ps.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return self._ps.get_data_parallel_group()

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(dist.get_process_group_ranks(self._ps.get_data_parallel_group()))

    def get_pipeline_model_parallel_rank(self) -> int:
        return self._ps.get_pipeline_model_parallel_rank()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self._ps.get_pipeline_model_parallel_world_size()

    def get_pipe_parallel_group(self):
        return self._ps.get_pipeline_model_parallel_group()

    def get_norm_group(self):
        """Every rank holding other parameters of the same model replica (TP x PP): the global gradient norm's group."""
        return self._ps.get_model_parallel_group()


# ---------------------------------------------------------------------- dropout RNG
class CPURNGTracker:
    """Named CPU RNG states (megatron's CUDA RNG tracker, for CPU tensors).

    Dropout on tensor-parallel shards (attention probabilities of this rank's heads) must draw
    different numbers on each TP rank, dropout on replicated activations the same numbers: the
    replicated draws use the default generator, the sharded ones ``with tracker.fork():``.
    """

    def __init__(self):
        self.states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states:
            raise RuntimeError(f"RNG state {name!r} was not added: call model_parallel_seed(seed) first")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


_CPU_TRACKER = CPURNGTracker()


def get_rng_tracker():
    """Megatron's CUDA RNG tracker on GPU, the CPU tracker otherwise."""
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import get_cuda_rng_tracker

        return get_cuda_rng_tracker()
    return _CPU_TRACKER


def model_parallel_seed(seed: int) -> None:
    """Seed the default RNG (same on every TP rank) and the tensor-parallel RNG (one stream per TP rank).

    The offset 2718 is megatron's, so a GPU run seeds as megatron does.
    """
    from megatron.core import parallel_state

    torch.manual_seed(seed)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(seed)
        return
    _CPU_TRACKER.states.clear()
    _CPU_TRACKER.add("model-parallel-rng", seed + 2718 + parallel_state.get_tensor_model_parallel_rank())
