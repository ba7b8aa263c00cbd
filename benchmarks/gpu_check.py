"""One-shot GPU check (≤ 10 minutes on an H200): every measurement the project wants from its first GPU, in one
output folder. Each stage runs in its own process (`python -m benchmarks.gpu_check --stage_result FILE`), time-boxed:
a stage that fails or runs over is recorded, with its output, and the next one runs.

Stages:
  triton_tests  the Triton test modules, their kernels compiled on the GPU (pytest)
  kernels       the kernel benchmark (benchmarks/kernel_timing.py): ours vs fla vs SDPA-flash on the four shapes and
                T 1K ... 64K (ms, TFLOP/s, % of bf16 peak); rows measured before a time-out are kept
  decode        ms per decode token after growing contexts, linear model vs Llama (SDPA, dynamic cache)
  decode_compiled  the same with compiled steps on CUDA graphs: the window hybrid on its fixed-shape cache vs Llama
                on a static cache; rows measured before a time-out are kept
  train         training tokens/s (forward + backward + AdamW, bf16) of a ~340M linear model vs the same Llama
  fsdp          a few FSDP2 (fully_shard) training steps of the linear model, one process
  deepspeed     a few DeepSpeed ZeRO-2 steps, one process (skipped with a line when deepspeed is not installed)

    python -m benchmarks.gpu_check --wheels build/wheels     # make gpu-check
    python -m benchmarks.gpu_check --dry                     # every stage on CPU at toy sizes (CI)

It runs from the root of a checkout installed in place (`pip install --no-deps -e .`); --wheels: a folder of wheels
installed (pip --no-index --no-deps --target) into a temporary folder on the stages' PYTHONPATH, for a GPU machine
without network (`make fla-wheels` downloads fla's). The versions of the packages the stages use are recorded
first. Writes, to --output_dir: gpu_check.json (versions; every stage's status, seconds and rows),
gpu_check.log (every stage's output), gpu_check.png (decode and train) and the kernel benchmark's
kernels.{md,json,png}: 6 files, so that a device run's output folder brings all of them back.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser

from hf_linear_attn.configuration_linear_attention import InputError
from hf_linear_attn.training.command_line import exit_on_bad_input, parse_dataclasses

ROOT = Path(__file__).resolve().parents[1]
TRITON_TESTS = ["tests/test_triton_ops.py", "tests/test_window_ops.py", "tests/test_delta_rule_triton.py"]
STAGES = ("triton_tests", "kernels", "decode", "decode_compiled", "train", "fsdp", "deepspeed")
# Seconds each stage may take on the GPU, its process's start included; --budget_s bounds their sum.
TIME_BOX = {"triton_tests": 480, "kernels": 130, "decode": 45, "decode_compiled": 60, "train": 50, "fsdp": 25,
            "deepspeed": 25}
DRY_TIME_BOX = 120
# The packages the stages use (distribution names), whose versions gpu_check.json records.
PACKAGES = ("torch", "triton", "transformers", "accelerate", "safetensors", "huggingface_hub", "einops", "fla-core",
            "flash-linear-attention", "deepspeed", "matplotlib", "pytest")


@dataclass
class GpuCheckArguments:
    stages: list[str] = field(default_factory=lambda: list(STAGES), metadata={"help": "Stages to run, in order."})
    wheels: str = field(default="", metadata={"help": "A folder of wheels to put on the stages' path."})
    dry: bool = field(default=False, metadata={"help": "Every stage on CPU at toy sizes: the script cannot rot."})
    budget_s: float = field(default=float(sum(TIME_BOX.values())), metadata={
        "help": "Seconds for all the stages: each gets its own time box or what is left of this, the smaller."})
    output_dir: str = "outputs/gpu_check"
    stage_result: str = field(default="", metadata={
        "help": "Internal: run the one stage of --stages in this process and write its result (JSON) to this file, "
                "as each stage's own process does."})


@dataclass
class ModelSize:
    """The dimensions of the linear model and of its Llama twin."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    vocab_size: int


