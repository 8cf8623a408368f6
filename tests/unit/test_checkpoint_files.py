"""scape_ds.checkpoint in one process: safe_load refuses pickled code, the manifest names a missing,
extra, truncated or altered file."""
import os

import pytest
import torch

from scape_ds.checkpoint import _check_contents, check_manifest, safe_load, write_manifest


class _RunsCode:
    """Unpickling this calls os.system: what a checkpoint from an untrusted source could hold."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _tag(tmp_path):
    tag = tmp_path / "global_step3"
    tag.mkdir()
    torch.save({"m": torch.arange(10000, dtype=torch.float32), "step": 3, "name": "a", "xs": [1, 2.5]},
               tag / "scape_dp_rank_00000.pt")
    torch.save({"w": torch.ones(5, 5)}, tag / "mp_rank_00_model_states.pt")
    write_manifest(str(tag))
    return tag


def test_safe_load_reads_plain_state(tmp_path):
    state = safe_load(str(_tag(tmp_path) / "scape_dp_rank_00000.pt"))
    assert state["step"] == 3 and state["xs"] == [1, 2.5] and torch.equal(state["m"], torch.arange(10000.0))


def test_pickled_callable_is_refused_not_run(tmp_path):
    marker = tmp_path / "code_ran"
    path = tmp_path / "evil.pt"
    torch.save({"m": torch.zeros(3), "payload": _RunsCode(marker)}, path)
    with pytest.raises(ValueError) as err:
        safe_load(str(path))
    line = str(err.value)
    assert str(path) in line and "system" in line and "refused" in line and "\n" not in line, line
    assert not marker.exists()
    # the scan before any load names it too (load_checkpoint's step 2), without running it
    tag = tmp_path / "tag"
    tag.mkdir()
    os.replace(path, tag / "evil.pt")
    write_manifest(str(tag))
    problems = _check_contents(str(tag))
    assert len(problems) == 1 and "evil.pt" in problems[0] and "not plain data" in problems[0], problems
    assert not marker.exists()


def test_truncated_file_is_named_by_safe_load(tmp_path):
    path = _tag(tmp_path) / "scape_dp_rank_00000.pt"
    data = path.read_bytes()
    for keep in (len(data) - 10, len(data) // 2, 100):
        path.write_bytes(data[:keep])
        with pytest.raises(ValueError, match="corrupt or truncated") as err:
            safe_load(str(path))
        assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_complete_tag_passes_the_manifest(tmp_path):
    tag = _tag(tmp_path)
    assert check_manifest(str(tag)) == [] and _check_contents(str(tag)) == []
    assert not [n for n in os.listdir(tag) if ".tmp." in n]


def test_manifest_names_missing_extra_truncated_and_altered_files(tmp_path):
    tag = _tag(tmp_path)
    victim = tag / "scape_dp_rank_00000.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[:-1])
    (problem,) = check_manifest(str(tag))
    assert str(victim) in problem and "truncated" in problem and f"says {len(data)}" in problem, problem
    altered = bytearray(data)
    altered[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    victim.write_bytes(bytes(altered))
    assert check_manifest(str(tag)) == []
    (problem,) = _check_contents(str(tag))
    assert str(victim) in problem and "altered" in problem, problem
    victim.unlink()
    (tag / "stray.pt").write_bytes(b"x")
    assert check_manifest(str(tag)) == [f"{victim} is missing", f"{tag / 'stray.pt'} is not in the manifest"]
    (tag / "manifest.json").unlink()
    (problem,) = check_manifest(str(tag))
    assert "no manifest.json" in problem
