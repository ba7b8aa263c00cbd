"""Pytest fixtures and session setup. Everything runs offline on CPU with tiny models.

Fixtures are used by name (never imported); plain helpers are in `helpers.py`.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter. triton reads this when @triton.jit decorates the
# kernels, i.e. when hf_linear_attn.ops_triton is imported: it must be set before the package is (test modules
# import it after this file has run).
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


@pytest.fixture(scope="session")
def dataset_cache(tmp_path_factory):
    """One `datasets` cache folder for the session, so tokenised data is reused between runs."""
    return tmp_path_factory.mktemp("datasets-cache")
