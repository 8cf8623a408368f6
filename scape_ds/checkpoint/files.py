"""The checkpoint file format: atomic writes, the manifest, safe loading, the files of a tag.

The bottom of :mod:`scape_ds.checkpoint`: it knows files, not engines or optimizers, and imports
no other part of scape_ds. Layout of ``save_dir``::

    latest                           the tag of the newest complete checkpoint, written last
    global_step<N>/                  DeepSpeed's model, scheduler and client state files
    global_step<N>/scape_dp_rank_<r>.pt   rank r's ScapeAdamS state: master weights, momentum,
                                     error feedback, masks, step counters (with tensor or pipeline
                                     parallelism several ranks share a data-parallel rank:
                                     scape_dp_rank_<r>_global_rank_<g>.pt)
    global_step<N>/manifest.json     every other file of the tag: name, size in bytes, sha256

Under ZeRO-3 the SCAPE state is inside DeepSpeed's per-rank optimizer files
(``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``) and there is no ``scape_dp_rank_*`` file.

Every checkpoint file is read with ``torch.load(weights_only=True)`` (:func:`safe_load`): tensors,
numbers, strings, lists and dicts, plus the two DeepSpeed classes its ZeRO files hold
(``SAFE_DEEPSPEED_GLOBALS``). A pickled callable is refused, never run.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import shutil

import torch
import torch.distributed as dist

__all__ = ["LATEST", "MANIFEST", "SAFE_DEEPSPEED_GLOBALS", "read_latest_tag", "resolve_load", "check_load",
           "check_save_dir", "newest_intact_tag", "intact_tag_hint", "discard_partial_tag", "free_bytes", "safe_load",
           "safe_loading", "write_manifest", "check_manifest", "scape_rank_files", "saved_dp_size",
           "saved_zero3_dp_size", "zero3_files", "ZERO_OPTIM_FILE", "ZERO_MODEL_FILE", "atomic_torch_save",
           "atomic_write_text", "check_contents", "gather_problems", "one_line", "refuse_load"]

LATEST = "latest"
MANIFEST = "manifest.json"
# classes DeepSpeed pickles into its ZeRO optimizer files, allowed (as data, not code) when loading them
SAFE_DEEPSPEED_GLOBALS = ("deepspeed.runtime.zero.config.ZeroStageEnum",
                          "deepspeed.runtime.fp16.loss_scaler.LossScaler")


def atomic_torch_save(obj, path: str) -> None:
    """``torch.save`` to a temporary name, fsync, rename to ``path``: ``path`` is whole or absent."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(obj, tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
    except BaseException:
        _remove_quietly(tmp)  # a full disk: give back what the partial file took
        raise
    os.replace(tmp, path)


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def atomic_write_text(path: str, text: str) -> None:
    """Write ``text`` to a temporary name, fsync, rename to ``path``."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        _remove_quietly(tmp)
        raise
    os.replace(tmp, path)


def read_latest_tag(load_dir: str) -> str:
    """The tag named by ``load_dir/latest``.

    Raises:
        ValueError: ``load_dir`` is not a directory holding a complete checkpoint.
    """
    if not os.path.isdir(load_dir):
        raise ValueError(f"--load {load_dir}: no such directory")
    latest = os.path.join(load_dir, LATEST)
    if not os.path.isfile(latest):
        raise ValueError(f"--load {load_dir}: not a checkpoint directory (no '{LATEST}' file)")
    with open(latest, encoding="utf-8") as f:
        tag = f.read().strip()
    if not tag or not os.path.isdir(os.path.join(load_dir, tag)):
        raise ValueError(f"--load {load_dir}: '{LATEST}' names {tag!r}, which is not a directory there")
    return tag


def resolve_load(path: str) -> tuple[str, str]:
    """``(load_dir, tag)`` for ``--load PATH``: PATH a checkpoint directory (the tag its ``latest``
    names) or a tag directory ``DIR/TAG`` (an older tag, say the newest intact one).

    Raises:
        ValueError: PATH is neither.
    """
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, LATEST)) and (
            os.path.isfile(os.path.join(path, MANIFEST)) or any(n.endswith(".pt") for n in os.listdir(path))):
        load_dir, tag = os.path.split(os.path.normpath(path))
        return load_dir or ".", tag
    return path, read_latest_tag(path)


def _tag_order(tag: str) -> tuple[int, str]:
    digits = re.search(r"\d+", tag)
    return (int(digits.group()) if digits else -1, tag)


def newest_intact_tag(load_dir: str, skip: tuple[str, ...] = ()) -> str | None:
    """The tag in ``load_dir`` with the highest step whose files all match its manifest (names,
    sizes and sha256, every file hashed by this process), other than those in ``skip``; None if none."""
    try:
        names = os.listdir(load_dir)
    except OSError:
        return None
    tags = [n for n in names if n not in skip and os.path.isfile(os.path.join(load_dir, n, MANIFEST))]
    for tag in sorted(tags, key=_tag_order, reverse=True):
        tag_dir = os.path.join(load_dir, tag)
        if not check_manifest(tag_dir) and not check_contents(tag_dir, share=False):
            return tag
    return None


def intact_tag_hint(load_dir: str, refused: str) -> str:
    """What to resume from when tag ``refused`` of ``load_dir`` is damaged: the newest intact tag
    and the ``--load DIR/TAG`` that loads it, or that there is none."""
    tag = newest_intact_tag(load_dir, skip=(refused,))
    if tag is None:
        return f"{load_dir} holds no other intact tag"
    return f"the newest intact tag is {tag}: resume from it with --load {os.path.join(load_dir, tag)}"


def check_load(path: str) -> tuple[str, str]:
    """Check ``--load PATH`` before any process group exists: a tag is named (by ``latest`` or as
    ``DIR/TAG``) and its files match its manifest's names and sizes; returns ``(load_dir, tag)``.

    Raises:
        ValueError: one line naming the problem and, for a damaged tag, the newest intact one.
    """
    load_dir, tag = resolve_load(path)
    problems = check_manifest(os.path.join(load_dir, tag))
    if problems:
        refuse_load(path, problems, load_dir, tag)
    return load_dir, tag


def check_save_dir(save_dir: str) -> None:
    """Make sure ``--save DIR`` is, or can be created as, a folder this process can write: it is
    created and a probe file is written and removed in it (before the first step, not at the first save).

    Raises:
        ValueError: one line naming the folder and the reason.
    """
    if os.path.exists(save_dir) and not os.path.isdir(save_dir):
        raise ValueError(f"--save {save_dir}: exists and is not a folder")
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--save {save_dir}: cannot create the folder ({one_line(e)})") from None
    probe = os.path.join(save_dir, f".scape_write_probe.{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"probe")
    except OSError as e:
        raise ValueError(f"--save {save_dir}: the folder is not writable ({one_line(e)})") from None
    finally:
        _remove_quietly(probe)


def free_bytes(save_dir: str) -> int:
    """Free bytes on the file system holding ``save_dir`` (for this user)."""
    return shutil.disk_usage(save_dir).free


def discard_partial_tag(save_dir: str, tag: str) -> bool:
    """Remove ``save_dir/tag`` after a failed save, unless ``latest`` names it; returns whether it did."""
    tag_dir = os.path.join(save_dir, tag)
    try:
        if read_latest_tag(save_dir) == tag:
            return False
    except ValueError:
        pass
    if not os.path.isdir(tag_dir):
        return False
    shutil.rmtree(tag_dir, ignore_errors=True)
    return not os.path.exists(tag_dir)


def refuse_load(given: str, problems: list[str], load_dir: str | None = None, tag: str | None = None):
    """Raise the one-line refusal of ``--load given``; with ``tag`` (a damaged tag of ``load_dir``)
    it ends with the newest intact tag there and the ``--load DIR/TAG`` that resumes from it."""
    more = f"; and {len(problems) - 3} more" if len(problems) > 3 else ""
    hint = f"; {intact_tag_hint(load_dir, tag)}" if tag is not None else ""
    raise ValueError(f"--load {given}: " + "; ".join(problems[:3]) + more + hint)


# ---------------------------------------------------------------- safe loading
def _safe_globals() -> list:
    """The classes of ``SAFE_DEEPSPEED_GLOBALS`` (those this DeepSpeed version has)."""
    import importlib

    found = []
    for name in SAFE_DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        try:
            found.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            pass
    return found


def safe_load(path: str, map_location="cpu"):
    """``torch.load(path, weights_only=True)``, allowing only ``SAFE_DEEPSPEED_GLOBALS`` beyond torch's
    own list; nothing in the file is executed.

    Raises:
        ValueError: one line naming ``path``: it holds objects weights_only loading refuses (a
            pickled callable, say), or it is corrupt or truncated.
    """
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        unsafe = _unsafe_globals(path)
        what = ", ".join(unsafe[:3]) if unsafe else one_line(e)
        raise ValueError(_not_plain_data(path, what)) from None
    except Exception as e:  # torch's zip reader raises many types for a damaged file
        raise ValueError(f"{path} is corrupt or truncated ({one_line(e)})") from None


def _not_plain_data(path: str, what: str) -> str:
    return f"{path} holds objects that are not plain data ({what}): refused, not loaded"


def _unsafe_globals(path: str) -> list[str]:
    """The classes and functions named in ``path``'s pickle that weights_only loading refuses
    (the pickle is scanned, not run; the tensors are not read)."""
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            return torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except Exception:  # not a zip archive, or damaged: judged by the loader
        return []


class _SafeLoading:
    """DeepSpeed's checkpoint engine with :func:`safe_load` as its ``load``."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def load(self, path: str, map_location=None):
        return safe_load(path, map_location)


