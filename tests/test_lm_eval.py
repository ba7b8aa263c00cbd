"""lm-eval-harness runs a linear-attention checkpoint as an ordinary `hf` model, with the local tasks in
configs/lm_eval; its scores are checked against the same quantities computed directly from the model."""

import importlib.util
import math
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import ROOT, tiny_config

import hf_linear_attn
from hf_linear_attn.training.data import byte_level_tokenizer
from hf_linear_attn.training.long_context_data import (
    DEFAULT_NEEDLES_DIR,
    LongDocument,
    PasskeyTrial,
    long_documents,
    passkey_trials,
    write_needles,
)
from hf_linear_attn.training.long_context_metrics import answer_matches, greedy_generate

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
def task_manager():
    """One index of lm-eval's tasks and ours for the module: building it reads every task's YAML (~15 s on the
    suite's slow machine); `simple_evaluate` builds its tasks afresh from it on each call."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS))


@pytest.fixture(scope="module")
def results(checkpoint, task_manager):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    output = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={checkpoint},trust_remote_code=True",
                                     tasks=["jargon_cloze", "jargon_perplexity"], limit=LIMIT, batch_size=4,
                                     device="cpu", task_manager=task_manager)
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
    from hf_linear_attn.training.data import DataArguments, load_documents

    splits = load_documents(DataArguments())
    train_texts = set(splits["train"]["text"])
    held_out = jargon_tasks.held_out_documents()["test"]["text"]
    assert held_out and not train_texts & set(held_out)
    items = jargon_tasks.cloze_items()["test"]
    assert len(items) > 50 and all(len(item["choices"]) == 4 for item in items)
    assert all(item["context"].split("\n")[0] in {t.partition("\n")[0] for t in held_out} for item in items)
    # The right answer is not always in the same place.
    assert len({item["label"] for item in items}) == 4


# ------------------------------------------------------------------------------------------ needle tasks

NEEDLE_TRIALS = 4  # prompts per task (depths 1/8, 3/8, 5/8, 7/8): the 1K tasks of configs/lm_eval/needles
NEEDLE_TASKS = [f"needle_{variant}_{haystack}_1k" for variant in ("single", "multi")
                for haystack in ("natural", "filler")]


def needle_documents(tokenizer) -> list[LongDocument]:
    """Long documents for the natural haystack: the held-out Jargon File entries, one stream."""
    texts = {"jargon": list(jargon_tasks.held_out_documents()["test"])}
    return long_documents(tokenizer, texts, document_tokens=1536, documents_per_source=2)


def needle_trials(tokenizer, task: str) -> list[PasskeyTrial]:
    """The passkey trials a needle task's data holds (`write_needles`' defaults but NEEDLE_TRIALS)."""
    _, variant, haystack, _ = task.split("_")
    return passkey_trials(tokenizer, needle_documents(tokenizer), 1024, NEEDLE_TRIALS, haystack, variant)


def evaluate_needles(model, tmp_path, task_manager, **kwargs) -> dict:
    """lm-eval's `simple_evaluate` on the group `needle_1k`, run in `tmp_path`, where the tasks' data is written
    (they read outputs/lm_eval_needles relative to the directory lm_eval runs in)."""
    tokenizer = byte_level_tokenizer()
    write_needles(tokenizer, needle_documents(tokenizer), tmp_path / DEFAULT_NEEDLES_DIR, lengths=[1024],
                     trials=NEEDLE_TRIALS)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path)
        return lm_eval.simple_evaluate(model=model, tasks=["needle_1k"], log_samples=True,
                                       task_manager=task_manager, **kwargs)


def test_needle_accuracy_is_the_models_own_greedy_passkey_accuracy(checkpoint, task_manager, tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    # add_bos_token=False: the prompt's tokens only, as training.long_context feeds them.
    output = evaluate_needles("hf", tmp_path, task_manager, batch_size=1, device="cpu",
                              model_args=f"pretrained={checkpoint},trust_remote_code=True,add_bos_token=False")
    model = hf_linear_attn.LinearAttentionForCausalLM.from_pretrained(checkpoint).eval()
    tokenizer = byte_level_tokenizer()
    for task in NEEDLE_TASKS:
        trials = needle_trials(tokenizer, task)
        samples = sorted(output["samples"][task], key=lambda sample: sample["doc_id"])
        assert len(samples) == NEEDLE_TRIALS
        hits = 0
        for sample, trial in zip(samples, trials, strict=True):
            context, generation_kwargs = sample["arguments"][0]
            # The harness gets the prompt as text and tokenizes it again: to the trial's very tokens.
            assert tokenizer(context, add_special_tokens=False).input_ids == trial.input_ids[0].tolist()
            assert generation_kwargs["max_gen_toks"] == len(trial.answer) + 3
            with torch.no_grad():
                continuation = greedy_generate(model, trial.input_ids, len(trial.answer) + 3, tokenizer)
            assert sample["filtered_resps"][0] == tokenizer.decode(continuation, skip_special_tokens=True)
            hits += answer_matches(sample["filtered_resps"][0], trial.answer)
        assert output["results"][task]["acc,none"] == pytest.approx(hits / len(trials))
    torch.set_num_threads(threads)


class KeyReader(pytest.importorskip("lm_eval.api.model").LM):
    """A fake harness model whose continuation is the asked-for key read out of the prompt, plus `offset`."""

    def __init__(self, offset: int = 0):
        super().__init__()
        self.offset = offset

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        answers = []
        for context, _ in (request.args for request in requests):
            door = re.search(r"pass key of the (\w+) door\?", context)
            pattern = rf"pass key of the {door.group(1)} door is (\d+)" if door else r"pass key is (\d+)"
            answers.append(f" {int(re.search(pattern, context).group(1)) + self.offset}. And")
        return answers

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError("the needle tasks only generate")

    loglikelihood_rolling = loglikelihood


def test_a_model_that_reads_the_key_scores_1_through_the_harness_and_one_that_does_not_0(task_manager, tmp_path):
    right = evaluate_needles(KeyReader(), tmp_path / "right", task_manager)["results"]
    wrong = evaluate_needles(KeyReader(offset=1), tmp_path / "wrong", task_manager)["results"]
    for task in [*NEEDLE_TASKS, "needle_1k"]:
        assert right[task]["acc,none"] == 1.0
        assert wrong[task]["acc,none"] == 0.0
