"""Softmax-layer selection: restoring converted layers to softmax, ranking them by KL to the teacher, parsing."""

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_model
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_linear_attn import LinearAttentionCache, convert_to_linear_attention
from hf_linear_attn.conversion import linear_attention_config
from hf_linear_attn.head_selection import RetrievalPrompt
from hf_linear_attn.layer_selection import (
    SoftmaxLayerSpec,
    check_layer_selection,
    check_same_conversion,
    estimated_restoration_gains,
    parse_softmax_layers,
    rank_softmax_layers,
    recurrent_kv_heads,
    restoration_gains,
    restore_softmax_heads,
    restore_softmax_layers,
    select_softmax_layers,
    write_ranking,
)
from hf_linear_attn.modeling_linear_attention import LinearAttention, SoftmaxAttention
from hf_linear_attn.training.attention_transfer import AttentionTransfer

LAYERS = 4
OPTIONS = dict(feature_map="hedgehog", feature_dim=8, window_size=4, num_sink_tokens=1)


def llama_teacher(seed: int = 0, **extra) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(**{"vocab_size": 96, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": LAYERS,
                            "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                            "attn_implementation": "sdpa", **extra})
    return LlamaForCausalLM(config).eval()


def converted(teacher, seed: int = 1, **options):
    """The teacher converted with OPTIONS, its feature maps and window gates moved off their initial values (so
    that no layer is accidentally exact)."""
    student = convert_to_linear_attention(teacher, **{**OPTIONS, **options})
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, parameter in student.named_parameters():
            if "feature_map" in name or "window_gate" in name:
                parameter.add_(0.3 * torch.randn_like(parameter))
    return student


def make_worse(student, layer: int) -> None:
    """Plant a bad layer: random, sharp feature maps and a window gate that leaves the linear part in charge."""
    attention = student.model.layers[layer].self_attn
    with torch.no_grad():
        for feature_map in (attention.feature_map_q, attention.feature_map_k):
            feature_map.weight.copy_(20 * torch.randn_like(feature_map.weight))
        attention.window_gate.fill_(-8.0)


def direct_kl(student, teacher, rows: torch.Tensor) -> float:
    """Mean KL(teacher || student) over every position of every row: full forward passes, no shortcut."""
    with torch.no_grad():
        log_p = F.log_softmax(teacher(rows).logits.float(), dim=-1)
        log_q = F.log_softmax(student(rows, use_cache=False).logits.float(), dim=-1)
    return F.kl_div(log_q, log_p, log_target=True, reduction="sum").item() / rows.numel()


def rows(n: int = 2, length: int = 32) -> torch.Tensor:
    return torch.randint(0, 96, (n, length), generator=torch.Generator().manual_seed(7))


# ----------------------------------------------------------------------------------------------- restoring
def test_restoring_every_layer_gives_back_the_teacher():
    rope = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    teacher = llama_teacher(attention_bias=True, mlp_bias=True, rope_parameters=rope)
    student = converted(teacher)
    ids = rows(2, 40)
    restored = restore_softmax_layers(student, list(range(LAYERS)))
    assert restored.config.softmax_layers == list(range(LAYERS))
    assert all(isinstance(layer.self_attn, SoftmaxAttention) for layer in restored.model.layers)
    assert not any(name for name, _ in restored.named_parameters() if "feature_map" in name or "window_gate" in name)
    with torch.no_grad():
        expected = teacher(ids).logits
        assert not torch.allclose(student(ids, use_cache=False).logits, expected, atol=1e-3)  # the test can fail
        torch.testing.assert_close(restored(ids, use_cache=False).logits, expected, atol=2e-5, rtol=1e-4)
        generated = restored.generate(ids[:, :12], max_new_tokens=6, do_sample=False)
        torch.testing.assert_close(generated, teacher.generate(ids[:, :12], max_new_tokens=6, do_sample=False))


@pytest.mark.parametrize("layer", [0, 2])
def test_restoring_one_layer_equals_converting_with_it_as_softmax(layer, tmp_path):
    teacher = llama_teacher()
    student = converted(teacher)
    before = {name: value.clone() for name, value in student.state_dict().items()}
    restored = restore_softmax_layers(student, [layer])

    # The source model is untouched (restore returns a copy) ...
    assert isinstance(student.model.layers[layer].self_attn, LinearAttention) and student.config.softmax_layers == []
    assert all(torch.equal(value, before[name]) for name, value in student.state_dict().items())
    # ... and the copy is exactly a model converted with softmax_layers=[layer] carrying the same weights.
    assert restored.config.softmax_layers == [layer]
    reference = convert_to_linear_attention(teacher, **OPTIONS, softmax_layers=[layer])
    reference.load_state_dict(restored.state_dict(), strict=True)  # same parameter names: the linear ones are gone
    dropped = {name for name in before if name not in restored.state_dict()}
    assert dropped and all(name.startswith(f"model.layers.{layer}.self_attn.") for name in dropped)
    assert all(torch.equal(restored.state_dict()[name], value) for name, value in before.items() if name not in dropped)
    ids = rows(2, 32)
    with torch.no_grad():
        got = restored(ids, use_cache=False).logits
        assert torch.equal(got, reference(ids, use_cache=False).logits)
        assert not torch.allclose(got, student(ids, use_cache=False).logits, atol=1e-4)
        # The cache follows the new layer kinds: chunked prefill + a step equal the full forward.
        cache = LinearAttentionCache(restored.config)
        restored(ids[:, :20], cache=cache)
        step = restored(ids[:, 20:21], cache=cache).logits
        torch.testing.assert_close(step, restored(ids[:, :21], use_cache=False).logits[:, -1:], atol=1e-5, rtol=1e-4)

    restored.save_pretrained(tmp_path / "hybrid")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hybrid").eval()
    assert loaded.config.softmax_layers == [layer]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, use_cache=False).logits, got)


