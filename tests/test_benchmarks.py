"""The benchmark scripts run end to end on tiny settings, so they cannot rot between real runs."""

import json

import pytest
from helpers import run_script


def test_decode_benchmark_runs_and_reports_constant_cache(tmp_path):
    result = run_script("bench_decode.py", "--contexts", "16", "80", "--new_tokens", "2", "--warmup_tokens", "1",
                        "--hidden_size", "32", "--num_attention_heads", "2", "--intermediate_size", "64",
                        "--num_hidden_layers", "1", "--vocab_size", "64", "--prefill_chunk", "32", "--peak_memory",
                        "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "decode.json").read_text())["rows"]
    linear = [r for r in rows if r["model"] == "linear"]
    llama = [r for r in rows if r["model"] == "llama"]
    assert [r["context"] for r in linear] == [16, 80]
    assert linear[0]["cache_bytes"] == linear[1]["cache_bytes"] > 0
    assert llama[1]["cache_bytes"] > llama[0]["cache_bytes"]
    assert all(r["ms_per_token"] > 0 and "prefill_peak_mib" in r for r in rows)
    assert "| linear | 80 |" in result.stdout


def test_decode_benchmark_compiles_and_batches_generate(tmp_path):
    """--compile with dynamo's aot_eager backend (the graph capture without inductor's C++ build, which
    tests/test_compile.py runs once): every variant decodes the eager tokens, the warm-up compiles and the timed
    run does not recompile; a left-padded batch of mixed lengths runs next to batch 1."""
    result = run_script("bench_decode.py", "--contexts", "24", "--new_tokens", "3", "--warmup_tokens", "2",
                        "--hidden_size", "32", "--num_attention_heads", "2", "--intermediate_size", "64",
                        "--num_hidden_layers", "1", "--vocab_size", "64", "--window_size", "4", "--num_sink_tokens",
                        "1", "--feature_map", "hedgehog", "--feature_dim", "8", "--compile", "--compile_backend",
                        "aot_eager", "--batch_size", "1", "3", "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "decode_generate.json").read_text())["rows"]
    assert {(r["model"], r["variant"], r["batch"]) for r in rows} == {
        (model, variant, batch) for batch in (1, 3) for model, variant in
        [("linear", "eager"), ("linear", "compiled"), ("llama", "eager"), ("llama", "static"), ("llama", "compiled")]}
    assert all(r["tokens_per_s"] > 0 and r["context"] == 24 for r in rows)
    assert all("vs_llama" in r for r in rows if r["model"] == "linear")
    compiled = [r for r in rows if r["variant"] == "compiled"]
    assert all(r["graphs"] >= 1 and r["graphs_while_timed"] == 0 for r in compiled)
    assert result.stdout.count("same greedy tokens as eager") == 6
    assert (tmp_path / "decode.json").exists()  # the batch-1 eager scaling table is written too


@pytest.mark.parametrize("attention", [[], ["--attention", "delta_window"]])
def test_decode_loop_benchmark_times_every_variant_in_turn(tmp_path, attention):
    """--timings loop alone: the loop table for a left-padded batch, compiled variants without recompiles while
    timed, the LM head timed alone; no scaling or generate() table. The additive hybrid, and the delta rule behind
    the window."""
    result = run_script("bench_decode.py", "--contexts", "40", "--new_tokens", "3", "--warmup_tokens", "3",
                        "--hidden_size", "32", "--num_attention_heads", "2", "--intermediate_size", "64",
                        "--num_hidden_layers", "1", "--vocab_size", "64", "--window_size", "4", "--num_sink_tokens",
                        "1", "--feature_map", "hedgehog", "--feature_dim", "8", *attention, "--compile",
                        "--compile_backend", "aot_eager", "--batch_size", "1", "3", "--timings", "loop",
                        "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "decode_loop.json").read_text())["rows"]
    variants = ["eager", "compiled", "decoder eager", "decoder compiled"]
    assert {(r["model"], r["variant"], r["batch"]) for r in rows} == {
        (model, variant, batch) for batch in (1, 3) for model, variant in
        [*(("linear", v) for v in variants), ("llama", "eager")]}
    assert all(r["tokens_per_s"] > 0 and r["lm_head_ms"] > 0 and r["context"] == 40 for r in rows)
    assert all(r["graphs"] >= 1 and r["graphs_while_timed"] == 0 for r in rows if r["variant"].endswith("compiled"))
    # Eager steps have their aten operators counted; the LM head and the logits' argmax are a step's, not a decoder's.
    ops = {(r["variant"], r["batch"]): r.get("aten_ops") for r in rows if r["model"] == "linear"}
    assert ops["compiled", 1] is None and ops["decoder eager", 1] > 0
    assert all(ops["eager", batch] > ops["decoder eager", batch] for batch in (1, 3))
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".json") == ["decode_loop.json"]


def test_decode_benchmark_refuses_bad_arguments_before_running(tmp_path):
    result = run_script("bench_decode.py", "--batch_size", "0", "--output_dir", str(tmp_path))
    assert result.returncode != 0 and "--batch_size must be positive" in result.stderr
    assert not list(tmp_path.iterdir())
    result = run_script("bench_decode.py", "--timings", "loop", "prefill", "--output_dir", str(tmp_path))
    assert result.returncode != 0 and "--timings must be some of" in result.stderr
    result = run_script("bench_decode.py", "--attention", "delta", "--output_dir", str(tmp_path))
    assert result.returncode != 0 and "--attention must be one of ['delta_window']" in result.stderr
    assert not list(tmp_path.iterdir())


def test_op_benchmark_runs_and_computes_speedups(tmp_path):
    result = run_script("bench_ops.py", "--lengths", "70", "130", "--decays", "none", "vector", "--heads", "2",
                        "--head_dim", "8", "--repeats", "1", "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "ops.json").read_text())["rows"]
    assert {(r["decay"], r["method"]) for r in rows} == {
        ("none", "torch"), ("none", "recurrent"), ("-", "sdpa"), ("vector", "torch"), ("vector", "recurrent")}
    chunked = [r for r in rows if r["method"] == "torch"]
    assert all(r["fwd_ms"] > 0 and "fwd_bwd_speedup_vs_recurrent" in r for r in chunked)
    assert all("fwd_speedup_vs_sdpa" in r for r in chunked)


def test_train_benchmark_runs(tmp_path):
    result = run_script("bench_train.py", "--seq_lens", "32", "--steps", "1", "--hidden_size", "32",
                        "--num_attention_heads", "2", "--intermediate_size", "64", "--num_hidden_layers", "1",
                        "--vocab_size", "64", "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((tmp_path / "train.json").read_text())["rows"]
    assert [r["model"] for r in rows] == ["elu", "llama"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
