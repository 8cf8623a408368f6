"""basis "dct" against answers computed by hand: one step written out, decayed error feedback, the local
clip, and the byte meter with dense tensors (2-3 gloo ranks, the shipped ``ds_configs/scape_dct.json``).

Every oracle here is plain torch in float64 and calls nothing of scape_ds's transform, masks or update
rules: the DCT-II matrix is built below from the cosine formula (and checked against ``scipy.fft.dct``),
tiles are cut with ``view``/``permute``, top-k is ``torch.topk`` per tile, byte counts are written out.

- ``test_sign_update_matches_a_step_by_hand`` / ``test_rms_update_matches_a_step_by_hand``: two steps of a
  model with two weights (one with rows that pad their tiles) and a bias. Each rank's gradient is
  all-gathered and the whole step is redone by hand for every rank: ``clip_local`` scaling by the rank's
  norm over every tensor, ``e_r = 0.999 e_r + Q g_r`` tile by tile, rank r's top-41 ``|e_r|`` of each 64 x 64
  tile sent and emptied, the sum of every rank's sent coefficients divided by D, decoded ``Q^T Y Q`` and
  cropped, then ``p = (1 - lr wd) p - lr sign(u)`` (or ``- lr u / rms(u)``, the RMS over each weight), and
  AdamS (its paper's formula) on the all-reduced mean of the bias's clipped gradients. Every rank's
  parameters must equal the hand answer and be bitwise equal across ranks. (Both rules, and AdamS, are
  free of a global scale of their input, so the 1/D itself cannot show here.)
- ``test_decayed_error_feedback_identity``: over 4 steps with ``ef_decay`` 0.999, per rank and coefficient,
  ``new_e + sent == 0.999 old_e + Q g``, where old/new e are the optimizer's own buffer before and after
  the step, ``Q g`` is the hand transform of the rank's gradient, and ``sent`` is what the rank put on the
  wire (values and 16-bit offsets read off its communicator); the sent offsets are the top-41 of
  what was accumulated in each tile, and the identity is far from the ones of a decay on the gradient,
  after the send (on what is kept), or none.
- ``test_clip_local_clips_the_gradient_not_the_accumulator``: over 3 steps with gradients of norm > 1, the
  accumulated ``new_e + sent`` equals ``0.999 old_e + Q (s g)``, ``s = 1 / (||g|| + 1e-6)`` over the
  rank's whole gradient, and not the accumulator clipped to norm 1, nor the unclipped one.
- ``test_dct_byte_count_with_dense_tensors``: per-step bytes by tag and the dense yardstick of a model
  with biases, a LayerNorm and a small 2-D weight (dense path) and a padded tile count, against counts
  written out from the tile counts and numels (2 and 3 ranks, so that D - 1 and 2 (D - 1) / D show).
"""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from scape_ds.comm import TorchCommunicator
from scape_ds.optim import ScapeAdamS

from .harness import run_ranks

pytestmark = pytest.mark.timeout(90)  # 9-27 s each measured on 2 cores at load 2-13

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# what the oracles below assume of the shipped configuration (checked against the file)
SHIPPED = dict(basis="dct", mask="per_rank", sparsity=0.99, chunk_size=4096, dct_update="sign", clip_local=1.0,
               ef_decay=0.999)
T = 64  # tile side, sqrt(4096)
C = T * T
KC = 41  # coefficients each rank sends per tile: round(0.01 * 4096)
DECAY = 0.999
CLIP = 1.0
HP = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def _shipped_scape(**over) -> dict:
    with open(os.path.join(REPO, "ds_configs", "scape_dct.json"), encoding="utf-8") as f:
        scape = json.load(f)["scape"]
    assert scape == SHIPPED, scape  # the oracles' constants (T, KC, DECAY, CLIP) are these
    return {**scape, **over}