def test_restoring_in_place_keeps_the_object_and_adds_to_existing_softmax_layers():
    student = converted(llama_teacher(), softmax_layers=[3])
    q_proj = student.model.layers[1].self_attn.q_proj
    same = restore_softmax_layers(student, [1, 3, 1], inplace=True)
    assert same is student and student.config.softmax_layers == [1, 3]
    assert student.model.layers[1].self_attn.q_proj is q_proj  # the projections are shared, not copied


def test_attention_transfer_of_a_layer_does_not_depend_on_which_others_are_softmax():
    """Why selection runs after stage 1: with teacher forcing each linear layer's transfer loss (and so its
    gradient) is the same whether other layers are linear or restored, so restoring layers of a stage-1 model
    gives what stage 1 of the hybrid itself would train (up to global-norm gradient clipping)."""
    student = converted(llama_teacher())
    hybrid = restore_softmax_layers(student, [0, 2])
    ids = rows(2, 32)

    def transfer_losses(model):
        with AttentionTransfer(model) as transfer:
            model(ids, use_cache=False, logits_to_keep=1)
        return {layer.layer_idx: loss for layer, loss in zip(transfer.layers, transfer.layer_losses, strict=True)}

    everywhere, only_some = transfer_losses(student), transfer_losses(hybrid)
    assert sorted(only_some) == [1, 3]
    for index, loss in only_some.items():
        assert loss > 0
        torch.testing.assert_close(loss, everywhere[index], atol=1e-7, rtol=1e-6)


# ----------------------------------------------------------------------------------------------- ranking
def test_ranking_is_deterministic_leaves_the_student_as_it_was_and_matches_a_direct_computation():
    teacher = llama_teacher()
    student = converted(teacher)
    student.train()
    modules = [layer.self_attn for layer in student.model.layers]
    before = {name: value.clone() for name, value in student.state_dict().items()}
    ids = rows(2, 32)
    ranking = rank_softmax_layers(student, teacher, ids)

    assert ranking == rank_softmax_layers(student, teacher, ids)
    assert [layer.self_attn for layer in student.model.layers] == modules and student.training
    assert all(torch.equal(value, before[name]) for name, value in student.state_dict().items())
    assert sorted(entry["layer"] for entry in ranking) == list(range(LAYERS))
    reductions = [entry["kl_reduction"] for entry in ranking]
    assert reductions == sorted(reductions, reverse=True)

    student.eval()
    reference = direct_kl(student, teacher, ids)
    for entry in ranking:
        assert entry["reference_kl"] == pytest.approx(reference, rel=1e-5)
        assert entry["kl_reduction"] == pytest.approx(entry["reference_kl"] - entry["kl"], rel=1e-9, abs=1e-12)
    one = ranking[-1]
    assert one["kl"] == pytest.approx(direct_kl(restore_softmax_layers(student, [one["layer"]]), teacher, ids),
                                      rel=1e-5)


