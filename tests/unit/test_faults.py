"""The lost-peer report of scape_ds.faults, without a process group: which errors count, and the line."""
from __future__ import annotations

import pytest
import torch

from scape_ds.comm import ByteMeter, TorchCommunicator, torch_comm
from scape_ds.faults import describe_lost_peer, is_peer_lost, last_checkpoint

GLOO_TIMEOUT = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                "20000ms for recv operation to complete")
GLOO_RESET = ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
              "[10.77.0.2]:40312: Connection reset by peer. This is typically caused by a remote worker hanging or "
              "bugs in the application. Check the logs of the remote worker.")


def _comm() -> TorchCommunicator:
    """A TorchCommunicator of rank 1 of 2 on the CPU, without a process group behind it."""
    comm = object.__new__(TorchCommunicator)
    comm.group, comm.rank, comm.world_size = None, 1, 2
    comm.meter, comm.device, comm._src_global = ByteMeter(), torch.device("cpu"), [0, 1]
    return comm


def _failed_all_reduce(monkeypatch, message: str) -> RuntimeError:
    """The error a SCAPE all-reduce raises when the backend says ``message``."""
    def all_reduce(*args, **kwargs):
        raise RuntimeError(message)

    monkeypatch.setattr(torch_comm.dist, "all_reduce", all_reduce)
    with pytest.raises(RuntimeError) as info:
        _comm().all_reduce(torch.zeros(3), "norm_ar")
    return info.value


@pytest.mark.parametrize("message", [GLOO_TIMEOUT, GLOO_RESET, "Connection closed by peer [10.77.0.1]:29600",
                                     "Broken pipe", "Socket Timeout"])
def test_backend_timeouts_and_dropped_connections_are_lost_peers(message):
    assert is_peer_lost(RuntimeError(message))
    try:  # DeepSpeed or our code may wrap it: the cause counts
        try:
            raise RuntimeError(message)
        except RuntimeError as e:
            raise ValueError("wrapped") from e
    except ValueError as wrapped:
        assert is_peer_lost(wrapped)


@pytest.mark.parametrize("error", [RuntimeError("collective 'grad_rs': a meta tensor for a communicator on cpu"),
                                   RuntimeError("CUDA out of memory"), ValueError("Timed out waiting 5ms")])
def test_other_errors_are_not_lost_peers(error):
    assert not is_peer_lost(error)


def test_line_names_rank_peer_collective_phase_timeout_and_checkpoint(monkeypatch, tmp_path):
    (tmp_path / "latest").write_text("global_step60")
    err = _failed_all_reduce(monkeypatch, GLOO_TIMEOUT)
    line = describe_lost_peer(1, err, [0], phase="step 61", timeout_s=20, save_dir=str(tmp_path))
    assert line == (f"rank 1: lost contact with rank 0 (collective 'norm_ar' in step 61 timed out after 20 s); "
                    f"the last complete checkpoint is global_step60 in {tmp_path}: resume with --load {tmp_path}")
    assert "\n" not in line


def test_line_when_the_store_is_silent_too_or_everyone_answers(monkeypatch):
    err = _failed_all_reduce(monkeypatch, GLOO_RESET)
    line = describe_lost_peer(1, err, None, phase="saving global_step5", timeout_s=20, save_dir=None,
                              store_addr="10.77.0.1:29600")
    assert line.startswith("rank 1: lost contact with rank 0 (collective 'norm_ar' in saving global_step5 failed: "
                           "Read error [10.77.0.2]:40312: Connection reset by peer; the rendezvous store at "
                           "10.77.0.1:29600 does not answer either); nothing was saved (no --save)"), line
    line = describe_lost_peer(0, RuntimeError("Socket Timeout"), [], phase="start-up", timeout_s=15, save_dir=None)
    assert line.startswith("rank 0: lost contact with a peer (a collective in start-up timed out after 15 s; "
                           "every rank still answers the rendezvous store)"), line


def test_last_checkpoint_says_when_there_is_none_yet(tmp_path):
    assert last_checkpoint(None) == "nothing was saved (no --save)"
    assert last_checkpoint(str(tmp_path)) == f"no checkpoint was completed in {tmp_path} yet"
    (tmp_path / "latest").write_text("global_step5\n")
    assert last_checkpoint(str(tmp_path)).startswith("the last complete checkpoint is global_step5 in ")


def test_a_timeout_elsewhere_is_not_a_lost_peer():
    assert not is_peer_lost(RuntimeError("Timeout waiting for the lock on the extension build directory"))


def test_probe_of_a_dead_store_returns_none_without_a_thread_traceback(monkeypatch):
    import threading

    from torch.distributed import DistNetworkError
    from torch.distributed import distributed_c10d as c10d

    from scape_ds.faults import probe_peers

    class DeadStore:
        def set_timeout(self, timeout):
            pass

        def add(self, key, n):
            raise DistNetworkError("Connection reset by peer")  # rank 0, the store's host, went first

    escaped = []
    monkeypatch.setattr(c10d, "_get_default_store", lambda: DeadStore())
    monkeypatch.setattr(threading, "excepthook", lambda args: escaped.append(args.exc_value))
    assert probe_peers(1, 2, 0.5) is None
    assert escaped == []


def test_probe_of_a_closed_store_port_does_not_touch_the_store(monkeypatch):
    from torch.distributed import distributed_c10d as c10d

    from scape_ds.faults import probe_peers
    from scape_ds.spawn import free_port

    def no_store():
        raise AssertionError("the store client was used")  # its C++ warning would precede the line

    monkeypatch.setattr(c10d, "_get_default_store", no_store)
    assert probe_peers(1, 2, 0.5, ("127.0.0.1", free_port())) is None  # nothing listens there
