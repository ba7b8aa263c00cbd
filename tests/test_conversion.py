"""Conversion of Llama / Mistral / Qwen2 / Qwen3 checkpoints: copied weights, exactness at window >= T."""

import pytest
import torch
from helpers import SOURCES, save_with_tokenizer, teacher
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from hf_linear_attn import LinearAttentionForCausalLM, convert_to_linear_attention
from hf_linear_attn.configuration_linear_attention import ATTENTION_OPTIONS
from hf_linear_attn.conversion import DEFAULT_ATTENTION_OPTIONS, linear_attention_config


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
    with pytest.raises(ValueError, match="`normalize`"):
        linear_attention_config(teacher("llama").config, window_size=8, normalize=False)
    with pytest.raises(TypeError, match="PreTrainedModel or a path"):
        convert_to_linear_attention(42)


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


def test_convert_cli_takes_every_attention_option(tmp_path):
    save_with_tokenizer(teacher("llama"), tmp_path / "src")
    out = tmp_path / "out"
    assert run_convert("--model_name_or_path", str(tmp_path / "src"), "--output_dir", str(out), "--feature_map", "elu",
                       "--window_size", "0", "--num_sink_tokens", "0", "--decay", "vector", "--decay_low_rank_dim",
                       "4", "--output_norm", "--no_normalize", "--linear_attention_backend", "torch") == 0
    config = AutoModelForCausalLM.from_pretrained(out).config
    assert {name: getattr(config, name) for name in ATTENTION_OPTIONS} == {
        "feature_map": "elu", "feature_dim": None, "normalize": False, "output_norm": True, "decay": "vector",
        "decay_low_rank_dim": 4, "window_size": 0, "num_sink_tokens": 0, "softmax_layers": [],
        "linear_attention_backend": "torch"}


def test_conversion_defaults_are_the_lolcats_recipe():
    config = linear_attention_config(teacher("mistral").config)
    assert {name: getattr(config, name) for name in ATTENTION_OPTIONS} == DEFAULT_ATTENTION_OPTIONS
    assert (config.feature_map, config.window_size, config.num_sink_tokens) == ("hedgehog", 64, 4)
    with pytest.raises(TypeError, match="`normalize`='yes'"):
        linear_attention_config(teacher("mistral").config, normalize="yes")


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
    assert "error: invalid `decay_low_rank_dim`=0" in fails("--model_name_or_path", str(tmp_path / "src"),
                                                            "--output_dir", str(out), "--decay_low_rank_dim", "0")
    assert "error: invalid `window_size`=-1" in fails("--model_name_or_path", str(tmp_path / "src"), "--output_dir",
                                                      str(out), "--window_size", "-1")
    assert "error: invalid `softmax_layers`=[2]" in fails(  # the source has 2 layers
        "--model_name_or_path", str(tmp_path / "src"), "--output_dir", str(out), "--softmax_layers", "2")
    assert "invalid choice: 'cos'" in fails(  # not a choice: argparse's usage error
        "--model_name_or_path", str(tmp_path / "src"), "--output_dir", str(out), "--feature_map", "cos")
    assert "no tokenizer" in fails("--model_name_or_path", str(tmp_path / "no_tokenizer"), "--output_dir", str(out))
    (tmp_path / "bad.yaml").write_text("window: 3\n")
    assert "unknown key(s) ['window']" in fails("--model_name_or_path", str(tmp_path / "src"), "--output_dir",
                                                str(out), "--config", str(tmp_path / "bad.yaml"))
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert "not empty" in fails("--model_name_or_path", str(tmp_path / "src"), "--output_dir", str(out))
