"""The single-device GPT: shapes, initial loss, weight tying, causality, learning, config checks."""
import math

import pytest
import torch

from scape_ds.models import GPT, GPT_SHAPES, GPTConfig


@pytest.fixture
def model():
    torch.manual_seed(0)
    return GPT(GPTConfig())


def test_shapes_and_no_loss_without_targets(model):
    idx = torch.randint(0, 256, (2, 16))  # (B, T) int64
    logits, loss = model(idx)
    assert logits.shape == (2, 16, 256)
    assert loss is None
    logits, loss = model(idx, idx)
    assert loss.shape == ()


def test_structure_for_pipeline_split(model):
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    assert hasattr(model, "embed") and hasattr(model, "head")


def test_loss_at_init_is_near_uniform(model):
    idx = torch.randint(0, 256, (8, 128))
    targets = torch.randint(0, 256, (8, 128))
    _, loss = model(idx, targets)
    assert abs(loss.item() - math.log(256)) < 0.3


def test_weights_are_tied(model):
    assert model.head.lm_head.weight is model.embed.wte.weight
    n_unique = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert model.num_parameters() == n_unique
    assert model.num_parameters(exclude_position_embedding=True) == n_unique - 128 * 128


def test_causal(model):
    model.eval()
    idx = torch.randint(0, 256, (1, 32))
    t = 20
    changed = idx.clone()
    changed[0, t] = (idx[0, t] + 1) % 256
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(changed)
    assert torch.equal(a[:, :t], b[:, :t])
    assert not torch.allclose(a[:, t:], b[:, t:])


def test_adamw_reduces_loss_on_fixed_batch(model):
    torch.manual_seed(1)
    idx = torch.randint(0, 256, (4, 32))
    targets = torch.roll(idx, -1, dims=1)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        _, loss = model(idx, targets)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0


def test_too_long_sequence_raises(model):
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 129, dtype=torch.int64))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"n_embd": 130, "n_head": 4}, "n_embd"),
        ({"n_layer": 0}, "n_layer"),
        ({"n_head": -1}, "n_head"),
        ({"vocab_size": 0}, "vocab_size"),
        ({"seq_len": 0}, "seq_len"),
        ({"dropout": 1.0}, "dropout"),
    ],
)
def test_bad_config_raises_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**kwargs)


def test_shapes_table():
    assert GPT_SHAPES["tiny"] == GPTConfig()
    big = GPT_SHAPES["gpt2-125m"]
    assert (big.vocab_size, big.seq_len, big.n_layer, big.n_head, big.n_embd) == (50304, 1024, 12, 12, 768)
