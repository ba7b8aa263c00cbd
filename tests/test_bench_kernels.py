"""benchmarks/bench_kernels.py runs end to end on CPU (--dry-run: tiny shapes), so the GPU benchmark cannot rot."""

import json
import sys
import textwrap

from helpers import benchmark_module

from hf_linear_attn.ops_triton_common import HAS_TRITON

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


def test_kernel_benchmark_dry_run(tmp_path, monkeypatch, capsys):
    (tmp_path / "fla").mkdir()
    (tmp_path / "fla" / "__init__.py").write_text("")
    (tmp_path / "fla" / "ops.py").write_text(FAKE_FLA_OPS)
    # bench_kernels' main in this process, the interpreter already chosen (conftest): a subprocess spends ~9 s of
    # the suite's slow machine importing. The stand-in fla is imported from tmp_path, and forgotten afterwards.
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("fla", "fla.ops"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    out = tmp_path / "out"
    try:
        assert benchmark_module("bench_kernels.py").main(["--dry-run", "--output_dir", str(out)]) == 0
    finally:
        for name in ("fla", "fla.ops"):
            sys.modules.pop(name, None)
    stdout = capsys.readouterr().out
    rows = json.loads((out / "kernels.json").read_text())["rows"]
    ours = ["ours:torch", "ours:triton"] if HAS_TRITON else ["ours:torch"]
    methods = {(r["method"], r["decay"]) for r in rows}
    assert methods == {(m, d) for m in [*ours, "fla"] for d in ("none", "scalar", "vector")} | {("sdpa", "-")}
    assert sorted({r["shape"] for r in rows}) == ["1x32x1x16", "1x70x1x16"]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_bwd_tflops"] > 0 for r in rows)
    assert all("fwd_bwd_vs_fla" in r and "fwd_bwd_speedup_vs_sdpa" in r for r in rows if r["method"] in ours)
    assert "| 1x70x1x16 | vector | fla |" in stdout
