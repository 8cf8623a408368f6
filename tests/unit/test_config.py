"""The "scape" config block: defaults, derived values and one clear error per bad field."""
from __future__ import annotations

import pydantic
import pytest

from scape_ds.config import ScapeConfig, parse_scape_config


def test_defaults_and_derived_values():
    cfg = parse_scape_config(None)
    assert cfg.sparsity == 0.99 and cfg.compressor == "scape" and cfg.dense_refresh
    assert cfg.k_per_chunk == round(0.01 * cfg.chunk_size)
    assert parse_scape_config({"sparsity": 0.0, "chunk_size": 8}).k_per_chunk == 8
    assert parse_scape_config(cfg) is cfg


@pytest.mark.parametrize(
    "block,field,allowed",
    [
        ({"sparsity": 1.0}, "scape.sparsity", "[0, 1)"),
        ({"sparsity": -0.1}, "scape.sparsity", "[0, 1)"),
        ({"mask_refresh_interval": 0}, "scape.mask_refresh_interval", ">= 1"),
        ({"chunk_size": 1000}, "scape.chunk_size", "power of two in [8, 65536]"),
        ({"chunk_size": 131072}, "scape.chunk_size", "power of two in [8, 65536]"),
        ({"exploration": 1.5}, "scape.exploration", "[0, 1)"),
        ({"dense_numel_threshold": -1}, "scape.dense_numel_threshold", ">= 0"),
        ({"compressor": "powersgd"}, "scape.compressor", "'scape', 'topk', 'randk' or 'dense'"),
        ({"comm_backend": "nccl"}, "scape.comm_backend", "'torch' or 'mpi'"),
        ({"kernels": "cuda"}, "scape.kernels", "'auto', 'triton' or 'torch'"),
        ({"param_exchange": "sparse"}, "scape.param_exchange", "'dense' or 'sparse_replica'"),
        ({"error_feedback_dtype": "fp16"}, "scape.error_feedback_dtype", "'fp32' or 'bf16'"),
        ({"sparsity": "lots"}, "scape.sparsity", "valid number"),
        ({"update_rule": "linear"}, "scape.update_rule", "'lazy', 'catchup', 'sign_drift' or 'window_mean'"),
        ({"catchup_beta": 1.0}, "scape.catchup_beta", "[0, 1)"),
        ({"catchup_gain": 0.0}, "scape.catchup_gain", "must be > 0, got 0.0"),
        ({"drift_steps": 0}, "scape.drift_steps", "must be an integer >= 1, got 0"),
        ({"reselect_interval": -1}, "scape.reselect_interval", "must be >= 0, got -1"),
        ({"sparsityy": 0.9}, "scape.sparsityy", "unknown field; allowed fields: compressor, sparsity"),
    ],
)
def test_every_bad_value_names_field_and_range(block, field, allowed):
    with pytest.raises(ValueError) as err:
        parse_scape_config(block)
    msg = str(err.value)
    assert "\n" not in msg
    assert field in msg and allowed in msg, msg


def test_topk_needs_dense_refresh():
    with pytest.raises(ValueError, match="dense_refresh"):
        parse_scape_config({"compressor": "topk", "dense_refresh": False})


@pytest.mark.parametrize(
    "block,message",
    [
        ({"update_rule": "catchup", "dense_refresh": False}, "update_rule='catchup' acts at dense refresh steps"),
        ({"update_rule": "sign_drift", "compressor": "randk"}, "needs compressor 'scape' or 'topk'"),
        ({"update_rule": "window_mean", "hierarchy": "node"}, "built for hierarchy 'flat' only"),
        ({"update_rule": "sign_drift", "drift_steps": 100}, "drift_steps must be in [1, mask_refresh_interval=100)"),
        ({"reselect_interval": 100}, "reselect_interval must be 0 or in [1, mask_refresh_interval=100), got 100"),
        ({"reselect_interval": 25, "update_rule": "catchup"}, "reselect_interval needs update_rule 'lazy'"),
        ({"reselect_interval": 25, "dense_refresh": False}, "reselect_interval needs update_rule 'lazy'"),
    ],
)
def test_update_rule_combinations_are_one_line_errors(block, message):
    with pytest.raises(ValueError) as err:
        parse_scape_config(block)
    assert "\n" not in str(err.value) and message in str(err.value), str(err.value)
    if "reselect_interval" not in block:
        parse_scape_config({k: v for k, v in block.items() if k != "update_rule"})  # fine under "lazy"


def test_not_a_dict():
    with pytest.raises(TypeError, match="dict"):
        parse_scape_config([0.99])


def test_frozen():
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        ScapeConfig().sparsity = 0.5  # type: ignore[misc]


def test_unknown_comm_backend_is_a_clear_error():
    from scape_ds.comm import build_communicator

    with pytest.raises(ValueError, match="comm_backend must be"):
        build_communicator("nccl")


