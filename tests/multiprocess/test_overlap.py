"""scape.overlap on 2-4 gloo ranks: the bucketed exchange gives the non-overlapped path's parameters,
error feedback and bytes, on every rank alike; gradient accumulation; unused parameters; resume."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from scape_ds.optim import ScapeAdamS

from .harness import run_ranks
from .models import flat_params, make_batch

pytestmark = pytest.mark.timeout(300)

BUCKET_MB = 3 * 256 * 4 / 2**20  # three chunks of 256 fp32 values: many buckets on a small model


class _Net(nn.Module):
    """Three sparse-exchanged weights and dense-exchanged biases and norm; ``skip`` leaves the middle
    layer without a gradient (its buckets then start in step(), not in backward)."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(64, 128)
        self.norm = nn.LayerNorm(128)
        self.b = nn.Linear(128, 128)
        self.c = nn.Linear(128, 64)

    def forward(self, x, skip: bool = False):
        h = torch.nn.functional.gelu(self.norm(self.a(x)))
        if not skip:
            h = h + torch.tanh(self.b(h))
        return self.c(h)


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _build(seed, scape, overlap, hooked, is_boundary=None, lr=1e-2, dtype=torch.float32):
    model = _Net(seed).to(dtype)
    clip = 0.0 if scape.get("basis") == "dct" else 1.0  # basis dct's overlap refuses the global clip
    opt = ScapeAdamS(model.parameters(), lr=lr, weight_decay=0.1, max_grad_norm=clip,
                     scape=dict(scape, overlap=overlap, bucket_mb=BUCKET_MB))
    if overlap and hooked:
        opt.attach_model(model, is_boundary)
    return model, opt


def _train(model, opt, rank, steps, first=0, accumulation=1, skip_every=0, micro=None):
    dtype = next(model.parameters()).dtype
    for step in range(first, first + steps):
        opt.zero_grad()
        for m in range(accumulation):
            if micro is not None:
                micro[0] = m
            x, y = (t.to(dtype) for t in make_batch(step * accumulation + m, rank))
            skip = bool(skip_every) and step % skip_every == 0
            (torch.nn.functional.mse_loss(model(x, skip), y) / accumulation).backward()
        opt.step()
        yield step


def _worker_equal(rank, world_size, tmp_path, steps, scape, accumulation, skip_every, hooked, dtype=torch.float32):
    micro = [0]
    is_boundary = (lambda: micro[0] == accumulation - 1) if accumulation > 1 else None
    ref_model, ref = _build(5, scape, False, False, dtype=dtype)
    model, opt = _build(5, scape, True, hooked, is_boundary, dtype=dtype)
    worst, replica_mismatch, byte_mismatch, ef_worst, early = 0.0, 0, 0, 0.0, []
    ref_steps = _train(ref_model, ref, rank, steps, accumulation=accumulation, skip_every=skip_every)
    for _ in _train(model, opt, rank, steps, accumulation=accumulation, skip_every=skip_every, micro=micro):
        next(ref_steps)
        opt.synchronize()  # read outside a forward: wait for the broadcasts
        flat = flat_params(model)
        worst = max(worst, float((flat - flat_params(ref_model)).abs().max()))
        replica_mismatch += sum(not torch.equal(flat, c) for c in _gather(flat))
        byte_mismatch += int(opt.comm_stats["bytes_sent"] != ref.comm_stats["bytes_sent"])
        if ref.error_feedback() is not None:  # (compressor "dense" keeps none)
            ef_worst = max(ef_worst, float((opt.error_feedback() - ref.error_feedback()).abs().max()))
        early.append(opt._groups[0].overlap.started_in_backward)
    ref.synchronize()
    kinds = (opt.comm_stats["by_tag"].keys(), ref.comm_stats["by_tag"].keys())
    return worst, replica_mismatch, byte_mismatch, ef_worst, [sorted(k) for k in kinds], early, \
        len(opt._groups[0].overlap.buckets)


SCAPE = dict(sparsity=0.99, chunk_size=256, mask_refresh_interval=3, dense_numel_threshold=1024)


