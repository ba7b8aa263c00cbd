"""tests/device_faults.py: a CUDA error ends its pytest-xdist worker, whose remaining tests go to a fresh one."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from device_faults import is_device_fault

pytest.importorskip("xdist")


def test_cuda_errors_are_device_faults():
    assert is_device_fault(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert is_device_fault(RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"))
    assert not is_device_fault(RuntimeError("expected all tensors to be on the same device"))
    assert not is_device_fault(AssertionError("CUDA error"))


@pytest.mark.parametrize("hooked", [True, False])
def test_a_faulting_worker_is_replaced_and_the_rest_still_run(tmp_path, hooked):
    """One worker, a fault in the first of three tests, each of which fails in a faulted process: with the hooks the
    faulting test is reported as crashing the worker and the other two pass on its replacement; without them, they
    fail in the faulted one."""
    (tmp_path / "conftest.py").write_text(
        "from device_faults import pytest_runtest_logfinish, pytest_runtest_makereport\n" if hooked else "")
    (tmp_path / "test_cases.py").write_text(textwrap.dedent("""
        faulted = []

        def test_fault():
            faulted.append(True)
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def test_after_1():
            assert not faulted

        def test_after_2():
            assert not faulted
    """))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    run = subprocess.run([sys.executable, "-m", "pytest", "-n", "1", "-p", "no:cacheprovider", "-p", "no:randomly"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    summary = run.stdout.strip().splitlines()[-1]
    if hooked:
        assert "replacing crashed worker gw0" in run.stdout + run.stderr
        assert "2 passed" in summary and "test_fault" in run.stdout, run.stdout
    else:
        assert "3 failed" in summary, run.stdout
