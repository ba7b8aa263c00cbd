"""benchmarks/kernel_report.py and benchmarks/gpu_check.py run end to end on CPU (their dry modes), so the GPU
report and the one-shot GPU check cannot rot before a GPU is there to run them."""

import json
import textwrap

import pytest
import torch
from helpers import benchmark_module, run_script

from hf_linear_attn.ops_triton_common import HAS_TRITON

# fla's chunk ops run on a GPU (or in the interpreter with fla installed); this stand-in has their signatures and
# runs our torch backend, so the report's fla columns and ratios are exercised without fla.
FAKE_FLA_OPS = textwrap.dedent(
    '''
    from hf_linear_attn import linear_attention

    def chunk_simple_gla(q, k, v, g=None, scale=None):
        assert g is None or g.shape == q.shape[:3]
        return linear_attention(q, k, v, g, scale=scale, backend="torch")

    def chunk_gla(q, k, v, g, scale=None):
        assert g.shape == q.shape
        return linear_attention(q, k, v, g, scale=scale, backend="torch")
    '''
)
# The kernel benchmark's ops, one failing as an fla build that does not run on some GPU would: that row records the
# error, and the benchmark goes on.
FAKE_FLA_WITH_A_FAILING_OP = FAKE_FLA_OPS + textwrap.dedent(
    '''
    def chunk_linear_attn(q, k, v, scale=None, normalize=True):
        raise RuntimeError("this fla has no chunk_linear_attn")
    '''
)


def write_fake_fla(folder, ops: str):
    """The package fla with `ops` as fla.ops, in `folder` (a path entry)."""
    (folder / "fla").mkdir(parents=True)
    (folder / "fla" / "__init__.py").write_text("")
    (folder / "fla" / "ops.py").write_text(ops)
    return folder