@pytest.mark.parametrize("world_size,scape,accumulation,skip_every,hooked,dtype", [
    (2, SCAPE, 1, 0, True, torch.float32),
    (2, SCAPE, 2, 0, True, torch.float32),  # gradient accumulation: buckets start on the last micro-batch only
    (2, SCAPE, 1, 2, True, torch.float32),  # a layer without a gradient every other step
    (2, dict(SCAPE, error_feedback_dtype="bf16"), 1, 0, False, torch.float32),  # bf16 error, fp32 wire; no hooks
    (2, SCAPE, 1, 0, True, torch.bfloat16),  # fp32 error feedback, bf16 wire: the rounding residual stays
    (2, dict(SCAPE, compressor="dense"), 1, 0, True, torch.float32),
    (4, SCAPE, 1, 0, True, torch.float32),
])
def test_overlap_equals_the_non_overlapped_path(tmp_path, world_size, scape, accumulation, skip_every, hooked, dtype):
    results = run_ranks(_worker_equal, world_size, tmp_path, 12, scape, accumulation, skip_every, hooked, dtype)
    for worst, replicas, bytes_, ef, (tags, ref_tags), early, n_buckets in results:
        assert n_buckets >= 20, n_buckets
        # the first step's buckets start in step() (no hooks before it); later ones in backward, all of
        # them but those behind a layer without a gradient (and those still in flight stay counted)
        assert early[0] == 0, early
        if skip_every:
            assert all(0 < e < n_buckets for e in early[2::2]) and all(e == n_buckets for e in early[1::2]), early
        else:
            assert all(e == n_buckets for e in early[1:]), early
        assert replicas == 0, results  # every rank holds the same parameters after every step
        assert bytes_ == 0, results  # the byte meter counts the same bytes every step
        assert tags == ref_tags, results
        if world_size == 2:  # a sum of two terms does not depend on the reduction's algorithm
            assert worst == 0.0 and ef == 0.0, results
        else:  # a reduce and a reduce-scatter may add four terms in another order: rounding only
            assert worst < 1e-5 and ef < 1e-5, results


def _worker_in_flight(rank, world_size, tmp_path, steps, limit):
    ref_model, ref = _build(5, SCAPE, False, False)
    model, opt = _build(5, dict(SCAPE, buckets_in_flight=limit), True, True)
    most, worst = [], 0.0
    ref_steps = _train(ref_model, ref, rank, steps)
    for _ in _train(model, opt, rank, steps):
        next(ref_steps)
        most.append(opt._groups[0].overlap.most_in_flight)
        opt.synchronize()
        worst = max(worst, float((flat_params(model) - flat_params(ref_model)).abs().max()))
    return most, worst, len(opt._groups[0].overlap.buckets)


@pytest.mark.parametrize("limit", [2, 0])
def test_buckets_in_flight_are_bounded(tmp_path, limit):
    # 20+ buckets, all started in backward; with a bound of 2 the third waits for the first, and the
    # parameters are still the non-overlapped path's bit for bit (2 ranks); 0: no bound
    for most, worst, n_buckets in run_ranks(_worker_in_flight, 2, tmp_path, 6, limit):
        assert worst == 0.0, (most, worst)
        if limit:
            assert max(most) == limit, most
        else:
            assert max(most) > 2, most  # without a bound more than two are on the wire (gloo, loopback)


def _worker_resume(rank, world_size, tmp_path, steps, cut, scape=SCAPE):
    """``steps`` straight, or ``cut`` steps, a save (the state_dicts) and a resume into a model and
    optimizer built from another seed: True where the parameters are the same bits."""
    model, opt = _build(7, scape, True, True)
    for _ in _train(model, opt, rank, steps):
        pass
    opt.synchronize()
    straight = flat_params(model)
    model, opt = _build(7, scape, True, True)
    for _ in _train(model, opt, rank, cut):
        pass
    saved = dict(model=model.state_dict(), opt=opt.state_dict())  # state_dict waits for values in flight
    saved = {k: {n: (v.clone() if torch.is_tensor(v) else v) for n, v in d.items()} if k == "model" else d
             for k, d in saved.items()}
    resumed, opt2 = _build(8, scape, True, True)  # another seed: everything must come from the checkpoint
    resumed.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["opt"])
    for _ in _train(resumed, opt2, rank, steps - cut, first=cut):
        pass
    opt2.synchronize()
    return bool(torch.equal(flat_params(resumed), straight))


