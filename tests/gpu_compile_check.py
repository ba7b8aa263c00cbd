"""Compiles every Triton kernel specialization that a small workload of the triton backend launches, for a Hopper
GPU (sm_90), on a machine without one. The interpreter accepts code that a GPU compiler rejects (dot blocks < 16,
shapes it cannot lay out...): this catches it on CPU-only CI.

    python tests/gpu_compile_check.py         # bfloat16, one head-dim set: a few dozen kernels
    python tests/gpu_compile_check.py --all   # float16 / bfloat16 / float32, three head-dim sets

Run it WITHOUT TRITON_INTERPRET. Kernel launches are recorded instead of run, so the workload computes nothing.
Prints one line per kernel with its shared memory and exits 1 on any failure, a kernel that needs more shared memory
than a Hopper GPU has (227 KiB) included: such a kernel compiles, but fails at launch.
"""

import argparse
import itertools
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hf_linear_attn import ops_delta_rule_triton, ops_triton
from hf_linear_attn.ops import delta_rule_attention, linear_attention, window_attention

SHARED_MEMORY_KIB = 227  # per thread block on sm_90
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32"}


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the specialization instead of running it."""

    def __init__(self, kernel, seen: dict):
        self.configs, self.prune = getattr(kernel, "configs", []), getattr(kernel, "early_config_prune", None)
        while not isinstance(kernel, triton.runtime.jit.JITFunction):  # unwrap @triton.autotune
            kernel = kernel.fn
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        return self.record

    def record(self, *args, **kwargs):
        bound = dict(zip([p.name for p in self.kernel.params][: len(args)], args, strict=True), **kwargs)
        configs = self.prune(self.configs, bound, **bound) if self.prune else self.configs
        # One compile per distinct set of config constexprs (block sizes), with the first such config's warps.
        by_constexprs = {}
        for config in configs:
            by_constexprs.setdefault(tuple(sorted(config.kwargs.items())), config.num_warps)
        for config_constexprs, num_warps in by_constexprs.items() or [((), 4)]:
            self.record_one({**bound, **dict(config_constexprs)}, num_warps)

    def record_one(self, bound: dict, num_warps: int):
        if "BF16_DOT" in bound:  # what a GPU run chooses (the launchers chose for the interpreter-free CPU)
            first_tensor = next(x for x in bound.values() if isinstance(x, torch.Tensor))
            bound["BF16_DOT"] = first_tensor.dtype == torch.bfloat16
        signature, constexprs = {}, {}
        for param in self.kernel.params:
            value = bound[param.name]
            if param.is_constexpr:
                signature[param.name], constexprs[param.name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = POINTER_TYPES[value.dtype]
            else:
                signature[param.name] = "fp32" if isinstance(value, float) else "i32"
        key = (self.kernel.__name__, tuple(signature.items()), tuple(constexprs.items()), num_warps)
        self.seen.setdefault(key, (self.kernel, signature, constexprs, num_warps))


def record_workload(dtypes: list[torch.dtype], dims: list[tuple[int, int]], normalize_values: list[bool]) -> dict:
    """Every specialization the triton backend launches for these dtypes, (K, V) head dims and normalize values,
    forward and backward (normalize adds no kernel code, only a value column), and those of the delta rule's."""
    seen = {}
    for module in (ops_triton, ops_delta_rule_triton):
        for name in dir(module):
            if name.endswith("_kernel"):
                setattr(module, name, Recorder(getattr(module, name), seen))
        module.unsupported_inputs = lambda *_, **__: None  # CPU tensors stand in for CUDA ones
    batch, length, heads = 1, 100, 2
    for dtype, (key_dim, value_dim) in itertools.product(dtypes, dims):
        for decay, normalize in itertools.product((None, "scalar", "vector"), normalize_values):
            q, k = (torch.randn(batch, length, heads, key_dim, dtype=dtype, requires_grad=True) for _ in range(2))
            v = torch.randn(batch, length, heads, value_dim, dtype=dtype, requires_grad=True)
            shape = {None: None, "scalar": (batch, length, heads), "vector": (batch, length, heads, key_dim)}[decay]
            log_decay = None if shape is None else (-torch.rand(shape)).requires_grad_()
            state = torch.zeros(batch, heads, key_dim, value_dim + int(normalize), requires_grad=True)
            o, final = linear_attention(q, k, v, log_decay, normalize=normalize, initial_state=state,
                                        output_final_state=True, backend="triton")
            (o.float().sum() + final.sum()).backward()
        tensors = [torch.randn(batch, length, heads, dim, dtype=dtype, requires_grad=True)
                   for dim in (key_dim, key_dim, value_dim, 16, 16)]
        gate = torch.zeros(heads, dtype=dtype, requires_grad=True)
        o, _ = window_attention(*tensors, gate, window_size=8, num_sink_tokens=2, backend="triton")
        o.float().sum().backward()
        for decay in (False, True) if key_dim <= ops_delta_rule_triton.MAX_KEY_DIM else ():
            q = torch.randn(batch, length, heads, key_dim, dtype=dtype, requires_grad=True)
            k = torch.zeros(batch, length, heads, key_dim, dtype=dtype, requires_grad=True)  # unit norm not needed
            v = torch.randn(batch, length, heads, value_dim, dtype=dtype, requires_grad=True)
            beta = torch.rand(batch, length, heads, dtype=dtype, requires_grad=True)
            log_decay = (-torch.rand(batch, length, heads)).requires_grad_() if decay else None
            state = torch.zeros(batch, heads, key_dim, value_dim, requires_grad=True)
            o, final = delta_rule_attention(q, k, v, beta, log_decay, initial_state=state, output_final_state=True,
                                            backend="triton")
            (o.float().sum() + final.sum()).backward()
    return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="all input dtypes and three head-dim sets")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    if args.all:
        seen = record_workload([torch.bfloat16, torch.float16, torch.float32], [(128, 128), (80, 47), (256, 256)],
                               [False, True])
    else:
        seen = record_workload([torch.bfloat16], [(80, 47)], [False])
    target, failures = GPUTarget("cuda", 90, 32), 0
    for (name, *_), (kernel, signature, constexprs, num_warps) in seen.items():
        modes = {key: value for key, value in constexprs.items() if key in ("DECAY", "REVERSE", "TRANSPOSE", "D", "K")}
        try:
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target,
                                      options={"num_warps": num_warps, "num_stages": 2})
            shared = compiled.metadata.shared / 1024
            if shared > SHARED_MEMORY_KIB:
                raise RuntimeError(f"needs {shared:.0f} KiB of shared memory, sm_90 has {SHARED_MEMORY_KIB} KiB")
            print(f"ok   {name} {modes} {num_warps} warps, shared {shared:.0f} KiB", flush=True)
        except Exception as error:  # report every failing kernel, not only the first
            failures += 1
            print(f"FAIL {name} {modes}\n{error}", flush=True)
    print(f"{len(seen)} kernels compiled for sm_90, {failures} failed")
    return int(failures > 0)


if __name__ == "__main__":
    sys.exit(main())