def safe_loading(engine) -> None:
    """Make ``engine``'s checkpoint engine read every file with :func:`safe_load` (``scape_ds.initialize``
    does this for SCAPE engines; :func:`scape_ds.checkpoint.load_checkpoint` for any engine). Saving is
    unchanged."""
    inner = getattr(engine, "checkpoint_engine", None)
    if inner is not None and not isinstance(inner, _SafeLoading):
        engine.checkpoint_engine = _SafeLoading(inner)


# ---------------------------------------------------------------- manifest
def _tag_files(tag_dir: str) -> list[str]:
    """The files of a tag that the manifest covers (not itself, not temporary files)."""
    return sorted(n for n in os.listdir(tag_dir) if n != MANIFEST and ".tmp." not in n
                  and os.path.isfile(os.path.join(tag_dir, n)))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def write_manifest(tag_dir: str, collective: bool = True) -> None:
    """Write ``tag_dir/manifest.json``: each file's size and sha256; call after every file is in place.
    ``collective``: when torch.distributed is initialized every rank hashes its share and rank 0
    writes; otherwise (or when False) this process hashes every file and writes."""
    names = _tag_files(tag_dir)
    rank, world = _rank_world() if collective else (0, 1)
    mine = {n: dict(bytes=os.path.getsize(os.path.join(tag_dir, n)), sha256=_sha256(os.path.join(tag_dir, n)))
            for n in names[rank::world]}
    if world > 1:
        gathered: list = [None] * world
        dist.all_gather_object(gathered, mine)
        mine = {n: e for part in gathered for n, e in part.items()}
    if rank == 0:
        text = json.dumps(dict(version=1, files=dict(sorted(mine.items()))), indent=1) + "\n"
        atomic_write_text(os.path.join(tag_dir, MANIFEST), text)


