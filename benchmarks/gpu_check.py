"""One-shot GPU check (≤ 8 minutes on an H200): every measurement the project wants from its first GPU, in one
output folder, each stage in its own time-boxed child process (a stage that fails or runs over is recorded, and the
next one runs).

Stages:
  triton_tests  the Triton test modules, their kernels compiled on the GPU (pytest)
  kernels       benchmarks/bench_kernels.py: ours vs fla vs SDPA-flash on the four shapes and T 1K ... 64K
                (ms, TFLOP/s, % of bf16 peak)
  decode        ms per decode token after growing contexts, linear model vs Llama (SDPA, dynamic cache)
  train         training tokens/s (forward + backward + AdamW, bf16) of a ~340M linear model vs the same Llama
  fsdp          a few FSDP2 (fully_shard) training steps of the linear model, one process
  deepspeed     a few DeepSpeed ZeRO-2 steps, one process (skipped with a line when deepspeed is not installed)

    python benchmarks/gpu_check.py --wheels build/wheels --output_dir outputs/gpu_check   # make gpu-check
    python benchmarks/gpu_check.py --dry      # every stage on CPU at toy sizes (CI)

--wheels: a folder of wheels installed (pip --no-index --target) into a temporary folder on the stages' path:
the GPU machine has no network (`make fla-wheels` downloads fla's). Writes gpu_check.json (every stage's status,
seconds and rows), gpu_check.png (decode and train), the kernel benchmark's kernels.{md,json,png} and
triton_tests.log: at most 6 files, so that a device run's output folder brings all of them back.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parents[1]
TRITON_TESTS = ["tests/test_triton_ops.py", "tests/test_window_ops.py", "tests/test_delta_rule_triton.py"]
STAGES = ("triton_tests", "kernels", "decode", "train", "fsdp", "deepspeed")
# Seconds each stage may take on the GPU (their sum stays under 8 minutes with the start-ups).
TIME_BOX = {"triton_tests": 150, "kernels": 170, "decode": 40, "train": 60, "fsdp": 25, "deepspeed": 25}
DRY_TIME_BOX = 120


@dataclass
class GpuCheckArguments:
    stages: list[str] = field(default_factory=lambda: list(STAGES), metadata={"help": "Stages to run, in order."})
    wheels: str = field(default="", metadata={"help": "A folder of wheels to put on the stages' path."})
    dry: bool = field(default=False, metadata={"help": "Every stage on CPU at toy sizes: the script cannot rot."})
    output_dir: str = "outputs/gpu_check"
    stage: str = field(default="", metadata={"help": "Internal: run this one stage and write its JSON."})


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


def build(kind: str, size: ModelSize, device: str, dtype: torch.dtype) -> torch.nn.Module:
    """A randomly initialised linear-attention model ("linear", triton kernels on a GPU) or Llama with SDPA."""
    import hf_linear_attn

    torch.manual_seed(0)
    dims = asdict(size) | {"max_position_embeddings": 1 << 17}
    if kind == "llama":
        config = LlamaConfig(**dims, attn_implementation="sdpa")
        return LlamaForCausalLM(config).to(device, dtype)
    config = hf_linear_attn.LinearAttentionConfig(**dims, feature_map="elu")
    return hf_linear_attn.LinearAttentionForCausalLM(config).to(device, dtype)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def stage_decode(dry: bool, device: str) -> dict:
    """ms per greedy decode token after a prefilled context, batch 1, eager."""
    size = SIZE_TOY if dry else ModelSize(1024, 8, 8, 2816, 32000)
    contexts, steps = ([16, 64], 3) if dry else ([1024, 4096, 16384, 65536], 32)
    rows = []
    for kind in ("linear", "llama"):
        model = build(kind, size, device, torch.float32 if dry else torch.bfloat16).eval()
        for context in contexts:
            ids = torch.randint(3, size.vocab_size, (1, context), device=device,
                                generator=torch.Generator(device).manual_seed(context))
            with torch.no_grad():
                out = model(input_ids=ids, use_cache=True)
                cache, next_id = out.past_key_values, out.logits[:, -1:].argmax(-1)
                times = []
                for _ in range(steps + 2):  # two warm-up steps
                    synchronize(device)
                    start = time.perf_counter()
                    out = model(input_ids=next_id, past_key_values=cache, use_cache=True)
                    next_id = out.logits[:, -1:].argmax(-1)
                    synchronize(device)
                    times.append(time.perf_counter() - start)
            rows.append({"model": kind, "context": context, "ms_per_token": 1000 * statistics.median(times[2:])})
            print(f"  decode {kind:<6} context {context:>6}: {rows[-1]['ms_per_token']:.2f} ms/token", flush=True)
        del model
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


def run_stage(name: str, args: GpuCheckArguments, out: Path) -> dict:
    """The stage `name` in this process (the child): its result dict."""
    device = "cpu" if args.dry else "cuda"
    if name in ("triton_tests", "kernels"):
        raise ValueError(f"stage {name} runs as its own command, not with --stage")
    return {"decode": stage_decode, "train": stage_train, "fsdp": stage_fsdp,
            "deepspeed": stage_deepspeed}[name](args.dry, device)


def stage_command(name: str, args: GpuCheckArguments, argv: list[str], out: Path, result_json: Path) -> list[str]:
    if name == "triton_tests":  # dry: collection only (the interpreter runs them in the ordinary test suite)
        return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *(["--co"] if args.dry else []),
                *TRITON_TESTS]
    if name == "kernels":
        return [sys.executable, str(ROOT / "benchmarks" / "bench_kernels.py"), "--output_dir", str(out),
                *(["--dry-run"] if args.dry else [])]
    return [sys.executable, __file__, *argv, "--stage", name, "--output_dir", str(result_json)]


def main(argv: list[str]) -> int:
    (args,) = HfArgumentParser(GpuCheckArguments).parse_args_into_dataclasses(argv)
    unknown = sorted(set(args.stages) - set(STAGES))
    if unknown:
        raise SystemExit(f"unknown stages {unknown}; the stages are {list(STAGES)}")
    if args.stage:  # a child: one stage, its result as JSON at --output_dir
        Path(args.output_dir).write_text(json.dumps(run_stage(args.stage, args, Path(args.output_dir))))
        return 0
    if not args.dry and not torch.cuda.is_available():
        raise SystemExit("gpu_check.py needs a CUDA GPU (or --dry on CPU)")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    site = tempfile.mkdtemp(prefix="gpu_check_site_")
    if args.wheels:
        wheels = sorted(str(w) for w in Path(args.wheels).glob("*.whl"))
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--target", site, *wheels], check=True)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (site, str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")
    summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.dry else "cpu (dry)",
               "torch": torch.__version__, "stages": {}}
    child_argv = [a for a in argv if a != "--stage"]
    for name in args.stages:
        time_box = DRY_TIME_BOX if args.dry else TIME_BOX[name]
        result_json = out / f".{name}.json"
        start = time.perf_counter()
        print(f"== {name} (at most {time_box} s)", flush=True)
        record = {"time_box_s": time_box}
        try:
            done = subprocess.run(stage_command(name, args, child_argv, out, result_json), env=env, cwd=ROOT,
                                  timeout=time_box, capture_output=True, text=True)
            record["returncode"] = done.returncode
            record["status"] = "ok" if done.returncode == 0 else "failed"
            output = done.stdout + done.stderr
        except subprocess.TimeoutExpired as expired:
            record["status"] = "timed out"
            output = (expired.stdout or b"").decode(errors="replace") + (expired.stderr or b"").decode(errors="replace")
        record["seconds"] = time.perf_counter() - start
        print(output[-3000:], flush=True)
        if name == "triton_tests":
            (out / "triton_tests.log").write_text(output)
            record["summary"] = (output.strip().splitlines() or [""])[-1]
        elif name == "kernels" and (out / "kernels.json").exists():
            record["rows"] = json.loads((out / "kernels.json").read_text())["rows"]
        elif result_json.exists():
            record.update(json.loads(result_json.read_text()))
            result_json.unlink()
        if record["status"] != "ok":
            record["output_tail"] = output[-4000:]
        summary["stages"][name] = record
        print(f"== {name}: {record['status']} in {record['seconds']:.0f} s", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(summary, indent=2))
    plot(summary, out)
    failed = [name for name, r in summary["stages"].items() if r["status"] != "ok"]
    print(f"wrote {out}/gpu_check.json; stages not ok: {failed or 'none'}")
    return 0


def plot(summary: dict, out: Path) -> None:
    """gpu_check.png: decode ms/token against context, and training tokens/s, linear vs Llama."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(no matplotlib: no gpu_check.png)")
        return
    fig, (ax_decode, ax_train) = plt.subplots(1, 2, figsize=(10, 4))
    decode = summary["stages"].get("decode", {}).get("rows", [])
    train = summary["stages"].get("train", {}).get("rows", [])
    for kind in ("linear", "llama"):
        mine = [r for r in decode if r["model"] == kind]
        ax_decode.plot([r["context"] for r in mine], [r["ms_per_token"] for r in mine], "o-", label=kind)
        mine = [r for r in train if r["model"] == kind]
        ax_train.plot([r["seq_len"] for r in mine], [r["tokens_per_s"] for r in mine], "o-", label=kind)
    ax_decode.set(xscale="log", yscale="log", xlabel="context", ylabel="ms per decode token")
    ax_train.set(xscale="log", xlabel="sequence length", ylabel="training tokens/s")
    ax_decode.legend()
    fig.suptitle(summary["device"])
    fig.tight_layout()
    fig.savefig(out / "gpu_check.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
