"""Pytest fixtures, session setup and the test tiers. Everything runs offline on CPU with tiny models.

Fixtures are used by name (never imported); plain helpers are in `helpers.py`.
"""

import os
from collections import defaultdict
from fnmatch import fnmatch
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402
from device_faults import pytest_runtest_logfinish, pytest_runtest_makereport  # noqa: E402, F401 (hooks)

# Without a GPU the Triton kernels run in Triton's interpreter. triton reads this when @triton.jit decorates the
# kernels, i.e. when hf_linear_attn's Triton modules (ops_triton_*) are imported: it must be set before the package
# is (test modules import it after this file has run).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


# ---------------------------------------------------------------------------------------------------------------
# Test tiers: `make test` runs `pytest -m "not full"` (the quick tier), `make test-full` and CI run everything.
# ---------------------------------------------------------------------------------------------------------------

# Every test is in the quick tier unless this table says otherwise: a test added later runs in `make test` until
# someone decides it is slow or redundant, so no test is ever silently left out of the quick tier (the opposite
# default, a table of the quick tests, would drop every new test from it). Each test the table names gets the
# `full` marker (declared in pyproject.toml) on all or some of its cases:
#   FULL   every case runs only in the full tier;
#   COVER  the quick tier keeps the fewest cases in which every value of every parameter appears at least once;
#   ONE    the quick tier keeps the first case.
# Keys are "file::function" or "file::Class::method" (fnmatch patterns), never parametrize ids, so that cases
# can be added, renamed or reordered freely. A key that matches no test of the whole suite fails test_tiers.py.
# What the quick tier keeps of each code path: every attention kind (the modeling and cache tests run every
# variant), every backend under the Triton interpreter (the linear, window, delta-rule and decode kernels),
# every generate mode, conversion, fine-tuning (not its slowest runs), one transformers common-test class.
FULL, COVER, ONE = "full", "cover", "one"
STALE_TIERS = pytest.StashKey[list]()  # the keys that match no test, when the whole suite is collected
TIERS = {
    # Triton kernels in the interpreter (~10 min of the full tier): each kernel and option once.
    "test_triton_ops.py::test_linear_matches_recurrent": COVER,
    "test_triton_ops.py::test_linear_head_dims_beyond_one_block": ONE,
    "test_triton_ops.py::test_linear_half_precision": ONE,
    "test_triton_ops.py::test_linear_packed_sequences": ONE,
    "test_triton_ops.py::test_decay_gradient_in_the_kernels_only_when_needed": ONE,
    "test_triton_ops.py::test_bfloat16_inputs_store_bfloat16_chunk_states": ONE,
    "test_triton_ops.py::test_normalizer_is_carried_beside_the_values": ONE,
    "test_triton_ops.py::test_backward_reuses_the_forward_decay_sums_and_scores": ONE,
    "test_triton_ops.py::test_gradient_of_one_output_only": ONE,
    "test_triton_ops.py::test_strong_decay_stays_finite": ONE,
    "test_triton_ops.py::test_reset_decays_match_the_token_loop": ONE,
    "test_triton_ops.py::test_window_matches_reference": COVER,
    "test_triton_ops.py::test_window_half_precision": ONE,
    "test_triton_ops.py::test_window_decay_matches_reference": ONE,
    "test_triton_ops.py::test_window_decay_resets": ONE,
    "test_triton_ops.py::test_window_sink_gradients_in_query_slices": ONE,
    "test_triton_ops.py::test_window_sink_kernel_launched_only_when_needed": FULL,
    "test_triton_ops.py::test_window_backward_is_deterministic": FULL,
    "test_triton_ops.py::test_kernels_compile_for_a_hopper_gpu": FULL,
    "test_triton_ops.py::test_packed_calls_read_no_values_on_the_host": FULL,
    "test_delta_rule_triton.py::test_matches_recurrent_oracle": COVER,
    "test_delta_rule_triton.py::test_low_precision_matches_float64_oracle": ONE,
    "test_delta_rule_triton.py::test_packed_sequences_match_recurrent": ONE,
    "test_triton_decode.py::test_window_step_matches_twin": COVER,
    "test_triton_decode.py::test_window_steps_from_an_empty_cache": ONE,
    # The model's decode steps on the kernels: the window hybrid with decay (the window kernel; the linear step kernel
    # is checked against its twin in the quick tier's op tests).
    "test_triton_decode.py::test_generate_with_the_kernels_matches_torch": ONE,
    # Without triton (a fresh interpreter each, ~9 s): the quick tier imports every Triton module so
    # (test_triton_ops.py); the decode and delta-rule modules' own messages in the full tier.
    "test_triton_decode.py::test_module_imports_without_triton": FULL,
    "test_delta_rule_triton.py::test_without_triton_the_backend_explains_itself": FULL,
    # The torch ops: every backend, decay and shape is also in the quick tier's covering cases.
    "test_ops.py::test_backends_match_recurrent": COVER,
    # torch.export of the no-cache forward (4-10 s a variant): the variant with the most parts (delta rule, decay,
    # short convolution, output norm and gate, window, sinks) first, the rest in the full tier.
    "test_modeling.py::test_torch_export_of_the_no_cache_forward_matches_eager": ONE,
    # Reading past the trained positions where the package is not installed (a fresh interpreter; the quick tier
    # keeps test_remote_code_loads_where_the_package_is_not_installed, and the options' own tests).
    "test_save_load.py::test_a_checkpoint_read_past_its_positions_reads_so_where_the_package_is_not_installed": FULL,
    # Compilation: one variant (every variant's decode step is traced by test_decode_step_has_no_graph_breaks).
    "test_compile.py::test_generate_with_a_compiled_forward_gives_the_eager_tokens": ONE,
    "test_compile.py::test_inductor_compiled_decode_gives_the_eager_tokens": FULL,
    # transformers' common tests: one class, the variant with the most parts (delta rule, window, conv, gate).
    "test_transformers_common.py::PlainLinearTest::*": FULL,
    "test_transformers_common.py::HybridWindowWithSinksTest::*": FULL,
    "test_transformers_common.py::VectorDecayTest::*": FULL,
    "test_transformers_common.py::SoftmaxLayersWithGQATest::*": FULL,
    "test_transformers_common.py::SoftmaxHeadsTest::*": FULL,
    # Training runs beyond those the quick tier keeps (fine-tuning, its checkpoints and resumes, the push after it).
    "test_finetune.py::test_resume_after_sigkill_reproduces_the_loss_curve": FULL,
    "test_ddp.py::test_two_rank_gloo_ddp_*": FULL,
    # Several processes under `accelerate launch` (~20-45 s each): all in the full tier (the quick tier's DDP-free
    # paths of the same stages run in test_finetune.py and test_distill.py).
    "test_distributed.py::test_the_same_model_on_any_number_of_processes": FULL,
    "test_distributed.py::test_fsdp2_*": FULL,
    "test_distributed.py::test_attention_transfer_matches_one_process": FULL,
    "test_distributed.py::test_lora_with_a_kl_teacher_ends_in_a_merged_checkpoint_that_pushes_and_generates": FULL,
    "test_distributed.py::test_multi_node_fsdp2_as_two_machines_on_this_one": FULL,
    "test_distributed.py::test_deepspeed_zero_trains_saves_and_resumes_exactly": FULL,
    "test_distributed.py::test_sharding_engines_refuse_to_merge_lora_before_training": FULL,
    # Tools around the library: lm-eval-harness, the kernel report, the GPU check, the benchmarks.
    "test_lm_eval.py::test_rolling_perplexity_is_the_models_own_loglikelihood": FULL,
    "test_lm_eval.py::test_cloze_accuracy_is_the_argmax_of_the_choices_loglikelihood": FULL,
    "test_lm_eval.py::test_needle_accuracy_is_the_models_own_greedy_passkey_accuracy": FULL,
    "test_lm_eval.py::test_a_model_that_reads_the_key_scores_1_through_the_harness_and_one_that_does_not_0": FULL,
    "test_kernel_report.py::test_kernel_report_dry": FULL,
    "test_kernel_report.py::test_gpu_check_dry_stages": FULL,
    "test_kernel_report.py::test_kernel_report_delta_rule_backward_does_not_spill": FULL,
    "test_kernel_report.py::test_kernel_report_pruned_configs_do_not_spill": FULL,
    "test_benchmarks.py::test_decode_loop_benchmark_times_every_variant_in_turn": ONE,
    "test_benchmarks.py::test_decode_benchmark_compiles_and_batches_generate": FULL,
    "test_delta_rule_ops.py::test_benchmark_script_runs": FULL,
    # The allocator's heap behaviour (a process per case), and the recipes' offline switch (a process per setting).
    "test_host_memory.py::test_a_freed_large_block_stays_in_the_heap_only_when_kept": FULL,
    "test_recipes.py::test_the_demo_and_tour_stay_offline_unless_told_otherwise": ONE,
    # The GPU recipes' four commands on a tiny stand-in of each model (~40-80 s a model on one thread).
    "test_gpu_recipes.py::test_a_models_four_recipes_run_end_to_end_on_a_stand_in": FULL,
    # Softmax heads: every variant's cache, padding, packing and gradient paths stay quick; one variant's generate
    # modes, one Triton backend under the interpreter, the source architectures of one kind; tracing in the full tier.
    "test_softmax_heads.py::test_every_generate_mode_with_the_cache_equals_without": ONE,
    "test_softmax_heads.py::test_the_triton_backend_agrees": ONE,
    "test_softmax_heads.py::test_every_head_restored_is_the_teacher": COVER,
    "test_softmax_heads.py::test_a_model_with_softmax_heads_compiles_without_a_graph_break_and_exports": FULL,
    # A vLLM OpenAI server and a transformers server, each started on 127.0.0.1 (vLLM venv only: make test-vllm).
    "test_vllm.py::test_openai_server_answers_concurrent_clients_as_sequential_ones": FULL,
    "test_transformers_serve.py::test_chat_completion_equals_generate": FULL,
}


