"""The test tiers of tests/conftest.py: markers by directory, the slow list, and their registration."""
import configparser
import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import SLOW_TESTS, TESTS_DIR, TIER_BY_DIRECTORY, tier_markers

REPO = os.path.dirname(TESTS_DIR)


def test_markers_follow_the_directory():
    assert tier_markers("unit/test_adams.py", "test_x") == []
    assert tier_markers("multiprocess/test_zero3.py", "test_x") == ["multirank"]
    assert tier_markers("integration/test_pretrain_launcher.py", "test_x") == ["launcher"]
    assert tier_markers("mpi/test_mpi.py", "test_x") == ["mpi"]
    assert tier_markers("cluster/test_cluster.py", "test_x") == ["root"]
    assert tier_markers("gpu/test_kernels_gpu.py", "test_x") == ["gpu"]


@pytest.fixture(scope="module")
def collected(tmp_path_factory) -> list[dict]:
    """What ``pytest --collect-only tests`` collects, in a subprocess (this session holds only the files
    it was given): each item's node id, its marker names after tests/conftest.py added the tiers, and
    its ``pytest.mark.timeout`` (None without one)."""
    out = tmp_path_factory.mktemp("collect") / "items.json"
    proc = subprocess.run([sys.executable, "-c", _COLLECT, str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    items = json.loads(out.read_text())
    assert len(items) > 100, len(items)
    return items


_COLLECT = """
import json, sys
import pytest

class Dump:
    items = []

    def pytest_collection_finish(self, session):  # after every collection_modifyitems hook
        for item in session.items:
            timeout = item.get_closest_marker("timeout")
            self.items.append(dict(id=item.nodeid, marks=sorted({m.name for m in item.iter_markers()}),
                                   timeout=timeout.args[0] if timeout and timeout.args else None))

dump = Dump()
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"], plugins=[dump])
json.dump(dump.items, open(sys.argv[1], "w"))
sys.exit(int(code))
"""


def test_every_slow_entry_names_collected_tests_and_marks_them(collected):
    """Each SLOW_TESTS entry must name tests pytest really collects (a renamed function, a changed
    parametrization id or a moved file would silently leave the list), and those tests carry ``slow``."""
    assert SLOW_TESTS, "the slow list is empty"
    by_id = {item["id"]: item for item in collected}
    for entry in sorted(SLOW_TESTS):
        node = f"tests/{entry}"
        matched = [i for i in by_id if i == node or ("[" not in entry and i.startswith(node + "["))]
        assert matched, f"SLOW_TESTS entry {entry}: pytest collects no such test"
        for i in matched:
            assert "slow" in by_id[i]["marks"], (i, by_id[i]["marks"])
    # and nothing else is slow: the marker comes only from the list
    listed = {f"tests/{e}" for e in SLOW_TESTS}
    for item in collected:
        if "slow" in item["marks"]:
            assert item["id"] in listed or item["id"].split("[")[0] in listed, item["id"]


def test_every_multirank_test_has_its_own_timeout(collected):
    """pytest.ini bounds every test; a multi-rank test also states its own bound (pytest.mark.timeout),
    sized to what it measured, so that a hang ends and a slow machine does not fail it."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "pytest.ini"))
    assert float(cfg["pytest"]["timeout"]) > 0 and cfg["pytest"]["timeout_method"] == "signal"
    multirank = [item for item in collected if "multirank" in item["marks"]]
    assert multirank
    missing = [item["id"] for item in multirank if item["timeout"] is None]
    assert not missing, missing


def test_every_tier_marker_is_registered():
    """pytest runs with --strict-markers, so an unregistered marker would fail collection."""
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(REPO, "pytest.ini"))
    assert "--strict-markers" in cfg["pytest"]["addopts"]
    registered = {line.split(":")[0].strip() for line in cfg["pytest"]["markers"].strip().splitlines()}
    assert set(TIER_BY_DIRECTORY.values()) | {"slow"} <= registered


_DIRECTORY_MARKERS = set(TIER_BY_DIRECTORY.values())
_FAST_EXCLUDES = {"launcher", "mpi", "root", "slow", "gpu"}  # make test-fast's -m "not (...)"
_SELECTIONS = {
    "every test (`make test-all`)": lambda marks: True,
    "all but the slow tier (`make test`, CI)": lambda marks: "slow" not in marks,
    "the fast tier (`make test-fast`)": lambda marks: not marks & _FAST_EXCLUDES,
    "no tier marker (`unit/`)": lambda marks: not marks & _DIRECTORY_MARKERS,
    **{f"`{m}`": (lambda marks, m=m: m in marks) for m in (*TIER_BY_DIRECTORY.values(), "slow")},
}


def test_readme_counts_are_what_pytest_collects(collected):
    """tests/README.md's table of test counts per selection equals what pytest collects now."""
    with open(os.path.join(TESTS_DIR, "README.md"), encoding="utf-8") as f:
        rows = dict(re.findall(r"^\| (.+?) \| (\d+) \|$", f.read(), flags=re.MULTILINE))
    assert set(rows) == set(_SELECTIONS), sorted(rows)
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as f:  # the fast tier is make test-fast's
        makefile = f.read()
    assert 'FAST := not (launcher or mpi or root or slow or gpu)' in makefile
    assert '-m "not slow" tests $(ARGS)' in makefile  # make test: every test but the slow tier
    counts = {name: sum(1 for item in collected if pick(set(item["marks"]))) for name, pick in _SELECTIONS.items()}
    assert {name: int(n) for name, n in rows.items()} == counts, "update the table in tests/README.md"
