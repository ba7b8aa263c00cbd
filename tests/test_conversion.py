"""Conversion of Llama / Mistral / Qwen2 / Qwen3 checkpoints: copied weights, exactness at window >= T."""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from hf_linear_attn import LinearAttentionForCausalLM, convert_to_linear_attention
from hf_linear_attn.conversion import linear_attention_config

DIMS = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
SOURCES = {
    "llama": (LlamaForCausalLM, LlamaConfig, {
        "attention_bias": True, "mlp_bias": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": (MistralForCausalLM, MistralConfig, {"head_dim": 24, "sliding_window": None}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 16, "tie_word_embeddings": True}),
}


def teacher(name: str, seed: int = 0):
    model_cls, config_cls, extra = SOURCES[name]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**DIMS, **extra, attn_implementation="sdpa")).eval()
    with torch.no_grad():  # biases and norms start at 0 / 1: make them non-trivial so copying them is tested
        for name_, p in model.named_parameters():
            if name_.endswith("bias") or "norm" in name_:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("name", SOURCES)
@pytest.mark.parametrize("feature_map", ["hedgehog", "elu"])
def test_window_covering_the_sequence_reproduces_the_teacher(name, feature_map):
    source = teacher(name)
    student = convert_to_linear_attention(source, feature_map=feature_map, window_size=64, num_sink_tokens=4)
    ids = torch.randint(0, 96, (2, 50))
    with torch.no_grad():
        expected = source(ids).logits
        got = student(ids, use_cache=False).logits
        generated_teacher = source.generate(ids[:, :20], max_new_tokens=8, do_sample=False)
        generated_student = student.generate(ids[:, :20], max_new_tokens=8, do_sample=False)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(generated_student, generated_teacher)


@pytest.mark.parametrize("name", SOURCES)
def test_copied_weights_are_bit_identical_and_new_ones_initialised(name, tmp_path):
    source = teacher(name)
    source.save_pretrained(tmp_path / "teacher")
    student = convert_to_linear_attention(str(tmp_path / "teacher"), feature_dim=8, window_size=16)
    source_sd, student_sd = source.state_dict(), student.state_dict()
    for key, value in source_sd.items():
        assert torch.equal(student_sd[key], value), key
    new = sorted(set(student_sd) - set(source_sd))
    assert new and all("feature_map" in k or "window_gate" in k for k in new), new
    head_dim = student.config.head_dim
    assert torch.equal(student.model.layers[0].self_attn.feature_map_q.weight[0], torch.eye(head_dim, 8))
    config = student.config
    assert config.base_model_type == name
    assert config.base_model_name_or_path == str(tmp_path / "teacher")
    assert config.rope_parameters == source.config.rope_parameters
    assert config.use_qk_norm == (name == "qwen3")
    assert config.tie_word_embeddings == source.config.tie_word_embeddings
    if config.tie_word_embeddings:
        assert student.lm_head.weight.data_ptr() == student.model.embed_tokens.weight.data_ptr()


def test_converted_model_saves_and_reloads(tmp_path):
    student = convert_to_linear_attention(teacher("qwen3"), window_size=8, softmax_layers=[1])
    student.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(reloaded, LinearAttentionForCausalLM)
    ids = torch.randint(0, 96, (1, 30))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, student(ids).logits)


def test_short_window_differs_from_the_teacher_but_stays_close_at_init():
    source = teacher("llama")
    student = convert_to_linear_attention(source, window_size=4, num_sink_tokens=1)
    ids = torch.randint(0, 96, (1, 60))
    with torch.no_grad():
        diff = (student(ids).logits - source(ids).logits).abs()
    assert diff[:, :4].max() < 1e-4  # inside the first window it is still softmax attention
    assert diff[:, 10:].max() > 1e-3  # later the linear part takes over