SIZE_340M = ModelSize(1024, 24, 8, 2816, 32000)  # head dim 128; ~340M parameters (embeddings tied or not)
SIZE_TOY = ModelSize(32, 2, 2, 64, 128)
DECODE_SIZE = ModelSize(1024, 8, 8, 2816, 32000)  # the decode stages' models: 8 layers of the 340M's width


# The window hybrid of a converted model (hedgehog features, window 64 + 4 sinks), as `make demo` converts SmolLM2.
HYBRID = {"feature_map": "hedgehog", "feature_dim": 32, "window_size": 64, "num_sink_tokens": 4}


def build(kind: str, size: ModelSize, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A randomly initialised linear-attention model ("linear": elu; "hybrid": the window hybrid; triton kernels on a
    GPU) or Llama with SDPA."""
    from transformers import LlamaConfig, LlamaForCausalLM  # here: a stage's process imports what it uses

    import hf_linear_attn

    torch.manual_seed(0)
    dims = asdict(size) | {"max_position_embeddings": 1 << 17}
    if kind == "llama":
        config = LlamaConfig(**dims, attn_implementation="sdpa")
        return LlamaForCausalLM(config).to(device, dtype)
    options = HYBRID if kind == "hybrid" else {"feature_map": "elu"}
    config = hf_linear_attn.LinearAttentionConfig(**dims, **options)
    return hf_linear_attn.LinearAttentionForCausalLM(config).to(device, dtype)


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its cache by: `cache` (transformers ≥ 5.24, which deprecates the other)
    or `past_key_values` (older releases): the GPU machine runs its own transformers version."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def returned_cache(output):
    """The cache a forward returned (the output field is named as the forward's keyword)."""
    from hf_linear_attn.modeling_linear_attention import OUTPUT_CACHE_FIELD

    return getattr(output, OUTPUT_CACHE_FIELD)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def stage_decode(dry: bool, device: str) -> dict:
    """ms per greedy decode token after a prefilled context, batch 1, eager: the linear model and the window hybrid
    (their decode steps on the fused kernels of `ops_triton_decode`), the hybrid again with its torch step (the
    kernels' twin: what they gain) and Llama."""
    from hf_linear_attn import modeling_linear_attention

    size = SIZE_TOY if dry else DECODE_SIZE
    contexts, steps = ([16, 80], 3) if dry else ([1024, 4096, 16384, 65536], 24)
    rows = []
    window_step = modeling_linear_attention.window_attention_step
    for kind in ("linear", "hybrid", "hybrid torch step", "llama"):
        model = build(kind.split()[0], size, device, torch.float32 if dry else torch.bfloat16).eval()
        keyword = cache_keyword(model)
        modeling_linear_attention.window_attention_step = (
            functools.partial(window_step, backend="torch") if "torch" in kind else window_step)
        for context in contexts:
            ids = torch.randint(3, size.vocab_size, (1, context), device=device,
                                generator=torch.Generator(device).manual_seed(context))
            with torch.no_grad():
                out = model(input_ids=ids, use_cache=True)
                cache, next_id = returned_cache(out), out.logits[:, -1:].argmax(-1)
                times = []
                for _ in range(steps + 2):  # two warm-up steps
                    synchronize(device)
                    start = time.perf_counter()
                    out = model(input_ids=next_id, use_cache=True, **{keyword: cache})
                    next_id = out.logits[:, -1:].argmax(-1)
                    synchronize(device)
                    times.append(time.perf_counter() - start)
            rows.append({"model": kind, "context": context, "ms_per_token": 1000 * statistics.median(times[2:])})
            print(f"  decode {kind:<17} context {context:>6}: {rows[-1]['ms_per_token']:.2f} ms/token", flush=True)
        del model
    return {"rows": rows}


def stage_decode_compiled(dry: bool, device: str, save: Callable[[dict], None]) -> dict:
    """ms per greedy decode token with the step compiled as transformers' compiled generation runs it (inductor,
    "reduce-overhead": CUDA graphs), batch 1, after a prefilled context: the window hybrid on its fixed-shape cache
    (one graph serves every context) against Llama on a static cache of the context's length (a graph per length).
    Each row also says whether the compiled steps chose the eager steps' tokens (in bf16 on random weights a near tie
    may go either way: the hybrid's eager step runs the fused kernels); `save` keeps the rows measured so far (the
    compiles take most of the stage's time)."""
    from transformers import StaticCache

    size = SIZE_TOY if dry else DECODE_SIZE
    contexts, steps = ([16, 80], 3) if dry else ([4096, 16384, 65536], 24)
    options = {"backend": "eager"} if dry else {"mode": "reduce-overhead"}  # (dry: the capture without codegen)
    rows = []
    for kind in ("hybrid", "llama"):
        model = build(kind, size, device, torch.float32 if dry else torch.bfloat16).eval()
        step = torch.compile(model, fullgraph=True, dynamic=False, **options)  # as transformers' CompileConfig
        keyword = cache_keyword(model)
        for context in contexts:
            ids = torch.randint(3, size.vocab_size, (1, context), device=device,
                                generator=torch.Generator(device).manual_seed(context))
            row = {"model": f"{kind} compiled", "context": context}
            try:
                with torch.no_grad():
                    tokens = {}
                    for variant in ("eager", "compiled"):
                        cache = None
                        if kind == "llama" and variant == "compiled":
                            cache = StaticCache(config=model.config, max_cache_len=context + steps + 2)
                        out = model(input_ids=ids, use_cache=True, **{keyword: cache})  # the prefill, eager
                        cache, next_id = returned_cache(out), out.logits[:, -1:].argmax(-1)
                        tokens[variant], times = [], []
                        for i in range(steps + 2):  # two warm-up steps (the compile, the graph's capture)
                            position = torch.full((1, 1), context + i, device=device)
                            synchronize(device)
                            start = time.perf_counter()
                            out = (step if variant == "compiled" else model)(
                                input_ids=next_id, position_ids=position, use_cache=True, **{keyword: cache})
                            next_id = out.logits[:, -1:].argmax(-1)
                            synchronize(device)
                            times.append(time.perf_counter() - start)
                            tokens[variant].append(int(next_id))
                        row[f"{variant}_ms_per_token"] = 1000 * statistics.median(times[2:])
                    row["ms_per_token"] = row.pop("compiled_ms_per_token")
                    row["same_tokens_as_eager"] = tokens["compiled"] == tokens["eager"]
            except Exception as error:  # noqa: BLE001 - recorded in the row; the next context still runs
                row["error"] = f"{type(error).__name__}: {error}"
            rows.append(row)
            save({"rows": rows})
            print(f"  decode {row['model']:<16} context {context:>6}: "
                  + (f"{row['ms_per_token']:.2f} ms/token (eager {row['eager_ms_per_token']:.2f})"
                     if "error" not in row else row["error"]), flush=True)
        del model, step
        torch._dynamo.reset()
    return {"rows": rows}


def train_steps(model: torch.nn.Module, optimizer, vocab_size: int, batch: int, length: int, steps: int,
                device: str) -> float:
    """Median seconds of `steps` training steps (after one warm-up) on random tokens."""
    ids = torch.randint(0, vocab_size, (batch, length), device=device)
    times = []
    for _ in range(steps + 1):
        synchronize(device)
        start = time.perf_counter()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def stage_train(dry: bool, device: str) -> dict:
    """Training tokens/s of the ~340M linear model and its Llama twin (SDPA), bf16 weights, AdamW."""
    size, lengths, steps = (SIZE_TOY, [32], 2) if dry else (SIZE_340M, [2048, 8192], 4)
    rows = []
    for kind in ("linear", "llama"):
        model = build(kind, size, device, torch.float32 if dry else torch.bfloat16).train()
        parameters = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for length in lengths:
            seconds = train_steps(model, optimizer, size.vocab_size, 1, length, steps, device)
            rows.append({"model": kind, "parameters": parameters, "seq_len": length, "step_s": seconds,
                         "tokens_per_s": length / seconds})
            print(f"  train {kind:<6} ({parameters / 1e6:.0f}M) seq {length:>5}: {length / seconds:,.0f} tokens/s",
                  flush=True)
        del model, optimizer
    llama = {r["seq_len"]: r["tokens_per_s"] for r in rows if r["model"] == "llama"}
    for r in rows:
        r["vs_llama"] = r["tokens_per_s"] / llama[r["seq_len"]]
    return {"rows": rows}


def single_process_group(device: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    torch.distributed.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)


def stage_fsdp(dry: bool, device: str) -> dict:
    """A few FSDP2 steps of the linear model, every decoder layer and the whole model sharded (one process)."""
    from torch.distributed.fsdp import fully_shard

    size, length = (SIZE_TOY, 32) if dry else (ModelSize(1024, 8, 8, 2816, 32000), 2048)
    single_process_group(device)
    model = build("linear", size, device, torch.float32 if dry else torch.bfloat16).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    seconds = train_steps(model, optimizer, size.vocab_size, 1, length, 3, device)
    torch.distributed.destroy_process_group()
    print(f"  fsdp: {length / seconds:,.0f} tokens/s", flush=True)
    return {"rows": [{"seq_len": length, "step_s": seconds, "tokens_per_s": length / seconds}]}


def stage_deepspeed(dry: bool, device: str) -> dict:
    """A few DeepSpeed ZeRO-2 steps of the linear model (one process), when deepspeed is installed."""
    try:
        import deepspeed
    except ImportError:
        print("  deepspeed is not installed: stage skipped", flush=True)
        return {"skipped": "deepspeed is not installed"}
    size, length = (SIZE_TOY, 32) if dry else (ModelSize(1024, 8, 8, 2816, 32000), 2048)
    single_process_group(device)
    model = build("linear", size, device, torch.float32)
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}, "bf16": {"enabled": not dry},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ids = torch.randint(0, size.vocab_size, (1, length), device=device)
    times = []
    for _ in range(4):
        synchronize(device)
        start = time.perf_counter()
        engine.backward(engine(input_ids=ids, labels=ids, use_cache=False).loss)
        engine.step()
        synchronize(device)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times[1:])
    print(f"  deepspeed: {length / seconds:,.0f} tokens/s", flush=True)
    return {"rows": [{"seq_len": length, "step_s": seconds, "tokens_per_s": length / seconds}]}