def _worker_attach(rank, world_size, tmp_path, scape=SCAPE):
    """3 steps, then attach_model moving a group's exchange into step(): True where what was in
    flight landed first (the parameters are the non-overlapped run's) and the group lost its overlap."""
    ref_model, ref = _build(6, scape, False, False)
    model, opt = _build(6, scape, True, True)
    for _ in zip(_train(ref_model, ref, rank, 3), _train(model, opt, rank, 3)):
        pass
    opt.attach_model(model, exchange_at_step=[model.b.weight])
    return torch.equal(flat_params(model), flat_params(ref_model)) and opt._groups[0].overlap is None


def test_attach_model_applies_the_values_in_flight_first(tmp_path):
    assert run_ranks(_worker_attach, 2, tmp_path) == [True, True]


def test_overlap_resumes_exactly_mid_run(tmp_path):
    # the cut falls on a sparse step between refreshes (T = 3: steps 1, 4, 7, 10 refresh)
    assert run_ranks(_worker_resume, 2, tmp_path, 11, 5) == [True, True]


# ---------------------------------------------------------------- through DeepSpeed's engine
def _worker_engine(rank, world_size, tmp_path, gas, config="scape_coordinate.json", scape_extra=None):
    """7 steps through scape_ds.initialize with ``config`` (its "scape" block updated by
    ``scape_extra``), without and with overlap. Returns whether parameters and losses are the same bits,
    and (buckets started in backward, buckets, whether the forward is hooked) of the overlapped run."""
    import json
    import os

    import scape_ds
    from scape_ds.data import build_datasets, get_batch
    from scape_ds.engine import scape_optimizer
    from scape_ds.models import GPT, GPTConfig

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_RANK", str(rank))
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    train, _ = build_datasets()
    params, losses, early = {}, {}, {}
    for overlap in (False, True):
        with open(os.path.join(repo, "ds_configs", config)) as f:
            cfg = json.load(f)
        cfg.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=gas)
        cfg["scape"].update(chunk_size=256, overlap=overlap, bucket_mb=BUCKET_MB, **(scape_extra or {}))
        torch.manual_seed(0)
        engine, *_ = scape_ds.initialize(model=GPT(GPTConfig(seq_len=32, n_layer=1, n_head=2, n_embd=64)), config=cfg)
        losses[overlap] = []
        for step in range(7):
            for micro in range(gas):
                x, y = get_batch(train, 4, 32, step * gas + micro, rank, world_size, 0)
                _, loss = engine(x, y)
                engine.backward(loss)
                engine.step()
                losses[overlap].append(loss.item())
        opt = scape_optimizer(engine)
        opt.synchronize()
        params[overlap] = flat_params(engine.module)
        if overlap:
            ov = opt._groups[0].overlap
            early = (getattr(ov, "started_in_backward", 0), len(ov.buckets), ov.forward_hooked)
    return bool(torch.equal(params[False], params[True])) and losses[False] == losses[True], early


@pytest.mark.parametrize("gas", [1, 2])
def test_overlap_through_the_engine(tmp_path, gas):
    # scape_ds.initialize hooks the model's forward and DeepSpeed's accumulation boundary
    for equal, (early, n_buckets, hooked) in run_ranks(_worker_engine, 2, tmp_path, gas, "scape_coordinate.json",
                                                       dict(mask_refresh_interval=3)):
        assert equal and hooked and early == n_buckets > 1, (equal, early, n_buckets, hooked)


