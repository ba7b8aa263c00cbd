"""Stage-1 attention transfer (training/distill.py) on a tiny converted Llama."""

import json

import pytest
import torch
from helpers import save_with_tokenizer, teacher
from transformers import AutoModelForCausalLM

from hf_linear_attn import convert_to_linear_attention
from hf_linear_attn.training.attention_transfer import AttentionTransfer
from hf_linear_attn.training.data import DataArguments
from hf_linear_attn.training.loop import TrainArguments
from hf_linear_attn.training.stages import DistillArguments, distill


def transfer_loss(model, ids: torch.Tensor) -> float:
    with AttentionTransfer(model), torch.no_grad():
        return model(ids, use_cache=False, logits_to_keep=1).loss.item()


def write_corpus(folder, seed: int, lines: int, held_out: int) -> dict[str, str]:
    """Random 60-word lines over a 90-word vocabulary in `folder`/train.txt and valid.txt (the last `held_out` of
    `lines`): DataArguments' file keys."""
    words = [f"w{i}" for i in range(90)]
    generator = torch.Generator().manual_seed(seed)
    text = [" ".join(words[j] for j in torch.randint(0, 90, (60,), generator=generator)) for _ in range(lines)]
    (folder / "train.txt").write_text("\n".join(text[:-held_out]) + "\n")
    (folder / "valid.txt").write_text("\n".join(text[-held_out:]) + "\n")
    return {"train_file": str(folder / "train.txt"), "validation_file": str(folder / "valid.txt")}


def test_attention_transfer_lowers_the_layer_loss_and_trains_only_feature_maps(tmp_path):
    source = teacher("llama")
    student = convert_to_linear_attention(source, feature_map="hedgehog", feature_dim=8, window_size=4,
                                          num_sink_tokens=1)
    save_with_tokenizer(student, tmp_path / "converted")
    files = write_corpus(tmp_path, seed=0, lines=40, held_out=8)
    out = tmp_path / "distilled"
    result = distill(
        DistillArguments(model_name_or_path=str(tmp_path / "converted")),
        DataArguments(**files, block_size=48, max_eval_samples=4),
        TrainArguments(output_dir=str(out), max_steps=25, per_device_train_batch_size=4, learning_rate=3e-2,
                       warmup_steps=0, lr_scheduler_type="constant", report_to="none", logging_steps=5),
    )
    trained = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(3, 93, (2, 48), generator=torch.Generator().manual_seed(1))
    assert transfer_loss(trained, ids) < 0.8 * transfer_loss(student.eval(), ids)
    before, after = student.state_dict(), trained.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("feature_map" in k or "window_gate" in k for k in changed), changed
    # The transfer hooks are gone: the trained model in memory is an ordinary model again.
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in result.model.modules())
    # The run is recorded for the model card.
    summary = json.loads((out / "training_summary.json").read_text())
    assert summary["script"] == "training/distill.py" and summary["steps"] == 25
    assert summary["base_model"] == str(tmp_path / "converted") and summary["recipe"]["learning_rate"] == 3e-2
    card = (out / "README.md").read_text()
    assert "Recipe (`training/distill.py`" in card and "| eval_loss |" in card


@pytest.mark.parametrize("decay", ["scalar", "vector"])
def test_attention_transfer_trains_the_decay_gates_of_a_decayed_hybrid(tmp_path, decay):
    """A decayed window hybrid starts with long memory; stage 1 learns where to forget: its decay gates train,
    beside feature maps and γ, and nothing else does."""
    student = convert_to_linear_attention(teacher("llama"), feature_map="hedgehog", feature_dim=8, window_size=4,
                                          num_sink_tokens=1, decay=decay, decay_low_rank_dim=4)
    save_with_tokenizer(student, tmp_path / "converted")
    files = write_corpus(tmp_path, seed=1, lines=16, held_out=4)
    out = tmp_path / "distilled"
    distill(
        DistillArguments(model_name_or_path=str(tmp_path / "converted")),
        DataArguments(**files, block_size=48, max_eval_samples=2),
        TrainArguments(output_dir=str(out), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                       warmup_steps=0, lr_scheduler_type="constant", report_to="none", eval_steps=0),
    )
    before, after = student.state_dict(), AutoModelForCausalLM.from_pretrained(out).state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert all(any(p in k for p in ("feature_map", "window_gate", "decay_proj")) for k in changed), changed
    for layer in range(student.config.num_hidden_layers):
        gate = f"model.layers.{layer}.self_attn.decay_proj{'' if decay == 'scalar' else '.1'}"
        assert {f"{gate}.weight", f"{gate}.bias"} <= changed, changed


