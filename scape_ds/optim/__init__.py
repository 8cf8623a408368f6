"""Optimizers: dense AdamS and SCAPE (AdamS with the sparse sharded exchange)."""
from .adams import AdamS, adams
from .scape import ScapeAdamS

__all__ = ["AdamS", "adams", "ScapeAdamS"]
