"""A script that leaves torch.distributed up at exit still exits 0 (scape_ds.engine.end_at_exit)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scape_ds.spawn import free_port

pytestmark = pytest.mark.timeout(240)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# registered before scape_ds.initialize, so it runs after SCAPE's exit handler (atexit is LIFO)
SCRIPT = r'''
import atexit, json, sys
import torch
import torch.distributed as dist
atexit.register(lambda: print("at exit: process group up =", dist.is_initialized(), flush=True))
import scape_ds
from scape_ds.data import get_batch
from scape_ds.models import GPT, GPTConfig
cfg = json.load(open(sys.argv[1]))
cfg["train_micro_batch_size_per_gpu"] = 4
cfg.pop("train_batch_size", None)
cfg["gradient_accumulation_steps"] = 1
torch.manual_seed(0)
engine, *_ = scape_ds.initialize(model=GPT(GPTConfig(seq_len=32, n_layer=1, n_head=2, n_embd=64)), config=cfg)
data = torch.randint(0, 256, (4096,), dtype=torch.uint8)
for step in range(3):
    x, y = get_batch(data, 4, 32, step, dist.get_rank(), dist.get_world_size(), 0)
    _, loss = engine(x, y)
    engine.backward(loss)
    engine.step()
print("trained", flush=True)
'''


@pytest.mark.parametrize("config", ["ds_configs/scape_coordinate.json", "ds_configs/scape_zero3.json"])
def test_scape_destroys_the_group_left_up_at_exit(tmp_path, config):
    script = tmp_path / "leave_group_up.py"
    script.write_text(SCRIPT)
    port, world = free_port(), 2
    procs = []
    for rank in range(world):
        env = dict(os.environ, DS_ACCELERATOR="cpu", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), PYTHONPATH=REPO)
        procs.append(subprocess.Popen([sys.executable, str(script), os.path.join(REPO, config), str(world)], env=env,
                                      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = [p.communicate(timeout=200)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{out[-3000:]}"
        assert "trained" in out
        assert "at exit: process group up = False" in out, out[-3000:]