def stage_triton_tests(dry: bool) -> dict:
    """The Triton test modules under pytest, kernels compiled (a dry run collects them only: the interpreter runs
    them in the ordinary test suite). Compiling is the slow part and runs on the CPU: with pytest-xdist the tests
    spread over up to 12 processes sharing the GPU. Each test's outcome is printed as it ends (-v), so a stage cut
    off by its time box still says which tests failed. Kernels launch synchronously (CUDA_LAUNCH_BLOCKING), so a
    fault is raised at the launch that made it, and a worker that saw one is replaced (tests/device_faults.py).
    Failing tests fail the stage."""
    import pytest

    if not dry:
        os.environ["CUDA_LAUNCH_BLOCKING"] = "1"  # read when CUDA initialises: in the workers, which inherit it
    workers = min(12, os.cpu_count() or 1)
    parallel = [] if dry or workers < 2 or importlib.util.find_spec("xdist") is None else ["-n", str(workers)]
    code = pytest.main(["-v", "--tb=short", "-p", "no:cacheprovider", *parallel, *(["--co", "-q"] if dry else []),
                        *(str(ROOT / module) for module in TRITON_TESTS)])
    if code != 0:
        raise SystemExit(int(code))
    return {}


def stage_kernels(dry: bool, out: Path, save: Callable[[dict], None]) -> dict:
    """The kernel benchmark, its kernels.{md,json,png} in `out`; `save` keeps the rows measured so far."""
    from benchmarks.kernel_timing import KernelBenchmarkArguments, benchmark, report

    args = KernelBenchmarkArguments(dry_run=dry, output_dir=str(out))
    rows = benchmark(args, on_row=lambda rows: save({"rows": rows}))
    report(rows, args)
    return {"rows": rows}


