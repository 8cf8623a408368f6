"""The Hugging Face Trainer's save (``save_strategy="steps"``) and resume (``resume_from_checkpoint``)
with SCAPE, on 2 CPU ranks through the ``deepspeed`` launcher: examples/hf_trainer.py.

Run 1 trains 5 steps and saves at step 3; run 2 (new processes) resumes from that checkpoint and
trains to step 5. With ``--save-steps``/``--resume`` the example prints, on every rank, digests
(sha256) of each leaf of its optimizer's ``state_dict()`` and of each parameter
(:func:`scape_ds.integrations.state_digest`) at the save, right after the resume's load and at the
end. Equal digests are bitwise equal state: the SCAPE master and momentum shards, error feedback,
masks and step of every rank, and the parameters. In the coordinate basis ``mask_refresh_interval`` 3
makes step 4, the first after the resume, a dense refresh, which settles the weight decay owed by
the masked steps (the mask of step 3 must survive the load as an index). In basis "dct"
(``hf_scape.json``) each rank's state is its error feedback in DCT coefficients (no master or
momentum with ``dct_update`` "sign") and every step is sparse; under ZeRO-3 (``hf_scape_zero3.json``,
basis "dct") it is that error feedback plus ZeRO-3's own fp32 partitions and their momentum, in
DeepSpeed's per-rank optimizer files (the coordinate basis's ZeRO-3 resume:
tests/multiprocess/test_zero3.py).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from scape_ds.spawn import free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.dirname(sys.executable)
SAVE_AT, STEPS = 3, 5


def _launch(config: str, out: str, *args: str) -> str:
    cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
           "examples/hf_trainer.py", "--deepspeed", config, "--max-steps", str(STEPS), "--output-dir", out, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _digests(stdout: str) -> dict[tuple[int, str, int], dict[str, str]]:
    """(rank, when, step) -> digests, from the ``scape_state {json}`` lines of every rank."""
    rows = [json.loads(m) for m in re.findall(r"scape_state (\{.*?\}\})", stdout)]
    return {(r["rank"], r["when"], r["step"]): r["digest"] for r in rows}


def _digest_of(value) -> str:
    """state_digest's digest of a number, string or None (its repr's)."""
    return hashlib.sha256(repr(value).encode()).hexdigest()[:16]


def _differ(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


@pytest.mark.timeout(400)
@pytest.mark.parametrize("config,scape_keys", [
    # ZeRO stage 0/1 in basis "dct": every rank's error feedback in coefficients (its own gradients')
    # and the step; one scape_dp_rank_<r>.pt per rank in the tag
    ("ds_configs/hf_scape.json", ("optimizer/scape/groups/0/error", "optimizer/scape/step",
                                  "optimizer/scape/config/basis")),
    # (the coordinate basis's state, master and momentum sharded, resumes exactly in
    # multiprocess/test_train_loop.py and test_deepspeed_engine.py; not through the Trainer again: CI time)
    # SCAPE's ZeRO-3 in basis "dct": the state is in DeepSpeed's per-rank optimizer files (the fp32 partitions,
    # the momentum Stage3AdamS keeps for them, every rank's error feedback in coefficients)
    ("ds_configs/hf_scape_zero3.json", ("optimizer/fp32_flat_groups/0",
                                        "optimizer/optimizer_state_dict/state/0/momentum",
                                        "optimizer/scape/dct/error", "optimizer/scape/config/basis",
                                        "optimizer/scape/step")),
])
def test_trainer_resume_restores_every_ranks_state_exactly(config, scape_keys, tmp_path):
    with open(os.path.join(REPO, config)) as f:
        cfg = json.load(f)
    dct = cfg["scape"].get("basis") == "dct"
    zero3 = cfg["zero_optimization"]["stage"] == 3
    error = "optimizer/scape/dct/error" if zero3 else "optimizer/scape/groups/0/error"  # dct: in coefficients
    if not dct:
        cfg["scape"]["mask_refresh_interval"] = SAVE_AT  # steps 1 and 4 dense: the first after the resume
    config_path = str(tmp_path / "config.json")
    with open(config_path, "w") as f:
        json.dump(cfg, f)
    out = str(tmp_path / "out")
    straight = _digests(_launch(config_path, out, "--save-steps", str(SAVE_AT)))
    tag_dir = os.path.join(out, f"checkpoint-{SAVE_AT}", f"global_step{SAVE_AT}")
    if not zero3:
        assert {"scape_dp_rank_00000.pt", "scape_dp_rank_00001.pt", "manifest.json"} <= set(os.listdir(tag_dir))
    resumed = _digests(_launch(config_path, str(tmp_path / "out2"), "--resume",
                               os.path.join(out, f"checkpoint-{SAVE_AT}")))
    for rank in (0, 1):
        saved, loaded = straight[(rank, "saved", SAVE_AT)], resumed[(rank, "loaded", SAVE_AT)]
        assert set(scape_keys) <= set(saved), sorted(saved)
        if dct:  # the state is the coefficients' error feedback (stage 0/1: no sharded master or momentum, "sign")
            assert saved["optimizer/scape/config/basis"] == _digest_of("dct"), sorted(saved)
            assert zero3 or saved["optimizer/scape/groups/0/master"] == _digest_of(None)
            assert saved[error] != _digest_of(None)
        assert _differ(saved, loaded) == [], f"rank {rank}: loaded state differs from the saved one"
        # and the two steps after the resume (coordinate: a dense refresh, then a masked step) are the same
        end_a, end_b = straight[(rank, "end", STEPS)], resumed[(rank, "end", STEPS)]
        assert _differ(end_a, end_b) == [], f"rank {rank}: the resumed run ends elsewhere"
    assert straight[(0, "saved", SAVE_AT)] != straight[(1, "saved", SAVE_AT)]  # each rank has a state of its own
    if dct:  # each rank's error feedback is of its own gradients; at stage 0/1 the parameters are one replica
        a, b = straight[(0, "saved", SAVE_AT)], straight[(1, "saved", SAVE_AT)]
        assert a[error] != b[error]
        params = [k for k in a if k.startswith("params/")]
        assert params and (zero3 or [a[k] for k in params] == [b[k] for k in params])  # ZeRO-3: own partitions
