"""Conversion of Llama / Mistral / Qwen2 / Qwen3 checkpoints: copied weights, exactness at window >= T."""

import math
import subprocess
import sys

import pytest
import torch
from helpers import DIMS, SOURCES, save_with_tokenizer, script_env, teacher
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hf_linear_attn import InputError, LinearAttentionForCausalLM, convert_to_linear_attention
from hf_linear_attn.configuration_linear_attention import ATTENTION_OPTIONS
from hf_linear_attn.conversion import (
    DEFAULT_ATTENTION_OPTIONS,
    GATED_DELTANET_OPTIONS,
    GATED_DELTANET_WINDOW_OPTIONS,
    linear_attention_config,
    sliding_window_change,
)


@pytest.mark.parametrize("name", SOURCES)
@pytest.mark.parametrize("options", [{"feature_map": "hedgehog"}, {"feature_map": "elu"},
                                     GATED_DELTANET_WINDOW_OPTIONS], ids=["hedgehog", "elu", "gated-deltanet-window"])
def test_window_covering_the_sequence_reproduces_the_teacher(name, options):
    """Window 64 + 4 sinks over 50 tokens: softmax attention, so the teacher exactly (the delta rule's state is
    still empty, and its output norm and gate act on that state part only)."""
    source = teacher(name)
    student = convert_to_linear_attention(source, **{"window_size": 64, "num_sink_tokens": 4, **options})
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
    from hf_linear_attn.training import convert

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
                       "4", "--output_norm", "--no_normalize", "--linear_attention_backend", "torch", "--window_weight",
                       "0.75", "--rope_position_cap", "16", "--softmax_log_length_scale", "0.25") == 0
    config = AutoModelForCausalLM.from_pretrained(out).config
    assert config.rope_position_cap == 16
    assert {name: getattr(config, name) for name in ATTENTION_OPTIONS} == {
        "feature_map": "elu", "feature_dim": None, "normalize": False, "output_norm": True, "decay": "vector",
        "decay_low_rank_dim": 4, "decay_horizon": 2048, "window_size": 0, "num_sink_tokens": 0, "window_weight": 0.75,
        "softmax_layers": [],
        "linear_attention_backend": "torch", "update_rule": "additive", "conv_size": 0, "output_gate": False,
        "sparse_cache_size": 0, "softmax_log_length_scale": 0.25}


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
    assert "layer 2 does not exist" in fails(  # the source has 2 layers
        "--model_name_or_path", str(tmp_path / "src"), "--output_dir", str(out), "--softmax_layers", "2")
    assert "invalid choice: 'cos'" in fails(  # not a choice: argparse's usage error
        "--model_name_or_path", str(tmp_path / "src"), "--output_dir", str(out), "--feature_map", "cos")
    assert "no tokenizer" in fails("--model_name_or_path", str(tmp_path / "no_tokenizer"), "--output_dir", str(out))
    assert "rope_position_cap 100000: an int from 2" in fails("--model_name_or_path", str(tmp_path / "src"),
                                                              "--output_dir", str(out), "--rope_position_cap", "100000")
    (tmp_path / "bad.yaml").write_text("window: 3\n")
    assert "unknown key(s) ['window']" in fails("--model_name_or_path", str(tmp_path / "src"), "--output_dir",
                                                str(out), "--config", str(tmp_path / "bad.yaml"))
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert "not empty" in fails("--model_name_or_path", str(tmp_path / "src"), "--output_dir", str(out))


LOAD_TOKENIZER = """
import sys
sys.modules["hf_linear_attn"] = None  # as on a machine without `pip install hf-linear-attn`
from transformers import AutoTokenizer, PreTrainedTokenizerFast
documented = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True)  # as the model card says
plain = PreTrainedTokenizerFast.from_pretrained(sys.argv[1])
print(documented.model_max_length, plain.model_max_length, documented("w1 w2")["input_ids"])
"""