@pytest.mark.parametrize("planted", range(LAYERS))
def test_a_layer_made_worse_ranks_first(planted):
    teacher = llama_teacher()
    student = convert_to_linear_attention(teacher, **OPTIONS)
    make_worse(student, planted)
    layers, ranking = select_softmax_layers(student, teacher, rows(2, 32), k=1)
    assert layers == [planted]
    assert ranking[0]["layer"] == planted
    assert ranking[0]["kl_reduction"] > 3 * ranking[1]["kl_reduction"]
    assert ranking[0]["relative_reduction"] > 0.5


def test_selection_ranks_only_the_linear_layers():
    teacher = llama_teacher()
    student = converted(teacher, softmax_layers=[0])
    make_worse(student, 2)
    layers, ranking = select_softmax_layers(student, teacher, rows(1, 24).tolist(), k=2)
    assert sorted(entry["layer"] for entry in ranking) == [1, 2, 3]
    assert len(layers) == 2 and 2 in layers and 0 not in layers


def test_write_ranking_is_atomic(tmp_path):
    ranking = [{"layer": 1, "kl": 0.5, "kl_reduction": 0.25, "relative_reduction": 1 / 3, "reference_kl": 0.75}]
    path = write_ranking(tmp_path / "ranking.json", ranking, selected=[1], rows=2)
    written = json.loads(path.read_text())
    assert written["ranking"] == ranking and written["selected"] == [1] and written["rows"] == 2
    with pytest.raises(TypeError):
        write_ranking(tmp_path / "ranking.json", ranking, bad=object())  # not JSON: the old file stays whole
    assert json.loads(path.read_text()) == written
    assert [p.name for p in tmp_path.iterdir()] == ["ranking.json"]


# ----------------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("spec, expected", [
    (None, SoftmaxLayerSpec()),
    ([], SoftmaxLayerSpec()),
    ("", SoftmaxLayerSpec()),
    ([5, 1, 7, 1], SoftmaxLayerSpec(layers=(1, 5, 7))),
    ("1,5,7", SoftmaxLayerSpec(layers=(1, 5, 7))),
    (["1", "5", "7"], SoftmaxLayerSpec(layers=(1, 5, 7))),
    (["1,5", 7], SoftmaxLayerSpec(layers=(1, 5, 7))),
    ("auto:3", SoftmaxLayerSpec(auto_k=3)),
    (["auto:1"], SoftmaxLayerSpec(auto_k=1)),
    ("auto:7", SoftmaxLayerSpec(auto_k=7)),
])
def test_parse_softmax_layers(spec, expected):
    assert parse_softmax_layers(spec, 8) == expected


@pytest.mark.parametrize("spec, message", [
    ("auto:8", "K = 8 would restore every layer, which is the teacher"),
    ("auto:0", r"K = 0 is out of range; K lies in \[1, 7\]"),
    ("auto:-2", r"K = -2 is out of range"),
    ("auto:x", "exactly \"auto:K\" with an integer K"),
    ("auto:", "exactly \"auto:K\""),
    ("auto", "exactly \"auto:K\""),
    (["auto:2", "3"], "on its own"),
    ("1,x", "'x' is not a layer index"),
    ("1.5", "'1.5' is not a layer index"),
    ([1, 8], r"layer 8 does not exist; indices lie in \[0, 7\]"),
    ([-1], "layer -1 does not exist"),
    ([True], "True is not a layer index"),
    ([1.0], "1.0 is not a layer index"),
    (3, "expected a list of layer indices"),
])
def test_parse_softmax_layers_refuses_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message) as error:
        parse_softmax_layers(spec, 8)
    assert "softmax_layers" in str(error.value)


def test_parse_softmax_layers_names_command_line_words_as_typed():
    with pytest.raises(ValueError, match="softmax_layers='auto:9':"):
        parse_softmax_layers(["auto:9"], 8)


def test_parse_softmax_layers_refuses_a_bad_layer_count():
    with pytest.raises(ValueError, match="num_layers must be a positive integer"):
        parse_softmax_layers("1", 0)
    with pytest.raises(ValueError, match="one layer has no layer to choose"):
        parse_softmax_layers("auto:1", 1)