def stage_process(name: str, dry: bool, out: str, result_path: str) -> None:
    """The body of a stage's process: its result as JSON into `result_path`, rewritten whenever the stage saves a
    partial one."""

    def save(result: dict) -> None:
        partial = Path(result_path + ".partial")
        partial.write_text(json.dumps(result))
        partial.replace(result_path)  # whole, even when the process is stopped while writing

    device = "cpu" if dry else "cuda"
    if name == "triton_tests":
        result = stage_triton_tests(dry)
    elif name == "kernels":
        result = stage_kernels(dry, Path(out), save)
    elif name == "decode_compiled":
        result = stage_decode_compiled(dry, device, save)
    else:
        result = {"decode": stage_decode, "train": stage_train, "fsdp": stage_fsdp,
                  "deepspeed": stage_deepspeed}[name](dry, device)
    save(result)


def run_stage(name: str, dry: bool, out: Path, time_box: float, logs: Path) -> tuple[dict, str]:
    """Run stage `name` in its own process for at most `time_box` seconds: its record (status "ok", "failed" or
    "timed out", seconds, the stage's result, and the end of its output when not ok) and its whole output (Python's
    and the libraries')."""
    log_path, result_path = logs / f"{name}.log", logs / f"{name}.json"
    command = [sys.executable, "-m", "benchmarks.gpu_check", "--stages", name, "--output_dir", str(out),
               "--stage_result", str(result_path), *(["--dry"] if dry else [])]
    start = time.perf_counter()
    with open(log_path, "ab") as log:
        # Unbuffered, as a terminal would show it: a stage stopped at its time box keeps its output to that point.
        # A dry kernels stage runs the kernels in Triton's interpreter, which hf_linear_attn chooses when it is
        # imported (this module imports it first thing): set in the process's environment from its start.
        interpret = {"TRITON_INTERPRET": "1"} if dry and name == "kernels" else {}
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                   env=dict(os.environ, PYTHONUNBUFFERED="1", **interpret))
    record = {"time_box_s": time_box}
    try:
        process.wait(time_box)
    except subprocess.TimeoutExpired:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        record["status"] = "timed out"
    else:
        record["status"] = "ok" if process.returncode == 0 else "failed"
        record["exit_code"] = process.returncode
    record["seconds"] = time.perf_counter() - start
    if result_path.exists():  # the result, or what a stage stopped part-way saved
        record.update(json.loads(result_path.read_text()))
        failed_rows = sum("error" in row for row in record.get("rows", []))
        if failed_rows:  # measurements that raised (recorded in their rows) while the stage went on
            record["failed_rows"] = failed_rows
    output = log_path.read_text(errors="replace") if log_path.exists() else ""
    if name == "triton_tests":
        record["summary"] = (output.strip().splitlines() or [""])[-1]
    if record["status"] != "ok":
        record["output_tail"] = output[-4000:]
    return record, output


