"""No large file in git: raw run output belongs under the ignored runs/, not in the repository.

Every tracked file must be under ``LIMIT`` bytes (plots and summary CSVs are well under it; a per-step
JSONL of one 1500-step run is ~280 KB, so a directory of them fails on size long before it reaches a
reviewer). Skips outside a git checkout (an sdist, an installed copy).
"""
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 500 * 1024


def tracked_files(repo: str) -> list[str]:
    """Paths git tracks in ``repo`` (relative), or skip the test when there is no git checkout."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    out = subprocess.run(["git", "-C", repo, "ls-files", "-z"], capture_output=True)
    if out.returncode != 0:
        pytest.skip(f"{repo} is not a git checkout")
    return [p for p in out.stdout.decode("utf-8", "surrogateescape").split("\0") if p]


def test_no_tracked_file_over_500kb():
    paths = tracked_files(REPO)
    assert paths, "git ls-files listed nothing"
    sizes = {p: os.path.getsize(os.path.join(REPO, p)) for p in paths if os.path.isfile(os.path.join(REPO, p))}
    big = {p: s for p, s in sizes.items() if s > LIMIT}
    assert not big, (f"tracked files over {LIMIT // 1024} KB (write raw output under runs/, keep summaries): "
                     + ", ".join(f"{p} ({s / 1024:.0f} KB)" for p, s in sorted(big.items())))


def test_bench_stays_under_1mb():
    sizes = [os.path.getsize(os.path.join(REPO, p)) for p in tracked_files(REPO)
             if p.startswith("bench/") and os.path.isfile(os.path.join(REPO, p))]
    assert sum(sizes) < 1024 * 1024, f"bench/ holds {sum(sizes) / 1e6:.2f} MB in git; keep summaries, not raw runs"
