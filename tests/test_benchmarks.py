"""The benchmark scripts run end to end on tiny settings, so they cannot rot between real runs."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from hf_linear_attn import InputError

# The models of the decode and train benchmarks' tests: one layer, hidden 32, vocabulary 64.
TINY_DECODE = ["--hidden_size", "32", "--num_attention_heads", "2", "--intermediate_size", "64",
               "--num_hidden_layers", "1", "--vocab_size", "64"]


@pytest.fixture
def bench_decode(benchmark_main, capsys):
    """benchmarks/bench_decode.py's `main` run in this process (`benchmark_main`): `bench_decode(*args)` returns what
    it printed. A subprocess per run cost ~9 s of imports on the suite's slow machine, more than the tiny runs
    themselves."""

    def run(*args: str) -> str:
        capsys.readouterr()
        assert benchmark_main("bench_decode.py", *args) == 0
        return capsys.readouterr().out

    yield run
    torch._dynamo.reset()  # --compile's graphs do not outlive the test


def test_decode_benchmark_runs_and_reports_constant_cache(bench_decode, tmp_path):
    stdout = bench_decode("--contexts", "16", "80", "--new_tokens", "2", "--warmup_tokens", "1", *TINY_DECODE,
                          "--prefill_chunk", "32", "--output_dir", str(tmp_path))
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    linear = [r for r in rows if r["model"] == "linear"]
    llama = [r for r in rows if r["model"] == "llama"]
    assert [r["context"] for r in linear] == [16, 80]
    assert linear[0]["cache_bytes"] == linear[1]["cache_bytes"] > 0
    assert llama[1]["cache_bytes"] > llama[0]["cache_bytes"]
    assert all(r["ms_per_token"] > 0 and "prefill_peak_mib" not in r for r in rows)
    assert "| linear | 80 |" in stdout
    # --peak_memory starts a child process per model and context (mostly imports: ~9 s each here); one child, the
    # linear model's at one context, runs the code that the others run (the child's flags, its prefill, its JSON).
    bench_decode("--models", "linear", "--contexts", "16", "--new_tokens", "2", "--warmup_tokens", "1", *TINY_DECODE,
                 "--prefill_chunk", "32", "--peak_memory", "--output_dir", str(tmp_path / "peak"))
    (row,) = json.loads((tmp_path / "peak" / "decode.json").read_text())["rows"]
    assert row["model"] == "linear" and row["ms_per_token"] > 0 and row["prefill_peak_mib"] >= 0


def test_decode_benchmark_compiles_and_batches_generate(bench_decode, tmp_path):
    """--compile with dynamo's aot_eager backend (the graph capture without inductor's C++ build, which
    tests/test_compile.py runs once): every variant decodes the eager tokens, the warm-up compiles and the timed
    run does not recompile; a left-padded batch of mixed lengths runs next to batch 1."""
    stdout = bench_decode("--contexts", "24", "--new_tokens", "3", "--warmup_tokens", "2", *TINY_DECODE,
                          "--window_size", "4", "--num_sink_tokens", "1", "--feature_map", "hedgehog",
                          "--feature_dim", "8", "--compile", "--compile_backend", "aot_eager", "--batch_size", "1",
                          "3", "--output_dir", str(tmp_path))
    rows = json.loads((tmp_path / "decode_generate.json").read_text())["rows"]
    assert {(r["model"], r["variant"], r["batch"]) for r in rows} == {
        (model, variant, batch) for batch in (1, 3) for model, variant in
        [("linear", "eager"), ("linear", "compiled"), ("llama", "eager"), ("llama", "static"), ("llama", "compiled")]}
    assert all(r["tokens_per_s"] > 0 and r["context"] == 24 for r in rows)
    assert all("vs_llama" in r for r in rows if r["model"] == "linear")
    compiled = [r for r in rows if r["variant"] == "compiled"]
    assert all(r["graphs"] >= 1 and r["graphs_while_timed"] == 0 for r in compiled)
    assert stdout.count("same greedy tokens as eager") == 6
    assert (tmp_path / "decode.json").exists()  # the batch-1 eager scaling table is written too


# The delta rule behind the window runs the left-padded batch alone: batch 1 (no pads) takes the loop's code that the
# additive hybrid's batch 1 runs, and each batch size compiles both compiled variants afresh (~4 s here).
@pytest.mark.parametrize("attention, batches", [([], (1, 3)), (["--attention", "delta_window"], (3,))])
def test_decode_loop_benchmark_times_every_variant_in_turn(bench_decode, tmp_path, attention, batches):
    """--timings loop alone: the loop table for a left-padded batch, compiled variants without recompiles while
    timed, the LM head timed alone; no scaling or generate() table. The additive hybrid, and the delta rule behind
    the window."""
    bench_decode("--contexts", "40", "--new_tokens", "3", "--warmup_tokens", "3", *TINY_DECODE, "--window_size", "4",
                 "--num_sink_tokens", "1", "--feature_map", "hedgehog", "--feature_dim", "8", *attention, "--compile",
                 "--compile_backend", "aot_eager", "--batch_size", *map(str, batches), "--timings", "loop",
                 "--output_dir", str(tmp_path))
    rows = json.loads((tmp_path / "decode_loop.json").read_text())["rows"]
    variants = ["eager", "compiled", "decoder eager", "decoder compiled"]
    assert {(r["model"], r["variant"], r["batch"]) for r in rows} == {
        (model, variant, batch) for batch in batches for model, variant in
        [*(("linear", v) for v in variants), ("llama", "eager")]}
    assert all(r["tokens_per_s"] > 0 and r["lm_head_ms"] > 0 and r["context"] == 40 for r in rows)
    assert all(r["graphs"] >= 1 and r["graphs_while_timed"] == 0 for r in rows if r["variant"].endswith("compiled"))
    # Eager steps have their aten operators counted; the LM head and the logits' argmax are a step's, not a decoder's.
    ops = {(r["variant"], r["batch"]): r.get("aten_ops") for r in rows if r["model"] == "linear"}
    assert ops["compiled", batches[0]] is None and ops["decoder eager", batches[0]] > 0
    assert all(ops["eager", batch] > ops["decoder eager", batch] for batch in batches)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".json") == ["decode_loop.json"]


def test_decode_benchmark_refuses_bad_arguments_before_running(bench_decode, tmp_path, capsys):
    for args, match in [(["--batch_size", "0"], "--batch_size must be positive"),
                        (["--timings", "loop", "prefill"], "--timings must be some of"),
                        (["--attention", "delta"], "--attention must be one of ['delta_window']")]:
        with pytest.raises(SystemExit) as exit_:  # one `error: ...` line and status 2, as a bad flag
            bench_decode(*args, "--output_dir", str(tmp_path))
        assert exit_.value.code == 2 and capsys.readouterr().err.startswith(f"error: {match}")
    assert not list(tmp_path.iterdir())


def test_a_benchmark_refuses_an_unknown_flag_as_argparse_does(benchmark_main, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        benchmark_main("bench_ops.py", "--lengths", "70", "--lenghts", "130", "--output_dir", str(tmp_path))
    assert exit_.value.code == 2 and "error: unrecognized arguments: --lenghts 130" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_op_benchmark_runs_and_computes_speedups(benchmark_main, tmp_path):
    assert benchmark_main("bench_ops.py", "--lengths", "70", "130", "--decays", "none", "vector", "--heads", "2",
                      "--head_dim", "8", "--repeats", "1", "--output_dir", str(tmp_path)) == 0
    rows = json.loads((tmp_path / "ops.json").read_text())["rows"]
    assert {(r["decay"], r["method"]) for r in rows} == {
        ("none", "torch"), ("none", "recurrent"), ("-", "sdpa"), ("vector", "torch"), ("vector", "recurrent")}
    chunked = [r for r in rows if r["method"] == "torch"]
    assert all(r["fwd_ms"] > 0 and "fwd_bwd_speedup_vs_recurrent" in r for r in chunked)
    assert all("fwd_speedup_vs_sdpa" in r for r in chunked)


def test_train_benchmark_runs(benchmark_main, tmp_path):
    assert benchmark_main("bench_train.py", "--seq_lens", "32", "--steps", "1", *TINY_DECODE,
                      "--output_dir", str(tmp_path)) == 0
    rows = json.loads((tmp_path / "train.json").read_text())["rows"]
    assert [r["model"] for r in rows] == ["elu", "llama"]
    assert all(r["tokens_per_s"] > 0 for r in rows)


def test_serving_benchmark_prepares_the_teacher_and_both_conversions_with_more_positions(benchmark_main, tmp_path):
    from helpers import save_with_tokenizer, teacher
    from transformers import AutoConfig

    save_with_tokenizer(teacher("llama"), tmp_path / "teacher")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("feature_map: elu\nwindow_size: 4\nnum_sink_tokens: 1\nsoftmax_layers_k: 1\n"
                      "softmax_heads: [auto:1]\nrestored_heads_n: 1\n")
    out = tmp_path / "out"
    assert benchmark_main("bench_vllm.py", "prepare", "--teacher", str(tmp_path / "teacher"), "--recipe",
                          str(recipe), "--max_positions", "4096", "--output_dir", str(out)) == 0
    configs = {name: AutoConfig.from_pretrained(out / name, trust_remote_code=True)
               for name in ("teacher", "converted", "converted_heads")}
    assert {c.max_position_embeddings for c in configs.values()} == {4096}
    assert configs["converted"].softmax_layers == [0] and configs["converted"].window_size == 4
    assert not configs["converted"].softmax_heads
    assert configs["converted_heads"].softmax_heads == {1: [0, 1]}  # one per recurrent layer, then the next head


def test_serving_benchmark_refuses_a_non_positive_position_count(benchmark_main, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        benchmark_main("bench_vllm.py", "prepare", "--teacher", str(tmp_path), "--max_positions", "0")
    assert exit_.value.code == 2 and "--max_positions must be a positive number" in capsys.readouterr().err


@pytest.mark.parametrize("flag, value", [("--kv_cache_bytes", "0"), ("--concurrency", "0"), ("--budget_bytes", "-1")])
def test_serving_benchmark_refuses_a_non_positive_size_before_any_engine(flag, value, tmp_path, capsys):
    """bench_vllm.py checks its sizes in the main venv too (vLLM is imported by `run` only): a zero KV cache is an
    error, not the default sizing."""
    from helpers import benchmark_module

    with pytest.raises(SystemExit) as exit_:
        benchmark_module("bench_vllm.py").main(["run", flag, value, "--output_dir", str(tmp_path)])
    assert exit_.value.code == 2 and f"error: {flag} must be positive, got {value}" in capsys.readouterr().err


def test_reach_benchmark_scores_each_length_as_its_own_forward_with_each_cap(benchmark_main, tmp_path):
    """bench_reach on a byte-level Llama and its conversion (positions trained: 64; the conversion holds its slow
    rotations there): each length's numbers are those of a forward of the window's first L tokens (they are read
    from one forward of the longest), the last quarter and the within-N references (every token, and the last
    quarter) are the losses of the tokens they name, the cap variants are the converted model with the cap as saved
    and removed, and the scaling variant is the teacher loaded with YaRN."""
    from helpers import WORDS
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_linear_attn import convert_to_linear_attention
    from hf_linear_attn.training.data import byte_level_tokenizer
    from hf_linear_attn.training.long_context_data import load_texts, long_documents

    tokenizer = byte_level_tokenizer()
    torch.manual_seed(0)
    teacher = LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2,
                                           max_position_embeddings=64)).eval()
    student = convert_to_linear_attention(teacher, feature_map="hedgehog", feature_dim=8, window_size=8,
                                          num_sink_tokens=2).eval()
    assert student.config.rope_position_cap == 64
    with torch.no_grad():  # feature maps far from their start and a sharp head: where tokens sit then shows
        for name, parameter in student.named_parameters():
            if "feature_map" in name:
                parameter.add_(torch.randn_like(parameter))
        student.lm_head.weight.mul_(30)
    for name, model in (("teacher", teacher), ("student", student)):
        model.save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    (tmp_path / "texts").mkdir()
    for s, source in enumerate(("kjv", "austen")):
        text = " ".join(WORDS[(5 * i + s) % len(WORDS)] for i in range(120))
        (tmp_path / "texts" / f"{source}.jsonl").write_text(json.dumps({"title": source, "text": text}) + "\n")
    assert benchmark_main("bench_reach.py", "--models", f"teacher={tmp_path / 'teacher'}",
                          f"student={tmp_path / 'student'}", "--lengths", "128", "256", "--position_caps", "none",
                          "--rope_scalings", "yarn:2",
                          "--within", "64", "--within_offset", "64", "--slice_tokens", "40",
                          "--long_context_data", str(tmp_path / "texts"),
                          "--output_dir", str(tmp_path / "out")) == 0
    rows = json.loads((tmp_path / "out" / "reach.json").read_text())["rows"]
    assert [(r["model"], r["variant"], r["text"], r["length"]) for r in rows] == [
        (model, variant, text, length) for model, variant in (("teacher", "as saved"), ("teacher", "yarn ×2"),
                                                               ("student", "as saved"), ("student", "cap none"))
        for text in ("kjv", "austen") for length in (128, 256)]
    documents = long_documents(tokenizer, load_texts(tmp_path / "texts"), document_tokens=256, documents_per_source=1)
    uncapped = convert_to_linear_attention(teacher, feature_map="hedgehog", feature_dim=8, window_size=8,
                                           num_sink_tokens=2).eval()
    uncapped.load_state_dict(student.state_dict())
    uncapped.config.rope_position_cap = None  # read at every call: holds at once
    yarn = LlamaForCausalLM.from_pretrained(tmp_path / "teacher", rope_parameters={
        **teacher.config.rope_parameters, "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 64})
    assert not torch.equal(yarn.model.rotary_emb.inv_freq, teacher.model.rotary_emb.inv_freq)
    models = {("teacher", "as saved"): teacher, ("teacher", "yarn ×2"): yarn.eval(), ("student", "as saved"): student,
              ("student", "cap none"): uncapped}
    for row in rows:
        ids = documents[row["text"] == "austen"].input_ids[None, :row["length"]]
        with torch.no_grad():
            losses = F.cross_entropy(models[row["model"], row["variant"]](ids).logits[0, :-1], ids[0, 1:],
                                     reduction="none")
        assert row["perplexity"] == pytest.approx(math.exp(losses.mean().item()), rel=1e-5)
        assert row["last_quarter"] == pytest.approx(math.exp(losses[-(row["length"] // 4):].mean().item()), rel=1e-5)
        for key, first in (("within", 0), ("within_offset", 64)):
            positions = torch.arange(first, first + 64)[None]  # windows read at 0-63, or 64-127 (past the cap)
            with torch.no_grad():  # the first 64 tokens whole, then windows of 64 scoring their last 32
                logits = models[row["model"], row["variant"]](ids[:, :64], position_ids=positions).logits
            within = [F.cross_entropy(logits[0, :-1], ids[0, 1:64], reduction="none")]
            for start in range(64, row["length"], 32):
                window = ids[:, start - 32:start + 32]
                with torch.no_grad():
                    logits = models[row["model"], row["variant"]](window, position_ids=positions).logits
                within.append(F.cross_entropy(logits[0, -33:-1], window[0, -32:], reduction="none"))
            within = torch.cat(within)
            assert len(within) == row["length"] - 1
            assert row[key] == pytest.approx(math.exp(within.mean().item()), rel=1e-5)
            last_quarter = within[-(row["length"] // 4):]
            assert row[f"last_quarter_{key}"] == pytest.approx(math.exp(last_quarter.mean().item()), rel=1e-5)
        # softmax attention with RoPE reads by distance alone, so where the windows sit is moot to the teacher; the
        # conversion's feature maps read rotated q and k, so it is not to the student (its readings differ by > 5e-4)
        same = row["last_quarter_within_offset"] == pytest.approx(row["last_quarter_within"], rel=1e-4)
        assert same == (row["model"] == "teacher")
    ids = documents[0].input_ids[None]
    with torch.no_grad():  # the two variants are two models past the cap (so the checks above tell them apart)
        torch.testing.assert_close(student(ids[:, :64]).logits, uncapped(ids[:, :64]).logits, rtol=0, atol=0)
        assert not torch.allclose(student(ids).logits, uncapped(ids).logits, atol=1e-5)


def test_reach_benchmark_refuses_what_it_cannot_use():
    """`--within_offset` reads the --within windows elsewhere: refused without --within, or below 0; a RoPE scaling
    with no factor, a factor below 1 or a type that needs more than a factor is refused too; all before any model is
    loaded."""
    from benchmarks.bench_reach import ReachArguments, check_arguments

    assert check_arguments(ReachArguments(models=["a=x"], lengths=[16384, 32768], within=8192,
                                           within_offset=8192)) == {"a": "x"}
    # lengths within N are read whole anyway: only the longer ones must split into windows of N
    assert check_arguments(ReachArguments(models=["a=x"], lengths=[4096, 8192, 16384, 32768], within=8192))
    assert check_arguments(ReachArguments(models=["a=x"], lengths=[4096, 12288], within=8192))
    with pytest.raises(InputError, match=r"--within 8192: an even number whose half divides every length above it "
                                         r"\(\[10240\]\)"):
        check_arguments(ReachArguments(models=["a=x"], lengths=[4096, 10240], within=8192))
    for scaling in ("yarn", "yarn:0.5", "ntk:2", "dynamic:x"):
        with pytest.raises(InputError, match=f"--rope_scalings takes type:factor items .* got '{scaling}'"):
            check_arguments(ReachArguments(models=["a=x"], rope_scalings=[scaling]))
    for within, offset in ((0, 8192), (8192, -1)):
        with pytest.raises(InputError, match=f"--within_offset {offset}: a position ≥ 0, and only with --within"):
            check_arguments(ReachArguments(models=["a=x"], lengths=[16384, 32768], within=within,
                                           within_offset=offset))
