"""The GPU recipes of configs/gpu/ (the demo's recipe scaled to four models, configs/gpu/README.md): each parses with
the command it is for, a model's four recipes hand their checkpoints on and agree where they must, the numbers follow
the README's rules from the real model's config, and each model's four commands run end to end, by the recipe's name,
on a tiny stand-in of its architecture."""

import json
from pathlib import Path

import pytest
from helpers import write_documents
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from hf_linear_attn.configuration_linear_attention import ATTENTION_OPTIONS, AttentionOptions
from hf_linear_attn.training import convert, distill, finetune
from hf_linear_attn.training.checkpoint_conversion import ConversionArguments
from hf_linear_attn.training.data import DataArguments, byte_level_tokenizer
from hf_linear_attn.training.demo import DEFAULT_RECIPE as DEMO_RECIPE
from hf_linear_attn.training.demo import DemoArguments
from hf_linear_attn.training.loop import TrainArguments
from hf_linear_attn.training.model_card import SUMMARY_FILE
from hf_linear_attn.training.recipes import attention_options, parse_recipe_args, shipped_recipe_names
from hf_linear_attn.training.stages import FINETUNE_ARGUMENTS, DistillArguments

# Each step of a model's pipeline: the command that runs it and the argument dataclasses that command parses.
STEPS = {
    "convert": (convert.main, (ConversionArguments, DataArguments)),
    "distill": (distill.main, (DistillArguments, DataArguments, TrainArguments)),
    "restore": (convert.main, (ConversionArguments, DataArguments)),
    "recover": (finetune.main, FINETUNE_ARGUMENTS),
}
# The real models' config.json values that the conversion and the recipes read (the Hub's files).
REAL_CONFIGS = {
    "llama-3.2-1b": (LlamaConfig, dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=128000,
        eos_token_id=128001, tie_word_embeddings=True, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192})),
    "llama-3-8b": (LlamaConfig, dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=8192, rms_norm_eps=1e-5, bos_token_id=128000,
        eos_token_id=128001, tie_word_embeddings=False, rope_theta=500000.0)),
    "mistral-7b": (MistralConfig, dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, max_position_embeddings=32768, sliding_window=4096, rms_norm_eps=1e-5, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, rope_theta=10000.0)),
    "qwen2.5-7b": (Qwen2Config, dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, max_position_embeddings=131072, sliding_window=131072, use_sliding_window=False,
        max_window_layers=28, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151643, tie_word_embeddings=False,
        rope_theta=1000000.0)),
}
# What each stand-in shrinks: widths, a vocabulary for the byte-level tokenizer (its ids 1 and 2 for BOS and EOS), and
# layers enough for the recipe's KV heads (kept at conversion, then a restoration shortlist among the others). The
# query heads are as few as the KV heads allow (one per KV head; Qwen2.5's stand-in keeps a group of 2): the softmax
# targets over 2048-token rows cost in proportion to them.
STAND_IN_SIZES = {
    "llama-3.2-1b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=8, head_dim=8),
    "llama-3-8b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=8),
    "mistral-7b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=8),
    "qwen2.5-7b": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=8),
}
TOKENS = dict(vocab_size=320, bos_token_id=1, eos_token_id=2)
MODELS = sorted(REAL_CONFIGS)


def recipe_name(model: str, step: str) -> str:
    return f"gpu/{model}-{step}"


def parsed_steps(model: str) -> dict:
    """{step: the model's recipe for it, parsed into the dataclasses of its command}."""
    return {step: parse_recipe_args(types, ["--config", recipe_name(model, step)])
            for step, (_, types) in STEPS.items()}


def auto_count(softmax_heads: list[str]) -> int:
    (item,) = softmax_heads
    assert item.startswith("auto:"), item
    return int(item.removeprefix("auto:"))


def test_every_model_has_its_four_recipes_and_nothing_else_is_shipped_there():
    shipped = {name for name in shipped_recipe_names() if name.startswith("gpu/")}
    assert shipped == {recipe_name(model, step) for model in MODELS for step in STEPS}


@pytest.mark.parametrize("model", MODELS)
def test_a_models_recipes_hand_their_checkpoints_on_and_agree(model):
    steps = parsed_steps(model)
    converted, convert_data = steps["convert"]
    stage1, stage1_data, stage1_training = steps["distill"]
    restored, restore_data = steps["restore"]
    model_args, recover_data, _, _ = steps["recover"]
    assert stage1.model_name_or_path == converted.output_dir
    assert restored.ranking_model == stage1_training.output_dir
    assert model_args.model_name_or_path == restored.output_dir
    assert converted.model_name_or_path == restored.model_name_or_path == model_args.teacher_name_or_path
    # The restoration ranks heads on stage 1 of this same conversion: the same attention options, valid together.
    assert attention_options(restored) == attention_options(converted)
    AttentionOptions(**attention_options(converted))
    assert (converted.head_ranking, restored.head_ranking) == ("teacher", "restoration")
    # The same streamed documents (and so the same held-out share) and rows in every step; offsets in both stages.
    for data in (restore_data, stage1_data, recover_data):
        for name in ("dataset_name", "dataset_config_name", "stream_documents", "block_size", "separate_documents",
                     "validation_split_seed"):
            assert getattr(data, name) == getattr(convert_data, name), name
    assert convert_data.stream_documents > 0
    assert stage1_data.position_offset == recover_data.position_offset > 0
    # The demo's stage 2: LoRA on the KL to the teacher alone, with γ raised, over a bf16 frozen base.
    assert (model_args.use_lora, model_args.kl_weight, model_args.set_window_weight, model_args.dtype) == (
        True, 1.0, 0.99, "bfloat16")
    # Saved with the slow rotations held at the training rows' length, trained at the teacher's positions.
    demo = parse_recipe_args(DemoArguments, [], default_recipe=DEMO_RECIPE)
    assert model_args.saved_rope_position_cap == demo.saved_rope_position_cap == recover_data.block_size
    assert converted.rope_position_cap is None
    assert (converted.dtype, restored.dtype) == ("float32", "float32")  # stage 1 trains in the checkpoint's dtype


