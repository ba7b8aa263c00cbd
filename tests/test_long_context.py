"""training/long_context.py: held-out texts, perplexity by context, passkey prompts and their teacher-forced
scores (against greedy decoding), window baseline decoding and cache bytes, on tiny models and synthetic texts."""

import dataclasses
import json
import math
import re
import struct
import zlib
from itertools import pairwise

import pytest
import torch
import torch.nn.functional as F
from helpers import WORDS, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from hf_linear_attn.training import long_context, measure
from hf_linear_attn.training.data import byte_level_tokenizer
from hf_linear_attn.training.evaluation import EvaluateArguments, check_arguments
from hf_linear_attn.training.long_context_data import (
    PREAMBLE,
    RANKING_PREAMBLE,
    RANKING_VARIANT,
    VARIANTS,
    austen_novels,
    load_texts,
    long_documents,
    passkey_prompt,
    passkey_trials,
    read_r_strings,
    write_needles,
)
from hf_linear_attn.training.long_context_metrics import (
    WindowBaseline,
    answer_matches,
    cache_bytes_at,
    greedy_generate,
    key_score,
    passkey_scores,
    perplexity_by_context,
    perplexity_by_position,
    perplexity_spans,
    perplexity_windows,
)
from hf_linear_attn.training.measure import (
    cache_bytes,
    cache_bytes_by_context,
    cache_memory,
    decode_profile,
    decode_times,
    extend_cache,
    extension_period,
    new_cache,
    prefill,
)

pytestmark = pytest.mark.usefixtures("single_thread")
VOCAB = 259  # the byte-level tokenizer's


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def synthetic_texts(words: int = 400) -> dict[str, list[dict]]:
    """Two sources of a few records each, deterministic, different per source and record."""
    texts = {}
    for s, source in enumerate(("kjv", "austen")):
        texts[source] = [{"title": f"{source} {r}",
                          "text": " ".join(WORDS[(7 * i + 3 * r + s) % len(WORDS)] for i in range(words))}
                         for r in range(3)]
    return texts


@pytest.fixture(scope="module")
def documents(tokenizer):
    return long_documents(tokenizer, synthetic_texts(), document_tokens=512, documents_per_source=2)


def byte_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    return LlamaForCausalLM(config).eval()


def window_mask(length: int, window: int, sinks: int) -> torch.Tensor:
    """Additive float mask [1, 1, L, L], written out directly: causal, last `window` positions and first `sinks`."""
    i = torch.arange(length)
    allowed = (i[:, None] >= i[None]) & ((i[:, None] - i[None] < window) | (i[None] < sinks))
    return torch.where(allowed, 0.0, -torch.inf)[None, None]


# ------------------------------------------------------------------------------------------ texts and documents

def r_serialization(strings: list[str | None], version: int = 3) -> bytes:
    header = b"X\n" + struct.pack(">iii", version, 0x040201, 0x030500)
    if version == 3:
        header += struct.pack(">i", 5) + b"UTF-8"
    body = struct.pack(">ii", 16, len(strings))
    for text in strings:
        if text is None:
            body += struct.pack(">ii", 9, -1)
        else:
            raw = text.encode()
            body += struct.pack(">ii", 9 | (1 << 15) | (1 << 18), len(raw)) + raw
    return header + body


def test_read_r_strings_reads_a_character_vector_and_refuses_anything_else():
    strings = ["EMMA", "", None, "Mr. Knightley’s"]
    assert read_r_strings(r_serialization(strings)) == strings
    assert read_r_strings(r_serialization(strings, version=2)) == strings
    with pytest.raises(ValueError, match="XDR"):
        read_r_strings(b"A\n" + r_serialization(strings)[2:])
    integers = r_serialization([])[:-8] + struct.pack(">ii", 13, 0)
    with pytest.raises(ValueError, match="STRSXP"):
        read_r_strings(integers)


def test_austen_novels_are_read_block_by_block_with_paragraphs_rejoined(tmp_path):
    """A fake janeaustenr package: its lazy-load database is a run of (4-byte length, zlib block) records."""
    novels = [["EMMA", "", "By Jane Austen", "", "", "Emma Woodhouse, handsome,", "clever, and rich."],
              ["PERSUASION", None, "Sir Walter Elliot"]]
    data = tmp_path / "usr/lib/R/site-library/janeaustenr/data"
    data.mkdir(parents=True)
    blocks = [r_serialization(lines) for lines in novels]
    (data / "Rdata.rdb").write_bytes(b"".join(struct.pack(">i", len(b)) + zlib.compress(b) for b in blocks))
    assert austen_novels(tmp_path) == [
        {"title": "Emma", "text": "EMMA\n\nBy Jane Austen\n\nEmma Woodhouse, handsome, clever, and rich."},
        {"title": "Persuasion", "text": "PERSUASION\n\nSir Walter Elliot"}]