def _read_manifest(tag_dir: str) -> dict:
    with open(os.path.join(tag_dir, MANIFEST), encoding="utf-8") as f:
        return json.load(f)["files"]


def check_manifest(tag_dir: str) -> list[str]:
    """What is wrong with ``tag_dir`` against its manifest, by name and size (no hashing, no
    communication): a missing manifest, a missing, extra or resized file. Empty if nothing is."""
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        return [f"{tag_dir} has no {MANIFEST} (an incomplete save, or saved by an older scape_ds)"]
    try:
        files = _read_manifest(tag_dir)
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{path} is unreadable ({one_line(e)})"]
    problems = []
    present = set(_tag_files(tag_dir))
    for name, entry in files.items():
        full = os.path.join(tag_dir, name)
        if name not in present:
            problems.append(f"{full} is missing")
        elif os.path.getsize(full) != entry["bytes"]:
            problems.append(f"{full} is truncated or altered ({os.path.getsize(full)} bytes, "
                            f"the manifest says {entry['bytes']})")
    problems += [f"{os.path.join(tag_dir, n)} is not in the manifest" for n in sorted(present - set(files))]
    return problems


def check_contents(tag_dir: str, share: bool = True) -> list[str]:
    """This rank's share of the tag's files (file i on rank i mod world size; every file when not
    ``share``): sha256 against the manifest, and the pickle scanned for objects weights_only loading refuses."""
    files = _read_manifest(tag_dir)
    rank, world = _rank_world() if share else (0, 1)
    problems = []
    for name in sorted(files)[rank::world]:
        full = os.path.join(tag_dir, name)
        if _sha256(full) != files[name]["sha256"]:
            problems.append(f"{full} is altered (its sha256 differs from the manifest's)")
        elif name.endswith(".pt") and (unsafe := _unsafe_globals(full)):
            problems.append(_not_plain_data(full, ", ".join(unsafe[:3])))
    return problems


