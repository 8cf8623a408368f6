"""scape_ds.checkpoint in one process: safe_load refuses pickled code, the manifest names a missing,
extra, truncated or altered file."""
import os

import pytest
import torch

from scape_ds.checkpoint.files import check_contents, check_manifest, safe_load, write_manifest


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
    problems = check_contents(str(tag))
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
    assert check_manifest(str(tag)) == [] and check_contents(str(tag)) == []
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
    (problem,) = check_contents(str(tag))
    assert str(victim) in problem and "altered" in problem, problem
    victim.unlink()
    (tag / "stray.pt").write_bytes(b"x")
    assert check_manifest(str(tag)) == [f"{victim} is missing", f"{tag / 'stray.pt'} is not in the manifest"]
    (tag / "manifest.json").unlink()
    (problem,) = check_manifest(str(tag))
    assert "no manifest.json" in problem


# ---------------------------------------------------------------- issue 35: checks before step 1
def _ckpt(tmp_path, steps=(2, 4, 6)):
    """A checkpoint folder with complete tags global_step<s> and ``latest`` naming the last."""
    from scape_ds.checkpoint import LATEST

    root = tmp_path / "ckpt"
    root.mkdir()
    for s in steps:
        tag = root / f"global_step{s}"
        tag.mkdir()
        torch.save({"w": torch.full((100,), float(s))}, tag / "mp_rank_00_model_states.pt")
        write_manifest(str(tag))
    (root / LATEST).write_text(f"global_step{steps[-1]}")
    return root


def test_load_accepts_a_dir_or_a_dir_slash_tag(tmp_path):
    from scape_ds.checkpoint import check_load, resolve_load

    root = _ckpt(tmp_path)
    assert resolve_load(str(root)) == (str(root), "global_step6")
    assert resolve_load(str(root / "global_step2")) == (str(root), "global_step2")
    assert check_load(str(root / "global_step4") + "/") == (str(root), "global_step4")
    with pytest.raises(ValueError, match="no such directory"):
        check_load(str(root / "global_step9"))


def _flip_middle_byte(data: bytes) -> bytes:
    i = len(data) // 2
    return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]


@pytest.mark.parametrize("damage", ["truncate", "alter"])
def test_damaged_newest_tag_names_the_newest_intact_tag(tmp_path, damage):
    from scape_ds.checkpoint import check_load, intact_tag_hint

    root = _ckpt(tmp_path)
    newest = root / "global_step6" / "mp_rank_00_model_states.pt"
    data = newest.read_bytes()
    # the middle tag is damaged too (altered, same size): the hint skips it
    middle = root / "global_step4" / "mp_rank_00_model_states.pt"
    middle.write_bytes(_flip_middle_byte(middle.read_bytes()))
    if damage == "truncate":
        newest.write_bytes(data[:-10])
        with pytest.raises(ValueError) as err:
            check_load(str(root))
        msg = str(err.value)
        assert "\n" not in msg and "truncated" in msg and str(newest) in msg
        assert f"the newest intact tag is global_step2: resume from it with --load {root}/global_step2" in msg, msg
    else:
        newest.write_bytes(_flip_middle_byte(data))
        assert check_load(str(root)) == (str(root), "global_step6")  # sizes pass; hashes are checked at load
    assert intact_tag_hint(str(root), "global_step6").endswith(f"--load {root}/global_step2")
    assert intact_tag_hint(str(tmp_path), "x") == f"{tmp_path} holds no other intact tag"


def test_save_dir_is_created_and_probed_before_the_first_step(tmp_path):
    from scape_ds.checkpoint import check_save_dir

    check_save_dir(str(tmp_path / "new" / "ckpt"))
    assert os.listdir(tmp_path / "new" / "ckpt") == []  # the probe file is gone
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        check_save_dir(str(tmp_path / "file"))
    with pytest.raises(ValueError, match=r"cannot create the folder \(NotADirectoryError"):
        check_save_dir(str(tmp_path / "file" / "x"))  # under a file: read-only even for root


def test_save_dir_that_is_not_writable_is_refused(tmp_path, monkeypatch):
    import builtins

    from scape_ds.checkpoint import check_save_dir

    real_open = builtins.open

    def read_only(path, mode="r", *a, **k):
        if ".scape_write_probe." in str(path) and "w" in mode:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr(builtins, "open", read_only)  # root writes past chmod: a refused write stands in
    with pytest.raises(ValueError, match=r"the folder is not writable \(PermissionError"):
        check_save_dir(str(tmp_path))


def test_failed_save_leftovers_are_removed_but_never_the_latest_tag(tmp_path):
    from scape_ds.checkpoint import discard_partial_tag

    root = _ckpt(tmp_path, steps=(2,))
    (root / "global_step4").mkdir()
    (root / "global_step4" / "half.pt").write_bytes(b"x" * 10)
    assert discard_partial_tag(str(root), "global_step4") and not (root / "global_step4").exists()
    assert not discard_partial_tag(str(root), "global_step2") and (root / "global_step2").is_dir()
    assert not discard_partial_tag(str(root), "global_step8")  # nothing there
