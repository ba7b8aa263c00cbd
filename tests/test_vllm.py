"""The vLLM model plugin (hf_linear_attn/vllm_model.py) on vLLM's CPU build: tokens equal generate()'s.

These tests need vLLM, which the main test venv does not have (its transformers pin differs): `make test-vllm` builds
the vLLM venv (`make vllm-env`) and runs them there; elsewhere they skip. Each engine runs in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) on one thread, with a small KV cache and a small token budget per step, so that
long prompts are prefilled in chunks beside other requests' decode steps.
"""

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
pytest.importorskip("vllm", reason="vLLM is not installed here: `make test-vllm` builds its venv and runs these tests")

from helpers import free_port, save_with_tokenizer, wait_until_healthy  # noqa: E402
from transformers import Qwen3Config, Qwen3ForCausalLM  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

from hf_linear_attn import (  # noqa: E402
    LinearAttentionCache,
    LinearAttentionConfig,
    LinearAttentionForCausalLM,
    convert_to_linear_attention,
)
from hf_linear_attn.cache_linear_attention import LinearStateLayer, SoftmaxHeadsState  # noqa: E402
from hf_linear_attn.vllm_model import PADDING, VLLM_ATTENTION_CLASSES, engine_linear, state_tensors  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=2,
            num_key_value_heads=1, head_dim=32, max_position_embeddings=512)
WINDOW = dict(window_size=16, num_sink_tokens=2)
# Softmax heads: 2 of the 4 query heads (KV head 1 of layer 0, KV head 0 of layer 2) keep exact softmax attention.
HEADS_SHAPE = dict(num_attention_heads=4, num_key_value_heads=2)
HEADS = dict(**HEADS_SHAPE, softmax_heads={0: [1], 2: [0]})
# One small model per kind the plugin serves (head dim 32: one of vLLM's CPU attention sizes). "demo" is the demo's
# kind: the window hybrid with sinks and a decay, the hedgehog feature map, a softmax layer.
KINDS = {
    "demo": dict(**WINDOW, decay="scalar", feature_map="hedgehog", feature_dim=16),
    "linear": dict(decay="vector", feature_map="hedgehog", feature_dim=16, normalize=True),
    "delta": dict(update_rule="delta", normalize=False, decay="scalar", conv_size=4, output_gate=True,
                  output_norm=True),
    "delta_window": dict(**WINDOW, update_rule="delta", normalize=False, decay="scalar", conv_size=4),
    "window_no_softmax": dict(**WINDOW, decay="fixed", feature_map="hedgehog", feature_dim=16, softmax_layers=[]),
    # the sparse exact memory: 8 slots per KV head, re-chosen every 64 positions (prompts reach 300 + 20 tokens)
    "window_memory": dict(**WINDOW, decay="vector", feature_map="hedgehog", feature_dim=16, sparse_cache_size=8),
    # softmax heads in recurrent layers: beside a softmax layer (window), alone (linear), with the sparse memory and a
    # short convolution (their q / k / v after it)
    "window_heads": dict(**WINDOW, **HEADS, decay="scalar", feature_map="hedgehog", feature_dim=16),
    "linear_heads": dict(**HEADS, decay="vector", feature_map="hedgehog", feature_dim=16, softmax_layers=[]),
    "memory_heads": dict(**WINDOW, **HEADS, decay="scalar", feature_map="hedgehog", feature_dim=16,
                         sparse_cache_size=8, conv_size=4),
}
# The engine tests' models: one per kind, and checkpoints converted from a softmax model (biases, tied embeddings,
# q/k norms: Qwen3) with the demo's options: its kind, and its recipe scaled down (a 64-token window, 4 sinks, 2 of 4
# layers softmax, softmax heads in the others), with its slow rotations held at position 99 (`rope_position_cap`, as
# a conversion of a source trained on 100 positions has them), which the prompts of 120 and 300 tokens run past.
MODELS = {**{kind: (lambda options=options: tiny_model(options)) for kind, options in KINDS.items()},
          "converted_qwen3": lambda: converted_model(),
          "converted_demo_recipe": lambda: converted_model(
              dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
              dict(KINDS["demo"], window_size=64, num_sink_tokens=4, softmax_layers=[1, 3],
                   softmax_heads={0: [1], 2: [0, 1]}), rope_position_cap=100)}
