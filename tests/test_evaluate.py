"""training/evaluate.py: perplexity with documents kept apart, the sliding-window baseline, decode profile,
and the numbers written into each linear-attention checkpoint's model card."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import document_pieces
from transformers import LlamaConfig, LlamaForCausalLM

from hf_linear_attn import convert_to_linear_attention
from training import evaluate
from training.data import DataArguments, build_datasets, byte_level_tokenizer, collate_rows
from training.model_card import EVALUATION_FILE

pytestmark = pytest.mark.usefixtures("single_thread")
BLOCK = 64


def byte_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def per_document_loss(model, rows, window: int = 0, sinks: int = 0) -> float:
    """exp(mean next-token loss) with every document of the packed rows run alone; with `window`, each
    position sees only the last `window` positions and the first `sinks` of its document (explicit mask)."""
    total, count = 0.0, 0
    for piece in document_pieces(rows):
        mask = None
        if window:
            i = torch.arange(piece.shape[1])
            allowed = (i[:, None] >= i[None]) & ((i[:, None] - i[None] < window) | (i[None] < sinks))
            mask = torch.where(allowed, 0.0, -torch.inf)[None, None]
        with torch.no_grad():
            logits = model(piece, attention_mask=mask).logits[0, :-1]
        total += F.cross_entropy(logits, piece[0, 1:], reduction="sum").item()
        count += piece.shape[1] - 1
    return math.exp(total / count)


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, dataset_cache):
    """A byte-level Llama teacher, its conversion with a window covering every row (exactly the teacher)
    and one with a short window, evaluated together."""
    root = tmp_path_factory.mktemp("evaluate")
    teacher = byte_llama()
    tokenizer = byte_level_tokenizer()
    teacher.save_pretrained(root / "teacher")
    tokenizer.save_pretrained(root / "teacher")
    for name, window in (("wide", BLOCK), ("narrow", 8)):
        student = convert_to_linear_attention(teacher, feature_map="hedgehog", feature_dim=8, window_size=window,
                                              num_sink_tokens=2)
        student.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    evaluate.main(["--teacher", str(root / "teacher"), "--models", f"wide={root / 'wide'}",
                   f"narrow={root / 'narrow'}", "--block_size", str(BLOCK), "--max_eval_rows", "6",
                   "--baseline_window", "8", "--baseline_sinks", "2", "--passkey_lengths", "160",
                   "--passkey_trials", "1", "--decode_contexts", "40", "160", "--decode_tokens", "2",
                   "--prefill_chunk", "64", "--cache_dir", str(dataset_cache), "--output_dir", str(root / "out")])
    torch.set_num_threads(threads)
    data = DataArguments(block_size=BLOCK, cache_dir=str(dataset_cache))
    rows = collate_rows(list(build_datasets(data, tokenizer)["validation"])[:6])
    return root, teacher, rows


def test_perplexities_are_per_document_and_the_window_baseline_is_masked_attention(evaluated):
    root, teacher, rows = evaluated
    result = {r["model"]: r for r in json.loads((root / "out" / "evaluation.json").read_text())["rows"]}
    assert list(result) == ["teacher", "teacher, window 8 + 2 sinks", "wide", "narrow"]
    assert result["teacher"]["perplexity"] == pytest.approx(per_document_loss(teacher, rows), rel=1e-5)
    baseline = result["teacher, window 8 + 2 sinks"]["perplexity"]
    assert baseline == pytest.approx(per_document_loss(teacher, rows, window=8, sinks=2), rel=1e-5)
    assert baseline != pytest.approx(result["teacher"]["perplexity"], rel=1e-5)  # the window does bind
    # A window covering every row makes the converted model the teacher.
    assert result["wide"]["perplexity"] == pytest.approx(result["teacher"]["perplexity"], rel=1e-4)
    assert result["wide"]["vs_teacher"] == pytest.approx(1.0, rel=1e-4)
    assert all(0.0 <= r["passkey@160"] <= 1.0 for name, r in result.items() if "window" not in name)


def test_decode_profile_cache_is_constant_for_linear_attention_and_grows_for_the_teacher(evaluated):
    root, _, _ = evaluated
    decode = json.loads((root / "out" / "decode.json").read_text())["rows"]
    by_model = {}
    for row in decode:
        by_model.setdefault(row["model"], []).append(row)
    assert [r["context"] for r in by_model["teacher"]] == [40, 160]
    assert by_model["teacher"][1]["cache_bytes"] == 4 * by_model["teacher"][0]["cache_bytes"]
    assert by_model["narrow"][1]["cache_bytes"] == by_model["narrow"][0]["cache_bytes"] > 0
    assert all(r["ms_per_token"] > 0 for r in decode)


def test_each_linear_checkpoint_gets_the_numbers_in_its_model_card(evaluated):
    root, _, _ = evaluated
    assert not (root / "teacher" / "evaluation.json").exists()  # a softmax checkpoint is left alone
    evaluation = json.loads((root / "out" / "evaluation.json").read_text())["rows"]
    for label in ("wide", "narrow"):
        record = json.loads((root / label / EVALUATION_FILE).read_text())
        assert record["label"] == label and record["rows"] == evaluation
        card = (root / label / "README.md").read_text()
        assert "### Against the softmax teacher" in card
        mine = next(r for r in evaluation if r["model"] == label)
        assert f"| **{label}** | **{mine['perplexity']:,.1f}** |" in card or f"**{mine['perplexity']:.3g}**" in card
        assert "| teacher, window 8 + 2 sinks |" in card