def _tier_key(item: pytest.Item) -> str:
    """"file::function" or "file::Class::method": the item's node id without folders or parametrize id."""
    cls = getattr(item, "cls", None)
    return "::".join([item.path.name, *([cls.__name__] if cls else []), getattr(item, "originalname", item.name)])


def _covering_cases(cases: list[pytest.Item]) -> list[pytest.Item]:
    """Greedily, the case with the most parameter values not yet seen, until every value of every parameter is in
    one (ties: the first collected). Values are told apart by repr, the same in every run."""
    params = [case.callspec.params if hasattr(case, "callspec") else {} for case in cases]
    values = [{(name, repr(value)) for name, value in case_params.items()} for case_params in params]
    missing = set().union(*values)
    kept = [cases[0]]
    missing -= values[0]
    while missing:
        best = max(range(len(cases)), key=lambda i: len(values[i] & missing))
        kept.append(cases[best])
        missing -= values[best]
    return kept


@pytest.hookimpl(tryfirst=True)  # before -m / -k deselect: the cases kept never depend on what else is selected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cases = defaultdict(list)  # (rule, test) -> its collected cases, in collection order
    used = set()
    for item in items:
        key = _tier_key(item)
        pattern = next((pattern for pattern in TIERS if fnmatch(key, pattern)), None)
        if pattern is not None:
            used.add(pattern)
            cases[TIERS[pattern], key].append(item)
    for (rule, _), group in cases.items():
        quick = group[:1] if rule == ONE else _covering_cases(group) if rule == COVER else []
        for item in group:
            if item not in quick:
                item.add_marker(pytest.mark.full)
    # When the whole suite is collected, a key that matches no test names a test renamed or moved (or its file is
    # gone): the table must follow it, or a slow test would slip into the quick tier unnoticed. A file collected
    # without items (transformers' common tests skip themselves when not fetched) is no sign of that.
    here = Path(__file__).parent
    whole_suite = not config.getoption("lf", False) and all(  # --lf collects the failures only
        (config.invocation_params.dir / arg).resolve() == here for arg in config.args)
    collected_files = {item.path.name for item in items}
    stale = [pattern for pattern in TIERS if pattern not in used and whole_suite and (
        pattern.split("::")[0] in collected_files or not (here / pattern.split("::")[0]).is_file())]
    # Reported by a test of its own (`stale_tiers`, test_tiers.py), not raised here: an error in this hook ends a
    # pytest-xdist worker, which `make test` runs, without its message.
    config.stash[STALE_TIERS] = stale


