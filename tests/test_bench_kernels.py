"""benchmarks/bench_kernels.py runs end to end on CPU (--dry-run: tiny shapes), so the GPU benchmark cannot rot."""

import json
import textwrap

from helpers import run_script

from hf_linear_attn.ops_triton import HAS_TRITON

# flash-linear-attention needs a GPU; this stand-in has its ops' signatures and runs our torch backend.
FAKE_FLA_OPS = textwrap.dedent(
    '''
    from hf_linear_attn import linear_attention

    def chunk_linear_attn(q, k, v, scale=None, normalize=True):
        assert not normalize  # fla's own normaliser differs from ours: the benchmark must turn it off
        return linear_attention(q, k, v, scale=scale, backend="torch")

    def chunk_simple_gla(q, k, v, g, scale=None):
        assert g.shape == q.shape[:3]
        return linear_attention(q, k, v, g, scale=scale, backend="torch")

    def chunk_gla(q, k, v, g, scale=None):
        assert g.shape == q.shape
        return linear_attention(q, k, v, g, scale=scale, backend="torch")
    '''
)


def test_kernel_benchmark_dry_run(tmp_path, monkeypatch):
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("")
    (tmp_path / "fla" / "ops.py").write_text(FAKE_FLA_OPS)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    out = tmp_path / "out"
    result = run_script("bench_kernels.py", "--dry-run", "--output_dir", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads((out / "kernels.json").read_text())["rows"]
    ours = ["ours:torch", "ours:triton"] if HAS_TRITON else ["ours:torch"]
    methods = {(r["method"], r["decay"]) for r in rows}
    assert methods == {(m, d) for m in [*ours, "fla"] for d in ("none", "scalar", "vector")} | {("sdpa", "-")}
    assert sorted({r["shape"] for r in rows}) == ["1x32x1x16", "1x70x1x16"]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_bwd_tflops"] > 0 for r in rows)
    assert all("fwd_bwd_vs_fla" in r and "fwd_bwd_speedup_vs_sdpa" in r for r in rows if r["method"] in ours)
    assert "| 1x70x1x16 | vector | fla |" in result.stdout