def test_auto_selection_needs_a_teacher_and_a_ranking_model():
    auto = SoftmaxLayerSpec(auto_k=2)
    check_layer_selection(auto, teacher="teacher-dir", ranking_model="stage1-dir")
    check_layer_selection(SoftmaxLayerSpec(layers=(1,)), teacher=None, ranking_model=None)
    with pytest.raises(ValueError, match="'auto:2' needs a teacher"):
        check_layer_selection(auto, teacher=None, ranking_model="stage1-dir")
    with pytest.raises(ValueError, match="'auto:2' needs a ranking_model"):
        check_layer_selection(auto, teacher="teacher-dir", ranking_model=None)
    with pytest.raises(ValueError, match="ranking_model='stage1-dir' is only used with softmax_layers='auto:K'"):
        check_layer_selection(SoftmaxLayerSpec(), teacher="teacher-dir", ranking_model="stage1-dir")


def test_ranking_model_must_be_the_same_conversion(tmp_path):
    teacher = llama_teacher()
    converted(teacher).save_pretrained(tmp_path / "stage1")
    saved = AutoConfig.from_pretrained(tmp_path / "stage1")
    check_same_conversion(saved, linear_attention_config(teacher.config, **OPTIONS, softmax_layers=[1]))
    with pytest.raises(ValueError, match="feature_dim: 8 vs 16"):
        check_same_conversion(saved, linear_attention_config(teacher.config, **{**OPTIONS, "feature_dim": 16}))
    with pytest.raises(ValueError, match="ranking_model is a 'llama' model"):
        check_same_conversion(teacher.config, linear_attention_config(teacher.config, **OPTIONS))


def test_bad_arguments_fail_before_any_work():
    teacher = llama_teacher()
    student = converted(teacher)
    ids = rows(1, 8)
    with pytest.raises(TypeError, match="model must be a LinearAttentionForCausalLM; got LlamaForCausalLM"):
        restore_softmax_layers(teacher, [0])
    with pytest.raises(ValueError, match=r"\[4\] are not layer indices; indices are integers in \[0, 3\]"):
        restore_softmax_layers(student, [1, 4])
    with pytest.raises(TypeError, match="layers must be a list of layer indices"):
        restore_softmax_layers(student, "1")
    with pytest.raises(TypeError, match="student must be a LinearAttentionForCausalLM"):
        rank_softmax_layers(teacher, teacher, ids)
    with pytest.raises(TypeError, match="teacher must be a transformers PreTrainedModel"):
        rank_softmax_layers(student, "teacher", ids)
    other = llama_teacher()
    other.resize_token_embeddings(100)
    with pytest.raises(ValueError, match=r"different vocabularies \(100 vs 96 tokens\)"):
        rank_softmax_layers(student, other, ids)
    for bad, message in [(ids[0], r"shape \[N, L\] .* got shape \[8\]"), (ids[:, :0], r"got shape \[1, 0\]"),
                         (ids.float(), "integer token ids; got dtype torch.float32"),
                         (ids + 96, r"outside \[0, 95\]"), ([[1, 2], [3]], "equal-length lists")]:
        with pytest.raises(ValueError, match=message):
            rank_softmax_layers(student, teacher, bad)
    with pytest.raises(ValueError, match="no linear-attention layer to rank"):
        rank_softmax_layers(restore_softmax_layers(student, list(range(LAYERS))), teacher, ids)
    for k in (0, LAYERS, 2.0):
        with pytest.raises(ValueError, match=r"choose an integer in \[1, 3\]"):
            select_softmax_layers(student, teacher, ids, k)


