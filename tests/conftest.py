"""Shared test set-up: the Triton interpreter on CPU, and the test tiers.

Triton kernels run on CPU tensors only in Triton's interpreter, which must be chosen before triton
is first imported: without a GPU we choose it here, for every test process.

Tiers (markers registered in pytest.ini, described in tests/README.md): every test gets the marker
of its directory (``TIER_BY_DIRECTORY``), and the tests in ``SLOW_TESTS`` also get ``slow``.
``make test`` (CI) runs ``-m "not slow"``, ``make test-slow`` the slow tier, ``make test-all`` both;
``make test-fast`` runs ``-m "not (launcher or mpi or root or slow or gpu)"``.
"""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

# directory under tests/ -> the marker every test in it gets
TIER_BY_DIRECTORY = {
    "multiprocess": "multirank",
    "integration": "launcher",
    "mpi": "mpi",
    "cluster": "root",
    "gpu": "gpu",
}

# Tests measured over ~30 s (pytest --durations=0, one file at a time, on 2 CPU cores shared with
# other jobs; tests/README.md has the numbers). Node ids relative to tests/: "file::function" marks
# every parametrization, "file::function[params]" one. tests/unit/test_tiers.py checks that each
# entry still names a test function.
SLOW_TESTS = {
    # 8 gloo ranks on 2 cores, about 20 s each; the 2- and 4-rank variants stay in make test
    "multiprocess/test_dct_quantized.py::test_shared_mask_bf16_values_keep_their_rounding_and_cost_six_bytes_a_slot[8]",
    "multiprocess/test_dct_quantized.py::test_coded_exchanges_resume_exactly[q8-bf16-8ranks]",
    "multiprocess/test_dct_quantized.py::test_coded_exchanges_resume_exactly[shared-bf16-8ranks]",
    "multiprocess/test_dct_quantized.py::test_shared_mask_coded_values_lose_nothing_over_the_ranks[8-8]",
    # make test leaves these to make test-slow, so that it (and .ci/run) fits 25 minutes: a fresh-clone make
    # test of every test took 30.5 min on 2 idle cores (2026-12-06); each took 16-56 s there
    "integration/test_pretrain_launcher.py::test_deepspeed_launcher_tp2_and_pp2_with_resume[dct]",
    "integration/test_frameworks.py::test_accelerate_zero3_runs_exit_zero_again_and_again",
    "integration/test_examples.py::test_hf_gpt2_script_example_trains_with_scape",
    "integration/test_quality_smoke.py::test_quality_smoke_scape90_matches_dense_adams_at_100_steps",
    "integration/test_frameworks.py::test_lightning_example_trains_and_resumes_exactly[ds_configs/scape_zero3.json-ScapeStage3-dct]",
    "integration/test_frameworks.py::test_lightning_example_trains_and_resumes_exactly[scape_dct.json-ScapeAdamS-dct]",
    "integration/test_trainer_resume.py::test_trainer_resume_restores_every_ranks_state_exactly[ds_configs/hf_scape_zero3.json-scape_keys1]",
    "integration/test_trainer_resume.py::test_trainer_resume_restores_every_ranks_state_exactly[ds_configs/hf_scape.json-scape_keys0]",
    "multiprocess/test_megatron.py::test_overlap_under_tp2_equals_the_non_overlapped_run",
    "multiprocess/test_megatron.py::test_dct_overlap_under_model_parallelism_equals_the_non_overlapped_run[tp2xdp2]",
    "multiprocess/test_megatron.py::test_dct_overlap_under_model_parallelism_equals_the_non_overlapped_run[pp2xdp2]",
    "integration/test_stop.py::test_stop_ends_every_process_after_a_checkpoint_that_resumes[sigterm_to_deepspeed]",
    "integration/test_examples.py::test_hf_trainer_example_trains_with_scape[ds_configs/hf_scape_zero3.json-ScapeStage3-dct]",
    "integration/test_quality_smoke.py::test_quality_run_resumes_from_its_checkpoint_with_the_same_losses",
    "integration/test_examples.py::test_hf_trainer_example_with_overlap[coordinate]",
    "integration/test_examples.py::test_hf_trainer_example_with_overlap[dct]",
    # kept out of the fast tier so that it fits 3 minutes (make test-fast took 4.5 min with them): the
    # 4-rank variants of the exchange tests (10-62 s; their 2-rank variants stay fast) and the
    # DeepSpeed save/resume tests (23-24 s), measured in one make test-fast run at load 0.4-12
    "multiprocess/test_scape_engine.py::test_density_one_reproduces_dense_adams[4-dtype2]",
    "multiprocess/test_scape_engine.py::test_error_feedback_loses_nothing[4]",
    "multiprocess/test_scape_engine.py::test_replicas_bitwise_equal_and_mask_delayed[scape-True-4]",
    "multiprocess/test_scape_engine.py::test_byte_meter_counts_exactly[4]",
    "multiprocess/test_deepspeed_engine.py::test_resume_is_exact_at_sparsity_099",
    "multiprocess/test_deepspeed_engine.py::test_killed_save_leaves_previous_checkpoint_loadable",
    # 4 ranks (TP2 or PP2) after a 2-rank reference, DeepSpeed engines: 206 s and 210 s measured
    "multiprocess/test_megatron.py::test_tp2_reproduces_tp1_at_sparsity_zero",
    # 4 ranks, DeepSpeed engine through the mpu adapter, 4 steps: 292 s measured
    "multiprocess/test_megatron.py::test_mpu_adapter_answers_deepspeed_engine",
    # not measured (the file run was stopped): the same 2 + 4 rank engines as the TP2 test, or 30 steps on 4 ranks
    "multiprocess/test_megatron.py::test_pp2_reproduces_pp1_at_sparsity_zero",
    "multiprocess/test_megatron.py::test_sparse_099_trains_with_equal_replicas",
    # two PP2 x DP2 PipelineModule engines, 8 steps each (one with scape.overlap): 25-45 s measured
    "multiprocess/test_megatron.py::test_overlap_under_pp2_equals_the_non_overlapped_run",
    # basis "dct" under TP2/PP2 x DP2 (a 2-rank reference and a 4-rank run, or 30 steps on 4 ranks)
    "multiprocess/test_megatron.py::test_dct_under_model_parallelism_reproduces_one_rank_per_replica",
    "multiprocess/test_megatron.py::test_dct_099_under_model_parallelism_trains_with_equal_replicas",
    # ZeRO-3 engines on 2 ranks: 57-87 s each measured
    "multiprocess/test_zero3.py::test_sparsity_zero_reproduces_deepspeed_dense_zero3",
    "multiprocess/test_zero3.py::test_sparse_099_replicas_equal_and_bytes_cut",
    "multiprocess/test_zero3.py::test_error_feedback_conserves_everything_under_zero3",
    "multiprocess/test_zero3.py::test_exact_resume_under_zero3",
    "multiprocess/test_zero3.py::test_bf16_under_zero3",
    "multiprocess/test_zero3.py::test_installed_under_deepspeeds_own_optimizer",
    # basis "dct" under ZeRO-3: a stage-1 and a ZeRO-3 engine per test (2 or 4 ranks), or four engines
    # and a 1-rank load: 10-35 s each measured at load 4-8, 165 s the file (the refusal table stays fast)
    "multiprocess/test_zero3_dct.py::test_sparsity_zero_matches_stage1_dct",
    "multiprocess/test_zero3_dct.py::test_sparse_replicas_bitwise_equal_and_match_stage1",
    "multiprocess/test_zero3_dct.py::test_exact_resume_under_zero3_dct",
    # 4 -> 2 -> 4 ranks, three DeepSpeed engines a phase and a ZeRO-3 one: 50-71 s measured at load 4-6
    "multiprocess/test_elastic.py::test_elastic_resume_4_to_2_to_4",
    # basis "dct": 2 -> 1 and 2 -> 4 ranks, two DeepSpeed engines a phase (and the converted tag's):
    # 39-55 s at load 7-10
    "multiprocess/test_elastic_dct.py::test_dct_elastic_resume_2_to_1_and_2_to_4",
    # the same under ZeRO-3 (two engines a phase, both param_exchange modes): 35 s at load 4.6
    "multiprocess/test_elastic_dct.py::test_dct_elastic_resume_under_zero3_2_to_1_and_2_to_4",
    # root: a link cut mid-run (10 s timeout, then a resumed run) and a link slowed to 1 Mbit/s (two 18-step
    # runs): 34-74 s and 19-40 s measured at load 3.5-9
    "cluster/test_faults.py::test_link_down_ends_every_rank_within_the_timeout_and_the_last_checkpoint_resumes",
    "cluster/test_faults.py::test_link_slowed_to_1mbit_mid_run_loses_nothing",
    # root: two 12-step launcher runs (flat and hierarchical dct) on 2 emulated nodes x 2 ranks: 48 s measured
    "cluster/test_cluster.py::test_dct_hierarchy_across_two_emulated_nodes_of_two_sends_under_half_of_flat",
}


def tier_markers(relpath: str, name: str, params: str = "") -> list[str]:
    """The tier markers of test ``name[params]`` in file ``relpath`` (relative to tests/, '/'-separated)."""
    marks = []
    top = relpath.split("/", 1)[0]
    if top in TIER_BY_DIRECTORY:
        marks.append(TIER_BY_DIRECTORY[top])
    test_id = f"{relpath}::{name}"
    if test_id in SLOW_TESTS or (params and f"{test_id}[{params}]" in SLOW_TESTS):
        marks.append("slow")
    return marks


def pytest_collection_modifyitems(config, items):
    for item in items:
        relpath = os.path.relpath(str(item.path), TESTS_DIR).replace(os.sep, "/")
        name = getattr(item, "originalname", None) or item.name.split("[")[0]
        params = item.name[len(name) + 1:-1] if item.name.startswith(name + "[") else ""
        for mark in tier_markers(relpath, name, params):
            item.add_marker(getattr(pytest.mark, mark))