# Beyond the window (16) and the step's token budget (64); 120 + 10 tokens decode across a sparse memory block end
# (position 127); two one-token prompts start in one decode batch (vLLM counts a one-token step as a decode).
PROMPT_LENGTHS = (1, 1, 7, 40, 120, 300)
NEW_TOKENS = 10
ENGINE = dict(dtype="float32", max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8, seed=0,
              gpu_memory_utilization=0.05, kv_cache_memory_bytes=64 << 20)


def tiny_model(options: dict) -> LinearAttentionForCausalLM:
    """A random 3-layer model (layer 1 softmax unless the options say otherwise) with weights large enough that
    greedy tokens do not hinge on rounding."""
    torch.manual_seed(0)
    config = LinearAttentionConfig(**{**TINY, "softmax_layers": [1], **options})
    model = LinearAttentionForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.add_(0.1 * torch.randn_like(p))
    return model


def converted_model(shape: dict | None = None, options: dict | None = None,
                    **config_overrides) -> LinearAttentionForCausalLM:
    """A random Qwen3 (TINY, with `shape`'s sizes) converted with `options` (the demo's kind, layer 1 softmax), its
    config then given `config_overrides`."""
    torch.manual_seed(0)
    source = Qwen3ForCausalLM(Qwen3Config(**{**TINY, **(shape or {})}, tie_word_embeddings=True, attention_bias=True,
                                          bos_token_id=1, eos_token_id=2))
    with torch.no_grad():
        for p in source.parameters():
            p.normal_(0, 0.3) if p.dim() > 1 else p.add_(0.1 * torch.randn_like(p))
    model = convert_to_linear_attention(source, **(options or dict(KINDS["demo"], softmax_layers=[1])))
    if config_overrides:
        state = model.state_dict()
        model = LinearAttentionForCausalLM(LinearAttentionConfig(**{**model.config.to_dict(), **config_overrides}))
        model.load_state_dict(state)
    return model.eval()


def prompts(lengths=PROMPT_LENGTHS, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (n,), generator=generator).tolist() for n in lengths]


def greedy(max_tokens: int = NEW_TOKENS) -> SamplingParams:
    # min_tokens keeps EOS out, as generate()'s min_new_tokens does
    return SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True)


def generate_tokens(model: LinearAttentionForCausalLM, prompt: list[int], n: int = NEW_TOKENS) -> list[int]:
    """generate()'s greedy continuation of one prompt (unpadded: its own batch)."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module", params=list(MODELS))
def served(request, tmp_path_factory):
    """(name, transformers model, its checkpoint folder, a vLLM engine on it)."""
    model = MODELS[request.param]()
    path = tmp_path_factory.mktemp(request.param)
    save_with_tokenizer(model, path)
    llm = LLM(str(path), **ENGINE)
    yield request.param, model, path, llm
    llm.llm_engine.engine_core.shutdown()


def test_greedy_tokens_equal_generate(served):
    """A batch of mixed lengths, long ones prefilled in chunks while the short ones decode."""
    _, model, _, llm = served
    batch = prompts()
    outputs = llm.generate([{"prompt_token_ids": p} for p in batch], greedy(), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [generate_tokens(model, p) for p in batch]


def fill_state_slots(model) -> None:
    """Write garbage into every state slot of the vLLM model's recurrent layers, as a finished request leaves it."""
    for layer in model.model.layers:
        for tensor in getattr(layer.self_attn, "kv_cache", ()):
            tensor.fill_(True if tensor.dtype == torch.bool else 3)


def test_requests_arriving_and_leaving_while_others_decode(served):
    """Continuous batching: requests join at different steps, one is cancelled half-way; every other request's
    tokens equal generate()'s. Every state slot holds garbage first (vLLM reuses slots without clearing them)."""
    _, model, _, llm = served
    llm.apply_model(fill_state_slots)
    engine = llm.llm_engine
    batch = prompts((300, 5, 130, 1, 40, 64), seed=2)
    arrivals = {0: [0, 1], 3: [2, "cancelled"], 6: [3], 12: [4, 5]}  # step -> requests added before it
    tokens, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for name in arrivals.get(step, []):
            prompt = batch[0] if name == "cancelled" else batch[name]
            engine.add_request(str(name), {"prompt_token_ids": prompt}, greedy(NEW_TOKENS * 2))
        if step == 8:
            engine.abort_request(["cancelled"])
        for output in engine.step():
            tokens[output.request_id] = list(output.outputs[0].token_ids)
        step += 1
    assert {int(i): tokens[i] for i in tokens if i != "cancelled"} == {
        i: generate_tokens(model, p, NEW_TOKENS * 2) for i, p in enumerate(batch)}


