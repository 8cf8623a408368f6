"""tests/deepspeed_upstream/run_upstream.py takes its arguments in the order its help shows."""
import pytest

from tests.deepspeed_upstream.run_upstream import main, parse_args


@pytest.mark.parametrize("argv", [
    ["/src", "--baseline", "--", "-k", "Zero3", "unit/x.py::T"],
    ["--baseline", "/src", "--", "-k", "Zero3", "unit/x.py::T"],
])
def test_pytest_args_after_double_dash(argv):
    args = parse_args(argv)
    assert (args.deepspeed_src, args.baseline, args.pytest_args) == ("/src", True, ["-k", "Zero3", "unit/x.py::T"])


def test_no_pytest_args_means_default_selection():
    args = parse_args(["/src"])
    assert (args.deepspeed_src, args.baseline, args.pytest_args) == ("/src", False, [])


def test_pytest_options_are_not_read_as_our_own():
    assert parse_args(["/src", "--", "--baseline", "-x"]).pytest_args == ["--baseline", "-x"]
    assert parse_args(["/src", "--", "--baseline"]).baseline is False


def test_missing_checkout_is_one_line_error(tmp_path, capsys):
    assert main([str(tmp_path / "nope"), "--baseline", "--", "-x"]) == 2
    assert "has no tests/unit" in capsys.readouterr().err
