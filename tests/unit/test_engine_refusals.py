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


def test_what_dct_under_zero3_does_not_run_is_refused_in_one_line():
    # basis "dct" runs under ZeRO-3 (tests/multiprocess/test_zero3_dct.py); its momentum in coefficients does not
    cfg = dict(_dct_config(), zero_optimization={"stage": 3})
    cfg["scape"] = dict(cfg["scape"], dct_update="adams_coef")
    with pytest.raises(ValueError, match="scape.dct_update 'adams_coef' is not built for ZeRO stage 3") as err:
        scape_ds.initialize(model=torch.nn.Linear(4, 4), config=cfg)
    assert "\n" not in str(err.value)