# ------------------------------------------------------------------ the oracle's own pieces (float64)
def dct_ii(t: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix, ``Q[k, i] = s_k cos(pi (2 i + 1) k / (2 t))``, s_0 = sqrt(1/t),
    s_k = sqrt(2/t); checked against scipy's ``dct(norm="ortho")`` and for orthonormality."""
    k = torch.arange(t, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(t, dtype=torch.float64).unsqueeze(0)
    q = torch.cos(math.pi * (2 * i + 1) * k / (2 * t))
    q[0] *= math.sqrt(1.0 / t)
    q[1:] *= math.sqrt(2.0 / t)
    import scipy.fft

    x = torch.randn(t, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(q @ x, torch.from_numpy(scipy.fft.dct(x.numpy(), axis=0, norm="ortho")), atol=1e-12)
    assert torch.allclose(q @ q.T, torch.eye(t, dtype=torch.float64), atol=1e-12)
    return q


def tiles_of(w: torch.Tensor) -> torch.Tensor:
    """(r, c) -> (tiles, T, T): zero-padded to whole tiles, tiles in row-major order of the tile grid."""
    r, c = w.shape
    gr, gc = -(-r // T), -(-c // T)
    padded = torch.zeros(gr * T, gc * T, dtype=torch.float64)
    padded[:r, :c] = w
    return padded.view(gr, T, gc, T).permute(0, 2, 1, 3).reshape(gr * gc, T, T)


def untile(x: torch.Tensor, r: int, c: int) -> torch.Tensor:
    """(tiles, T, T) -> (r, c): the inverse of :func:`tiles_of`, cropped."""
    gr, gc = -(-r // T), -(-c // T)
    return x.view(gr, gc, T, T).permute(0, 2, 1, 3).reshape(gr * T, gc * T)[:r, :c]


def coefficients(q: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Q X Q^T of every tile of ``w``: (tiles, T, T)."""
    return q @ tiles_of(w.double()) @ q.T


def top_k_mask(e: torch.Tensor, k: int, margin: float) -> torch.Tensor:
    """(tiles, T, T) bool: the k largest |e| of each tile. Asserts the k-th and (k+1)-th magnitudes are
    ``margin`` (relative to the tile's largest) apart, so that the implementation's rounding (fp32)
    cannot choose another set: a near-tie is this seed's problem, not the code's."""
    mag = e.abs().reshape(e.shape[0], -1)
    top = mag.topk(k + 1, dim=1).values
    gap = (top[:, k - 1] - top[:, k]) / top[:, 0].clamp_min(1e-300)
    assert bool((gap > margin).all()), f"a near-tie at the top-{k} boundary ({gap.min():.2e}): another seed"
    chosen = torch.zeros_like(mag, dtype=torch.bool)
    chosen.scatter_(1, mag.topk(k, dim=1).indices, True)
    return chosen.view_as(e)


def layout_vector(coefs: list[torch.Tensor], numel: int) -> torch.Tensor:
    """The documented coefficient buffer: weight after weight, tile after tile, each tile row-major
    (``Y[k1, k2]`` at ``k1 T + k2``), zeros after the last tile (the padding tiles): (numel,) fp64."""
    flat = torch.cat([y.reshape(-1) for y in coefs])
    out = torch.zeros(numel, dtype=torch.float64)
    out[: flat.numel()] = flat
    return out


def _gather(t: torch.Tensor) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


class RecordingCommunicator(TorchCommunicator):
    """Keeps what this rank put on the wire in its last step: per-rank values and int16 offsets."""

    def __init__(self):
        super().__init__()
        self.sent: dict[str, torch.Tensor] = {}

    def all_gather(self, out, inp, tag):
        if tag in ("grad_ag", "index_ag"):
            self.sent[tag] = inp.detach().clone()
        super().all_gather(out, inp, tag)

    def sent_vector(self, numel: int) -> torch.Tensor:
        """(numel,) fp64: the values this rank sent, placed at chunk * C + 16-bit offset (chunk-major,
        KC per tile: the wire format); consumed."""
        values = self.sent.pop("grad_ag").double()
        offsets = self.sent.pop("index_ag").view(torch.int16).to(torch.int64) & 0xFFFF
        assert values.numel() == offsets.numel() and values.numel() % KC == 0, (values.shape, offsets.shape)
        index = torch.arange(offsets.numel()) // KC * C + offsets
        assert index.unique().numel() == index.numel(), "an offset repeated inside one rank's message"
        out = torch.zeros(numel, dtype=torch.float64)
        out[index] = values
        return out


# ------------------------------------------------------------------ 1. one step by hand (sign, rms)
OUT = 100  # the second weight's rows: 100 x 128 pads its lower tiles (grid 2 x 2)


def _model(dtype) -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(64, 128, bias=True), nn.Tanh(), nn.Linear(128, OUT, bias=False)).to(dtype)


def _batch(step: int, rank: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)  # another batch on every rank and step
    return torch.randn(8, 64, generator=g).to(dtype), torch.randn(8, OUT, generator=g).to(dtype)


def _backward(model, step, rank, dtype, gain):
    x, y = _batch(step, rank, dtype)
    (gain * nn.functional.mse_loss(model(x), y)).backward()


def _hand_adams(p, g, m, t):
    """AdamS (arXiv 2505.16363, as scape_ds/optim/adams.py's docstring states it), float64, in place."""
    beta1, beta2 = HP["betas"]
    c = 1.0 - beta1**t
    p.mul_(1.0 - HP["lr"] * HP["weight_decay"])
    denom = (beta2 * (m / c) ** 2 + (1.0 - beta2) * g**2).sqrt() + HP["eps"]
    m.mul_(beta1).add_((1.0 - beta1) * g)
    p.sub_(HP["lr"] * (m / c) / denom)


def _worker_step_by_hand(rank, world_size, tmp_path, update, dtype, steps):
    """Returns per step: (worst |p - hand|, coordinates whose sign of u is within rounding of 0, replicas
    bitwise equal, the clip acted on every rank)."""
    model = _model(dtype)
    opt = ScapeAdamS(model.parameters(), **HP, scape=_shipped_scape(dct_update=update))
    q = dct_ii(T)
    params = list(model.parameters())  # W1 (128, 64), b1 (128,), W2 (100, 128)
    sparse, dense = [0, 2], [1]
    hand = [p.detach().double().clone() for p in params]
    errors = [[torch.zeros_like(coefficients(q, hand[i])) for i in sparse] for _ in range(world_size)]
    momentum = {i: torch.zeros_like(hand[i]) for i in dense}
    margin = 1e-5  # fp32 rounding of e (~1e-7 of the tile's largest) cannot reorder magnitudes this far apart
    zero = 1e-5 if dtype == torch.float32 else 1e-12  # |u| / max |u| under which rounding may flip sign(u)
    out = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        _backward(model, step, rank, dtype, gain=20.0)
        mine = [p.grad.detach().double().clone() for p in params]
        opt.step()
        grads = [_gather(g) for g in mine]  # grads[i][r]: rank r's gradient of parameter i
        # clip_local: each rank's gradient, every tensor, scaled to norm <= CLIP
        norms = [math.sqrt(sum(float(grads[i][r].square().sum()) for i in range(len(params))))
                 for r in range(world_size)]
        scales = [min(1.0, CLIP / (n + 1e-6)) for n in norms]
        total = [torch.zeros_like(errors[0][j]) for j in range(len(sparse))]  # sum of what every rank sent
        for r in range(world_size):
            for j, i in enumerate(sparse):
                e = errors[r][j]
                e.mul_(DECAY).add_(coefficients(q, scales[r] * grads[i][r]))
                chosen = top_k_mask(e, KC, margin)
                total[j] += torch.where(chosen, e, 0.0)
                e.masked_fill_(chosen, 0.0)
        lr, wd = HP["lr"], HP["weight_decay"]
        ambiguous, undetermined, decayed = 0, {}, {}  # where sign(u) is within rounding of 0, per weight
        for j, i in enumerate(sparse):
            r_, c_ = hand[i].shape
            u = untile(q.T @ (total[j] / world_size) @ q, r_, c_)  # the decoded mean
            if update == "sign":
                undetermined[i] = u.abs() <= zero * u.abs().max()
                ambiguous += int(undetermined[i].sum())
                decayed[i] = hand[i] * (1.0 - lr * wd)
                hand[i] = decayed[i] - lr * torch.sign(u)
            else:  # the RMS over this weight's part of u
                hand[i] = hand[i] * (1.0 - lr * wd) - lr * u / u.square().mean().sqrt()
        for i in dense:
            mean = sum(scales[r] * grads[i][r] for r in range(world_size)) / world_size
            _hand_adams(hand[i], mean, momentum[i], step)
        worst = 0.0
        for i, p in enumerate(params):
            got = p.detach().double()
            diff = (got - hand[i]).abs()
            if i in undetermined:  # there p may have moved by -lr, 0 or +lr: the nearest of the three
                near = torch.stack([(got - decayed[i] - s * lr).abs() for s in (-1.0, 0.0, 1.0)]).amin(0)
                diff = torch.where(undetermined[i], near, diff)
                hand[i] = torch.where(undetermined[i], got, hand[i])  # carry the implementation's choice on
            worst = max(worst, float(diff.max()))
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        replicas = all(torch.equal(flat, other) for other in _gather(flat))
        out.append((worst, ambiguous, replicas, min(norms) > CLIP))
        if worst > TOLERANCE[dtype]:  # already wrong: the next step's hand answer would start elsewhere
            break
    return out


# absolute, on parameters |p| <= 0.125: fp32 (the shipped dtype), the implementation's rounding of p and of
# its fp32 transform, measured 2.4e-8 worst (1.6 ulp of 0.125) over both rules and steps, checked to 1e-7;
# fp64, measured 1.8e-16, checked to 1e-14. A wrong sign, mask, mean, clip or decay moves a coordinate by
# about lr = 1e-2 (sign) or by a share of lr u / rms(u) (rms).
TOLERANCE = {torch.float32: 1e-7, torch.float64: 1e-14}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_sign_update_matches_a_step_by_hand(tmp_path, dtype):
    results = run_ranks(_worker_step_by_hand, 2, tmp_path, "sign", dtype, 2)
    for per_step in results:
        assert len(per_step) == 2, results  # (a worker stops after a wrong step)
        for worst, ambiguous, replicas, clipped in per_step:
            assert worst <= TOLERANCE[dtype], results
            assert replicas, results  # every rank's parameters bitwise equal
            assert clipped, results  # clip_local acted on every rank: its scaling is part of the answer
            # coordinates where sign(u) is within rounding of 0 (either sign allowed): a handful of 20992
            assert ambiguous <= (20 if dtype == torch.float32 else 0), results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_rms_update_matches_a_step_by_hand(tmp_path, dtype):
    results = run_ranks(_worker_step_by_hand, 2, tmp_path, "rms", dtype, 2)
    for per_step in results:
        assert len(per_step) == 2, results  # (a worker stops after a wrong step)
        for worst, _, replicas, clipped in per_step:
            assert worst <= TOLERANCE[dtype], results
            assert replicas, results
            assert clipped, results


# ------------------------------------------------------------------ 2. and 3. the error-feedback ledger
def _worker_ledger(rank, world_size, tmp_path, steps, clip_local, gain):
    """Per step, this rank's: (new_e + sent) and the hand candidates for it, as max-abs distances relative
    to the hand answer's largest coefficient; plus checks of the mask and of the sent coefficients."""
    model = _model(torch.float32)
    comm = RecordingCommunicator()
    opt = ScapeAdamS(model.parameters(), **HP, comm=comm, scape=_shipped_scape(clip_local=clip_local))
    q = dct_ii(T)
    params = list(model.parameters())
    assert params[0].shape == (128, 64) and params[2].shape == (OUT, 128)  # the sparse weights; params[1]: b1
    numel = 6 * C  # 2 tiles of W1 (128 x 64) + 4 of W2 (100 x 128, padded to 128 x 128); 6 is a multiple of D
    old = torch.zeros(numel, dtype=torch.float64)
    out = []
    for step in range(1, steps + 1):
        opt.zero_grad()
        _backward(model, step, rank, torch.float32, gain)
        grads = [p.grad.detach().double().clone() for p in params]
        norm = math.sqrt(sum(float(g.square().sum()) for g in grads))
        if step > 1:
            old = opt.error_feedback().double().clone()  # the optimizer's own e before this step
        opt.step()
        new = opt.error_feedback().double().clone()
        assert new.numel() == numel, new.numel()
        sent = comm.sent_vector(numel)
        got = new + sent  # what this step accumulated, in the documented coefficient layout
        qg = layout_vector([coefficients(q, g) for g in (grads[0], grads[2])], numel)  # Q g, by hand
        s = min(1.0, clip_local / (norm + 1e-6)) if clip_local > 0 else 1.0
        want = DECAY * old + s * qg  # the documented rule: clip g, then e = decay e + Q g
        scale = float(want.abs().max())
        candidates = dict(
            want=want,
            decay_on_gradient=old + DECAY * s * qg,
            decay_after_send=torch.where(sent != 0, old + s * qg, DECAY * (old + s * qg)),  # on what is kept
            no_decay=old + s * qg,
        )
        if clip_local > 0:
            acc = DECAY * old + qg
            candidates["clip_accumulator"] = acc * min(1.0, clip_local / (float(acc.norm()) + 1e-6))
            candidates["no_clip"] = acc
        dist_ = {name: float((got - c).abs().max()) / scale for name, c in candidates.items()}
        # the sent coefficients: emptied in e, and the top-KC |accumulated| of each tile (the same fp32
        # numbers the implementation ranked, so only an exact tie could be ranked otherwise)
        emptied = bool((new[sent != 0] == 0).all())
        chosen = top_k_mask(got.view(-1, T, T), KC, 0.0).reshape(-1)
        same_mask = bool(torch.equal(chosen, sent != 0))
        out.append(dict(dist=dist_, emptied=emptied, same_mask=same_mask, norm=norm,
                        old_norm=float(old.norm()), clip_scale=s))
    return out


def test_decayed_error_feedback_identity(tmp_path):
    # clip_local off here (the next test checks it): the identity is the decay alone
    results = run_ranks(_worker_ledger, 2, tmp_path, 4, 0.0, 1.0)
    for per_step in results:
        assert len(per_step) == 4, results
        for t, s in enumerate(per_step, 1):
            # relative to the largest coefficient: the implementation's fp32 transform (two 64-term sums)
            # and 0.999 e, measured 3.9e-7 worst, checked to 1e-5; a misplaced decay is off by 4e-4 to 1e-3
            assert s["dist"]["want"] <= 1e-5, (t, results)
            assert s["emptied"] and s["same_mask"], (t, results)
            if t > 1:  # from step 2 on e is not empty, so each misplaced decay differs
                for wrong in ("decay_on_gradient", "decay_after_send", "no_decay"):
                    assert s["dist"][wrong] >= 1e-4, (t, wrong, results)


def test_clip_local_clips_the_gradient_not_the_accumulator(tmp_path):
    results = run_ranks(_worker_ledger, 2, tmp_path, 3, CLIP, 20.0)
    for per_step in results:
        assert len(per_step) == 3, results
        for t, s in enumerate(per_step, 1):
            assert s["norm"] > 2 * CLIP, (t, results)  # the clip acts: the gradient's norm is over clip_local
            assert s["dist"]["want"] <= 1e-5, (t, results)  # accumulated == 0.999 e + Q (s g), as above
            assert s["emptied"] and s["same_mask"], (t, results)
        last = per_step[-1]  # step 3: e holds two steps' unsent coefficients
        assert last["old_norm"] > 0.5 * CLIP, results
        # clipping e + Q g instead is off by 0.41-0.47 of the largest coefficient (measured), no clip by 6-7
        assert last["dist"]["clip_accumulator"] >= 0.1, results
        assert last["dist"]["no_clip"] >= 1.0, results


# ------------------------------------------------------------------ 4. bytes with dense tensors
def _worker_bytes(rank, world_size, tmp_path, mask):
    torch.manual_seed(5)
    model = nn.Sequential(
        nn.Linear(64, 100), nn.LayerNorm(100), nn.GELU(),  # W 100 x 64: 2 tiles (rows padded); b, LN: dense
        nn.Linear(100, 64),  # W 64 x 100: 2 tiles (columns padded); b: dense
        nn.Linear(64, 64, bias=False),  # 4096 elements, not under the threshold: 1 tile
        nn.Linear(64, 16),  # W 16 x 64 = 1024 < 4096 (dense_numel_threshold): dense, with its bias
    )
    opt = ScapeAdamS(model.parameters(), **HP, scape=_shipped_scape(mask=mask))
    stats = []
    for step in range(2):
        opt.zero_grad()
        g = torch.Generator().manual_seed(10 * step + rank)
        model(torch.randn(4, 64, generator=g)).square().mean().backward()
        opt.step()
        stats.append(dict(opt.comm_stats))
    return stats


@pytest.mark.parametrize("mask,world_size", [("per_rank", 2), ("per_rank", 3), ("shared", 2)])
def test_dct_byte_count_with_dense_tensors(tmp_path, mask, world_size):
    D = world_size
    tiles = 2 + 2 + 1  # ceil(100/64) x 1, 1 x ceil(100/64), 1 x 1
    n_c = -(-tiles // D) * D  # the tile count padded to a multiple of D: 6 at D = 2 and 3
    dense_numel = 100 + 100 + 100 + 64 + 16 * 64 + 16  # b1, LN weight and bias, b2, the 16 x 64 weight, its bias
    dense_ar = 2 * (D - 1) * dense_numel * 4 // D  # one fp32 all-reduce of the dense tensors' gradients
    if mask == "per_rank":  # all-gathers of this rank's KC fp32 values and KC 16-bit offsets per tile
        want = {"grad_ag": (D - 1) * n_c * KC * 4, "index_ag": (D - 1) * n_c * KC * 2, "dense_ar": dense_ar}
    else:  # K = KC // D nominations per tile: offsets all-gathered, D K slots reduce-scattered, K all-gathered
        K = KC // D
        want = {"index_ag": (D - 1) * n_c * K * 2, "grad_rs": (D - 1) * n_c * D * K * 4 // D,
                "grad_ag": (D - 1) * n_c * K * 4, "dense_ar": dense_ar}
    # the dense yardstick: a ZeRO-1 step on the flat buffer (N = 2 * 6400 + 4096 padded to a multiple of
    # D * 4096) and the same all-reduce of the dense tensors
    n_pad = -(-(2 * 6400 + 4096) // (D * C)) * D * C
    dense = (D - 1) * n_pad * 4 // D + (D - 1) * (n_pad // D) * 4 + dense_ar
    written = {("per_rank", 2): (dict(grad_ag=984, index_ag=492, dense_ar=5616), 103920),
               ("per_rank", 3): (dict(grad_ag=1968, index_ag=984, dense_ar=7488), 138560),
               ("shared", 2): (dict(index_ag=240, grad_rs=480, grad_ag=480, dense_ar=5616), 103920)}
    assert (want, dense) == written[mask, world_size]  # the formulas above, evaluated by hand
    for rank_stats in run_ranks(_worker_bytes, world_size, tmp_path, mask):
        for s in rank_stats:  # every step alike (init broadcasts are not a step's)
            assert s["by_tag"] == want, s
            assert s["bytes_sent"] == sum(want.values()), s
            if D == 2:
                assert s["bytes_dense"] == dense, s
            else:  # the yardstick floors 2 (D - 1) n 4 / D per dense tensor (6 of them), the all-reduce it
                # stands for is one of all M: up to 6 bytes less at D = 3 (2 measured)
                assert dense - 6 <= s["bytes_dense"] <= dense, s