def one_line(err: BaseException) -> str:
    """``"OSError: <message>"`` on one line, at most 200 characters of message."""
    text = " ".join(str(err).split()) or "no message"
    return f"{type(err).__name__}: {text[:200]}"


def gather_problems(problems: list[str]) -> list[str]:
    """Every rank's problems, in rank order, each distinct one once, on every rank (one all-gather of
    short strings); the ranks agree on whether to load before any of them enters DeepSpeed's loading
    collectives."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problems
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)  # pickled; placed on the current device by torch
    return list(dict.fromkeys(p for rank_problems in gathered for p in rank_problems))


# ---------------------------------------------------------------- the files of a tag
_RANK_FILE = re.compile(r"scape_dp_rank_(\d{5})(_global_rank_\d{5})?\.pt$")
def scape_rank_files(tag_dir: str) -> dict[int, list[str]]:
    """Data-parallel rank -> the SCAPE state files saved for it in ``tag_dir`` (several with
    tensor or pipeline parallelism: one per model-parallel rank)."""
    found: dict[int, list[str]] = {}
    for name in sorted(os.listdir(tag_dir)):
        m = _RANK_FILE.match(name)
        if m:
            found.setdefault(int(m.group(1)), []).append(os.path.join(tag_dir, name))
    return found


def saved_dp_size(tag_dir: str) -> int | None:
    """The data-parallel size the SCAPE files in ``tag_dir`` were saved with (None: there are none).

    Raises:
        ValueError: the files of some data-parallel rank are missing.
    """
    return _rank_count(scape_rank_files(tag_dir), f"{tag_dir} has SCAPE state")


def _rank_count(files: dict, what: str) -> int | None:
    """The number of data-parallel ranks ``files`` (rank -> file(s)) were saved by (None: no files).

    Raises:
        ValueError: ``what`` (``"<dir> has SCAPE state"``...) for ranks up to some but not every rank.
    """
    if not files:
        return None
    size = max(files) + 1
    missing = [r for r in range(size) if r not in files]
    if missing:
        raise ValueError(f"{what} for data-parallel ranks up to {size - 1} but none for rank(s) {missing}")
    return size


ZERO_OPTIM_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
ZERO_MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def zero3_files(tag_dir: str) -> dict[int, str]:
    """Old data-parallel rank -> its ZeRO-3 optimizer file in ``tag_dir``."""
    found, mp = {}, set()
    for name in sorted(os.listdir(tag_dir)):
        m = ZERO_OPTIM_FILE.match(name)
        if m:
            found[int(m.group(1))] = os.path.join(tag_dir, name)
            mp.add(int(m.group(2)))
    if mp - {0}:
        raise ValueError(f"{tag_dir} was saved with tensor or pipeline parallelism: elastic resume "
                         "supports data parallelism only")
    return found


def saved_zero3_dp_size(tag_dir: str) -> int | None:
    """The data-parallel size a ZeRO-3 checkpoint in ``tag_dir`` was saved with (None: not ZeRO-3).

    Raises:
        ValueError: some rank's optimizer file is missing, or tensor/pipeline-parallel files.
    """
    return _rank_count(zero3_files(tag_dir), f"{tag_dir} has ZeRO-3 optimizer files")