def test_decode_steps_of_requests_at_one_context_run_as_one_batch(served):
    """Requests that decode at the same context in every step (each added one step later with one token more), and
    one 64 positions ahead of them (the same place in the sparse memory's blocks), run their decode steps as one
    batch in every recurrent layer (`StateSlots.groups`), across sparse memory block ends (positions 63, 127); each
    one's tokens equal generate()'s."""
    _, model, _, llm = served
    engine = llm.llm_engine
    batch = prompts((50, 116, 51, 52), seed=4)
    arrivals = {0: [0, 1], 1: [2], 2: [3]}  # step -> requests added before it
    tokens, step = {}, 0
    while step <= max(arrivals) or engine.has_unfinished_requests():
        for i in arrivals.get(step, []):
            engine.add_request(str(i), {"prompt_token_ids": batch[i]}, greedy(NEW_TOKENS * 2))
        for output in engine.step():
            tokens[int(output.request_id)] = list(output.outputs[0].token_ids)
        step += 1
    assert tokens == {i: generate_tokens(model, p, NEW_TOKENS * 2) for i, p in enumerate(batch)}


@pytest.mark.parametrize("kind", ["demo", "linear", "delta", "delta_window", "window_memory", "memory_heads"])
def test_batched_decode_step_equals_each_requests_own(kind):
    """One decode step of a recurrent layer for requests at different contexts, their state slots gathered into one
    batch and written back (`StateSlots.slot_batch`, `cache_layer`, `store`: rings rotated, memory positions
    shifted), leaves in each slot what that request's own transformers cache holds after the same step alone (a
    block end of the sparse memory included: position 127 and, 64 behind it, 63), and outputs what it outputs."""
    model = tiny_model(KINDS[kind])
    config, attention = model.config, model.model.layers[0].self_attn
    layer = VLLM_ATTENTION_CLASSES[type(attention)](config, 0)
    layer.load_state_dict(attention.state_dict())
    layer.specs = state_tensors(config, torch.float32)
    layer.kv_cache = tuple(torch.zeros(6, *shape, dtype=dtype) for _, shape, dtype in layer.specs)
    contexts, slots = ([127, 63], [4, 1]) if config.sparse_cache_size else ([100, 63, 125], [4, 1, 2])
    x = torch.randn(len(slots), 1, config.hidden_size, generator=torch.Generator().manual_seed(5))  # [B, 1, hidden]
    rotation = model.model.rotary_emb.rotation(x, torch.tensor(contexts)[:, None])  # [B, 1, 1, D] each
    expected_o, expected_state = [], []
    with torch.no_grad():
        for row, (context, slot) in enumerate(zip(contexts, slots, strict=True)):
            cache = LinearAttentionCache(config)
            model(torch.tensor(prompts((context,), seed=row)), cache=cache)
            for (name, _, _), tensor in zip(layer.specs, layer.kv_cache, strict=True):
                if name != PADDING:
                    tensor[slot] = getattr(cache.layers[0], name)[0]
            own = rotation._replace(cos=rotation.cos[row : row + 1], signed_sin=rotation.signed_sin[row : row + 1])
            q, k, v = attention.rotated_qkv(x[row : row + 1], own, None, cache.layers[0], None)
            expected_o.append(attention.attend(x[row : row + 1], q, k, v, None, cache.layers[0], None))
            expected_state.append(cache.layers[0])
        batch = layer.slot_batch(slots, contexts)
        cache_layer = layer.cache_layer(batch)
        q, k, v = layer.rotated_qkv(x, rotation, None, cache_layer, None)
        o = layer.attend(x, q, k, v, None, cache_layer, None)
        layer.store(cache_layer, batch)
    torch.testing.assert_close(o, torch.cat(expected_o))
    for (name, _, _), tensor in zip(layer.specs, layer.kv_cache, strict=True):
        for slot, state in zip(slots, expected_state, strict=True):
            if name != PADDING:
                torch.testing.assert_close(tensor[slot], getattr(state, name)[0], rtol=1e-5, atol=1e-5, msg=name)


