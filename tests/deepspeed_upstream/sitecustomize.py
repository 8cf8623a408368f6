"""Installs the SCAPE stage 3 (sparsity 0) in every Python process of DeepSpeed's own test run.

``run_upstream.py`` puts this directory first on ``PYTHONPATH`` and sets ``SCAPE_DS_UPSTREAM_LOG``;
Python imports ``sitecustomize`` at start-up, so the forkserver and spawned ranks of DeepSpeed's
test harness get the swap too. Each optimizer built writes a marker file there, so the run can
show that the SCAPE class was the one exercised. Without the variable this does nothing.
"""
import os

_LOG = os.environ.get("SCAPE_DS_UPSTREAM_LOG")

if _LOG:
    import itertools

    from deepspeed.runtime.zero import stage3

    from scape_ds.config import parse_scape_config
    from scape_ds.zero3 import scape_stage3_class

    _Scape = scape_stage3_class(parse_scape_config({"sparsity": 0.0}))
    _built = itertools.count()

    class _LoggedScapeStage3(_Scape):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            name = f"{os.getpid()}-{next(_built)}-{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}"
            with open(os.path.join(_LOG, name.replace("/", "_").replace(":", "_")), "w") as f:
                f.write(type(self.optimizer).__name__)

    stage3.DeepSpeedZeroOptimizer_Stage3 = _LoggedScapeStage3