def test_the_demo_restores_the_best_ranked_layers_of_stage1_and_writes_the_ranking_beside_them(tmp_path,
                                                                                              dataset_cache):
    """`training/demo.py` and `training/convert.py` share `restore_ranked_layers`: stage 1 with the best-ranked
    layer restored, the ranking of the held-out rows of the data pipeline in softmax_layer_ranking.json."""
    from hf_linear_attn.training import demo
    from hf_linear_attn.training.data import DataArguments, build_datasets, byte_level_tokenizer

    teacher = llama_teacher(vocab_size=259)  # byte-level ids
    converted(teacher).save_pretrained(tmp_path / "stage1")
    tokenizer, data = byte_level_tokenizer(), DataArguments(block_size=32, cache_dir=str(dataset_cache))
    folder = demo.select_layers(tmp_path, teacher, tokenizer, data, k=1, rows=2)

    rows = torch.tensor(build_datasets(data, tokenizer)["validation"]["input_ids"][:2])
    layers, ranking = select_softmax_layers(AutoModelForCausalLM.from_pretrained(tmp_path / "stage1"), teacher, rows, 1)
    written = json.loads((folder / "softmax_layer_ranking.json").read_text())
    assert list(written) == ["measure", "selected", "rows", "row_tokens", "ranking"]
    assert written["selected"] == layers and (written["rows"], written["row_tokens"]) == (2, 32)
    assert [entry["layer"] for entry in written["ranking"]] == [entry["layer"] for entry in ranking]
    assert [entry["kl"] for entry in written["ranking"]] == pytest.approx([entry["kl"] for entry in ranking])
    assert AutoModelForCausalLM.from_pretrained(folder).config.softmax_layers == layers


@pytest.mark.parametrize("kind", [{"feature_map": "hedgehog", "feature_dim": 8, "window_size": 5, "num_sink_tokens": 2,
                                   "decay": "scalar"}, {}], ids=["window", "linear"])
def test_restoration_gains_are_each_heads_log_prob_gain_measured_on_a_restored_copy(kind):
    """Each recurrent KV head's gain equals the answer's mean log-probability of a full forward of a copy with that
    head restored (`restore_softmax_heads`) minus the unmodified model's, averaged over the prompts; heads exact
    already get -inf; the model is left as it was."""
    model = tiny_model(num_hidden_layers=3, softmax_layers=[2], softmax_heads={0: [1]}, **kind).eval()
    generator = torch.Generator().manual_seed(0)
    prompts = []
    for needle in (5, 17):
        ids = torch.randint(3, 120, (1, 40), generator=generator)
        ids[0, -3:] = ids[0, needle:needle + 3]
        prompts.append(RetrievalPrompt(ids, (needle, needle + 3), (37, 40)))

    def answer_log_prob(m, prompt):
        log_probs = F.log_softmax(m(input_ids=prompt.input_ids).logits[0, 36:39].float(), dim=-1)
        return log_probs.gather(-1, prompt.input_ids[0, 37:40, None]).mean().item()

    before = {name: p.clone() for name, p in model.state_dict().items()}
    gains = restoration_gains(model, prompts, progress=False)
    expected = torch.full((3, 2), float("-inf"))
    for layer, head in [(0, 0), (1, 0), (1, 1)]:
        restored = restore_softmax_heads(model, {layer: [head]})
        expected[layer, head] = sum(answer_log_prob(restored, p) - answer_log_prob(model, p) for p in prompts) / 2
    torch.testing.assert_close(gains, expected, rtol=1e-4, atol=1e-5)
    assert (gains[[0, 1, 1], [0, 0, 1]].abs() > 1e-4).all()  # restoring a head changes the answer's probability
    assert model.config.softmax_heads == {0: [1]} and not model.training
    assert all(torch.equal(p, before[name]) for name, p in model.state_dict().items())
    assert isinstance(model.model.layers[1].self_attn, LinearAttention)
    with pytest.raises(ValueError, match="at least one prompt"):
        restoration_gains(model, [])
    with pytest.raises(ValueError, match="no recurrent KV head"):
        restoration_gains(tiny_model(num_hidden_layers=2, softmax_heads={0: [0, 1], 1: [0, 1]}), prompts)


def passkey_like_prompts(vocab: int = 120, length: int = 40) -> list[RetrievalPrompt]:
    """Two teacher-forced prompts whose last 3 tokens repeat 3 tokens stated earlier (at 5 and at 17)."""
    generator = torch.Generator().manual_seed(0)
    prompts = []
    for needle in (5, 17):
        ids = torch.randint(3, vocab, (1, length), generator=generator)
        ids[0, -3:] = ids[0, needle:needle + 3]
        prompts.append(RetrievalPrompt(ids, (needle, needle + 3), (length - 3, length)))
    return prompts