def test_distill_refuses_a_softmax_checkpoint(tmp_path):
    save_with_tokenizer(teacher("qwen2"), tmp_path / "softmax")
    with pytest.raises(ValueError, match="not a linear-attention model"):
        distill(DistillArguments(model_name_or_path=str(tmp_path / "softmax")), DataArguments(block_size=32),
                TrainArguments(output_dir=str(tmp_path / "out"), max_steps=1, report_to="none"))
    assert not (tmp_path / "out").exists()


def test_distill_refuses_a_checkpoint_with_a_missing_weight(tmp_path):
    from safetensors.torch import load_file, save_file

    student = convert_to_linear_attention(teacher("llama"), feature_map="hedgehog", feature_dim=8, window_size=4)
    save_with_tokenizer(student, tmp_path / "converted")
    state = load_file(str(tmp_path / "converted" / "model.safetensors"))
    del state["model.layers.1.self_attn.feature_map_q.weight"]
    save_file(state, str(tmp_path / "converted" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"is missing weights \['model.layers.1.self_attn.feature_map_q.weight'\]"):
        distill(DistillArguments(model_name_or_path=str(tmp_path / "converted")), DataArguments(block_size=32),
                TrainArguments(output_dir=str(tmp_path / "out"), max_steps=1, report_to="none"))
    assert not (tmp_path / "out").exists()


def test_distill_with_window_dropout_records_it_and_saves_the_whole_window(tmp_path):
    student = convert_to_linear_attention(teacher("llama"), feature_map="hedgehog", feature_dim=8, window_size=4,
                                          num_sink_tokens=1)
    save_with_tokenizer(student, tmp_path / "converted")
    files = write_corpus(tmp_path, seed=2, lines=16, held_out=4)
    out = tmp_path / "distilled"
    result = distill(
        DistillArguments(model_name_or_path=str(tmp_path / "converted"), window_dropout=0.5),
        DataArguments(**files, block_size=48, max_eval_samples=2),
        TrainArguments(output_dir=str(out), max_steps=3, per_device_train_batch_size=4, learning_rate=1e-2,
                       warmup_steps=0, lr_scheduler_type="constant", report_to="none", eval_steps=0),
    )
    assert all(layer.self_attn.window_size == 4 for layer in result.model.model.layers)
    trained = AutoModelForCausalLM.from_pretrained(out)
    assert trained.config.window_size == 4 and all(layer.self_attn.window_size == 4 for layer in trained.model.layers)
    assert json.loads((out / "training_summary.json").read_text())["recipe"]["window_dropout"] == 0.5


def test_distill_refuses_window_dropout_without_a_window_before_any_work(tmp_path):
    student = convert_to_linear_attention(teacher("llama"), feature_map="hedgehog", feature_dim=8, window_size=0,
                                          num_sink_tokens=0)
    save_with_tokenizer(student, tmp_path / "converted")
    with pytest.raises(ValueError, match="no sliding window to shrink"):
        distill(DistillArguments(model_name_or_path=str(tmp_path / "converted"), window_dropout=0.3),
                DataArguments(block_size=32), TrainArguments(output_dir=str(tmp_path / "out"), max_steps=1,
                                                             report_to="none"))
    assert not (tmp_path / "out").exists()