def test_converted_tokenizer_loads_without_a_prompt_and_keeps_the_maximum_length(tmp_path):
    save_with_tokenizer(teacher("llama"), tmp_path / "src")
    assert run_convert("--model_name_or_path", str(tmp_path / "src"), "--output_dir", str(tmp_path / "out"),
                       "--window_size", "8", "--feature_dim", "8") == 0
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    env = {key: value for key, value in script_env().items() if key != "PYTHONPATH"}
    loaded = subprocess.run([sys.executable, "-c", LOAD_TOKENIZER, str(tmp_path / "out")], cwd=empty, env=env,
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    assert loaded.returncode == 0, loaded.stderr[-2000:]
    assert "Do you wish to run the custom code" not in loaded.stdout + loaded.stderr
    # The source's maximum: its tokenizer sets none, so its max_position_embeddings (256).
    assert loaded.stdout.split()[:2] == ["256", "256"]


def test_convert_never_replaces_its_source_and_replaces_an_output_atomically(tmp_path, capsys):
    source = tmp_path / "src"
    save_with_tokenizer(teacher("llama"), source)
    before = {path.name: path.read_bytes() for path in source.iterdir()}
    for output in (source, source / "converted", tmp_path):
        with pytest.raises(SystemExit):
            run_convert("--model_name_or_path", str(source), "--output_dir", str(output), "--overwrite_output_dir")
        assert "would replace its source" in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in source.iterdir()} == before

    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("from an earlier conversion")
    assert run_convert("--model_name_or_path", str(source), "--output_dir", str(out), "--overwrite_output_dir",
                       "--window_size", "8") == 0
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # nothing set aside is left


