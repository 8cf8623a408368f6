"""The training loop's pieces that need no process group: the closing summary and the metrics writer."""
from __future__ import annotations

import json
import math

import pytest

from scape_ds.metrics import MetricsWriter
from scape_ds.train import _log_line, build_parser, format_summary, loss_windows

SUMMARY = dict(steps=0, wall_s=12.3, val_loss=2.5, bytes_sent=10_000_000, bytes_dense=100_000_000)


@pytest.mark.parametrize("n,w", [(1, 1), (2, 1), (3, 1), (5, 2), (9, 4), (10, 5), (500, 5)])
def test_loss_windows_are_disjoint_ends_of_the_run(n, w):
    losses = [float(i) for i in range(n)]
    got_w, first, last = loss_windows(losses)
    assert got_w == w
    assert first == sum(range(w)) / w
    assert last == sum(range(n - w, n)) / w
    assert n == 1 or w <= n - w  # the windows do not overlap


def test_no_steps_give_nan_not_zero():
    w, first, last = loss_windows([])
    assert w == 0 and math.isnan(first) and math.isnan(last)


def test_short_run_summary_shows_its_losses():
    """A 3-step run used to print 0.000 for "last 5" (every loss went to the first window)."""
    line = format_summary(dict(SUMMARY, steps=3), [5.5, 5.0, 4.0])
    assert "loss 5.500 (first 1) -> 4.000 (last 1)" in line, line
    assert "0.000" not in line


def test_long_run_summary_is_the_first_and_last_five():
    losses = [6.0] * 5 + [3.0] * 10 + [2.0] * 5
    line = format_summary(dict(SUMMARY, steps=len(losses)), losses)
    assert line == ("done: 20 steps in 12 s | loss 6.000 (first 5) -> 2.000 (last 5) | val loss 2.5000 | "
                    "sent 10.0 MB of a dense 100.0 MB: 10.00% (90.0% saved)")
    one_rank = format_summary(dict(SUMMARY, steps=20, bytes_sent=0, bytes_dense=0), losses)
    assert one_rank.endswith("0.00% (one rank: nothing to exchange)")


def test_metrics_writer_jsonl_appends_on_resume_and_fills_tensorboard(tmp_path):
    path, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    with MetricsWriter(str(path), str(tb)) as w:
        w.write(dict(step=1, loss=2.0, lr=1e-3, step_time_s=0.1, bytes_sent=5, tokens_per_s=10.0))
        w.write(dict(step=2, loss=1.5, lr=1e-3, step_time_s=0.1, bytes_sent=5, tokens_per_s=10.0, val_loss=1.7))
    with MetricsWriter(str(path), append=True) as w:
        w.write(dict(step=3, loss=1.2))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[1]["val_loss"] == 1.7
    # the event file holds the scalars at their steps (train/<key>, val/loss), not just some file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/step_time_s", "train/bytes_sent", "train/tokens_per_s",
            "val/loss"} <= set(scalars), scalars
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 2.0), (2, 1.5)]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("val/loss")] == [(2, 1.7)]
    with MetricsWriter(str(path)) as w:  # a new run starts the file anew
        w.write(dict(step=1, loss=2.0))
    assert len(path.read_text().splitlines()) == 1
    MetricsWriter().write(dict(step=1))  # no outputs: nothing to do


def test_parser_keeps_the_launcher_options():
    args = build_parser().parse_args(["--deepspeed_config", "c.json", "--local_rank=1", "--deepspeed"])
    assert (args.deepspeed_config, args.local_rank, args.train_iters, args.log_interval) == ("c.json", 1, 500, 20)


def test_log_line_shows_the_bytes_across_nodes_under_a_hierarchy():
    record = dict(step=6, loss=4.6, lr=1e-3, tokens_per_s=1000.0, bytes_sent=3_000_000, bytes_dense=4_000_000,
                  bytes_inter=100_000, bytes_intra=2_900_000, bytes_dense_inter=2_000_000)
    line = _log_line(record)
    assert "sent 3.000 MB vs dense 4.000 MB (75.0%) | across nodes 0.100 MB vs dense 2.000 MB (5.0%)" in line
    flat = _log_line(dict(record, bytes_intra=0))  # a flat run: every byte is inter-node, said once
    assert "across nodes" not in flat
