"""lm-eval-harness runs a linear-attention checkpoint as an ordinary `hf` model, with the local tasks in
configs/lm_eval; its scores are checked against the same quantities computed directly from the model."""

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, tiny_config

import hf_linear_attn
from training.data import byte_level_tokenizer

lm_eval = pytest.importorskip("lm_eval", reason="the lm-eval extra: pip install -e '.[dev]'")
TASKS = ROOT / "configs" / "lm_eval"
LIMIT = 12  # documents / questions per task: enough to compare, quick on 2 cores


def _load_tasks_module():
    """configs/lm_eval/jargon_tasks.py, loaded from its file as lm-eval loads it (it is no package)."""
    spec = importlib.util.spec_from_file_location("jargon_tasks", TASKS / "jargon_tasks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


jargon_tasks = _load_tasks_module()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm-eval-model")
    torch.manual_seed(0)
    config = tiny_config(vocab_size=259, max_position_embeddings=4096, feature_map="hedgehog", feature_dim=8,
                         window_size=16, num_sink_tokens=2)
    hf_linear_attn.LinearAttentionForCausalLM(config).save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def results(checkpoint):
    from lm_eval.tasks import TaskManager

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    output = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={checkpoint},trust_remote_code=True",
                                     tasks=["jargon_cloze", "jargon_perplexity"], limit=LIMIT, batch_size=4,
                                     device="cpu", task_manager=TaskManager(include_path=str(TASKS)))
    torch.set_num_threads(threads)
    return output["results"]


def continuation_logprob(model, context: list[int], continuation: list[int]) -> float:
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = F.log_softmax(model(ids, use_cache=False).logits[0, :-1].float(), dim=-1)
    targets = ids[0, len(context):]
    return logprobs[len(context) - 1:].gather(-1, targets[:, None]).sum().item()


def test_rolling_perplexity_is_the_models_own_loglikelihood(checkpoint, results):
    model = hf_linear_attn.LinearAttentionForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = byte_level_tokenizer()
    texts = jargon_tasks.held_out_documents()["test"]["text"][:LIMIT]
    # Every document is shorter than the model's 4096 positions: one window, after the BOS token.
    loglikelihood = sum(continuation_logprob(model, [tokenizer.bos_token_id], tokenizer(text).input_ids)
                        for text in texts)
    bytes_ = sum(len(text.encode("utf-8")) for text in texts)
    got = results["jargon_perplexity"]
    assert got["bits_per_byte,none"] == pytest.approx(-loglikelihood / bytes_ / math.log(2), rel=1e-4)
    assert got["byte_perplexity,none"] == pytest.approx(math.exp(-loglikelihood / bytes_), rel=1e-4)


def test_cloze_accuracy_is_the_argmax_of_the_choices_loglikelihood(checkpoint, results):
    model = hf_linear_attn.LinearAttentionForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = byte_level_tokenizer()
    items = jargon_tasks.cloze_items()["test"].select(range(LIMIT))
    hits = hits_norm = 0
    for item in items:
        context = tokenizer(item["context"]).input_ids  # bytes: encoding is concatenation-invariant
        scores = [continuation_logprob(model, context, tokenizer(" " + choice).input_ids) for choice in item["choices"]]
        lengths = [len(choice) for choice in item["choices"]]  # acc_norm: per character of the choice
        hits += max(range(len(scores)), key=scores.__getitem__) == item["label"]
        hits_norm += max(range(len(scores)), key=lambda i: scores[i] / lengths[i]) == item["label"]
    assert results["jargon_cloze"]["acc,none"] == pytest.approx(hits / LIMIT)
    assert results["jargon_cloze"]["acc_norm,none"] == pytest.approx(hits_norm / LIMIT)


def test_the_tasks_are_built_from_held_out_documents_only():
    from training.data import DataArguments, load_documents

    splits = load_documents(DataArguments())
    train_texts = set(splits["train"]["text"])
    held_out = jargon_tasks.held_out_documents()["test"]["text"]
    assert held_out and not train_texts & set(held_out)
    items = jargon_tasks.cloze_items()["test"]
    assert len(items) > 50 and all(len(item["choices"]) == 4 for item in items)
    assert all(item["context"].split("\n")[0] in {t.partition("\n")[0] for t in held_out} for item in items)
    # The right answer is not always in the same place.
    assert len({item["label"] for item in items}) == 4
