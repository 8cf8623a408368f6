"""GPT from megatron-core's tensor_parallel layers, flat (TP x DP) or as a DeepSpeed PipelineModule.

The architecture is :class:`scape_ds.models.GPT`'s (pre-LN GPT-2, tied lm head, learned
positions, GELU MLP, nanoGPT initialisation); the linear layers and the token embedding are
megatron-core's, sharded over the tensor-parallel group:

    VocabParallelEmbedding   wte  (V/tp, C)  vocabulary rows of this TP rank
    ColumnParallelLinear     qkv  (3C/tp, C) whole heads: rows are laid out [head][q|k|v][head_dim]
    RowParallelLinear        proj (C, C/tp)  input columns of this rank's heads; bias replicated
    ColumnParallelLinear     fc   (4C/tp, C)
    RowParallelLinear        proj (C, 4C/tp)
    lm head                  x @ wte^T -> (B, T, V/tp) logits, vocab_parallel_cross_entropy

Weights are initialised on CPU at full size and split (``use_cpu_initialization``), so any TP
size starts from the same model. Parameters replicated across TP ranks (LayerNorms, row-parallel
biases, the position embedding) get the same gradient on every TP rank; they are marked
``scape_group = "tp_replicated"``: ``scape_ds.initialize`` puts them in a param group of their own,
whose SCAPE state (layout, momentum, masks) is then the same on every TP rank, so they stay
bitwise equal across TP ranks at any sparsity (in one layout with the sharded weights each TP
rank would choose its own mask). On TP ranks > 0 they are also ``scape_norm_skip``: counted once
in the global gradient norm. In a pipeline the tied token embedding lives on the first and the
last stage; DeepSpeed sums its gradient across the two, its own group (``scape_group = "tied"``)
makes both stages choose the same masks and apply the same update, and the last stage's copy is
left out of the norm.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.gpt import GPTConfig
from .parallel import get_rng_tracker

__all__ = ["MegatronGPT", "build_pipeline_gpt", "megatron_config", "mark_replicated", "gpt_loss"]


def megatron_config(dtype: torch.dtype = torch.float32):
    """megatron-core ModelParallelConfig for CPU or GPU runs of these layers (TP size from parallel_state)."""
    from megatron.core import ModelParallelConfig, parallel_state

    return ModelParallelConfig(
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        params_dtype=dtype, pipeline_dtype=dtype, use_cpu_initialization=True, perform_initialization=True,
        gradient_accumulation_fusion=False, async_tensor_model_parallel_allreduce=False,
        sequence_parallel=False)


def _normal(std: float):
    return lambda w: nn.init.normal_(w, mean=0.0, std=std)


def mark_replicated(module: nn.Module) -> None:
    """Mark the parameters replicated across TP ranks (no ``tensor_model_parallel`` attribute)."""
    from megatron.core import parallel_state

    tp, tp_rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    for p in module.parameters():
        if tp > 1 and not getattr(p, "tensor_model_parallel", False):
            p.scape_group = "tp_replicated"
            p.scape_norm_skip = tp_rank > 0


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of (B, T, V/tp) vocab-parallel logits against (B, T) int64 targets."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(logits.float(), targets).mean()


class TokenEmbedding(nn.Module):
    """Vocab-parallel token embedding; also the tied lm head (:meth:`logits`)."""

    def __init__(self, cfg: GPTConfig, mp_config):
        super().__init__()
        from megatron.core.tensor_parallel import VocabParallelEmbedding

        self.wte = VocabParallelEmbedding(cfg.vocab_size, cfg.n_embd, init_method=_normal(0.02), config=mp_config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.wte(idx)  # (B, T, C), reduced over TP

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        return F.linear(copy_to_tensor_model_parallel_region(x), self.wte.weight)  # (B, T, V/tp)


class PositionEmbedding(nn.Module):
    """Adds the learned position embedding (replicated over TP), then dropout."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.wpe = nn.Embedding(cfg.seq_len, cfg.n_embd)
        nn.init.normal_(self.wpe.weight, mean=0.0, std=0.02)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(x.shape[1], device=x.device)  # (T,)
        return self.drop(x + self.wpe(pos))  # (B, T, C); same dropout draws on every TP rank