def o_proj_input(model, layer: int, prompt: RetrievalPrompt) -> torch.Tensor:
    """The input of layer `layer`'s o_proj (its heads' outputs, [T, H·V]) in a forward of `prompt`."""
    seen = []
    handle = model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        model(input_ids=prompt.input_ids)
    finally:
        handle.remove()
    return seen[0]


def answer_log_prob_with_change(model, layer: int, change: torch.Tensor, prompt: RetrievalPrompt) -> torch.Tensor:
    """The answer's mean log-probability (0-d) with `change` added to layer `layer`'s o_proj input."""
    handle = model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(lambda m, args: (args[0] + change,))
    try:
        log_probs = F.log_softmax(model(input_ids=prompt.input_ids).logits[0, -4:-1], dim=-1)
    finally:
        handle.remove()
    return log_probs.gather(-1, prompt.input_ids[0, -3:, None]).mean()


@pytest.mark.parametrize("kind", [{"feature_map": "hedgehog", "feature_dim": 8, "window_size": 5, "num_sink_tokens": 2,
                                   "decay": "scalar", "use_short_conv": True}, {"decay": "vector"}],
                         ids=["window", "linear"])
def test_estimated_restoration_gains_are_the_derivative_along_each_heads_restoration(kind):
    """Each recurrent head's estimate is the derivative d/dε of the answer's mean log-probability with ε times the
    change that restoring the head makes to its layer's o_proj input added there (the change taken from a restored
    copy: it touches only the head's query group), averaged over the prompts; the whole step (ε = 1) is the exact
    gain. Heads exact already get -inf; the model, its parameters and their requires_grad flags are left as they
    were."""
    model = tiny_model(num_hidden_layers=3, softmax_layers=[2], softmax_heads={0: [1]}, **kind).double().eval()
    model.model.layers[0].self_attn.q_proj.weight.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    before = {name: p.clone() for name, p in model.state_dict().items()}
    prompts = passkey_like_prompts()
    estimates = estimated_restoration_gains(model, prompts, progress=False)
    exact = restoration_gains(model, prompts, progress=False)
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    width = model.config.head_dim * groups
    for layer, head in [(0, 0), (1, 0), (1, 1)]:
        restored = restore_softmax_heads(model, {layer: [head]})
        slopes, steps = [], []
        for prompt in prompts:
            with torch.no_grad():
                change = o_proj_input(restored, layer, prompt) - o_proj_input(model, layer, prompt)  # [T, H·V]
                steps.append((answer_log_prob_with_change(model, layer, change, prompt)
                              - answer_log_prob_with_change(model, layer, 0 * change, prompt)).item())
            outside = torch.ones(change.shape[1], dtype=torch.bool)
            outside[head * width:(head + 1) * width] = False
            assert change[:, outside].abs().max() == 0 and change.abs().max() > 0
            epsilon = torch.zeros((), dtype=torch.float64, requires_grad=True)
            with_step = answer_log_prob_with_change(model, layer, epsilon * change, prompt)
            slope, = torch.autograd.grad(with_step, epsilon)
            slopes.append(slope.item())
        assert estimates[layer, head].item() == pytest.approx(sum(slopes) / 2, rel=1e-5, abs=1e-9)
        assert exact[layer, head].item() == pytest.approx(sum(steps) / 2, rel=1e-3, abs=1e-6)  # fp32 logits
        # a first-order estimate, not the measurement
        assert estimates[layer, head].item() != pytest.approx(exact[layer, head].item(), rel=1e-3)
    assert estimates[0, 1] == float("-inf") and (estimates[2] == float("-inf")).all()
    assert [p.requires_grad for p in model.parameters()] == flags and not model.training
    assert all(torch.equal(p, before[name]) for name, p in model.state_dict().items())


