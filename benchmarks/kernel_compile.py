"""Every Triton kernel specialization the triton backend launches, recorded on CPU and compiled for a Hopper GPU
(sm_90) without one: the library behind benchmarks/gpu_compile_check.py and benchmarks/kernel_report.py.

Import it WITHOUT TRITON_INTERPRET (interpreted kernels cannot be compiled). `record_workload` replaces the kernels
of every Triton module (`TRITON_MODULES`: hf_linear_attn's ops_triton_*) by recorders for the rest of the process:
the workload computes nothing.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import itertools
import pkgutil
import re
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import hf_linear_attn
from hf_linear_attn import ops_triton_common, ops_triton_decode, ops_triton_delta_rule
from hf_linear_attn.ops import delta_rule_attention, linear_attention, window_attention

SHARED_MEMORY_KIB = 227  # per thread block on sm_90
HOPPER = GPUTarget("cuda", 90, 32)
TRITON_MODULES = [importlib.import_module(f"hf_linear_attn.{module.name}")
                  for module in pkgutil.iter_modules(hf_linear_attn.__path__) if module.name.startswith("ops_triton_")]
POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int32: "*i32",
                 torch.bool: "*i1"}


@dataclass
class Specialization:
    """One kernel as launched: its argument types, its constexpr values, and the autotune configs it may run with
    ([None] when the kernel is not autotuned)."""

    kernel: triton.runtime.jit.JITFunction
    signature: dict
    constexprs: dict
    configs: list


class Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the specialization instead of running it."""

    def __init__(self, kernel, seen: dict):
        self.configs = list(getattr(kernel, "configs", None) or [None])  # @triton.autotune's, else one default
        self.prune = getattr(kernel, "early_config_prune", None)  # what the autotuner drops for given arguments
        while not isinstance(kernel, triton.runtime.jit.JITFunction):  # unwrap @triton.autotune
            kernel = kernel.fn
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        return self.record

    def record(self, *args, **kwargs):
        bound = dict(zip([p.name for p in self.kernel.params][: len(args)], args, strict=True), **kwargs)
        if "BF16_DOT" in bound:  # what a GPU run chooses (the launchers chose for the interpreter-free CPU)
            first_tensor = next(x for x in bound.values() if isinstance(x, torch.Tensor))
            bound["BF16_DOT"] = first_tensor.dtype == torch.bfloat16
        signature, constexprs = {}, {}
        for param in self.kernel.params:
            if param.name not in bound:  # a meta-parameter that each autotune config sets
                continue
            value = bound[param.name]
            if param.is_constexpr:
                signature[param.name], constexprs[param.name] = "constexpr", value
            elif isinstance(value, torch.Tensor):
                signature[param.name] = POINTER_TYPES[value.dtype]
            else:
                signature[param.name] = "fp32" if isinstance(value, float) else "i32"
        configs = self.prune(self.configs, bound, **bound) if self.prune else self.configs
        key = (self.kernel.__name__, tuple(signature.items()), tuple(constexprs.items()))
        self.seen.setdefault(key, Specialization(self.kernel, signature, constexprs, configs))


def record_workload(dtypes: list[torch.dtype], dims: list[tuple[int, int]], normalize_values: list[bool]) -> dict:
    """Every specialization the triton backend launches for these dtypes, (K, V) head dims and normalize values,
    forward and backward, those of the window and delta-rule ops, and the decode steps: {key: Specialization}."""
    seen = {}
    for module in TRITON_MODULES:
        for name in dir(module):
            if name.endswith("_kernel"):
                setattr(module, name, Recorder(getattr(module, name), seen))
    ops_triton_common.unsupported_inputs = lambda *_, **__: None  # CPU tensors stand in for CUDA ones
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
        for decay in (False, True) if key_dim <= ops_triton_delta_rule.MAX_KEY_DIM else ():
            q = torch.randn(batch, length, heads, key_dim, dtype=dtype, requires_grad=True)
            k = torch.zeros(batch, length, heads, key_dim, dtype=dtype, requires_grad=True)  # unit norm not needed
            v = torch.randn(batch, length, heads, value_dim, dtype=dtype, requires_grad=True)
            beta = torch.rand(batch, length, heads, dtype=dtype, requires_grad=True)
            log_decay = (-torch.rand(batch, length, heads)).requires_grad_() if decay else None
            state = torch.zeros(batch, heads, key_dim, value_dim, requires_grad=True)
            o, final = delta_rule_attention(q, k, v, beta, log_decay, initial_state=state, output_final_state=True,
                                            backend="triton")
            (o.float().sum() + final.sum()).backward()
        record_decode_steps(dtype, key_dim, value_dim, normalize_values)
    return seen