@pytest.fixture
def stale_tiers(pytestconfig) -> list[str]:
    """The TIERS keys that match no test of the whole suite (empty when only part of it was collected)."""
    return pytestconfig.stash.get(STALE_TIERS, [])


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


@pytest.fixture(autouse=True)
def _feature_maps_as_built_in():
    """A feature map a test or a docs example registers is gone after it (the registry is the process's)."""
    from hf_linear_attn.feature_maps import FEATURE_MAP_REGISTRY

    built_in = dict(FEATURE_MAP_REGISTRY)
    yield
    FEATURE_MAP_REGISTRY.clear()
    FEATURE_MAP_REGISTRY.update(built_in)


@pytest.fixture
def single_thread():
    """Run torch single-threaded, as the script subprocesses do (same numerics, no oversubscription)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def benchmark_main(single_thread, monkeypatch):
    """`benchmark_main(script, *args)`: benchmarks/SCRIPT's `main(args)` in this process, as its subprocess would run
    (single-threaded, offline; no ~9 s of imports). With MALLOC_MMAP_THRESHOLD_ set, as `run_script` sets it, the
    scripts' `return_freed_memory_to_the_os` does not re-exec the process (pytest's, here), and children they start
    inherit it."""
    from helpers import benchmark_module

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    return lambda script, *args: benchmark_module(script).main(list(args))


@pytest.fixture(scope="session")
def dataset_cache(tmp_path_factory):
    """One `datasets` cache folder for the session, so tokenised data is reused between runs."""
    return tmp_path_factory.mktemp("datasets-cache")