def test_hierarchy_fields():
    assert parse_scape_config(None).hierarchy == "flat"
    cfg = parse_scape_config({"hierarchy": "node", "intra_node_size": 4})
    assert (cfg.hierarchy, cfg.intra_node_size) == ("node", 4)
    assert parse_scape_config({"hierarchy": "node"}).intra_node_size is None  # from the launcher
    with pytest.raises(ValueError, match="scape.hierarchy: .*'flat' or 'node'"):
        parse_scape_config({"hierarchy": "rack"})
    with pytest.raises(ValueError, match="scape.intra_node_size: must be an integer >= 1"):
        parse_scape_config({"hierarchy": "node", "intra_node_size": 0})
    with pytest.raises(ValueError, match="intra_node_size is for hierarchy='node'"):
        parse_scape_config({"intra_node_size": 2})


def test_split_by_node_groups_local_ranks_across_nodes():
    from scape_ds.comm.hierarchy import split_by_node

    # TP2: the data-parallel group of tensor rank 0 is global ranks 0, 2, 4, 6; 4 ranks per node
    nodes, cross = split_by_node([0, 2, 4, 6], [r // 4 for r in (0, 2, 4, 6)])
    assert nodes == [[0, 2], [4, 6]] and cross == [[0, 4], [2, 6]]
    with pytest.raises(ValueError, match="same number of data-parallel ranks on every node"):
        split_by_node([0, 1, 2], [0, 0, 1])


def test_every_bundled_ds_config_has_a_valid_scape_block():
    import glob
    import json
    import os

    root = os.path.join(os.path.dirname(__file__), "..", "..", "ds_configs")
    names = sorted(glob.glob(os.path.join(root, "*.json")))
    assert len(names) >= 10
    for name in names:
        with open(name) as f:
            block = json.load(f).get("scape")
        if block is not None:
            parse_scape_config(block)  # raises on a bad field


def test_every_shipped_scape_config_runs_the_dct_basis_but_its_coordinate_twins():
    """A user who copies a SCAPE config gets the parity mode; the coordinate basis only where the name
    says so (``*_coordinate.json``), and every such config keeps a dct twin or is the top-k baseline."""
    import glob
    import json
    import os

    root = os.path.join(os.path.dirname(__file__), "..", "..", "ds_configs")
    scape = {}
    for path in sorted(glob.glob(os.path.join(root, "*.json"))):
        with open(path) as f:
            cfg = json.load(f)
        if "scape" in cfg or cfg.get("optimizer", {}).get("type") == "ScapeAdamS":
            scape[os.path.basename(path)] = parse_scape_config(cfg.get("scape")).basis
    assert len(scape) >= 20
    for name, basis in scape.items():
        assert basis == ("coordinate" if name.endswith("_coordinate.json") else "dct"), (name, basis)
    twins = {n.replace("_coordinate", "") for n in scape if n.endswith("_coordinate.json")}
    assert twins - set(scape) == {"scape.json", "scape_overlap.json", "scape_s90.json", "topk.json"}


# ---------------------------------------------------------------- issue 35: strict types, misspelled block
@pytest.mark.parametrize("block,needle", [
    ({"sparsity": "0.99"}, 'scape.sparsity: Input should be a valid number, got "0.99" (a JSON string)'),
    ({"chunk_size": 4096.0}, "scape.chunk_size: Input should be a valid integer, got 4096.0 (a JSON number)"),
    ({"dense_refresh": "yes"}, 'scape.dense_refresh: Input should be a valid boolean, got "yes" (a JSON string)'),
    ({"dense_refresh": 1}, "scape.dense_refresh: Input should be a valid boolean, got 1 (a JSON integer)"),
    ({"mask_refresh_interval": True}, "scape.mask_refresh_interval: Input should be a valid integer, got true"),
    ({"mask_refresh_interval": "100"}, "scape.mask_refresh_interval: Input should be a valid integer"),
])
def test_strings_and_floats_are_not_coerced(block, needle):
    with pytest.raises(ValueError) as err:
        parse_scape_config(block)
    assert needle in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_an_integer_is_a_number():
    cfg = parse_scape_config({"sparsity": 0, "catchup_gain": 1, "exploration": 0})
    assert cfg.sparsity == 0.0 and cfg.catchup_gain == 1.0 and cfg.k_per_chunk == cfg.chunk_size


@pytest.mark.parametrize("key", ["scapee", "scpae", "Scape", "scap", "sacpe", "spae"])
def test_misspelled_scape_block_is_refused(key):
    from scape_ds.engine import check_block_names

    with pytest.raises(ValueError, match=f"top-level key '{key}': did you mean \"scape\""):
        check_block_names({"optimizer": {"type": "ScapeAdamS"}, key: {"sparsity": 0.9}})


def test_deepspeed_keys_are_not_taken_for_scape():
    import deepspeed.runtime.constants as ds

    from scape_ds.engine import check_block_names

    keys = {v: 1 for k, v in vars(ds).items() if k.isupper() and isinstance(v, str) and v.isidentifier()}
    check_block_names({**keys, "scape": {}})
