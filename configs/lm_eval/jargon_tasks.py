"""Datasets of the two local lm-eval-harness tasks in this folder, built from the held-out documents of the
embedded corpus (`training/corpus/jargon.jsonl`): exactly the documents that every training stage of this
repository holds out (`training.data.load_documents` with the default DataArguments), so a converted,
distilled or fine-tuned model is scored on text it never trained on.

- `jargon_perplexity` (loglikelihood_rolling): each held-out document whole; word / byte perplexity and
  bits per byte.
- `jargon_cloze` (multiple_choice): the head line of a held-out entry ("term: /pronunciation/, n.") and the
  sentences of its body so far, then its next sentence against three sentences drawn from other held-out
  entries; accuracy (acc, and acc_norm with the log-likelihood per character).

    lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True \
        --tasks jargon_cloze,jargon_perplexity --include_path configs/lm_eval
"""

from __future__ import annotations

import random
import re
from pathlib import Path

from datasets import Dataset, DatasetDict

from hf_linear_attn.training.data import DataArguments, load_documents

ROOT = Path(__file__).resolve().parents[2]

SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
QUESTIONS_PER_DOCUMENT = 3
CONTEXT_WORDS = 120  # the passage: at most this many words before the sentence to pick
CHOICE_WORDS = 24  # every choice is cut to this many words, so length alone gives nothing away
MIN_CHOICE_WORDS = 4
DISTRACTORS = 3
SEED = 0


def held_out_documents(**_: object) -> DatasetDict:
    """The held-out documents (columns `title`, `text`) as the `test` split."""
    return DatasetDict(test=load_documents(DataArguments())["validation"])


def _words(text: str, limit: int, from_end: bool = False) -> str:
    words = text.split()
    return " ".join(words[-limit:] if from_end else words[:limit])


def cloze_items(**_: object) -> DatasetDict:
    """Multiple-choice items (`context`, `choices`, `label`) as the `test` split; deterministic."""
    heads, documents = [], []
    for text in held_out_documents()["test"]["text"]:
        head, _, body = text.partition("\n")
        heads.append(head)
        documents.append(SENTENCE_END.split(body.replace("\n", " ")))
    candidates = [  # (document, sentence index) of every sentence that can be a question's answer
        (d, i) for d, sentences in enumerate(documents) for i in range(len(sentences))
        if len(sentences[i].split()) >= MIN_CHOICE_WORDS
    ]
    rng = random.Random(SEED)
    items = []
    for d, sentences in enumerate(documents):
        own = [i for doc, i in candidates if doc == d][:QUESTIONS_PER_DOCUMENT]
        others = [(doc, i) for doc, i in candidates if doc != d]
        for i in own:
            picks = [sentences[i], *(documents[doc][j] for doc, j in rng.sample(others, DISTRACTORS))]
            choices = [_words(sentence, CHOICE_WORDS) for sentence in picks]
            order = list(range(len(choices)))
            rng.shuffle(order)
            items.append({
                "context": "\n".join([heads[d], _words(" ".join(sentences[:i]), CONTEXT_WORDS, from_end=True)][:i + 1]),
                "choices": [choices[k] for k in order],
                "label": order.index(0),
            })
    return DatasetDict(test=Dataset.from_list(items))
