"""scape_ds.checkpoint.check_archive: a truncated or damaged torch.save file is named, a complete one passes."""
import torch

from scape_ds.checkpoint import check_archive


def _saved(tmp_path):
    path = tmp_path / "state.pt"
    torch.save({"m": torch.arange(10000, dtype=torch.float32), "step": 3}, path)
    return path


def test_complete_file_passes(tmp_path):
    assert check_archive(str(_saved(tmp_path))) is None


def test_truncated_file_is_named(tmp_path):
    path = _saved(tmp_path)
    data = path.read_bytes()
    for keep in (len(data) - 10, len(data) // 2, 100):
        path.write_bytes(data[:keep])
        problem = check_archive(str(path))
        assert problem is not None and str(path) in problem and "truncated" in problem, (keep, problem)
        assert "\n" not in problem


def test_damaged_directory_is_named(tmp_path):
    path = _saved(tmp_path)
    data = bytearray(path.read_bytes())
    entry = data.find(b"PK\x01\x02")  # the central directory's first entry
    data[entry : entry + 4] = b"XXXX"
    path.write_bytes(bytes(data))
    assert "corrupt or truncated" in check_archive(str(path))


def test_other_files_are_not_judged(tmp_path):
    path = tmp_path / "legacy.pt"
    path.write_bytes(b"\x80\x02not a zip archive")
    assert check_archive(str(path)) is None