def test_conversion_refuses_a_source_with_unexpected_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    teacher("llama").save_pretrained(tmp_path / "src")
    state = load_file(str(tmp_path / "src" / "model.safetensors"))
    state["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(state, str(tmp_path / "src" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"has unexpected weights \['model.layers.0.self_attn.extra_proj.weight'\]"):
        convert_to_linear_attention(str(tmp_path / "src"), window_size=8)


def test_convert_cli_selects_softmax_layers_on_a_stage1_model(tmp_path, capsys, dataset_cache):
    """`--softmax_layers auto:K --ranking_model STAGE1`: STAGE1 with the K layers that matter most restored to
    softmax, the ranking beside it; bad selections stop with one error line before anything is written."""
    import json

    from hf_linear_attn.training import distill

    save_with_tokenizer(teacher("llama"), tmp_path / "src")
    common = ["--model_name_or_path", str(tmp_path / "src"), "--feature_dim", "8", "--window_size", "4",
              "--num_sink_tokens", "1"]
    data = ["--block_size", "32", "--cache_dir", str(dataset_cache)]
    assert run_convert(*common, "--output_dir", str(tmp_path / "converted")) == 0
    assert distill.main(["--model_name_or_path", str(tmp_path / "converted"), "--output_dir", str(tmp_path / "stage1"),
                         "--max_steps", "2", *data, "--report_to", "none"]) == 0
    for bad, message in (
        (["--softmax_layers", "auto:2", "--ranking_model", str(tmp_path / "stage1")], "softmax_layers"),  # = teacher
        (["--softmax_layers", "auto:1"], "needs a ranking_model"),
        (["--softmax_layers", "1", "--ranking_model", str(tmp_path / "stage1")], "only used with"),
        (["--softmax_layers", "auto:1", "--ranking_model", str(tmp_path / "stage1"), "--feature_dim", "16"],
         "feature_dim"),
    ):
        with pytest.raises(SystemExit) as exit_:
            run_convert(*common, *bad, *data, "--output_dir", str(tmp_path / "bad"))
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()

    assert run_convert(*common, "--softmax_layers", "auto:1", "--ranking_model", str(tmp_path / "stage1"),
                       "--ranking_rows", "2", *data, "--output_dir", str(tmp_path / "hybrid")) == 0
    ranking = json.loads((tmp_path / "hybrid" / "softmax_layer_ranking.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hybrid")
    assert model.config.softmax_layers == ranking["selected"] == [ranking["ranking"][0]["layer"]]
    stage1 = AutoModelForCausalLM.from_pretrained(tmp_path / "stage1").state_dict()
    kept = model.state_dict()
    assert kept and all(torch.equal(value, stage1[name]) for name, value in kept.items())  # stage-1 weights kept
def test_conversion_starts_the_short_convolution_as_the_identity():
    """With the identity convolution a window covering the sequence still reproduces the teacher exactly."""
    source = teacher("qwen3")
    student = convert_to_linear_attention(source, conv_size=4)
    weight = student.model.layers[0].self_attn.qkv_conv.weight  # [C, 1, 4]
    assert torch.equal(weight[:, 0, -1], torch.ones(weight.shape[0]))
    assert torch.equal(weight[:, 0, :-1], torch.zeros(weight.shape[0], 3))
    ids = torch.randint(0, 96, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(student(ids).logits, source(ids).logits, atol=2e-5, rtol=1e-4)


def test_delta_conversion_copies_the_teacher_and_adds_beta_conv_and_gate(tmp_path):
    source = teacher("llama")
    student = convert_to_linear_attention(source, **GATED_DELTANET_OPTIONS)
    config = student.config
    assert (config.update_rule, config.conv_size, config.output_gate, config.decay) == ("delta", 4, True, "scalar")
    teacher_weights = source.state_dict()
    new = {name for name in student.state_dict() if name not in teacher_weights}
    assert {name.split(".")[-2] for name in new} == {"beta_proj", "qkv_conv", "g_proj", "decay_proj", "o_norm"}
    for name, tensor in student.state_dict().items():
        if name in teacher_weights:
            assert torch.equal(tensor, teacher_weights[name]), name
    student.save_pretrained(tmp_path)
    ids = torch.randint(0, 96, (1, 30))
    with torch.no_grad():
        torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits, student(ids).logits)
    with pytest.raises(ValueError, match="`normalize`.*update_rule='delta'"):  # the LoLCATs defaults are additive
        convert_to_linear_attention(source, update_rule="delta")


def test_delta_window_conversion_starts_as_the_teachers_sliding_window():
    """GATED_DELTANET_WINDOW_OPTIONS: the Gated DeltaNet parameters plus λ = window_gate, at 0. So beyond the window
    the converted model is the teacher's sliding-window attention with sinks: the state part (β, decay, gate) has no
    effect until λ moves, and then it has."""
    source = teacher("llama")
    options = dict(GATED_DELTANET_WINDOW_OPTIONS, window_size=6, num_sink_tokens=2)
    student = convert_to_linear_attention(source, **options)
    new = {name.removeprefix("model.layers.0.self_attn.") for name in student.state_dict()
           if name.startswith("model.layers.0.") and name not in source.state_dict()}
    assert new == {"beta_proj.weight", "qkv_conv.weight", "g_proj.weight", "decay_proj.weight", "decay_proj.bias",
                   "o_norm.weight", "window_gate"}
    layer = student.model.layers[0].self_attn
    assert not layer.window_gate.any()
    # The decay gate starts with the window hybrid's long memory: a = 1 − 1/decay_horizon for every token.
    log_decay = layer.log_decay(torch.randn(1, 5, 64))
    torch.testing.assert_close(log_decay, torch.full_like(log_decay, math.log(1 - 1 / 2048)), rtol=1e-5, atol=0)
    ids = torch.randint(0, 96, (2, 40))
    with torch.no_grad():
        start = student(ids).logits
        for module in student.modules():
            if hasattr(module, "beta_proj"):
                module.beta_proj.weight.normal_()
        torch.testing.assert_close(student(ids).logits, start, atol=0, rtol=0)
        for module in student.modules():
            if hasattr(module, "beta_proj"):
                module.window_gate.fill_(1.0)
        moved = student(ids).logits
    assert (moved[:, :6] - start[:, :6]).abs().max() < 1e-5  # the first window: nothing has left it yet
    assert (moved[:, 10:] - start[:, 10:]).abs().max() > 1e-3


@pytest.mark.parametrize("options, new", [
    (GATED_DELTANET_OPTIONS, {"beta_proj", "qkv_conv", "g_proj", "decay_proj"}),
    (dict(GATED_DELTANET_WINDOW_OPTIONS, window_size=8, num_sink_tokens=2),
     {"beta_proj", "qkv_conv", "g_proj", "decay_proj", "window_gate"}),
], ids=["gated-deltanet", "gated-deltanet-window"])
def test_attention_transfer_of_a_delta_conversion_lowers_its_loss(options, new):
    """A few distillation steps (the parameters `training/distill.py` trains by default) on a converted tiny Llama
    with Gated DeltaNet layers (with the window: λ too, from 0): the transfer loss falls, and only the new attention
    parameters move."""
    from hf_linear_attn.training.attention_transfer import (
        AttentionTransfer,
        attention_transfer_loss,
        select_transfer_parameters,
    )

    torch.manual_seed(0)
    student = convert_to_linear_attention(teacher("llama"), **options).train()
    trained = select_transfer_parameters(student)
    assert {name.split(".self_attn.")[-1].split(".")[0] for name in trained} == new
    before = {name: p.detach().clone() for name, p in student.named_parameters()}
    batch = {"input_ids": torch.randint(0, 96, (4, 48)), "position_ids": torch.arange(48).expand(4, 48)}
    optimizer = torch.optim.Adam([p for p in student.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    with AttentionTransfer(student):
        for _ in range(25):
            loss, _ = attention_transfer_loss(student, batch)
            optimizer.zero_grad()
            loss.mean().backward()
            optimizer.step()
            losses.append(loss.mean().item())
    assert losses[-1] < 0.5 * losses[0], losses
    for name, p in student.named_parameters():
        assert torch.equal(p, before[name]) == (name not in trained), name


def test_convert_cli_keeps_the_teachers_retrieval_heads(tmp_path, capsys, dataset_cache):
    """`--softmax_heads auto:N`: the N KV heads the teacher retrieves with most (ranked on passkey prompts built from
    the data pipeline's documents, the ranking beside the output) keep softmax attention; explicit LAYER:HEAD items
    are taken as they are; bad requests stop with one error line before anything is written."""
    import json

    save_with_tokenizer(teacher("llama"), tmp_path / "src")
    common = ["--model_name_or_path", str(tmp_path / "src"), "--feature_dim", "8", "--window_size", "4",
              "--num_sink_tokens", "1", "--block_size", "96", "--cache_dir", str(dataset_cache)]
    for bad, message in (
        (["--softmax_heads", "auto:5"], "N must be in [1, 4]"),  # 2 layers x 2 KV heads
        (["--softmax_heads", "auto:3", "--softmax_layers", "0"], "N must be in [1, 2]"),
        (["--softmax_heads", "auto:0"], "N ≥ 1"),
        (["--softmax_heads", "1:2"], "KV head indices must lie in [0, 1]"),
        (["--softmax_heads", "1-0"], "not a LAYER:HEAD"),
        (["--softmax_heads", "auto:1", "--head_ranking_prompts", "0"], "at least one prompt"),
    ):
        with pytest.raises(SystemExit) as exit_:
            run_convert(*common, *bad, "--output_dir", str(tmp_path / "bad"))
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()

    assert run_convert(*common, "--softmax_heads", "1:1", "0:0", "--output_dir", str(tmp_path / "explicit")) == 0
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "explicit").config.softmax_heads == {0: [0], 1: [1]}

    assert run_convert(*common, "--softmax_heads", "auto:3", "--head_ranking_prompts", "2",
                       "--output_dir", str(tmp_path / "heads")) == 0
    ranking = json.loads((tmp_path / "heads" / "softmax_head_ranking.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "heads")
    best = {}
    for entry in ranking["ranking"][:3]:
        best.setdefault(entry["layer"], []).append(entry["kv_head"])
    assert model.config.softmax_heads == {layer: sorted(heads) for layer, heads in best.items()}
    assert {int(layer): heads for layer, heads in ranking["selected"].items()} == model.config.softmax_heads
    assert ranking["prompts"] == 2 and ranking["prompt_tokens"] == 96 and len(ranking["ranking"]) == 4
    scores = [entry["score"] for entry in ranking["ranking"]]
    assert scores == sorted(scores, reverse=True) and all(0 <= s <= 1 for s in scores)


def test_convert_cli_restores_the_heads_a_trained_checkpoint_gains_most_from(tmp_path, capsys, dataset_cache):
    """`--softmax_heads auto:N --head_ranking restoration --ranking_model STAGE1`: STAGE1 (its weights unchanged) with
    the N KV heads whose restoration alone raises its own log-probability of a pass key most restored, measured
    exactly on the `--ranking_shortlist` best of the first-order estimate (the measured heads in the ranking beside
    it); bad requests stop with one error line before anything is written."""
    import json

    from hf_linear_attn.layer_selection import restoration_gains
    from hf_linear_attn.training import distill
    from hf_linear_attn.training.checkpoint_conversion import head_ranking_prompts
    from hf_linear_attn.training.data import DataArguments

    save_with_tokenizer(teacher("llama"), tmp_path / "src")
    common = ["--model_name_or_path", str(tmp_path / "src"), "--feature_dim", "8", "--window_size", "4",
              "--num_sink_tokens", "1"]
    data = ["--block_size", "96", "--cache_dir", str(dataset_cache)]
    assert run_convert(*common, "--softmax_heads", "0:1", "--output_dir", str(tmp_path / "converted")) == 0
    assert distill.main(["--model_name_or_path", str(tmp_path / "converted"), "--output_dir", str(tmp_path / "stage1"),
                         "--max_steps", "2", *data, "--report_to", "none"]) == 0
    ranked = ["--softmax_heads", "auto:1", "--ranking_model", str(tmp_path / "stage1"), "--head_ranking_prompts", "2"]
    for bad, message in (
        (["--softmax_heads", "auto:1", "--head_ranking", "restoration"],
         "give --softmax_heads auto:N and --ranking_model"),
        (["--softmax_heads", "0:0", "--head_ranking", "restoration", "--ranking_model", str(tmp_path / "stage1")],
         "give --softmax_heads auto:N and --ranking_model"),
        ([*ranked, "--head_ranking", "kl"], "choose one of ['teacher', 'restoration']"),
        ([*ranked, "--head_ranking", "restoration", "--head_ranking_shortlist", "-1"], "measure at least the 1 heads"),
        ([*ranked, "--head_ranking", "restoration", "--feature_dim", "16"], "feature_dim"),
    ):
        with pytest.raises(SystemExit) as exit_:
            run_convert(*common, *bad, *data, "--output_dir", str(tmp_path / "bad"))
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()

    assert run_convert(*common, *ranked, "--head_ranking", "restoration", "--head_ranking_shortlist", "2", *data,
                       "--output_dir", str(tmp_path / "restored")) == 0
    ranking = json.loads((tmp_path / "restored" / "softmax_head_ranking.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "restored")
    stage1 = AutoModelForCausalLM.from_pretrained(tmp_path / "stage1")
    prompts = head_ranking_prompts(AutoTokenizer.from_pretrained(tmp_path / "src"),
                                   DataArguments(block_size=96, cache_dir=str(dataset_cache)), 2)
    gains = restoration_gains(stage1, prompts, progress=False, shortlist=2)
    measured = sorted(((layer, head) for layer in range(2) for head in range(2) if gains[layer, head] > -float("inf")),
                      key=lambda lh: (-round(float(gains[lh]), 6), lh))  # as written: 6 decimals, ties by index
    assert [(entry["layer"], entry["kv_head"]) for entry in ranking["ranking"]] == measured
    assert [entry["score"] for entry in ranking["ranking"]] == pytest.approx([float(gains[lh]) for lh in measured],
                                                                              abs=1e-5)
    best_layer, best_head = min(measured, key=lambda lh: (-float(gains[lh]), lh))  # top_heads' order
    expected = {0: [1]}
    expected.setdefault(best_layer, []).append(best_head)
    assert model.config.softmax_heads == {layer: sorted(heads) for layer, heads in expected.items()}
    assert ranking["selected"] == {str(best_layer): [best_head]}
    assert ranking["ranking_model"] == str(tmp_path / "stage1")
    assert "restored" in ranking["measure"] and ranking["prompts"] == 2
    assert all(torch.equal(value, stage1.state_dict()[name]) for name, value in model.state_dict().items())


@pytest.mark.parametrize("name", SOURCES)
def test_a_conversion_holds_the_slow_rotations_at_the_teachers_positions(name):
    """The converted model reads past the teacher's positions with its slow RoPE rotations held at the last one
    (`rope_position_cap`); below it, the cap changes nothing. A length-dependent RoPE is left as it is."""
    source = teacher(name)
    config = linear_attention_config(source.config)
    assert config.rope_position_cap == source.config.max_position_embeddings
    source.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0,
                                     "rope_theta": source.config.rope_parameters["rope_theta"]}
    assert linear_attention_config(source.config).rope_position_cap is None


def test_a_conversion_takes_a_position_cap_within_the_teachers_positions():
    """`rope_position_cap` at conversion (a recipe's training rows' length): kept in the config; anything but an int
    in [2, the teacher's max_position_embeddings], or any cap with a length-dependent RoPE, is refused before
    anything is built, naming what is allowed."""
    source = teacher("llama")
    trained = source.config.max_position_embeddings
    assert linear_attention_config(source.config, rope_position_cap=16).rope_position_cap == 16
    assert convert_to_linear_attention(source, rope_position_cap=trained).config.rope_position_cap == trained
    for bad in (1, trained + 1, 16.0, True, "16"):
        with pytest.raises(InputError, match=rf"an int from 2 to the source's max_position_embeddings \({trained}\)"):
            linear_attention_config(source.config, rope_position_cap=bad)
    source.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0,
                                     "rope_theta": source.config.rope_parameters["rope_theta"]}
    with pytest.raises(InputError, match="rotates by the input's length"):
        linear_attention_config(source.config, rope_position_cap=16)


# Sources that attend through a sliding window of 16 tokens (in the layers named), and the config changes that turn
# it off: Mistral's in every layer; Qwen2's, with use_sliding_window, in the layers from max_window_layers on.
SLIDING_SOURCES = {
    "mistral": (MistralForCausalLM, MistralConfig, {"head_dim": 24, "sliding_window": 16}, {"sliding_window": None},
                "all 2 layers", [0, 1]),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
              {"use_sliding_window": False}, "layers [1]", [1]),
}


@pytest.mark.parametrize("name", SLIDING_SOURCES)
def test_a_sliding_window_source_converts_to_whole_context_attention_and_says_so(name, caplog):
    """The source's sliding window is not kept: with a conversion window covering the input, the converted model is
    the source without its window (full causal attention), its own within the window; a warning says what changed."""
    model_cls, config_cls, sliding, whole, where, layers = SLIDING_SOURCES[name]
    torch.manual_seed(0)
    source = model_cls(config_cls(**DIMS, **sliding, attn_implementation="sdpa")).eval()
    unwindowed = model_cls(config_cls(**DIMS, **{**sliding, **whole}, attn_implementation="sdpa")).eval()
    unwindowed.load_state_dict(source.state_dict())
    with caplog.at_level("WARNING", logger="hf_linear_attn.conversion"):
        student = convert_to_linear_attention(source, window_size=64, num_sink_tokens=4, softmax_heads={1: [0]})
    assert f"The {name} source attends through a sliding window of 16 tokens in {where}; the converted model " \
           "does not keep that window" in caplog.text
    assert f"window layers {layers} attend with exact softmax over their last 64 tokens (+ 4 sinks)" in caplog.text
    assert "their window of 64 tokens reaches past the source's 16" in caplog.text
    assert "softmax heads {1: [0]} attend to the whole context" in caplog.text
    assert "train on rows (block_size) of at most 16 tokens" in caplog.text
    ids = torch.randint(0, 96, (1, 40))
    with torch.no_grad():
        got = student(ids).logits
        torch.testing.assert_close(got, unwindowed(ids).logits, atol=2e-5, rtol=1e-4)
        assert (got - source(ids).logits)[:, 16:].abs().max() > 1e-3  # past 16 tokens the source's window cut
        torch.testing.assert_close(got[:, :16], source(ids[:, :16]).logits, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("config", [
    Qwen2Config(**DIMS),  # use_sliding_window false: no window
    Qwen2Config(**DIMS, use_sliding_window=True, sliding_window=16, max_window_layers=2),  # no layer from 2 on
    MistralConfig(**DIMS, sliding_window=256),  # a window over every position the model has
], ids=["qwen2 without", "qwen2 in no layer", "mistral over every position"])
def test_a_source_whose_window_changes_nothing_converts_without_a_word(config, caplog):
    assert sliding_window_change(config, linear_attention_config(config)) is None
    with caplog.at_level("WARNING", logger="hf_linear_attn.conversion"):
        convert_to_linear_attention(AutoModelForCausalLM.from_config(config))
    assert "sliding window" not in caplog.text
