"""bench/quality.py's --runs: run and group names expand in order, without repeats; bad names fail."""
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "bench"))
import quality  # noqa: E402


def test_groups_expand_in_order_without_repeats():
    assert quality.expand_runs("comparison") == quality.COMPARISON
    names = quality.expand_runs("adamw,comparison,scape99_T10_lr1e-3,lr1e-3")
    assert names[: len(quality.COMPARISON)] == quality.COMPARISON
    assert names.count("scape99_T10_lr1e-3") == 1 and names.index("scape99_T10_lr1e-3") == len(quality.COMPARISON)
    assert set(quality.expand_runs("all")) == set(quality.RUNS)
    assert len(quality.expand_runs("all")) == len(quality.RUNS)
    named = set().union(*(v for g, v in quality.GROUPS.items() if g != "all"))
    assert named == set(quality.RUNS), "a run that belongs to no group"


def test_unknown_run_name_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown run 'adamx'"):
        quality.expand_runs("adamw,adamx")
    with pytest.raises(ValueError, match="unknown run 'adamx'"):
        quality.run(["adamw", "adamx"], str(tmp_path))
    assert not os.listdir(tmp_path)
