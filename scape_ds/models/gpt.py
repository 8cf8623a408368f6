"""A small GPT (nanoGPT-style), single-device code: no parallelism imports here.

Structure, kept flat so a pipeline split can cut it into stages::

    GPT.embed   token + learned position embedding (+ dropout)   (B, T) int64 -> (B, T, C)
    GPT.blocks  nn.ModuleList of pre-LN transformer blocks         (B, T, C) -> (B, T, C)
    GPT.head    final LayerNorm + lm head                          (B, T, C) -> (B, T, V)

The lm head weight *is* the token embedding weight (weight tying, as in GPT-2), so a pipeline split
that puts ``embed`` and ``head`` on different stages must keep the two copies in sync itself.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["GPT", "GPTConfig", "GPT_SHAPES"]


@dataclass
class GPTConfig:
    """Sizes of a GPT; the defaults are the ``tiny`` byte-level model used in tests."""

    vocab_size: int = 256
    """Number of token ids (256 for :class:`scape_ds.data.ByteTokenizer`)."""

    seq_len: int = 128
    """Longest sequence the model accepts (size of the position embedding)."""

    n_layer: int = 2
    """Number of transformer blocks."""

    n_head: int = 4
    """Attention heads per block; must divide ``n_embd``."""

    n_embd: int = 128
    """Width of the residual stream (C)."""

    dropout: float = 0.0
    """Dropout probability on embeddings, attention weights and residual branches, in [0, 1)."""

    bias: bool = True
    """Biases in the Linear layers and LayerNorms."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be a positive int, got {value!r}")
        if self.n_embd % self.n_head != 0:
            raise ValueError(
                f"GPTConfig: n_embd={self.n_embd} must be divisible by n_head={self.n_head}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout!r}")


GPT_SHAPES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "gpt2-125m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, n_embd=768),
}
"""Named model shapes. ``gpt2-125m`` (vocabulary padded to 50304) is for byte-counting benchmarks;
build it on the meta device (``with torch.device("meta"): GPT(cfg)``) to count without memory."""


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(C, 4C) -> GELU -> Linear(4C, C)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))  # (B, T, C)


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class Embedding(nn.Module):
    """Token embedding plus learned absolute position embedding, then dropout."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.seq_len, config.n_embd)
        self.drop = nn.Dropout(config.dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)  # (T,) int64
        return self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)


class Head(nn.Module):
    """Final LayerNorm and the lm head (its weight is tied to the token embedding by :class:`GPT`)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))  # (B, T, V)


class GPT(nn.Module):
    """Decoder-only transformer language model (GPT-2 architecture, nanoGPT initialisation).

    Initialisation: every Linear and Embedding weight ~ N(0, 0.02), biases zero, and the two
    projections that write into the residual stream (``attn.proj``, ``mlp.proj``) ~ N(0,
    0.02 / sqrt(2 * n_layer)) so the residual variance does not grow with depth (GPT-2 paper).

    Args:
        config: the model sizes.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = Embedding(config)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.head = Head(config)
        # weight tying: one (V, C) parameter shared by the embedding and the lm head
        self.head.lm_head.weight = self.embed.wte.weight

        self.apply(self._init_weights)
        proj_std = 0.02 / math.sqrt(2 * config.n_layer)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=proj_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=proj_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Compute next-token logits and, given targets, the mean cross-entropy loss.

        Args:
            idx: ``(B, T)`` int64 token ids, ``T <= config.seq_len``.
            targets: ``(B, T)`` int64 next-token ids, or None.

        Returns:
            ``(logits, loss)``: logits ``(B, T, V)`` float; loss a float scalar averaged over all
            ``B * T`` positions, or None when ``targets`` is None.

        Raises:
            ValueError: if ``idx`` is not 2-D or ``T`` exceeds ``config.seq_len``.
        """
        if idx.dim() != 2:
            raise ValueError(f"GPT.forward: idx must be (B, T), got shape {tuple(idx.shape)}")
        if idx.shape[1] > self.config.seq_len:
            raise ValueError(
                f"GPT.forward: sequence length {idx.shape[1]} exceeds config.seq_len={self.config.seq_len}"
            )
        x = self.embed(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)  # (B, T, C)
        logits = self.head(x)  # (B, T, V)
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    def num_parameters(self, exclude_position_embedding: bool = False) -> int:
        """Count parameters; the tied embedding / lm head weight is counted once.

        Args:
            exclude_position_embedding: leave out ``embed.wpe`` (nanoGPT's "non-embedding" count
                keeps the token embedding because it is also the lm head).

        Returns:
            The number of scalar parameters.
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() yields shared ones once
        if exclude_position_embedding:
            n -= self.embed.wpe.weight.numel()
        return n
