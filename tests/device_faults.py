"""Pytest hooks (imported by conftest.py): a GPU fault ends its pytest-xdist worker.

A CUDA error such as an illegal memory access leaves the process's CUDA context unusable, so every later test in that
process fails too: on the first GPU run one faulting test took the rest of its worker's share with it (416 of 641
Triton tests errored). Under pytest-xdist (benchmarks/gpu_check.py runs the Triton tests so) a worker whose test
raised one exits once that test is reported; xdist then reports the test as having crashed the worker, starts a
fresh worker and hands it the tests the old one had left. Outside xdist nothing changes.
"""

import os

# What CUDA errors look like from torch (torch.AcceleratorError, a RuntimeError) and from a Triton launch.
DEVICE_FAULT_MARKS = ("CUDA error", "Triton Error [CUDA]")
_faulted = False


def is_device_fault(error: BaseException) -> bool:
    """Whether `error` is a CUDA error, after which the process's device context cannot be trusted."""
    return isinstance(error, RuntimeError) and any(mark in str(error) for mark in DEVICE_FAULT_MARKS)


def pytest_runtest_makereport(item, call):
    # Returns None: pytest's own implementation still makes the report.
    global _faulted
    if call.excinfo is not None and is_device_fault(call.excinfo.value):
        _faulted = True


def pytest_runtest_logfinish(nodeid, location):
    # The test's reports went out (synchronously) as each phase ended; its protocol is not marked complete, so xdist
    # names this test as the one that crashed the worker, and gives its remaining tests to a fresh one.
    if _faulted and os.environ.get("PYTEST_XDIST_WORKER"):
        os._exit(3)