def test_seeded_sampling_is_reproducible(served):
    llm = served[3]
    batch = [{"prompt_token_ids": p} for p in prompts((3, 50))]

    def sample(seed: int) -> list[list[int]]:
        params = SamplingParams(temperature=1.0, max_tokens=12, seed=seed, ignore_eos=True)
        return [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


@pytest.mark.parametrize("kind", list(KINDS))
def test_state_bytes_are_constant_and_those_of_the_cache(kind):
    """A request's state in vLLM is the transformers cache of its recurrent layers, byte for byte, whatever its
    context (the page adds alignment only); the softmax heads' growing keys and values are in vLLM's paged KV
    cache, not in the state."""
    model = tiny_model(KINDS[kind])
    recurrent = sum(model.config.layer_kind(i) != "softmax" for i in range(model.config.num_hidden_layers))
    specs = state_tensors(model.config, torch.float32)
    per_layer = sum(math.prod(shape) * dtype.itemsize for name, shape, dtype in specs if name != PADDING)
    assert sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs) % 8 == 0
    for length in (5, 300):
        cache = LinearAttentionCache(model.config)
        with torch.no_grad():
            model(torch.tensor(prompts((length,))), cache=cache)
        states = [layer for layer in cache.layers if isinstance(layer, LinearStateLayer)]
        assert len(states) == recurrent
        assert sum(tensor.numel() * tensor.element_size() for layer in states
                   for name, tensor in layer.tensors().items()
                   if name not in SoftmaxHeadsState.SOFTMAX_HEAD_TENSORS) == recurrent * per_layer


def linear_layer_products(model) -> list[tuple[str, bool, float]]:
    """For each nn.Linear of the vLLM model: its name, whether it multiplies with the engine's CPU kernel, and the
    largest difference of its product of 5 random rows from torch's."""
    generator, rows = torch.Generator().manual_seed(0), []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            x = torch.randn(5, module.in_features, generator=generator, dtype=module.weight.dtype)
            engine = getattr(module.forward, "func", None) is engine_linear
            difference = (module(x) - torch.nn.functional.linear(x, module.weight, module.bias)).abs().max()
            rows.append((name, engine, float(difference)))
    return rows


def test_linear_layers_multiply_with_the_engines_cpu_kernel(served):
    """Every projection, MLP and lm_head runs vLLM's packed CPU product (`use_engine_gemm`), which equals torch's."""
    [rows] = served[3].apply_model(linear_layer_products)
    assert rows and all(engine for _, engine, _ in rows), [name for name, engine, _ in rows if not engine]
    assert max(difference for _, _, difference in rows) < 1e-4


def test_prefix_caching_is_switched_off(served):
    """vLLM turns prefix caching on for hybrid models; a recurrent state is kept for a request's last token only."""
    assert not served[3].llm_engine.vllm_config.cache_config.enable_prefix_caching


@pytest.mark.parametrize("options, engine, error", [
    (KINDS["demo"], dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                             "prompt_lookup_max": 3}), "speculative decoding is not supported"),
])
def test_unsupported_option_is_refused_at_load(tmp_path, options, engine, error):
    save_with_tokenizer(tiny_model(options), tmp_path)
    with pytest.raises(ValueError, match=error):
        LLM(str(tmp_path), **ENGINE, **engine)


