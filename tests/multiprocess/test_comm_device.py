"""Every tensor a collective gets lives on the communicator's device (NCCL takes CUDA tensors only).

On CPU the gloo communicator's device is the CPU; a tensor on another device is refused with the
collective's tag before it reaches the backend, which on a GPU turns NCCL's "No backend type
associated with device type cpu" into a message naming the collective.
"""
import pytest
import torch

from scape_ds.comm import TorchCommunicator, collective_device

from .harness import run_ranks


def _worker(rank, world_size, tmp_path):
    comm = TorchCommunicator()
    assert comm.device == torch.device("cpu") == collective_device(None)
    x = torch.ones(4, device=comm.device)
    comm.all_reduce(x, "ok_ar")
    refused = []
    meta = torch.empty(4, device="meta")
    for name, call in [
        ("all_reduce", lambda: comm.all_reduce(meta, "bad_ar")),
        ("broadcast", lambda: comm.broadcast(meta, 0, "bad_bc")),
        ("all_gather", lambda: comm.all_gather(torch.empty(4 * world_size, device="meta"), meta, "bad_ag")),
        ("reduce_scatter", lambda: comm.reduce_scatter(torch.empty(1, device="meta"),
                                                       torch.empty(world_size, device="meta"), "bad_rs")),
    ]:
        try:
            call()
        except RuntimeError as e:
            refused.append((name, str(e)))
    return float(x[0]), refused, dict(comm.meter.total)


@pytest.mark.timeout(120)
def test_collectives_refuse_tensors_off_the_communicator_device(tmp_path):
    results = run_ranks(_worker, 2, tmp_path)
    for value, refused, total in results:
        assert value == 2.0
        assert [n for n, _ in refused] == ["all_reduce", "broadcast", "all_gather", "reduce_scatter"]
        for name, msg in refused:
            assert "meta tensor" in msg and "comm.device" in msg, msg
        assert "'bad_ar'" in refused[0][1]
        assert list(total) == ["ok_ar"]  # a refused collective is not metered
