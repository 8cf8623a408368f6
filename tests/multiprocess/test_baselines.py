"""The quality bench's DiLoCo baseline (bench/qualitybench/baselines.py) on 2 gloo ranks."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from .harness import run_ranks

pytestmark = pytest.mark.timeout(300)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).double()


def _local_steps(model, opt, rank: int, steps: int, first: int) -> None:
    """Inner AdamW steps on this rank's own data (no exchange)."""
    for s in range(first, first + steps):
        gen = torch.Generator().manual_seed(1000 * rank + s)
        x, y = torch.randn(8, 6, generator=gen, dtype=torch.float64), torch.randn(8, 3, generator=gen,
                                                                                  dtype=torch.float64)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _flat(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _worker_diloco(rank, world_size, tmp_path, H, rounds):
    from qualitybench.baselines import DiLoCo

    model = _model(seed=0)  # the same start on every rank
    engine = SimpleNamespace(module=model, enable_backward_allreduce=True)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    diloco = DiLoCo(H=H)
    diloco.start(engine)
    assert engine.enable_backward_allreduce is False
    # the reference outer optimizer: torch's SGD with Nesterov momentum on theta_outer, grad = mean delta
    ref = torch.nn.Parameter(_flat(model).clone())
    ref_opt = torch.optim.SGD([ref], lr=0.7, momentum=0.9, nesterov=True)
    outer_ids, diffs = [], []
    for r in range(rounds):
        tensors = [p for p in model.parameters()]
        _local_steps(model, inner, rank, H, first=r * H)
        local = _flat(model)
        gathered = [torch.empty_like(local) for _ in range(world_size)]
        dist.all_gather(gathered, local)
        assert not torch.equal(gathered[0], gathered[1]), "inner steps exchanged nothing: the ranks differ"
        for step in range((r + 1) * H - H + 1, (r + 1) * H + 1):
            diloco(step, engine)  # only the last of these is an outer step
        ref.grad = ref.detach() - torch.stack(gathered).mean(0)  # the mean outer gradient
        ref_opt.step()
        diffs.append(float((_flat(model) - ref.detach()).abs().max()))
        outer_ids.append(all(a is b for a, b in zip(tensors, model.parameters())))
    return _flat(model), diffs, outer_ids


def test_diloco_outer_step_is_torch_nesterov_sgd_on_the_mean_outer_gradient(tmp_path):
    results = run_ranks(_worker_diloco, 2, tmp_path, 3, 3)
    (p0, diffs0, same0), (p1, _, _) = results
    assert torch.equal(p0, p1), "replicas differ after an outer step"
    assert max(diffs0) < 1e-12, diffs0  # fp64: the same arithmetic up to rounding
    assert all(same0), "the outer step must copy into the inner optimizer's tensors, not replace them"


def test_diloco_bytes_are_the_dense_all_reduce_at_outer_steps_only():
    from qualitybench.baselines import DiLoCo, build_baseline

    rows = [dict(step=s, bytes_dense=100) for s in range(1, 61)]
    assert DiLoCo(H=30).bytes_sent(rows) == 200
    assert isinstance(build_baseline(dict(kind="diloco", H=7)), DiLoCo)
    assert build_baseline(None) is None
    with pytest.raises(ValueError, match="unknown baseline kind"):
        build_baseline(dict(kind="sparseloco"))
    with pytest.raises(ValueError, match="H >= 1"):
        DiLoCo(H=0)
