"""Pytest fixtures and session setup. Everything runs offline on CPU with tiny models.

Fixtures are used by name (never imported); plain helpers are in `helpers.py`.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter. triton reads this when @triton.jit decorates the
# kernels, i.e. when hf_linear_attn's Triton modules (ops_triton_*) are imported: it must be set before the package
# is (test modules import it after this file has run).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


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