def record_decode_steps(dtype: torch.dtype, key_dim: int, value_dim: int, normalize_values: list[bool]) -> None:
    """One decode token of linear attention (K = key_dim features) and of the window hybrid (head dim key_dim,
    K features, values of value_dim) with each decay mode, against a cache of 10 slots, with and without pads."""
    batch, heads, slots = 2, 2, 10
    q = torch.randn(batch, 1, heads, key_dim, dtype=dtype)
    v = torch.randn(batch, 1, heads, value_dim, dtype=dtype)
    keys = torch.randn(batch, slots, heads, key_dim, dtype=dtype)
    values = torch.randn(batch, slots, heads, value_dim, dtype=dtype)
    mask = torch.ones(batch, slots, dtype=torch.bool)
    for decay in (None, (batch, 1, heads), (batch, 1, heads, key_dim)):
        log_decay = None if decay is None else -torch.rand(decay)
        for normalize in normalize_values:
            state = torch.zeros(batch, heads, key_dim, value_dim + int(normalize))
            ops_triton_decode.triton_linear_decode_step(q, q, v, log_decay, state, scale=1.0, normalize=normalize)
        state = torch.zeros(batch, heads, key_dim, value_dim + 1)
        for real in (None, mask[:, :1]):
            ops_triton_decode.triton_window_decode_step(q, q, log_decay, state, keys, values, mask, q, v, mask[:, :1],
                                                        torch.zeros(heads, dtype=dtype), real, scale=1.0)


@dataclass
class Compiled:
    """What ptxas reports for one kernel built for sm_90 (bytes; registers per thread)."""

    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int


def compile_for_hopper(spec: Specialization, config: triton.Config | None) -> Compiled:
    """Build `spec` with `config`'s meta-parameters, warps and stages (None: 4 warps, 2 stages) for sm_90, in a
    fresh cache (a cached kernel skips ptxas, whose log gives registers and spills). Raises when the kernel needs
    more shared memory than sm_90 has: such a kernel compiles, but fails at launch."""
    constexprs, options = dict(spec.constexprs), {"num_warps": 4, "num_stages": 2}
    signature = dict(spec.signature)
    if config is not None:
        constexprs.update(config.kwargs)
        signature.update(dict.fromkeys(config.kwargs, "constexpr"))
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    signature = {p.name: signature[p.name] for p in spec.kernel.params}  # in parameter order
    log = io.StringIO()
    with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(log):
        knobs = triton.knobs
        with knobs.cache.scope(), knobs.nvidia.scope():
            knobs.cache.dir, knobs.nvidia.dump_ptxas_log = cache, True
            compiled = triton.compile(ASTSource(fn=spec.kernel, signature=signature, constexprs=constexprs),
                                      target=HOPPER, options=options)
    text = log.getvalue()
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    registers = re.search(r"Used (\d+) registers", text)
    if spills is None or registers is None:
        raise RuntimeError(f"no ptxas log for {spec.kernel.__name__}:\n{text[-2000:]}")
    shared = compiled.metadata.shared
    if shared > SHARED_MEMORY_KIB * 1024:
        raise RuntimeError(f"needs {shared / 1024:.0f} KiB of shared memory, sm_90 has {SHARED_MEMORY_KIB} KiB")
    return Compiled(int(registers[1]), int(spills[1]), int(spills[2]), shared)


def modes(spec: Specialization) -> dict:
    """The constexprs that tell a kernel's specializations apart in a one-line listing."""
    return {key: value for key, value in spec.constexprs.items()
            if key in ("DECAY", "REVERSE", "TRANSPOSE", "HAS_STATE", "NORM", "NORMALIZE", "HAS_PADS", "D", "K", "V",
                       "BLOCK_K", "BLOCK_V")}
