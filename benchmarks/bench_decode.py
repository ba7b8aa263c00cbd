"""Decode speed: per-token latency and cache bytes after growing contexts, and `generate()` tokens/s compiled
and batched, linear attention vs Llama (the teacher's shape).

Both models have identical dimensions (default: 4 layers, hidden 256, 4 heads, SwiGLU 688, vocab
32000) and run in the same process, one after the other, so their ratios are measured side by
side ("× Llama": Llama's time per token over the model's, above 1 when faster).

Scaling (always, batch 1, eager): for every context length the context is prefilled in chunks (so
prefill memory stays bounded), then `--new_tokens` tokens are decoded one at a time with the cache
and the median time per token is reported. Peak RSS added by the prefill is measured in a child
process per model and length (`--peak_memory`, Linux /proc). Report `decode.*`.

Generate (with `--compile` or `--batch_size`): greedy `generate()` on a left-padded batch of random
prompts whose lengths spread over 3/4 to 5/4 of the context (exactly the context at batch 1); the
median time between steps (a streamer timestamps each) gives tokens/s. Variants: the linear model
eager and, with `--compile`, with its decode step compiled (`compile_config`: the cache is fixed-shape);
Llama eager (dynamic cache), and with `--compile` eager on a static cache and compiled on it. Each is
timed after a warm-up `generate()` that does the compiling; every variant of a model must decode the
eager tokens (else the script fails). Report `decode_generate.*`.

Loop (`--timings loop`, per `--batch_size`): a plain greedy decode loop calling the model (and with `--compile` the
linear model's `torch.compile`d forward) directly, as transformers' own static-cache benchmarks do, on a cache
brought to the context without the prefill's cost (`cache_at_context`; the teacher's prefill of 8 prompts of up to
20K tokens is quadratic in their length); the variants take turns step by step, and the LM head alone is timed in
the same rounds, so the ratios hold under a changing load; each eager variant's aten operators per step are counted
on one untimed step. Report `decode_loop.*`.

    python -m benchmarks.bench_decode                                # 256, 1K, 8K
    python -m benchmarks.bench_decode --contexts 256 1024 8192 65536 --peak_memory
    python -m benchmarks.bench_decode --layout smollm2 --contexts 1024 16384   # converted SmolLM2-135M shape
    python -m benchmarks.bench_decode --contexts 1024 --compile      # eager vs torch.compile, batch 1
    python -m benchmarks.bench_decode --layout smollm2 --contexts 1024 --batch_size 1 8
    python -m benchmarks.bench_decode --layout smollm2 --contexts 1024 16384 --batch_size 1 8 --timings loop
    python -m benchmarks.bench_decode --layout smollm2 --attention delta_window --contexts 1024 --batch_size 1 \
        --timings loop                                               # the delta rule behind the window

Prints the tables, writes JSON (and a PNG when matplotlib is installed) to --output_dir.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import CompileConfig, HfArgumentParser, LlamaConfig, LlamaForCausalLM
from transformers.generation.streamers import BaseStreamer

import hf_linear_attn
from benchmarks.common import added_peak_mib, reset_peak_rss
from hf_linear_attn.cache_linear_attention import LinearStateLayer
from hf_linear_attn.configuration_linear_attention import InputError
from hf_linear_attn.conversion import GATED_DELTANET_WINDOW_OPTIONS
from hf_linear_attn.training.command_line import exit_on_bad_input, parse_dataclasses
from hf_linear_attn.training.measure import cache_bytes, decode_times, new_cache, prefill
from hf_linear_attn.training.report import log_log_plot, machine, write_report


@dataclass
class DecodeBenchmarkArguments:
    contexts: list[int] = field(default_factory=lambda: [256, 1024, 8192], metadata={"help": "Context lengths."})
    new_tokens: int = field(default=48, metadata={"help": "Decode steps timed after each context."})
    warmup_tokens: int = field(default=4, metadata={"help": "Decode steps run before timing."})
    prefill_chunk: int = field(default=2048, metadata={"help": "Tokens per prefill forward."})
    layout: str = field(default="", metadata={
        "help": "'smollm2': the converted SmolLM2-135M shape (30 layers, hidden 576, 9 / 3 heads, hedgehog F = 32, "
                "window 64 + 4 sinks), overriding the size and attention fields below."})
    hidden_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 0  # 0: as many as query heads
    intermediate_size: int = 688
    vocab_size: int = 32000
    feature_map: str = field(default="elu", metadata={"help": "Feature map of the linear model."})
    feature_dim: int = 0  # 0: the head dimension
    window_size: int = field(default=0, metadata={"help": "Sliding window of the hybrid (0: pure linear)."})
    num_sink_tokens: int = 0
    attention: str = field(default="", metadata={
        "help": "'delta_window': the Gated DeltaNet recipe behind the window (conversion.GATED_DELTANET_WINDOW_OPTIONS"
                ": delta rule, 64 + 4 sinks, identity map, scalar decay, conv 4), instead of the four fields above."})
    models: list[str] = field(default_factory=lambda: ["linear", "llama"], metadata={"help": "linear and/or llama."})
    peak_memory: bool = field(default=False, metadata={"help": "Also measure prefill peak RSS (child processes)."})
    compile: bool = field(default=False, metadata={
        "help": "Also time generate() with torch.compile'd decode steps (Llama on a static cache, eager on it too)."})
    compile_backend: str = field(default="inductor", metadata={
        "help": "torch.compile backend of --compile ('aot_eager' checks the graph capture without generating code)."})
    batch_size: list[int] = field(default_factory=list, metadata={
        "help": "Batch sizes of the generate() runs (left-padded prompts of mixed lengths); --compile alone: 1."})
    timings: list[str] = field(default_factory=lambda: ["scaling", "generate"], metadata={
        "help": "What to time: 'scaling' (batch 1, eager, after a real prefill), 'generate' (generate() per "
                "--batch_size) and/or 'loop' (a plain decode loop per --batch_size on a cache brought to the context "
                "without a prefill)."})
    output_dir: str = "outputs/bench_decode"
    child: str = field(default="", metadata={"help": "Internal: 'MODEL:LENGTH' runs one prefill and prints JSON."})


# The converted SmolLM2-135M (`make demo`'s model) with random weights: what a chat on the CPU decodes with.
LAYOUTS = {
    "smollm2": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    intermediate_size=1536, vocab_size=49152, feature_map="hedgehog", feature_dim=32, window_size=64,
                    num_sink_tokens=4),
}


# generate() settings of each timed variant, per model: the cache kind and whether the decode step is compiled.
GENERATE_VARIANTS = {
    "linear": {"eager": {}, "compiled": {"compiled": True}},
    "llama": {"eager": {}, "static": {"cache_implementation": "static"},
              "compiled": {"cache_implementation": "static", "compiled": True}},
}


# Attention recipes `--attention` names, replacing the feature map, window and sink fields.
ATTENTIONS = {"delta_window": GATED_DELTANET_WINDOW_OPTIONS}
TIMINGS = ("scaling", "generate", "loop")
# Positions a loop cache is really prefilled with (the rest of the context is added without computing it).
LOOP_PREFILL = 64


def check_args(args: DecodeBenchmarkArguments) -> None:
    """Apply `--layout` and refuse bad values before anything runs."""
    if args.layout and args.layout not in LAYOUTS:
        raise InputError(f"--layout must be one of {sorted(LAYOUTS)} or empty; got {args.layout!r}")
    for name, value in LAYOUTS.get(args.layout, {}).items():
        setattr(args, name, value)
    if args.attention and args.attention not in ATTENTIONS:
        raise InputError(f"--attention must be one of {sorted(ATTENTIONS)} or empty; got {args.attention!r}")
    if not args.models or set(args.models) - set(GENERATE_VARIANTS):
        raise InputError(f"--models must be some of {sorted(GENERATE_VARIANTS)}; got {args.models}")
    if not args.contexts or min(args.contexts) < 1:
        raise InputError(f"--contexts must be positive token counts; got {args.contexts}")
    if args.new_tokens < 1 or args.warmup_tokens < 1:
        raise InputError(f"--new_tokens and --warmup_tokens must be at least 1; got {args.new_tokens}, "
                         f"{args.warmup_tokens}")
    if args.batch_size and min(args.batch_size) < 1:
        raise InputError(f"--batch_size must be positive; got {args.batch_size}")
    if args.compile and args.compile_backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise InputError(f"--compile_backend must be one of {torch._dynamo.list_backends(exclude_tags=())}; "
                         f"got {args.compile_backend!r}")
    if not args.timings or set(args.timings) - set(TIMINGS):
        raise InputError(f"--timings must be some of {TIMINGS}; got {args.timings}")
    if args.compile and not args.batch_size:
        args.batch_size = [1]


def build(kind: str, args: DecodeBenchmarkArguments) -> torch.nn.Module:
    torch.manual_seed(0)
    dims = dict(vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
                num_hidden_layers=args.num_hidden_layers, num_attention_heads=args.num_attention_heads,
                num_key_value_heads=args.num_key_value_heads or args.num_attention_heads,
                max_position_embeddings=max(args.contexts) * 5 // 4 + args.new_tokens + args.warmup_tokens + 16)
    if kind == "linear":
        attention = ATTENTIONS.get(args.attention) or dict(
            feature_map=args.feature_map, feature_dim=args.feature_dim or None, window_size=args.window_size,
            num_sink_tokens=args.num_sink_tokens)
        config = hf_linear_attn.LinearAttentionConfig(**dims, **attention)
        return hf_linear_attn.LinearAttentionForCausalLM(config).eval()
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**dims, attn_implementation="sdpa")).eval()
    raise ValueError(f"unknown model {kind!r}; choose linear or llama")


def peak_prefill_rss(kind: str, length: int, args: DecodeBenchmarkArguments) -> float:
    """MiB of peak RSS added by prefilling `length` tokens, measured in a fresh child process."""
    cmd = [sys.executable, "-m", __spec__.name, "--child", f"{kind}:{length}"]
    for name, value in asdict(args).items():
        if name in ("child", "peak_memory", "contexts", "models", "compile", "compile_backend", "batch_size",
                    "timings"):
            continue
        cmd += [f"--{name}", str(value)]
    cmd += ["--contexts", str(length)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def run_child(args: DecodeBenchmarkArguments) -> None:
    kind, length = args.child.split(":")
    model = build(kind, args)
    baseline = reset_peak_rss()
    prefill(model, new_cache(model), int(length), args.prefill_chunk)
    print(json.dumps({"peak_mib": added_peak_mib(baseline)}))


class StepClock(BaseStreamer):
    """A `generate()` streamer that only notes when tokens arrive: the prompt, then once per step."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def mixed_prompts(context: int, batch: int, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch` random prompts (seeded) of lengths spread evenly over 3/4 to 5/4 of `context` (`context` itself
    when `batch` is 1), left-padded: token ids `[B, T]` (pads 0) and attention mask `[B, T]`."""
    generator = torch.Generator().manual_seed(context)
    lengths = [context] if batch == 1 else [context * (3 * (batch - 1) + 2 * i) // (4 * (batch - 1))
                                            for i in range(batch)]
    ids = torch.zeros(batch, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, length in enumerate(lengths):
        ids[row, -length:] = torch.randint(3, vocab_size, (length,), generator=generator)
        mask[row, -length:] = 1
    return ids, mask


@torch.no_grad()
def time_generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, steps: int,
                  cache_implementation: str | None = None,
                  compile_backend: str | None = None) -> tuple[torch.Tensor, list[float], int]:
    """Greedy `generate()` of `steps` + 1 tokens after the prompts (the first comes from the prefill), its decode
    steps compiled with `compile_backend` if given. Returns the new tokens `[B, steps + 1]`, the seconds of each
    of the `steps` decode steps and the graphs dynamo compiled meanwhile."""
    kwargs = {"cache_implementation": cache_implementation}
    if compile_backend:
        # fullgraph: a graph break raises. generate() compiles only on accelerators unless told otherwise.
        kwargs["compile_config"] = CompileConfig(fullgraph=True, backend=compile_backend, mode="default")
        kwargs["compile_config"]._compile_all_devices = True
    clock = StepClock()
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    out = model.generate(ids, attention_mask=mask, max_new_tokens=steps + 1, do_sample=False, eos_token_id=None,
                         pad_token_id=0, streamer=clock, **kwargs)
    step_times = [b - a for a, b in zip(clock.times[1:-1], clock.times[2:], strict=True)]
    return out[:, ids.shape[1]:], step_times, torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs


def generate_rows(kind: str, model: torch.nn.Module, args: DecodeBenchmarkArguments) -> list[dict]:
    """One row per context, batch size and variant of `kind` (`GENERATE_VARIANTS`): median ms per decode step,
    tokens/s, and for compiled variants the graphs compiled by the warm-up and while timed (0 unless a step
    recompiles). Raises when a variant's greedy tokens differ from eager's."""
    rows = []
    for context in args.contexts:
        for batch in args.batch_size:
            ids, mask = mixed_prompts(context, batch, args.vocab_size)
            eager_tokens = None
            for variant, settings in GENERATE_VARIANTS[kind].items():
                if variant != "eager" and not args.compile:
                    continue
                compiled = settings.get("compiled", False)
                if compiled:
                    torch._dynamo.reset()  # each shape compiles afresh, never near dynamo's recompile limit
                run = dict(cache_implementation=settings.get("cache_implementation"),
                           compile_backend=args.compile_backend if compiled else None)
                _, _, warmup_graphs = time_generate(model, ids, mask, args.warmup_tokens, **run)
                tokens, times, timed_graphs = time_generate(model, ids, mask, args.new_tokens, **run)
                if eager_tokens is None:
                    eager_tokens = tokens
                elif not torch.equal(tokens, eager_tokens):
                    first, step = (tokens != eager_tokens).nonzero()[0].tolist()
                    raise RuntimeError(
                        f"{kind} {variant} decoded other greedy tokens than eager (context {context}, batch {batch}): "
                        f"first difference in row {first} at step {step}: {tokens[first].tolist()} vs "
                        f"{eager_tokens[first].tolist()}")
                ms = 1000 * statistics.median(times)
                row = {"model": kind, "variant": variant, "batch": batch, "context": context, "ms_per_step": ms,
                       "tokens_per_s": 1000 * batch / ms}
                if compiled:
                    row.update(graphs=warmup_graphs, graphs_while_timed=timed_graphs)
                rows.append(row)
                check = "same greedy tokens as eager" if variant != "eager" else "reference tokens"
                print(f"  {kind:<6} {variant:<8} batch {batch:>2} context {context:>6}: {ms:.2f} ms/step, "
                      f"{row['tokens_per_s']:.1f} tokens/s ({check})", flush=True)
                if timed_graphs:
                    print(f"  warning: {kind} {variant} compiled {timed_graphs} graph(s) while timed: it recompiles "
                          "during decoding (raise --warmup_tokens if the warm-up was too short)", flush=True)
    return rows


@torch.no_grad()
def cache_at_context(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor):
    """A cache that holds what a prefill of the left-padded prompts `ids`, `mask` `[B, T]` would leave, in shape:
    the last LOOP_PREFILL positions (real in every row) are prefilled, then the rest of the T positions is added
    without computing it: Llama's K/V grow to T positions of random values; the linear cache's tensors have a fixed
    shape, so only its position counter moves on to T. A decode step's cost depends on these shapes, not on the
    values (the batch-1 scaling rows decode after a real prefill). Returns (cache, next token ids `[B, 1]`)."""
    tail = min(LOOP_PREFILL, ids.shape[1])
    cache = new_cache(model)
    logits = model(input_ids=ids[:, -tail:], attention_mask=mask[:, -tail:], cache=cache, logits_to_keep=1).logits
    for layer in cache.layers:
        if isinstance(layer, LinearStateLayer):
            layer.seen.fill_(ids.shape[1])
        else:
            b, heads, _, dim = layer.keys.shape
            layer.keys = torch.randn(b, heads, ids.shape[1], dim, dtype=layer.keys.dtype)
            layer.values = torch.randn_like(layer.keys)
    return cache, logits[:, -1:].argmax(-1)


class DecodeLoop:
    """A plain greedy decode loop of `step` (a model or its compiled forward) from `cache`, fed as generate() feeds
    a model: the padding mask `[B, past]` grows by one real column a step, positions count each row's real tokens."""

    def __init__(self, step, cache, next_ids: torch.Tensor, mask: torch.Tensor) -> None:
        self.step, self.cache, self.next_ids, self.mask = step, cache, next_ids, mask

    @torch.no_grad()
    def __call__(self) -> float:
        """Run one step; returns its seconds."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.mask.shape[0], 1)], dim=1)
        start = time.perf_counter()
        positions = self.mask.cumsum(-1)[:, -1:] - 1
        out = self.step(input_ids=self.next_ids, attention_mask=self.mask, position_ids=positions, cache=self.cache)
        if not isinstance(out, torch.Tensor):  # (a `Decoder` gives hidden states: the next ids stay the same)
            self.next_ids = out.logits[:, -1].argmax(-1, keepdim=True)
        return time.perf_counter() - start


class CountAtenOps(TorchDispatchMode):
    """Counts the aten operators that eager code dispatches inside the `with` block: what a decode step pays
    per-operator overhead for (a few microseconds each on a CPU, whatever the tensors' size)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class Decoder(torch.nn.Module):
    """A causal LM without its LM head: the last hidden states `[B, T, hidden]`, the part of a step that compiling
    speeds up."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model.model

    def forward(self, **inputs) -> torch.Tensor:
        return self.model(**inputs).last_hidden_state


def loop_rows(models: dict[str, torch.nn.Module], args: DecodeBenchmarkArguments) -> list[dict]:
    """One row per context, batch size, model and variant: the median ms of a `DecodeLoop` step calling the model
    eagerly and, with --compile, the linear model's `torch.compile`d forward (fullgraph; the growing mask makes
    dynamo compile a second, length-generic graph during the warm-up) and its `Decoder` eager and compiled, each on
    its own `cache_at_context`. After
    the warm-ups the variants take turns step by step, so a change in the machine's load hits them alike. Also
    the ms of each model's LM head alone on the batch, timed in the same rounds: the part of a step that neither
    attention nor compiling touches (one matrix-vector product per row, its weight read from memory)."""
    rows = []
    steps = {(kind, "eager"): model for kind, model in models.items()}
    if args.compile and "linear" in models:
        decoder = Decoder(models["linear"])
        steps.update({
            ("linear", "compiled"): torch.compile(models["linear"], fullgraph=True, backend=args.compile_backend),
            ("linear", "decoder eager"): decoder,
            ("linear", "decoder compiled"): torch.compile(decoder, fullgraph=True, backend=args.compile_backend)})
    for context in args.contexts:
        for batch in args.batch_size:
            ids, mask = mixed_prompts(context, batch, args.vocab_size)
            loops, graphs = {}, {}
            torch._dynamo.reset()  # each shape compiles afresh, never near dynamo's recompile limit
            for (kind, variant), step in steps.items():
                before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
                loops[kind, variant] = DecodeLoop(step, *cache_at_context(models[kind], ids, mask), mask)
                for _ in range(args.warmup_tokens):
                    loops[kind, variant]()
                graphs[kind, variant] = torch._dynamo.utils.counters["stats"]["unique_graphs"] - before
            ops = {}  # aten operators of one untimed eager step (after the warm-up: the steady step)
            for key, loop in loops.items():
                if not key[1].endswith("compiled"):
                    with CountAtenOps() as counter:
                        loop()
                    ops[key] = counter.count
            counted = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            times = {key: [] for key in loops}
            head_times = {kind: [] for kind in models}
            hidden = torch.randn(batch, 1, args.hidden_size)
            for _ in range(args.new_tokens):
                for key, loop in loops.items():
                    times[key].append(loop())
                with torch.no_grad():
                    for kind, model in models.items():
                        head_times[kind].append(timed(model.lm_head, hidden))
            recompiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] - counted
            for (kind, variant), seconds in times.items():
                ms, head_ms = 1000 * statistics.median(seconds), 1000 * statistics.median(head_times[kind])
                row = {"model": kind, "variant": variant, "batch": batch, "context": context, "ms_per_step": ms,
                       "tokens_per_s": 1000 * batch / ms, "lm_head_ms": head_ms}
                if not variant.startswith("decoder"):
                    row["rest_ms"] = ms - head_ms
                if variant.endswith("compiled"):
                    row.update(graphs=graphs[kind, variant], graphs_while_timed=recompiled)
                else:
                    row["aten_ops"] = ops[kind, variant]
                rows.append(row)
                print(f"  loop {kind:<6} {variant:<8} batch {batch:>2} context {context:>6}: {ms:.2f} ms/step, "
                      f"{row['tokens_per_s']:.1f} tokens/s (LM head alone {head_ms:.2f} ms)", flush=True)
            del loops
    return rows


def timed(fn, *inputs) -> float:
    """Seconds of one call `fn(*inputs)`."""
    start = time.perf_counter()
    fn(*inputs)
    return time.perf_counter() - start


def scaling_row(kind: str, model: torch.nn.Module, length: int, args: DecodeBenchmarkArguments) -> dict:
    """Batch 1, eager: chunked prefill of `length` tokens, then the median ms of `new_tokens` decode steps."""
    cache = new_cache(model)
    start = time.perf_counter()
    logits = prefill(model, cache, length, args.prefill_chunk)
    prefill_s = time.perf_counter() - start
    decode_times(model, cache, logits, args.warmup_tokens)
    before = cache_bytes(cache)
    times = decode_times(model, cache, logits, args.new_tokens)
    row = {"model": kind, "context": length, "prefill_s": prefill_s,
           "ms_per_token": 1000 * statistics.median(times), "cache_bytes": before}
    if args.peak_memory:
        row["prefill_peak_mib"] = peak_prefill_rss(kind, length, args)
    print(f"  {kind:<6} context {length:>6}: {row['ms_per_token']:.2f} ms/token, "
          f"cache {before / 2**20:.2f} MiB, prefill {prefill_s:.1f} s", flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    (args,) = parse_dataclasses(HfArgumentParser(DecodeBenchmarkArguments), argv)
    with exit_on_bad_input():
        check_args(args)
    if args.child:
        run_child(args)
        return 0
    print(f"{machine()}; {args.num_hidden_layers} layers, hidden {args.hidden_size}, "
          f"{args.num_attention_heads} heads{'; attention ' + args.attention if args.attention else ''}")
    rows, generated, looped = [], [], []
    models = {kind: build(kind, args) for kind in args.models}
    for kind, model in models.items():
        if "scaling" in args.timings:
            rows += [scaling_row(kind, model, length, args) for length in args.contexts]
        if args.batch_size and "generate" in args.timings:
            generated += generate_rows(kind, model, args)
    if args.batch_size and "loop" in args.timings:
        looped = loop_rows(models, args)
    if rows:
        report(rows, args)
    if generated:
        report_generate(generated, args, "decode_generate")
    if looped:
        report_generate(looped, args, "decode_loop")
    return 0


def speed_vs_llama(rows: list[dict], time_key: str, match: tuple[str, ...]) -> None:
    """Set each non-Llama row's `vs_llama`: Llama's `time_key` over the row's, Llama's row matching it in the
    `match` keys (absent without such a row)."""
    llama = {tuple(r[k] for k in match): r[time_key] for r in rows if r["model"] == "llama"}
    for r in rows:
        key = tuple(r[k] for k in match)
        if r["model"] != "llama" and key in llama:
            r["vs_llama"] = llama[key] / r[time_key]


def report(rows: list[dict], args: DecodeBenchmarkArguments) -> None:
    first = {r["model"]: r["ms_per_token"] for r in rows if r["context"] == args.contexts[0]}
    for r in rows:
        r["latency_ratio"] = r["ms_per_token"] / first[r["model"]]
        r["cache_mib"] = r["cache_bytes"] / 2**20
    speed_vs_llama(rows, "ms_per_token", ("context",))
    columns = {"model": "model", "context": "context", "ms_per_token": "ms/token", "vs_llama": "× Llama",
               "latency_ratio": f"÷ at {args.contexts[0]}", "cache_mib": "cache MiB", "cache_bytes": "cache bytes",
               "prefill_s": "prefill s"}
    if args.peak_memory:
        columns["prefill_peak_mib"] = "prefill peak MiB"

    plot = log_log_plot(rows, "context", "context tokens",
                        [("ms_per_token", "ms per decoded token"), ("cache_mib", "cache MiB")])
    write_report(rows, columns, args.output_dir, "decode", plot, meta={"args": asdict(args)})


def report_generate(rows: list[dict], args: DecodeBenchmarkArguments, name: str) -> None:
    """The generate() or decode-loop table (report `name`): tokens/s, "× Llama" against Llama's same variant
    (eager vs eager, compiled vs compiled), "× eager" against the same model's eager run (a decoder's against the
    eager decoder); a bar chart of tokens/s."""
    rows.sort(key=lambda r: (r["context"], r["batch"], r["model"]))
    speed_vs_llama(rows, "ms_per_step", ("context", "batch", "variant"))
    def eager_key(r: dict) -> tuple:  # a `Decoder` row against the eager decoder
        return r["model"], r["context"], r["batch"], r["variant"].startswith("decoder")

    eager = {eager_key(r): r["ms_per_step"] for r in rows if r["variant"] in ("eager", "decoder eager")}
    for r in rows:
        r["vs_eager"] = eager[eager_key(r)] / r["ms_per_step"]
    columns = {"model": "model", "variant": "variant", "batch": "batch", "context": "context",
               "ms_per_step": "ms/step", "tokens_per_s": "tokens/s", "vs_llama": "× Llama", "vs_eager": "× eager"}
    if "lm_head_ms" in rows[0]:
        columns.update(lm_head_ms="LM head alone ms", rest_ms="step − LM head ms", aten_ops="aten ops per step")
    if args.compile:
        columns.update(graphs="graphs compiled", graphs_while_timed="recompiles while timed")

    def plot(plt):
        groups = list(dict.fromkeys((r["context"], r["batch"]) for r in rows))
        bars = list(dict.fromkeys((r["model"], r["variant"]) for r in rows))
        width = 0.8 / len(bars)
        fig, ax = plt.subplots(figsize=(min(12, max(6, 0.4 * len(groups) * len(bars))), 4))
        for i, (model, variant) in enumerate(bars):
            speed = {(r["context"], r["batch"]): r["tokens_per_s"] for r in rows
                     if (r["model"], r["variant"]) == (model, variant)}
            ax.bar([g + i * width for g in range(len(groups))], [speed.get(g, 0) for g in groups], width,
                   label=f"{model} {variant}")
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))],
                      [f"context {c:,}\nbatch {b}" for c, b in groups])
        ax.set(ylabel="generated tokens/s", yscale="log")
        ax.legend()
        fig.tight_layout()
        return fig

    write_report(rows, columns, args.output_dir, name, plot, meta={"args": asdict(args)})


if __name__ == "__main__":
    raise SystemExit(main())