def test_missing_data_is_a_clear_error_naming_the_prepare_command(tmp_path, capsys):
    with pytest.raises(FileNotFoundError, match=r"hf-linear-attn-long-context prepare --data_dir"):
        load_texts(tmp_path / "nowhere")
    (tmp_path / "kjv.jsonl").write_text('{"title": "Ge", "text": "In the beginning"}\n')
    with pytest.raises(FileNotFoundError, match=r"\['austen'\]"):
        load_texts(tmp_path)
    # The command line prepares and writes the needle data; evaluation is training/evaluate.py's.
    for argv in (["evaluate", "--data_dir", str(tmp_path)], []):  # one `error: ...` line, status 2
        with pytest.raises(SystemExit) as exit_:
            long_context.main(argv)
        assert exit_.value.code == 2 and "training/evaluate.py" in capsys.readouterr().err


def test_documents_are_deterministic_evenly_spaced_and_alternate_sources(tokenizer, documents):
    again = long_documents(tokenizer, synthetic_texts(), document_tokens=512, documents_per_source=2)
    assert [(d.source, d.index) for d in documents] == [(d.source, d.index) for d in again]
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(documents, again, strict=True))
    assert [d.source for d in documents] == ["kjv", "austen", "kjv", "austen"]
    assert all(len(d.input_ids) == 512 for d in documents)
    # Each document is the stated piece of its source's stream (records joined by blank lines).
    for document in documents:
        stream = "\n\n".join(record["text"] for record in synthetic_texts()[document.source])
        ids = tokenizer(stream, add_special_tokens=False).input_ids
        assert document.input_ids.tolist() == ids[512 * document.index:512 * (document.index + 1)]
    available = len(tokenizer("\n\n".join(r["text"] for r in synthetic_texts()["kjv"])).input_ids) // 512
    assert [d.index for d in documents if d.source == "kjv"] == [available // 4, 3 * available // 4]
    with pytest.raises(ValueError, match="documents_per_source"):
        long_documents(tokenizer, synthetic_texts(words=20), document_tokens=512, documents_per_source=2)


# ------------------------------------------------------------------------------------------ perplexity

class Uniform(torch.nn.Module):
    """Equal logits everywhere (perplexity = vocabulary size), recording every row it is given."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, input_ids, logits_to_keep=0):
        self.seen.append(input_ids.clone())
        kept = input_ids.shape[1] if logits_to_keep == 0 else logits_to_keep
        return type("Output", (), {"logits": torch.zeros(1, kept, VOCAB)})


def test_every_model_scores_the_same_rows_and_the_second_half_of_each(documents):
    first, second = Uniform(), Uniform()
    rows = perplexity_by_context({"a": first, "b": second}, documents, [32, 64], scored_tokens=100, log=str)
    by_context = {(r["model"], r["context"]): r for r in rows}
    assert by_context["a", 32]["rows"] == 7 and by_context["a", 32]["scored_tokens"] == 7 * 16
    assert by_context["b", 64]["rows"] == 4 and by_context["b", 64]["scored_tokens"] == 4 * 32
    assert all(r["perplexity"] == pytest.approx(VOCAB) for r in rows)
    # Row r: window r // 4 of document r % 4.
    assert perplexity_spans(documents, 32, 100) == [(r % 4, 32 * (r // 4)) for r in range(7)]
    assert perplexity_spans(documents, 64, 100) == [(r, 0) for r in range(4)]
    # Rows that start at the same token share one forward of the longest: window 0 at 64 of each document (which
    # holds window 0 at 32), then window 1 at 32 of documents 0-2; every model gets the same forwards.
    expected = [documents[d].input_ids[:64] for d in range(4)] + [documents[d].input_ids[32:64] for d in range(3)]
    for model in (first, second):
        assert len(model.seen) == len(expected)
        assert all(torch.equal(seen[0], row) for seen, row in zip(model.seen, expected, strict=True))
    # min_rows: at least that many rows, when scored_tokens would take fewer (the rows are the same, more of them).
    assert len(perplexity_windows(documents, 64, 100, min_rows=6)) == 6
    assert all(torch.equal(a, b) for a, b in zip(perplexity_windows(documents, 64, 100),
                                                 perplexity_windows(documents, 64, 100, min_rows=6), strict=False))
    assert len(perplexity_windows(documents, 32, 100, min_rows=2)) == 7
    by_rows = perplexity_by_context({"a": Uniform()}, documents, [64], scored_tokens=1, min_rows=5, log=str)
    assert by_rows[0]["rows"] == 5 and by_rows[0]["scored_tokens"] == 5 * 32
    with pytest.raises(ValueError, match="context 256 needs 129 rows"):
        perplexity_windows(documents, 256, 128 * 129)
    with pytest.raises(ValueError, match="context 256 needs 9 rows"):
        perplexity_windows(documents, 256, 1, min_rows=9)
    with pytest.raises(ValueError, match="min_rows ≥ 1"):
        perplexity_windows(documents, 64, 100, min_rows=0)


def direct_perplexity(model, windows, mask_of=None, first=lambda length: length // 2) -> float:
    """Perplexity over positions first(L) .. L - 1 of each row, one forward per row."""
    total, count = 0.0, 0
    for row in windows:
        length = row.shape[1]
        mask = None if mask_of is None else mask_of(length)
        with torch.no_grad():
            logits = model(row, attention_mask=mask).logits[0]
        total += F.cross_entropy(logits[first(length) - 1:-1], row[0, first(length):], reduction="sum").item()
        count += length - first(length)
    return math.exp(total / count)


def test_perplexity_equals_a_direct_per_row_computation(documents):
    teacher = byte_llama()
    linear = tiny_model(vocab_size=VOCAB, max_position_embeddings=1024, window_size=8, num_sink_tokens=2)
    models = {"teacher": teacher, "window": WindowBaseline(teacher, window=8, sinks=2), "linear": linear}
    # Row (document 0, token 32) is scored at 16 and 32, row (document 0, token 0) at every context: one forward of
    # the longest row scores each (`perplexity_by_context`), checked here against one forward per row.
    contexts = [16, 24, 32, 64]
    rows = perplexity_by_context(models, documents, contexts, scored_tokens=80, log=str)
    got = {(r["model"], r["context"]): r["perplexity"] for r in rows}
    for context in contexts:
        windows = perplexity_windows(documents, context, 80)
        assert got["teacher", context] == pytest.approx(direct_perplexity(teacher, windows), rel=1e-5)
        assert got["window", context] == pytest.approx(
            direct_perplexity(teacher, windows, lambda n: window_mask(n, 8, 2)), rel=1e-5)
        assert got["linear", context] == pytest.approx(direct_perplexity(linear, windows), rel=1e-5)
        assert got["window", context] != pytest.approx(got["teacher", context], rel=1e-4)  # the window binds
    last = {(r["model"], r["context"]): r["last_quarter_perplexity"] for r in rows}
    for context in contexts:
        windows = perplexity_windows(documents, context, 80)
        assert last["linear", context] == pytest.approx(
            direct_perplexity(linear, windows, first=lambda length: length - length // 4), rel=1e-5)


def test_perplexity_by_position_averages_each_bin_of_one_forward_per_document(documents):
    teacher = byte_llama()
    linear = tiny_model(vocab_size=VOCAB, max_position_embeddings=1024, window_size=8, num_sink_tokens=2)
    edges = [1, 40, 41, 200]
    rows = perplexity_by_position({"teacher": teacher, "linear": linear}, documents, edges, rows=3, log=str)
    assert [(r["model"], r["first"], r["end"]) for r in rows] == [
        (m, a, b) for m in ("teacher", "linear") for a, b in ((1, 40), (40, 41), (41, 200))]
    for label, model in (("teacher", teacher), ("linear", linear)):
        # Written out: one forward of each document's first 200 tokens, position p's loss at logits[p - 1].
        losses = []
        for d in range(3):
            row = documents[d].input_ids[None, :200]
            with torch.no_grad():
                logits = model(row).logits[0]
            losses.append(F.cross_entropy(logits[:-1], row[0, 1:], reduction="none"))
        losses = torch.stack(losses)  # [3, 199]: position p at column p - 1
        got = [r for r in rows if r["model"] == label]
        for r, (a, b) in zip(got, pairwise(edges), strict=True):
            assert r["rows"] == 3 and r["scored_tokens"] == 3 * (b - a)
            assert r["perplexity"] == pytest.approx(math.exp(losses[:, a - 1:b - 1].mean().item()), rel=1e-5)
    for bad in ([0, 10], [10], [10, 10], [20, 10], [1, 513]):
        with pytest.raises(ValueError, match="strictly increasing positions from 1"):
            perplexity_by_position({"teacher": teacher}, documents, bad, rows=1, log=str)
    with pytest.raises(ValueError, match=r"position rows 5: give 1 \.\. 4"):
        perplexity_by_position({"teacher": teacher}, documents, [1, 10], rows=5, log=str)


# ------------------------------------------------------------------------------------------ passkey

def test_passkey_prompt_puts_each_needle_at_its_depth_and_has_the_exact_length(tokenizer):
    haystack = tokenizer("abcdefghij" * 40, add_special_tokens=False).input_ids
    needles = [(0.75, " KEY-B "), (0.25, " KEY-A ")]
    ids, starts = passkey_prompt(tokenizer, haystack, 300, needles, " Q?")
    ids = ids[0].tolist()
    head = len(tokenizer(PREAMBLE).input_ids)
    budget = 300 - head - len(" Q?") - len(" KEY-B ") - len(" KEY-A ")
    assert len(ids) == 300
    assert tokenizer.decode(ids[starts[1]:starts[1] + 7]) == " KEY-A "
    assert tokenizer.decode(ids[starts[0]:starts[0] + 7]) == " KEY-B "
    assert starts[1] - head == round(0.25 * budget)  # haystack tokens before the first needle
    assert starts[0] - head - 7 == round(0.75 * budget)
    assert ids[head:starts[1]] == haystack[:round(0.25 * budget)]
    assert tokenizer.decode(ids[-3:]) == " Q?"
    with pytest.raises(ValueError, match="leaves"):
        passkey_prompt(tokenizer, haystack, 120, needles, " Q?")
    with pytest.raises(ValueError, match="depth"):
        passkey_prompt(tokenizer, haystack, 300, [(1.5, "x")], " Q?")


@pytest.mark.parametrize("haystack", ["natural", "filler"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_passkey_trials_spread_depth_and_are_deterministic(tokenizer, documents, haystack, variant):
    trials = passkey_trials(tokenizer, documents, 400, 5, haystack, variant, seed=3, keys=3)
    again = passkey_trials(tokenizer, documents, 400, 5, haystack, variant, seed=3, keys=3)
    assert [t.answer for t in trials] == [t.answer for t in again]
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(trials, again, strict=True))
    assert [t.depth for t in trials] == [0.1, 0.3, 0.5, 0.7, 0.9]
    if variant != "multi":  # haystack tokens before the needle: depth × all of them
        needle, question = {
            "single": (" The pass key is 12345. Remember it. 12345 is the pass key. ",
                       " What is the pass key? The pass key is"),
            "chat": ("\n\nThe secret pass key is 12345. Remember it: the secret pass key is 12345.\n\n",
                     "\n\nWhat is the secret pass key?<|im_end|>\n"
                     "<|im_start|>assistant\nThe secret pass key is")}[variant]
        head = len(("<|im_start|>user\n" if variant == "chat" else "") + PREAMBLE)  # bytes: tokens
        budget = 400 - head - len(question) - len(needle)
        assert [t.needle_start - head for t in trials] == [round(t.depth * budget) for t in trials]
    for trial in trials:
        assert trial.input_ids.shape == (1, 400) and re.fullmatch(r"\d{5}", trial.answer)
        assert trial.answer_ids.tolist() == [tokenizer(" " + trial.answer).input_ids]
        text = tokenizer.decode(trial.input_ids[0])
        needle = tokenizer.decode(trial.input_ids[0, trial.needle_start:])
        if variant == "single":
            assert needle.startswith(f" The pass key is {trial.answer}.")
            assert text.startswith(PREAMBLE) and text.endswith(" What is the pass key? The pass key is")
        elif variant == "chat":  # one user turn of the chat template, the assistant's turn opened
            assert needle.startswith(f"\n\nThe secret pass key is {trial.answer}. Remember it: the secret pass key "
                                     f"is {trial.answer}.\n\n")
            assert text.startswith("<|im_start|>user\n" + PREAMBLE)
            assert text.endswith("\n\nWhat is the secret pass key?<|im_end|>\n<|im_start|>assistant\n"
                                 "The secret pass key is")
        else:
            door = re.search(r"pass key of the (\w+) door\?", text).group(1)
            assert needle.startswith(f" The pass key of the {door} door is {trial.answer}.")
            assert len(re.findall(r"The pass key of the \w+ door is \d{5}", text)) == 3
        sentences = ("grass is green", "sky is blue", "sun is yellow", "Here we go", "back again")
        assert any(sentence in text for sentence in sentences) == (haystack == "filler")
    other_seed = passkey_trials(tokenizer, documents, 400, 5, haystack, variant, seed=4, keys=3)
    assert [t.answer for t in other_seed] != [t.answer for t in trials]


def test_ranking_trials_share_no_wording_with_any_evaluated_variant(tokenizer, documents):
    """Head ranking's prompts (RANKING_VARIANT) ask in words no evaluated variant uses, plain text and the chat
    template in turn, the code stated once; the evaluation does not accept the variant."""
    trials = passkey_trials(tokenizer, documents, 400, 4, "natural", RANKING_VARIANT, seed=3)
    evaluated = [tokenizer.decode(t.input_ids[0]) for v in VARIANTS
                 for t in passkey_trials(tokenizer, documents, 400, 2, "natural", v, seed=3, keys=3)]
    for i, trial in enumerate(trials):
        text = tokenizer.decode(trial.input_ids[0])
        needle = f" (The code of the archive room is {trial.answer}.) "
        assert tokenizer.decode(trial.input_ids[0, trial.needle_start:]).startswith(needle)
        assert text.count(trial.answer) == 1 and trial.input_ids.shape == (1, 400)
        assert text.startswith(RANKING_PREAMBLE if i % 2 == 0 else "<|im_start|>user\n" + RANKING_PREAMBLE)
        assert text.endswith(" Which code opens the archive room? The code is" if i % 2 == 0 else
                             "\n\nWhich code opens the archive room?<|im_end|>\n<|im_start|>assistant\nThe code is")
        assert trial.retrieval_prompt().needle == (trial.needle_start + len(" (The code of the archive room is"),
                                                   trial.needle_start + len(needle) - len(".) "))
    for phrase in ("archive room", "Which code", RANKING_PREAMBLE.strip()):
        assert not any(phrase in text for text in evaluated)
    for text in evaluated:
        assert "pass key" in text
    plain = byte_level_tokenizer()
    plain.chat_template = None  # without a template every ranking prompt is plain text
    assert all(tokenizer.decode(t.input_ids[0]).startswith(RANKING_PREAMBLE)
               for t in passkey_trials(plain, documents, 400, 2, "natural", RANKING_VARIANT))
    with pytest.raises(ValueError, match="passkey_variants"):
        check_arguments(EvaluateArguments(teacher_name_or_path="t", passkey_variants=[RANKING_VARIANT]))


def test_passkey_trials_refuse_bad_input(tokenizer, documents):
    with pytest.raises(ValueError, match="haystack must be one of"):
        passkey_trials(tokenizer, documents, 400, 5, "noise", "chat")
    with pytest.raises(ValueError, match=r"variant must be one of \['chat', 'single', 'multi'\], got 'twice'"):
        passkey_trials(tokenizer, documents, 400, 5, "natural", "twice")
    with pytest.raises(ValueError, match="trials must be ≥ 1, got 0"):
        passkey_trials(tokenizer, documents, 400, 0, "natural", "chat")
    with pytest.raises(ValueError, match="keys must be in"):
        passkey_trials(tokenizer, documents, 400, 5, "natural", "multi", keys=1)
    plain = byte_level_tokenizer()
    plain.chat_template = None
    with pytest.raises(ValueError, match="has none: use the variants 'single' or 'multi'"):
        passkey_trials(plain, documents, 400, 5, "natural", "chat")
    assert len(passkey_trials(plain, documents, 400, 2, "natural", "single")) == 2


def test_answer_check_is_exact():
    assert answer_matches(" 12345.", "12345")
    assert answer_matches("12345 is it", "12345")
    assert not answer_matches(" 123456", "12345")
    assert not answer_matches(" 1234", "12345")
    assert not answer_matches(" 54321 12345", "12345")
    assert not answer_matches(" the key", "12345")


class Oracle(torch.nn.Module):
    """A fake model that knows the whole sequence (prompt + key) and puts logit `confidence` on the token that
    follows each position, `shift` positions off (0: the true next token)."""

    def __init__(self, sequence: torch.Tensor, confidence: float, shift: int = 0):
        super().__init__()
        self.sequence, self.confidence, self.shift = sequence, confidence, shift

    def forward(self, input_ids, logits_to_keep=0):
        length = input_ids.shape[1]
        assert torch.equal(input_ids, self.sequence[:, :length])  # the prompt and the key but its last token
        targets = self.sequence[0, 1 + self.shift:length + 1 + self.shift]
        logits = torch.zeros(1, length, VOCAB)
        logits[0, torch.arange(len(targets)), targets] = self.confidence
        return type("Output", (), {"logits": logits[:, -logits_to_keep:]})


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_model_that_predicts_the_key_scores_it_exactly_and_one_position_off_does_not(tokenizer, documents,
                                                                                      variant):
    trial = passkey_trials(tokenizer, documents, 400, 1, "natural", variant)[0]
    sequence = torch.cat([trial.input_ids, trial.answer_ids], dim=1)
    count = trial.answer_ids.shape[1]
    right = key_score(Oracle(sequence, 50.0), trial)
    assert right.exact and right.argmax_hits == right.tokens == count == 6  # " " and 5 digits
    assert right.log_prob == pytest.approx(0.0, abs=1e-12)
    # Logit 1 on the right token: each has probability e / (e + VOCAB - 1).
    soft = key_score(Oracle(sequence, 1.0), trial)
    assert soft.log_prob == pytest.approx(count * (1 - math.log(math.e + VOCAB - 1)))
    off = key_score(Oracle(sequence, 50.0, shift=1), trial)
    assert not off.exact and off.argmax_hits == 0


def direct_key_log_probs(model, trial) -> torch.Tensor:
    """The key's per-token log-probabilities [K], from a full forward over the prompt and the whole key."""
    sequence = torch.cat([trial.input_ids, trial.answer_ids], dim=1)
    with torch.no_grad():
        logits = model(sequence).logits[0, -trial.answer_ids.shape[1] - 1:-1].log_softmax(-1)
    return logits.gather(-1, trial.answer_ids[0, :, None])[:, 0]


def test_passkey_scores_are_the_means_of_the_key_scores(tokenizer, documents):
    model = byte_llama()
    trials = passkey_trials(tokenizer, documents, 400, 3, "filler", "chat")
    scores = passkey_scores(model, trials)
    per_trial = torch.stack([direct_key_log_probs(model, t) for t in trials]).double()  # [trials, K]
    sums = per_trial.sum(1)
    assert scores["trials"] == 3
    assert scores["key_log_prob"] == pytest.approx(sums.mean().item(), rel=1e-4)
    assert scores["key_log_prob_se"] == pytest.approx(sums.std().item() / math.sqrt(3), rel=1e-3)
    assert scores["key_log_prob_per_token"] == pytest.approx(per_trial.mean().item(), rel=1e-4)
    hits = [key_score(model, t).argmax_hits for t in trials]
    assert scores["argmax_accuracy"] == sum(hits) / per_trial.numel()
    assert scores["accuracy"] == sum(key_score(model, t).exact for t in trials) / 3
    assert passkey_scores(model, trials[:1])["key_log_prob_se"] == 0.0
    with pytest.raises(ValueError, match="at least one trial"):
        passkey_scores(model, [])


@pytest.mark.parametrize("kind", ["softmax", "window-baseline", "linear"])
def test_greedy_exact_match_is_what_greedy_decoding_emits(tokenizer, documents, kind):
    """The teacher-forced exact match agrees with `greedy_generate`: true for a key that is the model's own
    greedy continuation (every token the argmax), false when only its last token differs (all but that one
    the argmax), and for the trial's real key exactly when greedy decoding emits it."""
    teacher = byte_llama()
    model = {"softmax": teacher, "window-baseline": WindowBaseline(teacher, window=8, sinks=2),
             "linear": tiny_model(vocab_size=VOCAB, max_position_embeddings=1024, window_size=8,
                                  num_sink_tokens=2)}[kind]
    for trial in passkey_trials(tokenizer, documents, 400, 2, "natural", "chat"):
        count = trial.answer_ids.shape[1]
        greedy = greedy_generate(model, trial.input_ids, count, tokenizer)
        real = key_score(model, trial)
        assert real.exact == (greedy == trial.answer_ids[0].tolist())
        assert len(greedy) == count  # no end-of-sequence token in the way
        own = key_score(model, dataclasses.replace(trial, answer_ids=torch.tensor([greedy])))
        assert own.exact and own.argmax_hits == count
        last = (greedy[-1] + 1) % VOCAB
        other = key_score(model, dataclasses.replace(trial, answer_ids=torch.tensor([[*greedy[:-1], last]])))
        assert not other.exact and other.argmax_hits == count - 1


# ------------------------------------------------------------------------------------------ lm-eval needle data

NEEDLE_FILES = [f"{variant}_{haystack}_{length}.jsonl" for length in (400, 500) for variant in ("single", "multi")
                for haystack in ("natural", "filler")]


def test_needle_data_is_the_passkey_trials_as_text_that_tokenizes_back_to_them(tokenizer, documents, tmp_path):
    paths = write_needles(tokenizer, documents, tmp_path / "needles", lengths=[400, 500], trials=3, seed=2, keys=3)
    assert [path.name for path in paths] == NEEDLE_FILES
    for path in paths:
        variant, haystack, length = path.stem.split("_")
        trials = passkey_trials(tokenizer, documents, int(length), 3, haystack, variant, seed=2, keys=3)
        records = [json.loads(line) for line in path.read_text().splitlines()]
        assert [record["answer"] for record in records] == [trial.answer for trial in trials]
        assert [record["depth"] for record in records] == [trial.depth for trial in trials] == [1 / 6, 0.5, 5 / 6]
        for record, trial in zip(records, trials, strict=True):
            assert tokenizer(record["prompt"], add_special_tokens=False).input_ids == trial.input_ids[0].tolist()
            assert record["length"] == record["tokens"] == int(length)


def test_needle_data_refuses_bad_arguments_before_writing_anything(tokenizer, documents, tmp_path):
    with pytest.raises(ValueError, match="at least one length"):
        write_needles(tokenizer, documents, tmp_path, lengths=[])
    with pytest.raises(ValueError, match="trials ≥ 1"):
        write_needles(tokenizer, documents, tmp_path, trials=0)
    with pytest.raises(ValueError, match="leaves"):  # the 400-token prompts are fine, the 60-token ones are not
        write_needles(tokenizer, documents, tmp_path / "needles", lengths=[400, 60])
    assert not (tmp_path / "needles").exists()


def test_needles_command_writes_the_data_for_the_given_tokenizer(tokenizer, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for source, records in synthetic_texts().items():
        (data / f"{source}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))
    tokenizer.save_pretrained(tmp_path / "model")
    assert long_context.main(["needles", "--tokenizer_name", str(tmp_path / "model"), "--data_dir", str(data),
                    "--output_dir", str(tmp_path / "out"), "--lengths", "400", "500", "--trials", "3", "--seed", "2",
                    "--keys", "3", "--document_tokens", "512", "--documents_per_source", "2"]) == 0
    assert capsys.readouterr().out.count(": 3 prompts\n") == len(NEEDLE_FILES)
    documents = long_documents(tokenizer, synthetic_texts(), document_tokens=512, documents_per_source=2)
    write_needles(tokenizer, documents, tmp_path / "direct", lengths=[400, 500], trials=3, seed=2, keys=3)
    for name in NEEDLE_FILES:
        assert (tmp_path / "out" / name).read_text() == (tmp_path / "direct" / name).read_text()
    with pytest.raises(SystemExit) as exit_:
        long_context.main(["needles", "--tokenizer_name", str(tmp_path / "model"), "--data_dir",
                           str(tmp_path / "nowhere")])
    assert exit_.value.code == 2 and "prepare" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ decoding and cache

@pytest.mark.parametrize("window", [0, 6])
def test_greedy_decoding_equals_the_argmax_of_full_forwards(window, tokenizer):
    teacher = byte_llama()
    model = WindowBaseline(teacher, window=window, sinks=2) if window else teacher
    ids = torch.randint(3, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    got = greedy_generate(model, ids, 6, tokenizer)
    expected = ids
    for _ in range(6):
        mask = window_mask(expected.shape[1], window, 2) if window else None
        with torch.no_grad():
            logits = teacher(expected, attention_mask=mask).logits
        expected = torch.cat([expected, logits[:, -1:].argmax(-1)], dim=1)
    assert got == expected[0, 20:].tolist()


def test_cache_bytes_constant_for_linear_growing_for_the_teacher_window_for_the_baseline():
    teacher = byte_llama()
    linear = tiny_model(vocab_size=VOCAB, max_position_embeddings=1024, window_size=8, num_sink_tokens=2)
    teacher_bytes = cache_bytes_at(teacher, [16, 64])
    assert teacher_bytes[1] == 4 * teacher_bytes[0] > 0
    assert cache_bytes_at(linear, [16, 64])[0] == cache_bytes_at(linear, [16, 64])[1] > 0
    baseline = WindowBaseline(teacher, window=6, sinks=2)
    assert cache_bytes_at(baseline, [64]) == [teacher_bytes[0] // 2]  # 8 of 16 tokens


def prefilled_cache_bytes(model, contexts) -> list[int]:
    """Bytes of the cache `generate()` would build, after a real chunked prefill of each context."""
    sizes = []
    for tokens in contexts:
        cache = new_cache(model)
        prefill(model, cache, tokens, chunk=16)
        sizes.append(cache_bytes(cache))
    return sizes


@pytest.mark.parametrize("options", [
    dict(window_size=8, num_sink_tokens=2, feature_map="hedgehog", decay="vector", softmax_layers=[1]),
    dict(feature_map="elu", update_rule="delta", normalize=False, decay="scalar", conv_size=4, softmax_layers=[0]),
], ids=["window-hybrid", "delta-rule"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_cache_bytes_equal_those_of_a_prefilled_hybrid_with_softmax_layers(options, dtype):
    model = tiny_model(vocab_size=VOCAB, num_hidden_layers=3, **options).to(dtype)
    contexts = [5, 40, 300]  # within and far beyond the window and convolution
    layout = cache_bytes_by_context(model, contexts)
    assert layout == prefilled_cache_bytes(model, contexts)
    assert layout[2] > layout[1] > layout[0]  # the softmax layer's keys and values grow with the context
    rows = cache_memory(model.config.to_dict() | {"dtype": str(dtype).removeprefix("torch.")}, tuple(contexts))
    assert [r["linear_bytes"] for r in rows] == layout


def cache_layout(cache) -> list[tuple]:
    """Per layer: its class, positions seen and the shape of every tensor it holds (by name)."""
    rows = []
    for layer in cache.layers:
        tensors = layer.tensors() if hasattr(layer, "tensors") else {"keys": layer.keys, "values": layer.values}
        rows.append((type(layer).__name__, layer.get_seq_length(),
                     {name: tuple(t.shape) for name, t in tensors.items()}))
    return rows


# Models whose cache `extend_cache` extends, with the period of their cache's bookkeeping: lcm(8, 8 + 64, 64) for the
# window of 8 with a sparse memory (its ring keeps a memory block more), the window for the delta-rule window, 1 for
# caches without a ring.
EXTENDED_MODELS = {
    "window-memory-heads": (lambda: tiny_model(
        vocab_size=VOCAB, num_hidden_layers=3, window_size=8, num_sink_tokens=2, decay="scalar", sparse_cache_size=16,
        softmax_layers=[2], softmax_heads={0: [1]}), 576),
    "delta-window-heads": (lambda: tiny_model(
        vocab_size=VOCAB, num_hidden_layers=2, window_size=8, num_sink_tokens=2, update_rule="delta",
        feature_map="elu", normalize=False, decay="scalar", softmax_heads={1: [0]}), 8),
    "linear-conv": (lambda: tiny_model(vocab_size=VOCAB, num_hidden_layers=2, decay="vector", conv_size=4,
                                       softmax_layers=[0]), 1),
    "llama": (byte_llama, 1),
}


@pytest.mark.parametrize(("build", "period"), EXTENDED_MODELS.values(), ids=EXTENDED_MODELS.keys())
def test_an_extended_cache_has_the_layout_of_a_real_prefill_and_decodes_like_it(build, period):
    model = build()
    cache = new_cache(model)
    assert extension_period(cache) == period
    head, extra = 21, 3 * period
    logits = prefill(model, cache, head, chunk=16)
    extend_cache(cache, extra)
    real = new_cache(model)
    real_logits = prefill(model, real, head + extra, chunk=16)
    assert cache_layout(cache) == cache_layout(real)  # positions seen included: each ring slot is where it is real
    assert cache_bytes(cache) == cache_bytes(real)
    decode_times(model, cache, logits, 3)  # decode steps run on it and grow it as on the real one
    decode_times(model, real, real_logits, 3)
    assert cache_layout(cache) == cache_layout(real)


def test_extending_a_cache_refuses_what_it_cannot_keep_consistent():
    model = EXTENDED_MODELS["window-memory-heads"][0]()
    cache = new_cache(model)
    prefill(model, cache, 10, chunk=16)
    with pytest.raises(ValueError, match="multiple of its period 576"):
        extend_cache(cache, 64)
    sliding = byte_mistral(sliding_window=8)
    cache = new_cache(sliding)
    prefill(sliding, cache, 10, chunk=16)
    before = cache_layout(cache)
    with pytest.raises(TypeError, match="DynamicSlidingWindowLayer"):
        extend_cache(cache, 8)
    assert cache_layout(cache) == before  # refused before any layer changed


def test_decode_is_timed_after_a_real_prefill_where_the_cache_cannot_be_extended():
    sliding = byte_mistral(sliding_window=8)
    [row] = decode_profile(sliding, [40], steps=2, chunk=16, prefilled=16)
    assert row["context"] == 40 and row["ms_per_token"] > 0


def test_decode_profile_times_the_contexts_in_turns(monkeypatch):
    model = byte_llama()
    lengths = []  # the context each timed or untimed step decodes after
    step = measure.timed_decode_step

    def recorded(model, cache, logits):
        lengths.append(cache.get_seq_length())
        return step(model, cache, logits)

    monkeypatch.setattr(measure, "timed_decode_step", recorded)
    rows = decode_profile(model, [20, 40], steps=3, chunk=16, prefilled=64)
    assert [row["context"] for row in rows] == [20, 40]
    assert all(row["ms_per_token"] > 0 for row in rows)
    # One untimed step after each prefill, then the timed steps alternate between the two caches.
    assert lengths == [20, 40, 21, 41, 22, 42, 23, 43]


def byte_mistral(sliding_window: int) -> MistralForCausalLM:
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=sliding_window)
    return MistralForCausalLM(config).eval()


@pytest.mark.parametrize("build", [byte_llama, lambda: byte_mistral(sliding_window=8)], ids=["llama", "sliding"])
def test_layout_cache_bytes_equal_those_of_a_prefilled_softmax_model(build):
    model = build()
    contexts = [5, 40]
    assert cache_bytes_by_context(model, contexts) == prefilled_cache_bytes(model, contexts)