def install_wheels(folder: str, site: Path) -> None:
    """pip-install the wheels of `folder` into `site` (no index, no dependencies)."""
    wheels = sorted(str(w) for w in Path(folder).glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--target", str(site), *wheels], check=True)


def versions(paths: list[str]) -> dict:
    """{distribution: version, or "not installed"} for the packages the stages use, found in `paths` (the stages'
    PYTHONPATH) or where this process finds them."""
    found = {}
    for name in PACKAGES:
        distribution = next(importlib.metadata.distributions(name=name, path=[*paths, *sys.path]), None)
        found[name] = distribution.version if distribution else "not installed"
    return found


def check_arguments(args: GpuCheckArguments) -> None:
    """Raise ValueError naming the argument for a check that cannot run, before anything is written."""
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        raise InputError(f"unknown stages {unknown}; the stages are {list(STAGES)}")
    if args.wheels and not list(Path(args.wheels).glob("*.whl")):
        raise InputError(f"--wheels {args.wheels}: no .whl files there (make fla-wheels writes build/wheels)")
    if not args.dry and not torch.cuda.is_available():
        raise InputError("gpu_check.py needs a CUDA GPU (or --dry on CPU)")
    if args.stage_result and len(args.stages) != 1:
        raise InputError(f"--stage_result runs one stage, not {args.stages}")


def main(argv: list[str] | None = None) -> int:
    (args,) = parse_dataclasses(HfArgumentParser(GpuCheckArguments), argv)
    with exit_on_bad_input():
        check_arguments(args)
    if args.stage_result:
        stage_process(args.stages[0], args.dry, args.output_dir, args.stage_result)
        return 0
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        site, logs = Path(tmp) / "site", Path(tmp) / "logs"
        logs.mkdir()
        if args.wheels:
            install_wheels(args.wheels, site)
        # What the stages' processes inherit: the wheels and the checkout on their path, kernels compiled.
        paths = [str(site), str(ROOT)] if args.wheels else [str(ROOT)]
        os.environ["PYTHONPATH"] = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
        os.environ.pop("TRITON_INTERPRET", None)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        summary = {"device": "cpu (dry)" if args.dry else torch.cuda.get_device_name(), "versions": versions(paths),
                   "stages": {}}
        print(f"{summary['device']}; " + ", ".join(f"{k} {v}" for k, v in summary["versions"].items()), flush=True)
        deadline = time.perf_counter() + args.budget_s
        with open(out / "gpu_check.log", "w") as full_log:
            for name in args.stages:
                time_box = round(min(DRY_TIME_BOX if args.dry else TIME_BOX[name], deadline - time.perf_counter()), 1)
                if time_box <= 0:
                    record = {"status": "not run", "reason": f"--budget_s {args.budget_s} spent"}
                    status = f"not run, {record['reason']}"
                else:
                    print(f"== {name} (at most {time_box:.0f} s)", flush=True)
                    record, output = run_stage(name, args.dry, out, time_box, logs)
                    status = f"{record['status']} in {record['seconds']:.0f} s"
                    full_log.write(f"== {name}: {status}\n{output}\n")
                    full_log.flush()
                    print(output[-1500 if record["status"] == "ok" else -3000:], flush=True)
                print(f"== {name}: {status}", flush=True)
                summary["stages"][name] = record
                (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out)
    not_ok = {name: r["status"] for name, r in summary["stages"].items() if r["status"] != "ok"}
    failed_rows = {name: r["failed_rows"] for name, r in summary["stages"].items() if "failed_rows" in r}
    print(f"wrote {out}/gpu_check.json and gpu_check.log; stages not ok: {not_ok or 'none'}; "
          f"rows that failed: {failed_rows or 'none'}")
    return 0


def plot(summary: dict, out: Path) -> None:
    """gpu_check.png: decode ms/token against context (eager and compiled), and training tokens/s, linear vs Llama
    (when measured)."""
    decode = [r for stage in ("decode", "decode_compiled") for r in summary["stages"].get(stage, {}).get("rows", [])
              if "error" not in r]
    train = summary["stages"].get("train", {}).get("rows", [])
    if not decode and not train:
        print("(no decode or train rows: no gpu_check.png)")
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no gpu_check.png)")
        return
    fig, (ax_decode, ax_train) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, rows, x, y, scales in ((ax_decode, decode, "context", "ms_per_token", {"xscale": "log", "yscale": "log"}),
                                   (ax_train, train, "seq_len", "tokens_per_s", {"xscale": "log"})):
        for kind in dict.fromkeys(r["model"] for r in rows):  # each model its line, in the stage's order
            mine = [r for r in rows if r["model"] == kind]
            ax.plot([r[x] for r in mine], [r[y] for r in mine], "o-", label=kind)
        ax.set(xlabel=x, ylabel=y.replace("_", " "), **(scales if rows else {}))
        if rows:
            ax.legend()
    fig.suptitle(summary["device"])
    fig.tight_layout()
    fig.savefig(out / "gpu_check.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