class ParallelBlock(nn.Module):
    """Pre-LN transformer block with tensor-parallel attention (whole heads per rank) and MLP."""

    def __init__(self, cfg: GPTConfig, mp_config):
        super().__init__()
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        tp = mp_config.tensor_model_parallel_size
        if cfg.n_head % tp != 0:
            raise ValueError(f"n_head={cfg.n_head} must be divisible by tensor-model-parallel-size {tp}")
        C, std, proj_std = cfg.n_embd, 0.02, 0.02 / math.sqrt(2 * cfg.n_layer)
        self.n_head_local, self.head_dim, self.dropout = cfg.n_head // tp, C // cfg.n_head, cfg.dropout
        self.ln_1 = nn.LayerNorm(C, bias=cfg.bias)
        self.qkv = ColumnParallelLinear(C, 3 * C, config=mp_config, init_method=_normal(std), bias=cfg.bias,
                                        gather_output=False)
        self.attn_proj = RowParallelLinear(C, C, config=mp_config, init_method=_normal(proj_std), bias=cfg.bias,
                                           input_is_parallel=True, skip_bias_add=False)
        self.ln_2 = nn.LayerNorm(C, bias=cfg.bias)
        self.fc = ColumnParallelLinear(C, 4 * C, config=mp_config, init_method=_normal(std), bias=cfg.bias,
                                       gather_output=False)
        self.mlp_proj = RowParallelLinear(4 * C, C, config=mp_config, init_method=_normal(proj_std), bias=cfg.bias,
                                          input_is_parallel=True, skip_bias_add=False)
        self.drop = nn.Dropout(cfg.dropout)
        for lin in (self.qkv, self.attn_proj, self.fc, self.mlp_proj):
            if lin.bias is not None:
                with torch.no_grad():
                    lin.bias.zero_()

    def _attention(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        qkv, _ = self.qkv(x)  # (B, T, 3C/tp)
        q, k, v = qkv.view(B, T, self.n_head_local, 3, self.head_dim).permute(3, 0, 2, 1, 4)  # 3 x (B, nh/tp, T, hs)
        p = self.dropout if self.training else 0.0
        with get_rng_tracker().fork():  # this rank's heads: its own dropout stream
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh/tp, T, hs)
        y = y.transpose(1, 2).reshape(B, T, self.n_head_local * self.head_dim)  # (B, T, C/tp)
        out, _ = self.attn_proj(y)  # (B, T, C), all-reduced over TP
        return self.drop(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self._attention(self.ln_1(x))  # (B, T, C)
        h, _ = self.fc(self.ln_2(x))  # (B, T, 4C/tp)
        out, _ = self.mlp_proj(F.gelu(h))  # (B, T, C)
        return x + self.drop(out)


class FinalNorm(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln_f(x)


class MegatronGPT(nn.Module):
    """Tensor-parallel GPT (no pipeline): ``forward(idx, targets) -> (vocab-parallel logits, loss)``.

    Build it after :func:`scape_ds.megatron.init_model_parallel`, with the same torch seed on
    every rank.
    """

    def __init__(self, cfg: GPTConfig, mp_config=None):
        super().__init__()
        mp_config = mp_config or megatron_config()
        self.config = cfg
        self.tok = TokenEmbedding(cfg, mp_config)
        self.pos = PositionEmbedding(cfg)
        self.blocks = nn.ModuleList(ParallelBlock(cfg, mp_config) for _ in range(cfg.n_layer))
        self.norm = FinalNorm(cfg)
        mark_replicated(self)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if idx.dim() != 2 or idx.shape[1] > self.config.seq_len:
            raise ValueError(f"MegatronGPT.forward: idx must be (B, T<={self.config.seq_len}), got {tuple(idx.shape)}")
        x = self.pos(self.tok(idx))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        logits = self.tok.logits(self.norm(x))  # (B, T, V/tp)
        return logits, (gpt_loss(logits, targets) if targets is not None else None)


def _head(module: TokenEmbedding, x: torch.Tensor) -> torch.Tensor:
    return module.logits(x)


def _seed_layer(seed) -> None:
    torch.manual_seed(int(seed))  # DeepSpeed passes a numpy int, which random.seed refuses


def build_pipeline_gpt(cfg: GPTConfig, topology, seed: int, mp_config=None,
                       partition_method: str = "type:ParallelBlock"):
    """The GPT as a DeepSpeed PipelineModule over ``topology`` (a ``PipeModelDataParallelTopology``).

    Layers: tied token embedding, position embedding, blocks, final norm, tied lm head. Each
    layer is built from seed ``seed + layer index`` (``seed_layers``), so every pipeline size
    starts from the same weights.
    """
    import deepspeed
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    if not deepspeed.comm.is_initialized():  # PipelineModule talks through deepspeed.comm
        from ..engine import skip_unused_cpu_ops

        skip_unused_cpu_ops()
        deepspeed.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    mp_config = mp_config or megatron_config()
    layers = [TiedLayerSpec("embed", TokenEmbedding, cfg, mp_config, tied_weight_attr=["wte.weight"]),
              LayerSpec(PositionEmbedding, cfg)]
    layers += [LayerSpec(ParallelBlock, cfg, mp_config) for _ in range(cfg.n_layer)]
    layers += [LayerSpec(FinalNorm, cfg),
               TiedLayerSpec("embed", TokenEmbedding, cfg, mp_config, forward_fn=_head,
                             tied_weight_attr=["wte.weight"])]
    module = PipelineModule(layers=layers, loss_fn=gpt_loss, topology=topology, partition_method=partition_method,
                            seed_layers=True, seed_fn=_seed_layer, base_seed=seed, activation_checkpoint_interval=0)
    mark_replicated(module)
    stage, stages = module._grid.get_stage_id(), module._grid.get_pipe_parallel_world_size()
    if stages > 1:
        for key, comm in module.tied_comms.items():
            for name in comm["weight_attr"]:
                w = module._recursive_getattr(comm["module"], name)
                w.scape_group = "tied"  # both stages choose the same masks and apply the same update
                w.scape_norm_skip = stage != 0  # counted on the first stage
    return module
