"""Every recipe in configs/ parses with the dataclasses of the script it is written for (the GPU recipes of
configs/gpu/: tests/test_gpu_recipes.py)."""

import os
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from helpers import save_with_tokenizer, teacher
from transformers import AutoTokenizer

from hf_linear_attn.configuration_linear_attention import ATTENTION_OPTIONS, AttentionOptions
from hf_linear_attn.conversion import DEFAULT_ATTENTION_OPTIONS, load_teacher
from hf_linear_attn.layer_selection import parse_softmax_layers
from hf_linear_attn.training.checkpoint_conversion import ConversionArguments
from hf_linear_attn.training.demo import DEFAULT_RECIPE as DEMO_RECIPE
from hf_linear_attn.training.demo import DemoArguments
from hf_linear_attn.training.recipes import attention_arguments, attention_options, parse_recipe_args

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
def test_recipe_with_an_unknown_key_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("window: 64\n")
    with pytest.raises(SystemExit):
        parse_recipe_args(ConversionArguments, ["--config", str(bad)])
    assert "unknown key(s) ['window']" in capsys.readouterr().err


def test_the_delta_rule_demo_is_the_demo_with_another_layer_kind():
    # configs/demo_delta_window.yaml is compared with configs/demo.yaml in the README: everything but the
    # attention layers (and what only the additive hybrid has: its γ schedule, the sparse memory) must match.
    default = parse_recipe_args(DemoArguments, [], default_recipe=DEMO_RECIPE)
    delta = parse_recipe_args(DemoArguments, ["--config", str(CONFIGS / "demo_delta_window.yaml")])
    options = AttentionOptions(**attention_options(delta))  # valid together
    assert (options.update_rule, options.window_size, options.num_sink_tokens) == ("delta", 64, 4)
    additive_only = {"recovery_window_weight", "sparse_cache_sizes", "output_dir"}
    differing = {f.name for f in fields(DemoArguments) if getattr(default, f.name) != getattr(delta, f.name)}
    assert differing - set(ATTENTION_OPTIONS) == additive_only


@pytest.mark.parametrize("arguments", [ConversionArguments, DemoArguments], ids=["convert", "demo"])
def test_scripts_take_every_attention_option_as_declared(arguments):
    declared = {f.name: f for f in fields(AttentionOptions)}
    own = {f.name: f for f in fields(arguments)}
    widened = {"softmax_layers"} if arguments is ConversionArguments else set()  # convert also takes `auto:K`
    for name in set(ATTENTION_OPTIONS) - widened:
        assert own[name].metadata == declared[name].metadata, name  # same help and choices
    parsed = parse_recipe_args(arguments, ["--decay_low_rank_dim", "8", "--softmax_layers", "1", "0"])
    assert attention_options(parsed)["decay_low_rank_dim"] == 8
    assert parse_softmax_layers(attention_options(parsed)["softmax_layers"], num_layers=2).layers == (0, 1)


def test_script_defaults():
    assert attention_options(ConversionArguments()) == DEFAULT_ATTENTION_OPTIONS
    assert attention_options(DemoArguments()) == {**DEFAULT_ATTENTION_OPTIONS, "feature_dim": 32}
    demo = parse_recipe_args(DemoArguments, [], default_recipe=DEMO_RECIPE)
    # The demo's recipe adds a decayed linear part with a short starting memory and a 96-token window; γ starts at the
    # default 0.5 and is raised to 0.99 for stage 2 (configs/demo.yaml).
    assert attention_options(demo) == {**DEFAULT_ATTENTION_OPTIONS, "feature_dim": 32, "decay": "scalar",
                                       "decay_horizon": 256, "window_size": 96}
    assert DemoArguments().recovery_window_weight is None and demo.recovery_window_weight == 0.99


def test_attention_arguments_refuse_bad_defaults_and_keep_lists_apart():
    with pytest.raises(ValueError, match="`normalize`"):
        attention_arguments("Bad", window_size=8, normalize=False)
    arguments = attention_arguments("WithLayers", softmax_layers=[1])
    first, second = arguments(), arguments()
    first.softmax_layers.append(2)
    assert second.softmax_layers == [1]


def test_the_demo_refuses_a_recovery_window_weight_without_a_window(tmp_path, capsys):
    from hf_linear_attn.training import demo
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("window_size: 0\nnum_sink_tokens: 0\nrecovery_window_weight: 0.9\n")
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--config", str(recipe), "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "`recovery_window_weight`=0.9 (float): only an additive window-hybrid layer" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("argv, named", [
    (["--feature_map", "identity", "--feature_dim", "32"], "feature_dim"),
    (["--window_size", "0", "--num_sink_tokens", "0", "--normalize", "false", "--sparse_cache_sizes", "64"],
     "sparse_cache_sizes"),
    (["--passkey_variants", "chat", "twice"], "passkey_variants must be"),
    (["--long_min_rows", "0"], "long_min_rows must be ≥ 1"),
    (["--restored_heads_n", "4", "--head_ranking_shortlist", "3"],
     "the shortlist must hold at least the heads restored"),
    (["--restored_heads_n", "-1"], "restored_heads_n -1"),
    (["--recovery_window_weight", "1"], "recovery_window_weight"),
    (["--window_dropout", "1"], "window_dropout=1.0"),
    (["--window_size", "0", "--num_sink_tokens", "0", "--normalize", "false", "--sparse_cache_sizes", "64",
      "--window_dropout", "0.5"], "no sliding window to shrink"),
    (["--mixed_precision", "fp16"], "mixed_precision 'fp16': use auto, bf16 or no"),
    (["--saved_rope_position_cap", "2048", "--recovery_steps", "0"],
     "saved_rope_position_cap 2048 is written by stage 2"),
], ids=["attention option", "memory without window", "passkey variant", "perplexity rows", "shortlist",
        "negative heads", "recovery γ of 1", "window dropout of 1", "window dropout without window", "precision",
        "saved cap without stage 2"])
