"""The test tiers of tests/conftest.py: markers by directory, the slow list, and their registration."""
import ast
import configparser
import os

from tests.conftest import SLOW_TESTS, TESTS_DIR, TIER_BY_DIRECTORY, tier_markers

REPO = os.path.dirname(TESTS_DIR)


def test_markers_follow_the_directory():
    assert tier_markers("unit/test_adams.py", "test_x") == []
    assert tier_markers("multiprocess/test_zero3.py", "test_x") == ["multirank"]
    assert tier_markers("integration/test_pretrain_launcher.py", "test_x") == ["launcher"]
    assert tier_markers("mpi/test_mpi.py", "test_x") == ["mpi"]
    assert tier_markers("cluster/test_cluster.py", "test_x") == ["root"]
    assert tier_markers("gpu/test_kernels_gpu.py", "test_x") == ["gpu"]


def test_every_slow_entry_names_a_test_function():
    """A renamed or moved test would silently leave the slow list: each entry must still exist."""
    assert SLOW_TESTS, "the slow list is empty"
    for entry in sorted(SLOW_TESTS):
        relpath, test = entry.split("::")
        name, _, params = test.partition("[")
        path = os.path.join(TESTS_DIR, relpath)
        assert os.path.isfile(path), f"SLOW_TESTS entry {entry}: no file tests/{relpath}"
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
        names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert name in names, f"SLOW_TESTS entry {entry}: tests/{relpath} has no function {name}"
        assert "slow" in tier_markers(relpath, name, params.rstrip("]"))


def test_every_tier_marker_is_registered():
    """pytest runs with --strict-markers, so an unregistered marker would fail collection."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "pytest.ini"))
    assert "--strict-markers" in cfg["pytest"]["addopts"]
    registered = {line.split(":")[0].strip() for line in cfg["pytest"]["markers"].strip().splitlines()}
    assert set(TIER_BY_DIRECTORY.values()) | {"slow"} <= registered
