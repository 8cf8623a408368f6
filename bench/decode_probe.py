"""Why does per_rank fall behind as D grows? A probe of the decoded direction, one process, D virtual ranks.

    python bench/decode_probe.py                      # D = 2, 4, 8; 0.45M bench model; about 2 min
    python bench/decode_probe.py --ranks 2 4 8 16 --out runs/decode_probe.json

The bench model (GPT 2 x 128) is first trained by dense AdamW for ``--warm`` steps (one process,
the global batch of 2 ranks), then frozen. At that point every one of D virtual ranks draws its own
batch of 16 sequences each step, as the quality bench's ranks do, and runs the default exchange's
accumulation as ScapeAdamS does: its gradient clipped to norm 1 (``clip_local``), added to its error
feedback in DCT coefficients (``e = 0.999 e + Q g``, 64 x 64 tiles of every weight matrix), and its
message taken out of ``e``. Nine exchanges, each with its own error feedback on every rank:

- ``per_rank`` (the default): each rank's top-kc of every tile; decoded as sum / D;
- ``per_rank/senders``: the same messages, each coefficient divided by its number of senders;
- ``shared``: each rank nominates its top kc // D of each tile, every rank sends its values at the
  union; sum / D (the nominated union, 1.25 rho of bytes whatever D);
- ``shared/equal``: the union with per_rank's bytes (25 D per tile, 10 B a slot against 6 B);
- ``per_rank/2%``: per_rank with kc = 160 // D per tile, which with 8-bit values and bf16 dense
  tensors (``dct_q8_bf16_k20`` at D = 8) keeps about 1.9% of the dense bytes whatever D, as the
  union at 0.99 keeps about 2.0% (the probe sends fp32: the coding's rounding is not modelled);
- ``per_rank/q4``: per_rank with kc = 312 // D, what 4-bit values buy within 2.0% of the bytes
  (``dct_scale_q4_b312``);
- ``shared/2%``: the union with 90 // D nominations per rank, what bf16 values and bf16 dense tensors
  buy within 2.0% of the bytes (``dct_shared16_s978``);
- ``shared/oracle`` and ``shared/2%/oracle``: each tile's top D (kc // D) or D (90 // D) of |sum over
  ranks of e|, the slots of ``shared`` and ``shared/2%`` chosen as no exchange can (it needs every
  rank's whole e): the ceiling of any better shared mask with those slots.

The decoded mean u of each is compared with the gradient of the frozen model on ``--ref-batches``
further batches, g (a stand-in for the true gradient), over the weight matrices: the sign agreement
weighted by |g| (the share of sum |g| where sign(u) = sign(g); the update is lr sign(u)), and for
reference the same of the dense mean of the D ranks' clipped gradients (what dense data parallelism
would see). Steps ``--skip`` and later are averaged (the error feedback needs some steps to fill).
A frozen model is not training: the probe says how well each exchange's direction follows the
gradient as D grows at fixed per-rank batch, not what loss a run reaches (bench/quality.py).
"""
from __future__ import annotations

import argparse
import json
import math
import os

import torch

from scape_ds.data import build_datasets, get_batch
from scape_ds.exchange.basis import TileLayout, dct_matrix, from_coefficients, to_coefficients
from scape_ds.exchange.masks import offsets_to_index
from scape_ds.kernels import torch_kernels
from scape_ds.models import GPT, GPTConfig

TILE, C, KC, DECAY, CLIP, MICRO, SEQ = 64, 4096, 41, 0.999, 1.0, 16, 128


def _weights(model) -> list[torch.nn.Parameter]:
    """The tensors the dct exchange sparsifies at the bench's settings: 2-D, at least 4096 elements."""
    return [p for p in model.parameters() if p.dim() == 2 and p.numel() >= C]


def _flat_grad(model, weights, data, step, rank, world) -> torch.Tensor:
    """This rank's gradient of the weight matrices, (N,), clipped as clip_local clips (whole model)."""
    model.zero_grad()
    x, y = get_batch(data, MICRO, SEQ, step, rank, world, seed=7)
    _, loss = model(x.long(), y.long())
    loss.backward()
    total = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    scale = min(1.0, CLIP / (total + 1e-6))
    return torch.cat([p.grad.reshape(-1) for p in weights]) * scale


def _top(e: torch.Tensor, k: int) -> torch.Tensor:
    """int64 indices of each tile's top-k |e|."""
    return offsets_to_index(torch_kernels.chunk_topk(e, C, k), C, k)


def _agreement(u: torch.Tensor, g: torch.Tensor) -> float:
    """The share of sum |g| where sign(u) agrees with sign(g) (u = 0 counts as disagreeing)."""
    return float((g.abs() * (torch.sign(u) == torch.sign(g))).sum() / g.abs().sum())