def test_a_shortlist_measures_exactly_the_heads_the_estimate_ranks_best():
    """restoration_gains with shortlist M: the M heads ranked best by estimated_restoration_gains hold their exact
    gains, every other head -inf; a shortlist out of range is refused before any forward. `rank_restoration_heads`'
    default shortlist, 3 × N, stops at every recurrent head (counted from the model or its config alike)."""
    from hf_linear_attn.training.checkpoint_conversion import rank_restoration_heads

    model = tiny_model(num_hidden_layers=3, feature_map="hedgehog", feature_dim=8, window_size=5, num_sink_tokens=2,
                       softmax_heads={0: [1]}).eval()
    candidates = [(0, 0), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert recurrent_kv_heads(model) == recurrent_kv_heads(model.config) == candidates
    assert recurrent_kv_heads(tiny_model(num_hidden_layers=3, softmax_layers=[1]).config) == [(0, 0), (0, 1), (2, 0),
                                                                                              (2, 1)]
    prompts = passkey_like_prompts()
    estimates = estimated_restoration_gains(model, prompts, progress=False)
    exact = restoration_gains(model, prompts, progress=False)
    shortlisted = restoration_gains(model, prompts, progress=False, shortlist=2)
    best = sorted(((layer, head) for layer in range(3) for head in range(2) if (layer, head) != (0, 1)),
                  key=lambda lh: (-float(estimates[lh]), lh))[:2]
    expected = torch.full_like(exact, float("-inf"))
    for lh in best:
        expected[lh] = exact[lh]
    torch.testing.assert_close(shortlisted, expected, rtol=1e-4, atol=1e-6)
    ranked = rank_restoration_heads(model, prompts, 2)  # shortlist min(6, 5): every head measured exactly
    torch.testing.assert_close(ranked.scores, exact, rtol=1e-4, atol=1e-6)
    for bad in (0, 6, 2.5):
        with pytest.raises(ValueError, match=rf"shortlist={bad!r}: give a number of KV heads in \[1, 5\]"):
            restoration_gains(model, prompts, shortlist=bad)


def test_the_demo_restores_the_heads_stage1_gains_most_from_and_writes_the_ranking_beside_them(tmp_path,
                                                                                             dataset_cache):
    """`training/demo.py` and `training/convert.py --head_ranking restoration` share `rank_restoration_heads`: stage 1
    with the KV head whose restoration alone raises its log-probability of a pass key most restored, the measured
    heads in softmax_head_ranking.json."""
    from hf_linear_attn.training import demo
    from hf_linear_attn.training.checkpoint_conversion import head_ranking_prompts
    from hf_linear_attn.training.data import DataArguments, byte_level_tokenizer

    teacher = llama_teacher(vocab_size=259, max_position_embeddings=512)  # byte-level ids, passkey prompts of 400
    converted(teacher).save_pretrained(tmp_path / "stage1")
    tokenizer, data = byte_level_tokenizer(), DataArguments(block_size=400, cache_dir=str(dataset_cache))
    args = demo.DemoArguments(restored_heads_n=2, head_ranking_shortlist=3, head_ranking_prompts=2)
    folder = demo.restore_heads(tmp_path, tmp_path / "stage1", tokenizer, data, args)

    stage1 = AutoModelForCausalLM.from_pretrained(tmp_path / "stage1")
    gains = restoration_gains(stage1, head_ranking_prompts(tokenizer, data, 2), progress=False, shortlist=3)
    best = sorted(((layer, head) for layer in range(LAYERS) for head in range(2)),
                  key=lambda lh: (-float(gains[lh]), lh))[:2]
    expected = {}
    for layer, head in sorted(best):
        expected.setdefault(layer, []).append(head)
    written = json.loads((folder / "softmax_head_ranking.json").read_text())
    assert len(written["ranking"]) == 3 and written["ranking_model"] == str(tmp_path / "stage1")
    assert {int(layer): heads for layer, heads in written["selected"].items()} == expected
    assert AutoModelForCausalLM.from_pretrained(folder).config.softmax_heads == expected

    # ranking_shortlist 0: the first-order estimate alone ranks, every recurrent head in the ranking
    estimate_only = demo.restore_heads(tmp_path / "estimate", tmp_path / "stage1", tokenizer, data,
                                       demo.DemoArguments(restored_heads_n=2, head_ranking_shortlist=0,
                                                          head_ranking_prompts=2))
    estimates = estimated_restoration_gains(stage1, head_ranking_prompts(tokenizer, data, 2), progress=False)
    written = json.loads((estimate_only / "softmax_head_ranking.json").read_text())
    assert len(written["ranking"]) == 2 * LAYERS and "first-order estimate" in written["measure"]
    assert [entry["score"] for entry in written["ranking"]] == pytest.approx(
        sorted((float(x) for x in estimates.flatten()), reverse=True), abs=1e-5)