def test_bad_conversions_raise():
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="supported architectures are llama, mistral, qwen2, qwen3"):
        convert_to_linear_attention(gpt2)
    with pytest.raises(ValueError, match="Unknown attention option"):
        convert_to_linear_attention(teacher("llama"), feature_mapp="elu")
    with pytest.raises(ValueError, match="`decay`"):
        linear_attention_config(teacher("llama").config, window_size=8, decay="vector")
    with pytest.raises(TypeError, match="PreTrainedModel or a path"):
        convert_to_linear_attention(42)


def save_with_tokenizer(model, path):
    """Save a checkpoint with a small word-level tokenizer, as a real source folder has."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(90)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    model.save_pretrained(path)


def run_convert(*argv):
    from training import convert

    return convert.main(list(argv))


def test_convert_cli_writes_a_loadable_checkpoint_with_tokenizer(tmp_path):
    source = teacher("qwen2")
    save_with_tokenizer(source, tmp_path / "src")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("feature_map: t2r\nfeature_dim: 8\nwindow_size: 4\nsoftmax_layers: [1]\n")
    out = tmp_path / "out"
    assert run_convert("--model_name_or_path", str(tmp_path / "src"), "--output_dir", str(out),
                       "--config", str(recipe), "--window_size", "100") == 0
    files = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "modeling_linear_attention.py"} <= files
    model = AutoModelForCausalLM.from_pretrained(out)
    assert (model.config.feature_map, model.config.window_size, model.config.softmax_layers) == ("t2r", 100, [1])
    assert model.config.base_model_name_or_path == str(tmp_path / "src")
    ids = torch.randint(0, 96, (1, 40))
    with torch.no_grad():  # window 100 >= 40 tokens: exactly the teacher
        torch.testing.assert_close(model(ids).logits, source(ids).logits, atol=2e-5, rtol=1e-4)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no staging folder left


def test_convert_cli_fails_before_writing_anything(tmp_path, capsys):
    def fails(*argv) -> str:
        """Bad input: exit status 2 with one `error: ...` line (argparse's style); returns stderr."""
        with pytest.raises(SystemExit) as exit_:
            run_convert(*argv)
        assert exit_.value.code == 2
        return capsys.readouterr().err

    save_with_tokenizer(teacher("llama"), tmp_path / "src")
    teacher("llama").save_pretrained(tmp_path / "no_tokenizer")
    out = tmp_path / "out"
    assert "`decay`" in fails("--model_name_or_path", str(tmp_path / "src"), "--output_dir", str(out),
                              "--decay", "scalar")
    assert "no tokenizer" in fails("--model_name_or_path", str(tmp_path / "no_tokenizer"), "--output_dir", str(out))
    (tmp_path / "bad.yaml").write_text("window: 3\n")
    assert "unknown key(s) ['window']" in fails("--model_name_or_path", str(tmp_path / "src"), "--output_dir",
                                                str(out), "--config", str(tmp_path / "bad.yaml"))
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert "not empty" in fails("--model_name_or_path", str(tmp_path / "src"), "--output_dir", str(out))


def test_attention_transfer_passes_the_teacher_on_and_trains_only_feature_maps():
    source = teacher("llama")
    student = convert_to_linear_attention(source, feature_map="hedgehog", feature_dim=8, window_size=6,
                                          num_sink_tokens=2).train()
    layers = [layer.self_attn for layer in student.model.layers]
    for attn in layers:
        attn.attention_transfer = True
    for name, p in student.named_parameters():
        p.requires_grad_("feature_map" in name or "window_gate" in name)
    ids = torch.randint(0, 96, (2, 40))
    mask = torch.ones(2, 40, dtype=torch.long)
    mask[1, :7] = 0  # a left-padded row: pads are left out of the loss
    logits = student(ids, attention_mask=mask, use_cache=False).logits
    with torch.no_grad():
        expected = source(ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(logits[real], expected[real], atol=2e-5, rtol=1e-4)  # teacher forcing
    losses = torch.stack([attn.transfer_loss for attn in layers])
    assert (losses > 0).all()
    losses.sum().backward()
    for name, p in student.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name
