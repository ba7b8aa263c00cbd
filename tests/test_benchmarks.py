"""The benchmark scripts run end to end on tiny settings, so they cannot rot between real runs."""

import json

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