def test_transformers_loads_a_checkpoint_without_the_plugin(tmp_path):
    """The checkpoint's remote code does not include the vLLM model, and loading it with transformers (here, where
    vLLM is installed) imports neither vLLM nor the plugin."""
    save_with_tokenizer(tiny_model(KINDS["demo"]), tmp_path)
    assert not (tmp_path / "vllm_model.py").exists()
    code = ("import sys; from transformers import AutoModelForCausalLM; "
            "AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm' or m.endswith('vllm_model')))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True,
                         cwd=tmp_path, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_openai_server_answers_concurrent_clients_as_sequential_ones(tmp_path):
    """`vllm serve` on 127.0.0.1 (the demo's kind): 4 concurrent completion requests get the tokens the same
    requests get one at a time, and generate()'s; a request beyond the maximum length is refused, the server stays
    up."""
    import requests

    model = tiny_model(KINDS["demo"])
    save_with_tokenizer(model, tmp_path)
    port = free_port()
    server = subprocess.Popen(
        [os.path.join(os.path.dirname(sys.executable), "vllm"), "serve", str(tmp_path), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--max-model-len", "512", "--max-num-batched-tokens", "64",
         "--kv-cache-memory-bytes", str(64 << 20), "--gpu-memory-utilization", "0.05"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(server, url, "vllm serve", 240)
        batch = prompts((3, 40, 130, 250), seed=3)

        def complete(prompt: list[int]) -> list[int]:
            body = {"model": str(tmp_path), "prompt": prompt, "max_tokens": NEW_TOKENS, "min_tokens": NEW_TOKENS,
                    "temperature": 0, "ignore_eos": True, "return_token_ids": True}
            response = requests.post(f"{url}/v1/completions", json=body, timeout=120)
            response.raise_for_status()
            return response.json()["choices"][0]["token_ids"]

        sequential = [complete(p) for p in batch]
        with ThreadPoolExecutor(len(batch)) as pool:
            concurrent = list(pool.map(complete, batch))
        assert concurrent == sequential == [generate_tokens(model, p) for p in batch]
        # A request longer than the model's maximum is refused; the server keeps answering the others.
        too_long = {"model": str(tmp_path), "prompt": prompts((600,))[0], "max_tokens": 1}
        assert requests.post(f"{url}/v1/completions", json=too_long, timeout=60).status_code == 400
        assert complete(batch[0]) == sequential[0]
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_serving_benchmark_times_every_request_together_in_a_kv_cache_sized_for_them(tmp_path, monkeypatch, capsys):
    """benchmarks/bench_vllm.py end to end on a tiny Llama teacher (vLLM's head dim): `prepare` saves it and its
    conversions; `run` sizes each timed engine's KV cache from a first one too small for 3 teacher requests, times
    every (context, concurrency) on at least --new_tokens steps of all requests decoding, and counts the requests a
    budget holds; a given cache too small for the requests is refused with the option to raise."""
    from helpers import benchmark_module
    from transformers import LlamaConfig, LlamaForCausalLM

    bench = benchmark_module("bench_vllm.py")
    torch.manual_seed(0)
    save_with_tokenizer(LlamaForCausalLM(LlamaConfig(**{**TINY, **HEADS_SHAPE})).eval(), tmp_path / "teacher")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("feature_map: hedgehog\nfeature_dim: 16\nwindow_size: 16\nnum_sink_tokens: 2\n"
                      "softmax_heads: [auto:1]\nrestored_heads_n: 1\n")
    out = tmp_path / "out"
    assert bench.main(["prepare", "--teacher", str(tmp_path / "teacher"), "--recipe", str(recipe),
                       "--output_dir", str(out)]) == 0
    capacities = []
    monkeypatch.setattr(bench, "engine_capacity", lambda llm, measure=bench.engine_capacity: capacities.append(
        measure(llm)) or capacities[-1])
    # 200 + 2 + 4 tokens a request (`request_length`): 2 of vLLM's 128-token CPU pages, each 192 KiB of the teacher's
    # 3 layers x 2 KV heads; 4 pages hold 2 requests, fewer than 3
    probe = 4 * 128 * 3 * 2 * 2 * 32 * 4
    monkeypatch.setattr(bench, "PROBE_KV_BYTES", probe)
    run = ["run", "--output_dir", str(out), "--contexts", "200", "--concurrency", "1", "3", "--new_tokens", "2",
           "--budget_context", "256", "--budget_bytes", str(1 << 20)]
    assert bench.main([*run, "--models", "teacher", "converted_heads"]) == 0
    assert capacities[0] < 3 <= capacities[1]  # the teacher's probe, then its resized engine
    result = json.loads((out / "bench_vllm.json").read_text())
    assert [(r["model"], r["context"], r["concurrency"]) for r in result["rows"]] == [
        (model, 200, n) for model in ("teacher", "converted_heads") for n in (1, 3)]
    assert all(r["decode_steps"] >= 2 and r["per_token_latency_ms"] > 0 for r in result["rows"])
    assert set(result["concurrent_requests_in_budget"]) == {"teacher", "converted_heads"}
    assert "concurrent 256-token requests" in capsys.readouterr().out
    assert "concurrent 256-token requests" in (out / "bench_vllm.md").read_text()
    with pytest.raises(SystemExit, match="fewer than --concurrency 3; raise --kv_cache_bytes"):
        bench.main([*run, "--models", "teacher", "--kv_cache_bytes", str(probe)])
    with pytest.raises(SystemExit, match="teacher has 512 positions, fewer than the 600"):
        bench.main([*run, "--models", "teacher", "--budget_context", "600"])
