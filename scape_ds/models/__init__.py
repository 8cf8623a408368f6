"""Models: single-device GPT code (``gpt.py``); parallel wrappers live in their own modules."""
from .gpt import GPT, GPT_SHAPES, GPTConfig

__all__ = ["GPT", "GPTConfig", "GPT_SHAPES"]