@pytest.mark.skipif(not HAS_TRITON, reason="the report compiles and interprets Triton kernels")
def test_kernel_report_dry(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the report compiles; it interprets in a child
    fla_dir = write_fake_fla(tmp_path / "fla_packages", FAKE_FLA_OPS)
    result = run_script("kernel_report.py", "--dry", "--fla_dir", str(fla_dir), "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    traffic = json.loads((tmp_path / "kernel_traffic.json").read_text())
    assert traffic["fla_error"] is None
    rows = traffic["rows"]
    assert [(r["shape"], r["decay"]) for r in rows] == [("2x256x3x16", d) for d in ("none", "scalar", "vector")]
    for row in rows:
        assert row["ours_total_gb"] == pytest.approx(row["ours_fwd_gb"] + row["ours_bwd_gb"])
        assert row["ours_fwd_gb"] > 0 and row["ours_bwd_gb"] > row["ours_fwd_gb"] / 2
        assert row["ours_vs_fla"] == pytest.approx(row["ours_total_gb"] / row["fla_total_gb"])
        assert row["ours_fit_error"] < 0.01  # linear in T, checked at a third T (the stand-in fla need not be)
        assert row["fla_fit_error"] >= 0
    detail = next(v for k, v in traffic.items() if k.startswith("detail_"))
    ours_kernels = {d["row"] for d in detail if d["method"] == "ours" and d["row"].startswith("kernel ")}
    assert "kernel _chunk_output_kernel" in ours_kernels and "kernel _state_pass_kernel" in ours_kernels
    # a vector decay is read and its gradient written: more bytes than no decay, in our kernels alone
    kernel_bytes = {decay: sum(d["read"] + d["written"] for d in detail if d["method"] == "ours"
                               and d["decay"] == decay and d["row"].startswith("kernel "))
                    for decay in ("none", "vector")}
    assert kernel_bytes["vector"] > kernel_bytes["none"]
    compiled = json.loads((tmp_path / "kernel_compile.json").read_text())["all"]
    assert len(compiled) == 1 and all("error" not in r for r in compiled)
    assert all(r["registers"] > 0 and r["shared_bytes"] >= 0 and r["spill_stores"] >= 0 for r in compiled)
    assert "kernel configs compiled for sm_90" in result.stdout and "| 2x256x3x16 | vector |" in result.stdout


@pytest.mark.skipif(not HAS_TRITON, reason="the report compiles Triton kernels")
def test_kernel_report_pruned_configs_do_not_spill(tmp_path, monkeypatch):
    """What the pruners (`usable_configs`, `_dqk_value_blocks`) and the launchers' block sizes leave compiles for sm_90
    without spilling registers at head dim 64, with at least one config per specialization: the dq/dk kernel in every
    decay mode with and without normalize's extra value column and in the window's linear part, the per-key-dim
    decay's gradient kernel and the window's backward kernels (the sinks' one included)."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernels = ["_chunk_dqk_kernel", "_vector_grads_kernel", "_window_dq_kernel", "_window_dkdv_kernel",
               "_window_sink_dkdv_kernel"]
    result = run_script("kernel_report.py", "--parts", "compile", "--compile_dims", "64", "--kernels", *kernels,
                        "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert not (tmp_path / "kernel_traffic.json").exists()  # --parts compile only
    rows = json.loads((tmp_path / "kernel_compile.json").read_text())["all"]
    specializations = {(r["kernel"], r["modes"]) for r in rows}
    assert {kernel for kernel, _ in specializations} == set(kernels)
    assert len([s for s in specializations if s[0] == "_chunk_dqk_kernel"]) == 7  # 3 decays x 2 V, the window's
    assert all("error" not in r for r in rows), rows
    assert [r for r in rows if r["spill_stores"] or r["spill_loads"]] == []
    assert all(r["config"].endswith("warps=8 stages=2") for r in rows)  # 4 warps or 3 stages spill at 64


@pytest.mark.skipif(not HAS_TRITON, reason="the report compiles Triton kernels")
def test_kernel_report_delta_rule_backward_does_not_spill(tmp_path, monkeypatch):
    """The delta rule's backward kernels (whole [CHUNK, K] tiles in the reverse state pass, K blocks in dq/dk, the
    [CHUNK, CHUNK] gradients apart) compile for sm_90 without spilling registers at K = V = 64 and 128, with and
    without decay, in every config the autotuner may pick."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    kernels = ["_delta_reverse_state_pass_kernel", "_delta_score_grads_kernel", "_delta_chunk_dqk_kernel"]
    result = run_script("kernel_report.py", "--parts", "compile", "--compile_dims", "64", "128", "--kernels", *kernels,
                        "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = json.loads((tmp_path / "kernel_compile.json").read_text())["all"]
    assert {r["kernel"] for r in rows} == set(kernels)
    assert len({(r["kernel"], r["modes"]) for r in rows}) == len(rows) == 12  # 2 dims x 2 decays, one config each
    assert all("error" not in r for r in rows), rows
    assert [r for r in rows if r["spill_stores"] or r["spill_loads"]] == []


def test_gpu_check_dry_stages(tmp_path, monkeypatch):
    """Each stage runs in its own process; the kernels stage writes the benchmark's report, a failing op's
    row included; the compiled decode steps (dry: captured whole by dynamo, run without codegen) give the eager
    tokens; deepspeed is skipped with a line when not installed; every stage's output lands in gpu_check.log."""
    monkeypatch.setenv("PYTHONPATH", str(write_fake_fla(tmp_path / "fla_packages", FAKE_FLA_WITH_A_FAILING_OP)))
    result = run_script("gpu_check.py", "--dry", "--stages", "kernels", "decode", "decode_compiled", "deepspeed",
                        "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert summary["versions"]["torch"] == torch.__version__ and summary["versions"]["fla-core"] == "not installed"
    assert list(summary["stages"]) == ["kernels", "decode", "decode_compiled", "deepspeed"]
    assert all(r["status"] == "ok" for r in summary["stages"].values()), summary
    kernels = summary["stages"]["kernels"]["rows"]
    assert json.loads((tmp_path / "kernels.json").read_text())["rows"] == kernels
    failed = [r for r in kernels if "error" in r]
    assert summary["stages"]["kernels"]["failed_rows"] == len(failed) == 2  # fla, no decay, at T = 32 and 70
    assert all(r["method"] == "fla" and r["decay"] == "none" and "no chunk_linear_attn" in r["error"] for r in failed)
    measured = [r for r in kernels if "error" not in r]
    assert {r["method"] for r in measured} >= {"ours:torch", "fla", "sdpa"}
    assert all(r["fwd_bwd_ms"] > 0 for r in measured)
    ours = [r for r in measured if r["method"].startswith("ours")]
    assert all(("fwd_bwd_vs_fla" in r) == (r["decay"] != "none") for r in ours)
    decode = summary["stages"]["decode"]["rows"]
    models = ("linear", "hybrid", "hybrid torch step", "llama")
    assert {(r["model"], r["context"]) for r in decode} == {(m, c) for m in models for c in (16, 80)}
    assert all(r["ms_per_token"] > 0 for r in decode)
    compiled = summary["stages"]["decode_compiled"]["rows"]
    assert {(r["model"], r["context"]) for r in compiled} == {(m, c) for m in ("hybrid compiled", "llama compiled")
                                                              for c in (16, 80)}
    assert all(r["ms_per_token"] > 0 and r["eager_ms_per_token"] > 0 and r["same_tokens_as_eager"] for r in compiled)
    deepspeed = summary["stages"]["deepspeed"]
    assert "rows" in deepspeed or deepspeed["skipped"] == "deepspeed is not installed"
    log = (tmp_path / "gpu_check.log").read_text()
    assert "== kernels: ok" in log and "decode hybrid torch step context     80" in log and "== deepspeed: ok" in log
    assert (tmp_path / "gpu_check.png").exists()


def test_gpu_check_stops_a_late_stage_and_keeps_to_its_budget(tmp_path):
    """A stage past its time box is stopped and recorded, and the check goes on: with a 1 s budget the first stage
    (its process cannot even import torch in that time) times out and the next is not started."""
    result = run_script("gpu_check.py", "--dry", "--stages", "decode", "train", "--budget_s", "1",
                        "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    stages = json.loads((tmp_path / "gpu_check.json").read_text())["stages"]
    assert stages["decode"]["status"] == "timed out" and "rows" not in stages["decode"]
    assert stages["train"] == {"status": "not run", "reason": "--budget_s 1.0 spent"}


def test_gpu_check_rejects_unknown_stages(tmp_path, capsys):
    # In this process (a subprocess is ~9 s of imports here): main refuses, as a bad flag (one `error: ...` line,
    # status 2), before it touches the environment.
    with pytest.raises(SystemExit) as exit_:
        benchmark_module("gpu_check.py").main(["--dry", "--stages", "decode", "warp_drive", "--output_dir",
                                               str(tmp_path)])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith("error: unknown stages ['warp_drive']")
    assert not list(tmp_path.iterdir())