@pytest.mark.parametrize("model", MODELS)
def test_the_numbers_follow_the_demo_and_the_readme_rules(model):
    """configs/gpu/README.md: the demo's attention options with feature_dim half of head_dim, position offsets up to
    max_position_embeddings − block_size, and the demo's shares of the KV heads."""
    config_cls, real = REAL_CONFIGS[model]
    config = config_cls(**real)
    steps = parsed_steps(model)
    converted, data = steps["convert"]
    restored = steps["restore"][0]
    demo = parse_recipe_args(DemoArguments, [], default_recipe=DEMO_RECIPE)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert attention_options(converted) == {**attention_options(demo), "feature_dim": head_dim // 2}
    assert steps["distill"][1].position_offset == config.max_position_embeddings - data.block_size
    assert data.block_size == demo.block_size and not data.separate_documents
    kv_heads, demo_kv_heads = config.num_hidden_layers * config.num_key_value_heads, 30 * 3  # SmolLM2-135M's
    restored_n = round(kv_heads * demo.restored_heads_n / demo_kv_heads)
    assert auto_count(converted.softmax_heads) == round(kv_heads * auto_count(demo.softmax_heads) / demo_kv_heads)
    assert auto_count(restored.softmax_heads) == restored_n
    assert restored.head_ranking_shortlist == round(restored_n * demo.head_ranking_shortlist / demo.restored_heads_n)
    assert converted.head_ranking_prompts == restored.head_ranking_prompts == demo.head_ranking_prompts


def save_stand_in(model: str, folder: Path) -> None:
    """The model's real config with shrunk sizes, randomly initialised, with the byte-level tokenizer."""
    config_cls, real = REAL_CONFIGS[model]
    config = config_cls(**{**real, **STAND_IN_SIZES[model], **TOKENS})
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)


@pytest.mark.parametrize("model", MODELS)
def test_a_models_four_recipes_run_end_to_end_on_a_stand_in(model, tmp_path, monkeypatch, dataset_cache, caplog):
    """Convert (the teacher's retrieval heads kept) -> stage 1 -> restoration ranking -> stage 2 (KL, LoRA), each run
    by its recipe's name; the checkpoints land where the recipes say, relative to the folder they run in. Given on the
    command line: the model and the dataset (a local folder, streamed as the recipe says), and how much work a step
    does: 2 steps of one row of 512 tokens, one held-out row, 2 ranking prompts (of 512 tokens too), and bf16 only
    where the machine computes it natively (`auto`: emulated on most CPUs, several times slower). Everything else is
    the recipe's (the rows' length is checked against the recipes by the test above)."""
    save_stand_in(model, tmp_path / "teacher")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_documents(corpus / "docs.jsonl", count=3000)
    monkeypatch.chdir(tmp_path)
    data = ["--dataset_name", str(corpus), "--dataset_config_name", "", "--cache_dir", str(dataset_cache),
            "--block_size", "512"]
    ranking = ["--model_name_or_path", str(tmp_path / "teacher"), "--head_ranking_prompts", "2"]
    training = ["--max_steps", "2", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
                "--max_eval_samples", "1", "--mixed_precision", "auto"]
    overrides = {"convert": ranking, "distill": training, "restore": ranking,
                 "recover": ["--teacher_name_or_path", str(tmp_path / "teacher"), *training]}
    steps = parsed_steps(model)
    for step, (main, _) in STEPS.items():
        with caplog.at_level("WARNING", logger="hf_linear_attn.conversion"):
            assert main(["--config", recipe_name(model, step), *overrides[step], *data]) == 0, step

    converted = AutoModelForCausalLM.from_pretrained(steps["convert"][0].output_dir).config
    restored = AutoModelForCausalLM.from_pretrained(steps["restore"][0].output_dir).config
    final = AutoModelForCausalLM.from_pretrained(steps["recover"][2].output_dir).config  # its TrainArguments'
    kept, more = auto_count(steps["convert"][0].softmax_heads), auto_count(steps["restore"][0].softmax_heads)
    assert sum(map(len, converted.softmax_heads.values())) == kept
    assert sum(map(len, restored.softmax_heads.values())) == kept + more
    assert final.softmax_heads == restored.softmax_heads
    # Stage 2 ran with γ raised (recorded in its config); every other attention option is the conversion's.
    assert {name: getattr(final, name) for name in ATTENTION_OPTIONS} == {
        **{name: getattr(converted, name) for name in ATTENTION_OPTIONS}, "window_weight": 0.99}
    for step in ("distill", "recover"):  # their TrainArguments: a few steps each
        summary = json.loads((Path(steps[step][2].output_dir) / SUMMARY_FILE).read_text())
        assert summary["steps"] == 2, step
    # Only Mistral's stand-in (its real 4096-token sliding window) is converted with a warning.
    assert ("sliding window of 4096 tokens" in caplog.text) == (model == "mistral-7b")