def test_the_demo_refuses_bad_arguments_before_any_work(argv, named, tmp_path, capsys):
    from hf_linear_attn.training import demo
    with pytest.raises(SystemExit) as exit_info:
        demo.main([*argv, "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_demo_checks_the_long_texts_before_any_work(tmp_path, monkeypatch, capsys):
    from hf_linear_attn.training import demo
    monkeypatch.setattr(demo, "DEFAULT_DATA_DIR", str(tmp_path / "no_texts"))
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert "hf-linear-attn-long-context prepare" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("recipe", sorted(CONFIGS.glob("demo*.yaml")), ids=lambda p: p.name)
def test_demo_recipes_parse_into_valid_attention_options(recipe):
    parsed = parse_recipe_args(DemoArguments, ["--config", str(recipe)])
    AttentionOptions(**attention_options(parsed))  # the recipe's options are valid together
    assert not parsed.sparse_cache_sizes or parsed.window_size > 0


def test_the_demo_evaluates_the_model_after_each_stage_it_runs(tmp_path):
    from hf_linear_attn.training import demo
    args = parse_recipe_args(DemoArguments, ["--output_dir", str(tmp_path)], default_recipe=DEMO_RECIPE)
    models = demo.stage_models(args, tmp_path)
    assert models == {"stage 1": tmp_path / "stage1", "stage 1 + 6 heads": tmp_path / "stage1-heads",
                      "stage 2": tmp_path / "stage2"}
    evaluate_args = demo.evaluation_arguments(args, tmp_path / "teacher", models)
    # the teacher de-quantized once, a plain checkpoint
    assert (evaluate_args.teacher_name_or_path, evaluate_args.teacher_gguf_file) == (str(tmp_path / "teacher"), None)
    assert evaluate_args.models == [f"{label}={path}" for label, path in models.items()]
    assert evaluate_args.passkey_models == ["teacher", "stage 2"]
    assert evaluate_args.decode_models == ["teacher", "stage 2", "stage 2 + memory 128"]
    assert (evaluate_args.passkey_variants, evaluate_args.passkey_trials, evaluate_args.long_min_rows) == (
        ["chat"], 5, 2)
    assert evaluate_args.output_dir == str(tmp_path / "evaluation")
    short = parse_recipe_args(DemoArguments, ["--recovery_steps", "0", "--restored_heads_n", "0"],
                              default_recipe=DEMO_RECIPE)
    assert demo.stage_models(short, tmp_path) == {"stage 1": tmp_path / "stage1"}
    layers = parse_recipe_args(DemoArguments, ["--softmax_layers_k", "2", "--softmax_head_counts", "6"],
                               default_recipe=DEMO_RECIPE)
    assert demo.stage_models(layers, tmp_path) == {
        "stage 1": tmp_path / "stage1", "stage 1 + 2 softmax layers": tmp_path / "stage1-softmax",
        "stage 1 + 2 softmax layers + 6 heads": tmp_path / "stage1-heads", "stage 2": tmp_path / "stage2"}
    assert demo.evaluation_arguments(layers, tmp_path / "teacher", models).passkey_models == ["teacher", "stage 2",
                                                                                  "stage 2 + 6 heads"]


def test_the_demo_saves_its_teacher_as_a_checkpoint_with_the_same_logits(tmp_path):
    """Stage 2 and the evaluation load the teacher the demo writes (`save_dequantized`: its weights in a fresh model,
    since transformers refuses to save a GGUF-loaded one): the same weights, generation config and tokenizer."""
    from hf_linear_attn.training import demo
    source = teacher("llama")
    source.generation_config.max_new_tokens = 7
    save_with_tokenizer(source, tmp_path / "source")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "source")
    demo.save_dequantized(source, tokenizer, tmp_path / "teacher")
    saved = load_teacher(str(tmp_path / "teacher")).eval()  # refuses missing, unexpected or mis-shaped weights
    ids = torch.randint(3, 93, (1, 24))
    with torch.no_grad():
        assert torch.equal(saved(ids).logits, source(ids).logits)
    assert saved.generation_config.max_new_tokens == 7
    assert AutoTokenizer.from_pretrained(tmp_path / "teacher")("w1 w2 w5").input_ids == tokenizer("w1 w2 w5").input_ids


OFFLINE_PROBE = """
import huggingface_hub.constants as hub
from transformers.utils.hub import is_offline_mode
from hf_linear_attn.training.command_line import offline_by_default
before = hub.is_offline_mode()
offline_by_default()
print(before, hub.is_offline_mode(), is_offline_mode())
"""


@pytest.mark.parametrize("preset, expected", [(None, "False True True"), ("0", "False False False"),
                                              ("1", "True True True")])
def test_the_demo_and_tour_stay_offline_unless_told_otherwise(preset, expected):
    # The demo and the tour call offline_by_default() in main(), after transformers (and with it huggingface_hub,
    # which reads HF_HUB_OFFLINE once at import) is imported: setting the variable alone would leave the Hub online.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    if preset is not None:
        env["HF_HUB_OFFLINE"] = preset
    probe = subprocess.run([sys.executable, "-c", OFFLINE_PROBE], env=env, capture_output=True, text=True,
                           cwd=CONFIGS.parent, check=True)
    assert probe.stdout.split("\n")[-2] == expected
