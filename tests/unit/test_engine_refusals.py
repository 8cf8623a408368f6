"""scape_ds.initialize refuses, in one line and before DeepSpeed is asked for anything, what the chosen
basis does not run (no process group is needed: the check comes first)."""
from __future__ import annotations

import json
import os

import pytest
import torch

import scape_ds

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _dct_config() -> dict:
    with open(os.path.join(REPO, "ds_configs", "scape_dct.json"), encoding="utf-8") as f:
        return json.load(f)


def test_dct_under_zero3_is_refused_in_one_line():
    cfg = dict(_dct_config(), zero_optimization={"stage": 3})
    with pytest.raises(ValueError, match="scape.basis 'dct' is not built for ZeRO stage 3"):
        scape_ds.initialize(model=torch.nn.Linear(4, 4), config=cfg)
