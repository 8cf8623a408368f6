"""Run DeepSpeed's own ZeRO-3 unit tests with the SCAPE stage 3 installed (sparsity 0).

    git clone --branch v0.19.8 --depth 1 https://github.com/deepspeedai/DeepSpeed /path/to/DeepSpeed  # once
    .venv/bin/python tests/deepspeed_upstream/run_upstream.py /path/to/DeepSpeed [--baseline] [-- PYTEST_ARGS ...]

Nothing is fetched here: it runs the tests of an upstream checkout you give it, from its ``tests``
directory (its pytest.ini and conftest.py), on this machine's CPU ranks. ``sitecustomize.py``
next to this file swaps ``deepspeed.runtime.zero.stage3.DeepSpeedZeroOptimizer_Stage3`` for the
SCAPE stage 3 at sparsity 0 in every process of the run (DeepSpeed's harness starts its ranks
through a forkserver), and counts every optimizer built. The run fails if the SCAPE class was
never built. ``--baseline`` runs the same selection once more without it, for the list of tests
that fail either way. The default selection is ``test_zero.py``'s stage-3 tests (about 10 min on
2 cores, plus about 2 min the first time to compile DeepSpeed's CPU Adam extensions) and
``test_coalesced_collectives.py``.

On CPU DeepSpeed's accelerator counts NUMA nodes as devices: ``LOCAL_SIZE=2`` lets its harness
start 2 ranks on one node.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
ZERO = "unit/v1/zero/test_zero.py"
SELECTION = [f"{ZERO}::{t}" for t in (
    "TestZero3ParamPartitioningBase", "TestZero3ParamPartitioningLargeParam", "TestZero3ParamPartitioningManyParams",
    "TestParamPartitioningSkipInit", "TestZero3SwitchModes", "TestZero3ClientModuleID", "TestEmptyParameterGroup",
    "TestZeroPartitionCache", "TestZero3InitForParentWeightInitialization", "TestZero3DictFwd",
    "TestZero3RepeatForwardLoop", "TestZeroUnbalancedGradients::test[3]", "TestZeroAdamOptimizerStepCount::test[3]",
    "TestZeroFrozenWeights::test[3]", "TestZeroToFP32::test_1_param_group[True-3]",
    "TestZeroToFP32::test_1_param_group[False-3]", "TestZeroToFP32::test_2_param_groups[True-3]",
    "TestZeroToFP32::test_2_param_groups[False-3]")] + ["unit/runtime/comm/test_coalesced_collectives.py"]


def run(src: str, with_scape: bool, pytest_args: list[str]) -> tuple[int, dict, set[str], list[str]]:
    """(exit code, outcome counts, failed test ids, optimizer classes SCAPE's stage 3 was built with)."""
    with tempfile.TemporaryDirectory() as log:
        env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", LOCAL_SIZE=os.environ.get("LOCAL_SIZE", "2"),
                   PYTHONPATH=os.pathsep.join([HERE, REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        if with_scape:
            env["SCAPE_DS_UPSTREAM_LOG"] = log
        else:
            env.pop("SCAPE_DS_UPSTREAM_LOG", None)
        cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", *(pytest_args or SELECTION)]
        print(f"-- {'with the SCAPE stage 3' if with_scape else 'baseline (DeepSpeed alone)'}: {' '.join(cmd)}",
              flush=True)
        proc = subprocess.run(cmd, cwd=os.path.join(src, "tests"), env=env, stdout=subprocess.PIPE, text=True)
        sys.stdout.write(proc.stdout[-6000:])
        built = []
        for name in os.listdir(log):
            with open(os.path.join(log, name)) as f:
                built.append(f.read())
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", summary)}
    failed = set(re.findall(r"^(?:FAILED|ERROR) (\S+)", re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout), re.M))
    return proc.returncode, counts, failed, built


def parse_args(argv: list[str]) -> argparse.Namespace:
    """``DEEPSPEED_SRC [--baseline] [-- PYTEST_ARGS...]``: everything after ``--`` goes to pytest
    unread (argparse alone cannot take a positional list after an option, nor pytest's own options)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 usage="%(prog)s DEEPSPEED_SRC [--baseline] [-- PYTEST_ARGS ...]",
                                 epilog="PYTEST_ARGS: test ids or pytest options instead of the default selection")
    ap.add_argument("deepspeed_src", help="an upstream DeepSpeed checkout (with tests/unit)")
    ap.add_argument("--baseline", action="store_true", help="also run the selection without SCAPE")
    own, pytest_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = ap.parse_args(own)
    args.pytest_args = pytest_args
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if not os.path.isdir(os.path.join(args.deepspeed_src, "tests", "unit")):
        print(f"run_upstream.py: error: {args.deepspeed_src} has no tests/unit (give an upstream DeepSpeed checkout)",
              file=sys.stderr)
        return 2
    import deepspeed
    try:
        with open(os.path.join(args.deepspeed_src, "version.txt")) as f:
            src_version = f.read().strip()
    except OSError:
        src_version = "unknown"
    if src_version != deepspeed.__version__:
        print(f"warning: the checkout's version.txt says {src_version}, the installed DeepSpeed is "
              f"{deepspeed.__version__}; tests that differ between them may fail either way (see --baseline)",
              flush=True)
    code, counts, failed, built = run(args.deepspeed_src, True, args.pytest_args)
    kinds = sorted(set(built))
    print(f"== with the SCAPE stage 3: {counts}; SCAPE stage 3 built {len(built)} times, stepping {kinds}")
    status = 0
    if not built:
        print("run_upstream.py: error: no test built the SCAPE stage 3 (the swap did not take)", file=sys.stderr)
        status = 1
    if args.baseline:
        _, base_counts, base_failed, _ = run(args.deepspeed_src, False, args.pytest_args)
        print(f"== baseline (DeepSpeed alone): {base_counts}")
        only_scape = sorted(failed - base_failed)
        print(f"== fail with SCAPE only: {only_scape or 'none'}; "
              f"fail either way: {sorted(failed & base_failed) or 'none'}")
        if only_scape:
            status = 1
    elif code != 0:
        status = code
    return status


if __name__ == "__main__":
    sys.exit(main())
