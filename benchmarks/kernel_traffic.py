"""The memory traffic of a forward + backward pass, counted in Triton's interpreter: the bytes each kernel reads and
writes, and those of the torch operations between the kernels.

Import it only with TRITON_INTERPRET=1 set before any Triton kernel is defined. Inside `count_traffic()`:
- every `tl.load` / `tl.store` / atomic of an interpreted kernel adds the bytes of its unmasked elements to the
  running kernel's row (each program's loads count, also when another program loaded the same bytes: what a GPU
  reads from HBM when its L2 cache keeps nothing between programs);
- every torch operation outside a kernel adds the bytes of its tensor inputs (read) and outputs (written) to its
  own row; views and allocations move no bytes and are not counted.
Kernel launch configurations are not benchmarked: an autotuned kernel runs with the config of the largest block
sizes (the fewest re-reads) among those its autotuner would try.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable, Iterator

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

try:
    import triton
    from triton.runtime import autotuner, interpreter
except ImportError:  # the report says so
    triton = None

# Allocations and metadata: no bytes move (the kernels that fill them count their stores).
NO_TRAFFIC = {"empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "detach", "lift_fresh",
              "_local_scalar_dense", "set_", "alias", "resize_"}


class Traffic:
    """Bytes read and written, per phase ("fwd", "bwd") and per row: "kernel NAME" or "torch OP"."""

    def __init__(self):
        self.phase = "fwd"
        self.kernel: str | None = None  # the interpreted kernel running now
        self.rows: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])

    def add(self, row: str, read: int, written: int) -> None:
        counts = self.rows[(self.phase, row)]
        counts[0] += read
        counts[1] += written

    def total(self, phase: str | None = None) -> int:
        return sum(r + w for (p, _), (r, w) in self.rows.items() if phase in (None, p))


def _tensor_bytes(value) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    elements = min(value.numel(), value.untyped_storage().nbytes() // value.element_size())  # expanded: once
    return elements * value.element_size()


def _all_bytes(values) -> int:
    return sum(_tensor_bytes(v) for v in torch.utils._pytree.tree_leaves(values))


class _CountTorchOps(TorchDispatchMode):
    def __init__(self, traffic: Traffic):
        super().__init__()
        self.traffic = traffic

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.traffic.kernel is None and not func.is_view and name not in NO_TRAFFIC:
            if name == "copy_":  # reads the source only
                read, written = _all_bytes(args[1]), _tensor_bytes(args[0])
            else:
                read, written = _all_bytes((args, kwargs)), _all_bytes(out)
            if read or written:
                self.traffic.add(f"torch {name}", read, written)
        return out


def _widest_config(configs: list) -> list:
    """The config of the largest block sizes (product of its integer meta-parameters), ties to the first."""
    return [max(configs, key=lambda c: math.prod(v for v in c.kwargs.values() if isinstance(v, int)))]


def _tensor_range(*bounds) -> Iterator:
    """`range` in a kernel body, as compiled: the loop index is an int32 scalar tensor (`i.to(tl.int64)` works),
    not the Python int the interpreter gives."""
    bounds = [int(b.handle.data.item()) if isinstance(b, triton.language.tensor) else int(b) for b in bounds]
    for i in range(*bounds):
        yield triton.language.tensor(interpreter.TensorHandle(np.array([i], dtype=np.int32), triton.language.int32),
                                     triton.language.int32)


def _element_bytes(pointers) -> int:
    return pointers.get_element_ty().primitive_bitwidth // 8


@contextlib.contextmanager
def count_traffic() -> Iterator[Traffic]:
    """Count the bytes moved inside the block (see the module docstring); set `.phase` to split them."""
    if triton is None or not triton.knobs.runtime.interpret:
        raise RuntimeError("counting traffic needs triton and TRITON_INTERPRET=1 set before the kernels are defined")
    traffic = Traffic()
    builder = interpreter.InterpreterBuilder
    originals = {name: getattr(builder, name) for name in
                 ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas",
                  "create_descriptor_load", "create_descriptor_store")}
    call, prune = interpreter.GridExecutor.__call__, autotuner.Autotuner.prune_configs

    def load(self, ptrs, mask, *args):
        traffic.add(f"kernel {traffic.kernel}", int(mask.data.sum()) * _element_bytes(ptrs), 0)
        return originals["create_masked_load"](self, ptrs, mask, *args)

    def store(self, ptrs, value, mask, *args):
        traffic.add(f"kernel {traffic.kernel}", 0, int(mask.data.sum()) * _element_bytes(ptrs))
        return originals["create_masked_store"](self, ptrs, value, mask, *args)

    def atomic_rmw(self, op, ptr, val, mask, *args):
        moved = int(mask.data.sum()) * _element_bytes(ptr)
        traffic.add(f"kernel {traffic.kernel}", moved, moved)
        return originals["create_atomic_rmw"](self, op, ptr, val, mask, *args)

    def atomic_cas(self, ptr, *args):
        moved = ptr.data.size * _element_bytes(ptr)
        traffic.add(f"kernel {traffic.kernel}", moved, moved)
        return originals["create_atomic_cas"](self, ptr, *args)

    def uncounted(self, *args):
        raise NotImplementedError("tensor-descriptor loads and stores are not counted: run without TMA")

    def run_kernel(self, *args, **kwargs):
        traffic.kernel = self.fn.__name__
        kernel_globals = self.fn.__globals__
        kernel_globals["range"] = _tensor_range
        try:
            return call(self, *args, **kwargs)
        finally:
            traffic.kernel = None
            del kernel_globals["range"]

    patches = {"create_masked_load": load, "create_masked_store": store, "create_atomic_rmw": atomic_rmw,
               "create_atomic_cas": atomic_cas, "create_descriptor_load": uncounted,
               "create_descriptor_store": uncounted}
    try:
        for name, patch in patches.items():
            setattr(builder, name, patch)
        interpreter.GridExecutor.__call__ = run_kernel
        autotuner.Autotuner.prune_configs = lambda self, kwargs: _widest_config(prune(self, kwargs))
        with _CountTorchOps(traffic):
            yield traffic
    finally:
        for name, original in originals.items():
            setattr(builder, name, original)
        interpreter.GridExecutor.__call__ = call
        autotuner.Autotuner.prune_configs = prune


def forward_backward_traffic(op: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor | None]) -> Traffic:
    """The traffic of `op(**inputs)` (its output [B, T, H, V]) and of its backward from a given output gradient
    (no loss computed, so only the op's own work counts)."""
    out_grad = None
    with count_traffic() as traffic:
        out = op(**inputs)
        traffic.phase = "bwd"
        with torch.utils._python_dispatch._disable_current_modes():
            out_grad = torch.randn_like(out)
        torch.autograd.backward(out, out_grad)
    return traffic
