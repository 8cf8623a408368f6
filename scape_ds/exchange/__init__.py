"""Mask selection, layout and index arithmetic of the sparse exchange (pure tensor functions)."""