def probe(D: int, model, weights, data, steps: int, skip: int, ref: torch.Tensor) -> dict:
    n = sum(p.numel() for p in weights)
    offsets = [0]
    for p in weights[:-1]:
        offsets.append(offsets[-1] + p.numel())
    tiles = TileLayout.build(weights, offsets, D, TILE)
    q = dct_matrix(TILE, torch.float32)
    own = tiles.tiles_numel  # the weights' own tiles (the padding tiles to a multiple of D are not counted)
    # kind -> (how the coefficients are chosen, per rank (per_rank, union) or per tile (oracle))
    counts = {"per_rank": ("per_rank", KC), "shared": ("union", max(1, KC // D)), "shared/equal": ("union", 25),
              "per_rank/2%": ("per_rank", max(1, 160 // D)), "per_rank/q4": ("per_rank", max(1, 312 // D)),
              "shared/2%": ("union", max(1, 90 // D)), "shared/oracle": ("oracle", D * max(1, KC // D)),
              "shared/2%/oracle": ("oracle", D * max(1, 90 // D))}
    kinds = list(counts) + ["per_rank/senders"]
    error = {k: torch.zeros(D, tiles.numel) for k in counts}
    error["per_rank/senders"] = error["per_rank"]  # the same messages, another decode
    scores = {k: [] for k in kinds + ["dense"]}
    sent = {k: [] for k in kinds}
    for step in range(steps):
        grads = [_flat_grad(model, weights, data, 10_000 + step, r, D) for r in range(D)]
        coef = torch.zeros(D, tiles.numel)
        for r in range(D):
            to_coefficients(tiles, grads[r], coef[r], q, torch_kernels)
        means = {}
        for kind, (how, k) in counts.items():
            e = error[kind]
            e.mul_(DECAY).add_(coef)
            total, count = torch.zeros(tiles.numel), torch.zeros(tiles.numel)
            if how == "per_rank":
                for r in range(D):
                    idx = _top(e[r], k)
                    total.index_add_(0, idx, e[r, idx])
                    count.index_add_(0, idx, torch.ones(idx.numel()))
                    e[r, idx] = 0.0
                means[kind] = total / D
                sent[kind].append(float((count[:own] > 0).sum()) / (own // C))
                if kind == "per_rank":
                    means["per_rank/senders"] = total / count.clamp(min=1)
                    sent["per_rank/senders"].append(sent["per_rank"][-1])
            else:
                if how == "union":  # every rank's top k, one mask
                    union = torch.zeros(tiles.numel, dtype=torch.bool)
                    for r in range(D):
                        union[_top(e[r], k)] = True
                    idx = union.nonzero().squeeze(1)
                else:  # "oracle": the top k of each tile of the sum
                    idx = _top(e.sum(dim=0), k)
                total[idx] = e[:, idx].sum(dim=0)
                e[:, idx] = 0.0
                means[kind] = total / D
                sent[kind].append(float((idx < own).sum()) / (own // C))
        if step >= skip:
            for kind, mean in means.items():
                u = torch.zeros(n)
                from_coefficients(tiles, mean, u, q, torch_kernels)
                scores[kind].append(_agreement(u, ref))
            scores["dense"].append(_agreement(torch.stack(grads).mean(dim=0), ref))
    out = {k: sum(v) / len(v) for k, v in scores.items()}
    out.update({f"coefficients_per_tile/{k}": sum(v[skip:]) / len(v[skip:]) for k, v in sent.items()})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--warm", type=int, default=300, help="dense AdamW steps before the model is frozen")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=20)
    ap.add_argument("--ref-batches", type=int, default=64)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)
    torch.manual_seed(1234)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    data, _ = build_datasets()
    model = GPT(GPTConfig(vocab_size=256, seq_len=SEQ, n_layer=2, n_head=4, n_embd=128))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    for step in range(args.warm):
        opt.zero_grad()
        x, y = get_batch(data, 2 * MICRO, SEQ, step, 0, 1, seed=7)
        model(x.long(), y.long())[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    weights = _weights(model)
    ref = sum(_flat_grad(model, weights, data, 50_000 + b, 0, 1) for b in range(args.ref_batches)) / args.ref_batches
    results = {}
    for D in args.ranks:
        results[D] = probe(D, model, weights, data, args.steps, args.skip, ref)
        r = results[D]
        print(f"D={D:2d}  sign agreement with the reference gradient, |g|-weighted: dense mean {r['dense']:.3f} | "
              f"per_rank {r['per_rank']:.3f} | per_rank/senders {r['per_rank/senders']:.3f} | "
              + " | ".join(f"{k} {r[k]:.3f}" for k in r if k not in ("dense", "per_rank", "per_rank/senders")
                           and not k.startswith("coefficients"))
              + "   distinct coefficients per tile: "
              + ", ".join(f"{k[len('coefficients_per_tile/'):]} {v:.0f}" for k, v in r.items()
                          if k.startswith("coefficients") and not k.endswith("senders")), flush=True)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(args=vars(args), results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