def _worker_second_backward(rank, world_size, tmp_path):
    model, opt = _build(9, SCAPE, True, True)
    for _ in _train(model, opt, rank, 2):  # the second step is sparse: hooks armed from here on
        pass
    x, y = make_batch(5, rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward(retain_graph=True)
    try:
        loss.backward()  # a second gradient after the buckets left: refused, not lost
    except RuntimeError as e:
        return str(e)
    return None


def _worker_guards(rank, world_size, tmp_path):
    model, opt = _build(9, SCAPE, True, True)
    for _ in _train(model, opt, rank, 2):  # the second step is sparse: hooks armed from here on
        pass
    good = opt.state_dict()
    x, y = make_batch(5, rank)
    torch.nn.functional.mse_loss(model(x), y).backward()  # the buckets leave
    refused = []
    for call in (opt.zero_grad, opt.state_dict, lambda: opt.load_state_dict(good)):
        try:
            call()
        except RuntimeError as e:
            refused.append(str(e))
    opt.step()
    saved = {k: v.clone() for k, v in model.state_dict().items()}  # its pre-hook waits for the new values
    opt.synchronize()
    fresh = all(torch.equal(v, model.state_dict()[k]) for k, v in saved.items())
    return refused, fresh


def test_mid_exchange_calls_are_refused_and_state_dict_waits(tmp_path):
    for refused, fresh in run_ranks(_worker_guards, 2, tmp_path):
        assert fresh  # model.state_dict() right after step() holds the new values, not the old ones
        assert len(refused) == 3, refused  # zero_grad, state_dict, load_state_dict
        assert all("call step() first" in m and "\n" not in m for m in refused), refused


def test_a_second_backward_after_the_buckets_left_is_refused(tmp_path):
    for message in run_ranks(_worker_second_backward, 2, tmp_path):
        assert message is not None and "got a second gradient" in message and "\n" not in message, message


# ---------------------------------------------------------------- ZeRO-3, param_exchange sparse_replica
def _worker_zero3(rank, world_size, tmp_path, steps):
    import os

    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import scape_ds

    from .models import loss_fn, make_mlp
    from .test_zero3 import _config, _from_partitions, _gathered

    runs = {}
    for overlap in (False, True):
        cfg = _config("ScapeAdamS", 0.99, exchange="sparse_replica")
        cfg["scape"].update(overlap=overlap, bucket_mb=64 * 64 * 4 / 2**20)  # one 64 x 64 weight a bucket
        engine, *_ = scape_ds.initialize(model=make_mlp(seed=5, bias=True, norm=True), config=cfg)
        losses, in_flight, after_forward = [], [], []
        for step in range(steps):
            x, y = make_batch(step, rank)
            loss = loss_fn(engine, x, y)  # each module's forward waits for its bucket of new values
            after_forward.append(len(engine.optimizer._values_in_flight))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
            in_flight.append(len(engine.optimizer._values_in_flight))
        engine.optimizer.synchronize()  # read outside a forward
        gathered = _gathered(engine)
        runs[overlap] = (losses, gathered, torch.equal(gathered, _from_partitions(engine)), in_flight, after_forward,
                         len(engine.optimizer._value_buckets))
    (l0, p0, fresh0, *_), (l1, p1, fresh1, in_flight, after_forward, n_buckets) = runs[False], runs[True]
    return l0 == l1, torch.equal(p0, p1), fresh0 and fresh1, in_flight, after_forward, n_buckets


def test_zero3_sparse_replica_values_wait_for_the_forward(tmp_path):
    # T = 4: steps 1 and 5 are dense (their values arrive at once), the others sparse: their values
    # are still in flight after step(), and every forward has written them all in before the loss;
    # the losses (computed from the values the forward waited for) and the final parameters are the
    # non-overlapped run's, bit for bit
    for same_losses, same_params, fresh, in_flight, after_forward, n_buckets in run_ranks(_worker_zero3, 2,
                                                                                           tmp_path, 8):
        assert same_losses and same_params and fresh and n_buckets > 1, (same_losses, same_params, fresh)
        assert [n > 0 for n in in_flight] == [False, True, True, True, False, True, True, True], in_flight
        assert after_forward == [0] * 8, after_forward
