"""Registration, safetensors checkpoints and Hub-style remote code.

The remote-code test loads the checkpoint in a fresh Python process in which
`import hf_linear_attn` fails, as on a machine where this package is not installed.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import tiny_model, triton_modules
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

import hf_linear_attn
from hf_linear_attn import LinearAttentionConfig, LinearAttentionForCausalLM, LinearAttentionModel
from hf_linear_attn.checkpoint_code import checkpoint_code_problems, code_files
from hf_linear_attn.configuration_linear_attention import AUTO_MAP

CHECKPOINT_VARIANT = {"feature_map": "hedgehog", "feature_dim": 8, "window_size": 6, "num_sink_tokens": 1,
                      "softmax_layers": [1], "softmax_heads": {0: [1]}, "use_qk_norm": True}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A saved tiny checkpoint with non-trivial learned parameters, its input and reference outputs."""
    path = tmp_path_factory.mktemp("checkpoint")
    model = tiny_model(seed=3, **CHECKPOINT_VARIANT)
    with torch.no_grad():  # move learned parameters away from their init so loading them is tested
        for name, p in model.named_parameters():
            if "feature_map" in name or "window_gate" in name:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(path)
    ids = torch.randint(3, 128, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
    generated = model.generate(ids, max_new_tokens=5, do_sample=False, use_cache=False, eos_token_id=None)
    torch.save({"ids": ids, "logits": logits, "generated": generated}, path / "expected.pt")
    return path


def test_auto_classes_resolve_after_import():
    config = AutoConfig.for_model("linear_attention", vocab_size=64, hidden_size=32, num_attention_heads=2,
                                  intermediate_size=64, num_hidden_layers=1)
    assert isinstance(config, LinearAttentionConfig)
    assert isinstance(AutoModel.from_config(config), LinearAttentionModel)
    assert isinstance(AutoModelForCausalLM.from_config(config), LinearAttentionForCausalLM)


def test_checkpoint_files_and_auto_map(saved):
    files = set(os.listdir(saved))
    assert "model.safetensors" in files
    assert not any(f.endswith(".bin") for f in files)
    triton_files = [Path(module.__file__).name for module in triton_modules()]
    for module in ("configuration_linear_attention.py", "modeling_linear_attention.py", "feature_maps.py",
                   "ops.py", "backends.py", *triton_files):
        assert module in files, module
    auto_map = json.loads((saved / "config.json").read_text())["auto_map"]
    assert auto_map == {
        "AutoConfig": "configuration_linear_attention.LinearAttentionConfig",
        "AutoModel": "modeling_linear_attention.LinearAttentionModel",
        "AutoModelForCausalLM": "modeling_linear_attention.LinearAttentionForCausalLM",
    }


class EngineMixin:
    """Stands in for the class a training engine mixes into the model's (FSDP2's `fully_shard` does this)."""


def test_a_model_whose_class_an_engine_swapped_saves_as_the_projects_model(tmp_path):
    """FSDP2 replaces the model's class by `FSDPLinearAttentionForCausalLM(FSDPModule, LinearAttentionForCausalLM)`,
    defined in torch's module: the save still names and copies only this package's code, and the model keeps the
    engine's class afterwards."""
    model = tiny_model()
    engine_class = type("FSDPLinearAttentionForCausalLM", (EngineMixin, LinearAttentionForCausalLM),
                        {"__module__": "torch.distributed.fsdp._fully_shard._fsdp_init"})
    model.__class__ = engine_class
    model.save_pretrained(tmp_path / "saved")
    assert type(model) is engine_class
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["architectures"] == ["LinearAttentionForCausalLM"]
    assert {path.name for path in (tmp_path / "saved").glob("*.py")} == code_files().keys()
    assert checkpoint_code_problems(tmp_path / "saved") == []


def test_a_checkpoint_saved_with_an_engines_code_loads_here_with_a_warning_naming_the_repair(saved, tmp_path,
                                                                                               caplog):
    """Such a checkpoint from an older version (auto_map naming the engine's class, the engine's files beside the
    weights) loads where the package is installed (its classes win over auto_map), with a warning that says where it
    fails and the one command that repairs it."""
    broken = tmp_path / "broken"
    shutil.copytree(saved, broken)
    config = json.loads((broken / "config.json").read_text())
    config["auto_map"]["AutoModelForCausalLM"] = "_fsdp_init.FSDPLinearAttentionForCausalLM"
    (broken / "config.json").write_text(json.dumps(config))
    (broken / "_fsdp_init.py").write_text("# torch's file\n")
    problems = checkpoint_code_problems(broken)
    assert len(problems) == 2 and "_fsdp_init.FSDPLinearAttentionForCausalLM" in problems[0]
    assert "_fsdp_init.py" in problems[1]
    model = AutoModelForCausalLM.from_pretrained(broken, trust_remote_code=True)
    assert type(model) is LinearAttentionForCausalLM
    warnings = [record.getMessage() for record in caplog.records if record.levelname == "WARNING"]
    assert any("_fsdp_init.FSDPLinearAttentionForCausalLM" in text and "hf-linear-attn-export --model_name_or_path "
               "CHECKPOINT_DIR --output_dir CHECKPOINT_DIR" in text for text in warnings), warnings
    caplog.clear()
    AutoModelForCausalLM.from_pretrained(saved)
    assert not [record for record in caplog.records if "auto_map" in record.getMessage()]


def relative_imports(module: Path) -> set[str]:
    """The package modules a source file imports relatively (`from .name import ...`), as transformers reads them."""
    return set(re.findall(r"^\s*from\s+\.(\w+)\s+import", module.read_text(), flags=re.MULTILINE))


def test_every_module_a_checkpoint_needs_is_a_direct_import_of_its_entry_files():
    """transformers 5.5 copies only the *direct* relative imports of the config and model files into a checkpoint's
    remote-code cache: every module they reach through other modules must be named in one of them too."""
    package = Path(hf_linear_attn.__file__).parent
    entry = {"configuration_linear_attention", "modeling_linear_attention"}
    direct = set().union(*(relative_imports(package / f"{name}.py") for name in entry))
    reached, todo = set(), list(entry)
    while todo:
        name = todo.pop()
        if name not in reached:
            reached.add(name)
            todo.extend(relative_imports(package / f"{name}.py"))
    assert reached - entry <= direct, sorted(reached - entry - direct)


def test_load_after_import_without_remote_code(saved):
    expected = torch.load(saved / "expected.pt")
    model = AutoModelForCausalLM.from_pretrained(saved).eval()
    assert type(model) is LinearAttentionForCausalLM
    with torch.no_grad():
        assert torch.equal(model(expected["ids"]).logits, expected["logits"])
    base = AutoModel.from_pretrained(saved)
    assert type(base) is LinearAttentionModel


def test_dtype_on_load(saved):
    model = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    expected = torch.load(saved / "expected.pt")
    with torch.no_grad():
        logits = model(expected["ids"]).logits
    torch.testing.assert_close(logits.float(), expected["logits"], atol=0.15, rtol=0.05)


FRESH_PROCESS = textwrap.dedent(
    """
    import sys
    sys.modules["hf_linear_attn"] = None  # make `import hf_linear_attn` fail, as if not installed
    try:
        import hf_linear_attn  # noqa: F401
        raise SystemExit("hf_linear_attn should not be importable here")
    except ImportError:
        pass
    import torch
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    path = sys.argv[1]
    expected = torch.load(path + "/expected.pt")
    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    assert type(config).__name__ == "LinearAttentionConfig", type(config)
    model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        logits = model(expected["ids"]).logits
    assert torch.equal(logits, expected["logits"]), (logits - expected["logits"]).abs().max()
    generated = model.generate(expected["ids"], max_new_tokens=5, do_sample=False, use_cache=False,
                               eos_token_id=None)
    assert torch.equal(generated, expected["generated"])
    cached = model.generate(expected["ids"], max_new_tokens=5, do_sample=False, eos_token_id=None)
    assert torch.equal(cached, expected["generated"])  # the remote copy of LinearAttentionCache
    base = AutoModel.from_pretrained(path, trust_remote_code=True)
    assert type(base).__name__ == "LinearAttentionModel"
    print("REMOTE-CODE-OK")
    """
)


def test_remote_code_loads_where_the_package_is_not_installed(saved, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    # Run from an empty folder so that the repository checkout is not on sys.path either.
    result = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(saved)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REMOTE-CODE-OK" in result.stdout


def test_a_checkpoint_read_past_its_positions_reads_so_where_the_package_is_not_installed(tmp_path):
    """`rope_position_cap` and `softmax_log_length_scale` are saved in config.json and honoured by the remote code:
    past the trained positions, a process without the package gives this process's logits (and not those of the
    model without either)."""
    from helpers import stranger_logits

    model = tiny_model(max_position_embeddings=64, rope_position_cap=16, head_dim=32, window_size=8,
                       num_sink_tokens=2, softmax_heads={1: [0]}, softmax_log_length_scale=0.5).eval()
    model.save_pretrained(tmp_path / "capped")
    saved = json.loads((tmp_path / "capped" / "config.json").read_text())
    assert (saved["rope_position_cap"], saved["softmax_log_length_scale"]) == (16, 0.5)
    ids = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids).logits
    got = stranger_logits(tmp_path / "stranger", ids, tmp_path / "capped")[str(tmp_path / "capped")]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
    for option in ({"rope_position_cap": None}, {"softmax_log_length_scale": 0.0}):
        other = AutoModelForCausalLM.from_pretrained(tmp_path / "capped", **option).eval()
        with torch.no_grad():
            assert not torch.allclose(other(ids).logits, expected, atol=1e-4), option
