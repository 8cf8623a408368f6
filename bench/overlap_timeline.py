"""Where SCAPE's exchange runs against forward and backward: a timeline from a torch.profiler trace.

    sudo python bench/step_time.py --overlap --nodes 4 --rates 1gbit --trace runs/overlap_trace.json
    python bench/overlap_timeline.py runs/overlap_trace.json            # -> bench/overlap_timeline.png

``step_time.py --trace`` profiles two steps and one forward of its last row (SCAPE 0.99 with
``scape.overlap``) on rank 0, marked ``forward``/``backward``/``step``. This draws them on the
main thread's lane and gloo's collectives (``gloo:reduce``: a bucket's gradients to its owner;
``gloo:broadcast``: a bucket's new values from it; ``gloo:all_reduce``: dense tensors and the norm;
``gloo:all_gather``: masks) on the lanes of gloo's worker threads, so one sees which collectives run
under backward and under the next forward, and which the step waits for.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = {"forward": "tab:blue", "backward": "tab:orange", "step": "tab:green"}
COLLECTIVES = {"gloo:reduce": "tab:red", "gloo:broadcast": "tab:purple", "gloo:all_reduce": "tab:gray",
               "gloo:all_gather": "tab:brown"}


def spans(trace: dict) -> tuple[list[tuple], list[tuple]]:
    """(phases, collectives): (name, lane, start ms, duration ms), times from the first phase."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    phases = [e for e in events if e["name"] in PHASES]
    if not phases:
        raise ValueError("no forward/backward/step marks in the trace: write it with step_time.py --trace")
    t0 = min(e["ts"] for e in phases)
    coll = [e for e in events if e["name"] in COLLECTIVES]
    lanes = {tid: i + 1 for i, tid in enumerate(sorted({e["tid"] for e in coll}))}

    def row(e, lane):
        return e["name"], lane, (e["ts"] - t0) / 1e3, e["dur"] / 1e3

    return [row(e, 0) for e in phases], [row(e, lanes[e["tid"]]) for e in coll if e["ts"] >= t0]


def plot(trace_path: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    with open(trace_path) as f:
        phases, coll = spans(json.load(f))
    lanes = 1 + max((lane for _, lane, _, _ in coll), default=0)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.6 * lanes))
    for name, lane, start, dur in phases + coll:
        colour = PHASES.get(name) or COLLECTIVES[name]
        ax.broken_barh([(start, max(dur, 0.05))], (lane - 0.4, 0.8), color=colour)
    ax.set_yticks(range(lanes), ["main thread"] + [f"gloo worker {i}" for i in range(1, lanes)])
    ax.invert_yaxis()
    ax.set_xlabel("ms (rank 0; two SCAPE 0.99 steps with scape.overlap, then a forward)")
    ax.legend(handles=[Patch(color=c, label=n) for n, c in {**PHASES, **COLLECTIVES}.items()], fontsize=8,
              ncol=7, loc="upper center", bbox_to_anchor=(0.5, -0.35 if lanes < 3 else -0.2))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="Chrome trace from step_time.py --trace")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "overlap_timeline.png"))
    args = ap.parse_args()
    try:
        plot(args.trace, args.out)
    except (OSError, ValueError) as e:
        print(f"overlap_timeline.py: error: {e}", file=sys.stderr)
        return 2
    print(f"plot: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
