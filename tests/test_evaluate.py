"""training/evaluate.py: short perplexity with documents kept apart, long-context perplexity, passkey and cache
bytes by context, the sliding-window baseline, decode profile, and the numbers written into each linear-attention
checkpoint's model card."""

import json
import math
import re

import pytest
import torch
import torch.nn.functional as F
from helpers import WORDS, document_pieces
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from hf_linear_attn import convert_to_linear_attention
from hf_linear_attn.training import evaluate
from hf_linear_attn.training.data import DataArguments, build_datasets, byte_level_tokenizer, collate_rows
from hf_linear_attn.training.long_context_data import SOURCES, VARIANTS, load_texts, long_documents, passkey_trials
from hf_linear_attn.training.long_context_metrics import passkey_scores, perplexity_windows
from hf_linear_attn.training.model_card import EVALUATION_FILE, passkey_cell

pytestmark = pytest.mark.usefixtures("single_thread")
BLOCK = 64
CONTEXTS = (32, 64)
SCORED = 48
MIN_ROWS = 3  # binds at context 64 (48 scored tokens take 2 rows of 32), not at 32 (3 rows of 16)
BASELINE = "SWA(8)+2 sinks"


def byte_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def write_long_texts(folder) -> None:
    """Tiny stand-ins for the prepared long texts: two sources of two records each, made of WORDS."""
    folder.mkdir(parents=True, exist_ok=True)
    for s, source in enumerate(SOURCES):
        records = [{"title": f"{source} {r}",
                    "text": " ".join(WORDS[(5 * i + 3 * r + s) % len(WORDS)] for i in range(150))} for r in range(2)]
        (folder / f"{source}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))


def window_mask(length: int, window: int, sinks: int) -> torch.Tensor:
    """Additive float mask [1, 1, L, L], written out directly: causal, last `window` positions and first `sinks`."""
    i = torch.arange(length)
    allowed = (i[:, None] >= i[None]) & ((i[:, None] - i[None] < window) | (i[None] < sinks))
    return torch.where(allowed, 0.0, -torch.inf)[None, None]


def per_document_loss(model, rows, window: int = 0, sinks: int = 0) -> float:
    """exp(mean next-token loss) with every document of the packed rows run alone; with `window`, each
    position sees only the last `window` positions and the first `sinks` of its document (explicit mask)."""
    total, count = 0.0, 0
    for piece in document_pieces(rows):
        mask = window_mask(piece.shape[1], window, sinks) if window else None
        with torch.no_grad():
            logits = model(piece, attention_mask=mask).logits[0, :-1]
        total += F.cross_entropy(logits, piece[0, 1:], reduction="sum").item()
        count += piece.shape[1] - 1
    return math.exp(total / count)


def second_half_perplexity(model, windows, window: int = 0, sinks: int = 0) -> float:
    """exp(mean loss) of the second half of each row, from one full forward per row."""
    total, count = 0.0, 0
    for row in windows:
        length = row.shape[1]
        mask = window_mask(length, window, sinks) if window else None
        with torch.no_grad():
            logits = model(row, attention_mask=mask).logits[0]
        total += F.cross_entropy(logits[length // 2 - 1:-1], row[0, length // 2:], reduction="sum").item()
        count += length - length // 2
    return math.exp(total / count)


def arguments(root, *extra: str) -> list[str]:
    """Command line of a tiny evaluation of root/{teacher,wide,narrow} with the texts in root/texts."""
    return ["--teacher_name_or_path", str(root / "teacher"), "--models", f"wide={root / 'wide'}",
            f"narrow={root / 'narrow'}",
            "--block_size", str(BLOCK), "--max_eval_rows", "6", "--baseline_window", "8", "--baseline_sinks", "2",
            "--long_context_data", str(root / "texts"), "--document_tokens", "512", "--documents_per_source", "2",
            "--long_contexts", *map(str, CONTEXTS), "--long_scored_tokens", str(SCORED),
            "--long_min_rows", str(MIN_ROWS),
            "--passkey_lengths", "400", "--passkey_trials", "2", "--passkey_keys", "2",
            "--passkey_models", "teacher", BASELINE, "narrow",
            "--decode_contexts", "40", "160", "--decode_tokens", "2", "--prefill_chunk", "64",
            "--decode_prefilled", "48",  # 160 tokens: about 48 prefilled, the rest by shape (measure.extend_cache)
            "--position_bins", "1", "8", "300", "--position_rows", "3",
            "--output_dir", str(root / "out"), *extra]


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, dataset_cache):
    """A byte-level Llama teacher, its conversion with a window covering every row and context (exactly the
    teacher) and one with a short window, evaluated together on tiny settings."""
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
    write_long_texts(root / "texts")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    assert evaluate.main(arguments(root, "--cache_dir", str(dataset_cache))) == 0
    torch.set_num_threads(threads)
    data = DataArguments(block_size=BLOCK, cache_dir=str(dataset_cache))
    rows = collate_rows(list(build_datasets(data, tokenizer)["validation"])[:6])
    documents = long_documents(tokenizer, load_texts(root / "texts"), 512, 2)
    return root, teacher, rows, documents


def test_short_perplexities_are_per_document_and_the_window_baseline_is_masked_attention(evaluated):
    root, teacher, rows, _ = evaluated
    result = {r["model"]: r for r in json.loads((root / "out" / "evaluation.json").read_text())["rows"]}
    assert list(result) == ["teacher", BASELINE, "wide", "narrow"]
    assert result["teacher"]["perplexity"] == pytest.approx(per_document_loss(teacher, rows), rel=1e-5)
    baseline = result[BASELINE]["perplexity"]
    assert baseline == pytest.approx(per_document_loss(teacher, rows, window=8, sinks=2), rel=1e-5)
    assert baseline != pytest.approx(result["teacher"]["perplexity"], rel=1e-5)  # the window does bind
    # A window covering every row makes the converted model the teacher.
    assert result["wide"]["perplexity"] == pytest.approx(result["teacher"]["perplexity"], rel=1e-4)
    assert result["wide"]["vs_teacher"] == pytest.approx(1.0, rel=1e-4)


def test_long_context_perplexity_and_cache_bytes_equal_direct_computations(evaluated):
    root, teacher, _, documents = evaluated
    long_rows = json.loads((root / "out" / "evaluation.json").read_text())["long_context"]
    assert [(r["model"], r["context"]) for r in long_rows] == [
        (m, c) for m in ("teacher", BASELINE, "wide", "narrow") for c in CONTEXTS]
    got = {(r["model"], r["context"]): r for r in long_rows}
    narrow = AutoModelForCausalLM.from_pretrained(root / "narrow").eval()
    for context in CONTEXTS:
        windows = perplexity_windows(documents, context, SCORED, MIN_ROWS)
        assert len(windows) == MIN_ROWS == got["teacher", context]["rows"]
        assert got["teacher", context]["scored_tokens"] == len(windows) * (context - context // 2) >= SCORED
        assert got["teacher", context]["perplexity"] == pytest.approx(second_half_perplexity(teacher, windows),
                                                                      rel=1e-5)
        assert got[BASELINE, context]["perplexity"] == pytest.approx(
            second_half_perplexity(teacher, windows, window=8, sinks=2), rel=1e-5)
        assert got["narrow", context]["perplexity"] == pytest.approx(second_half_perplexity(narrow, windows),
                                                                     rel=1e-5)
        assert got["wide", context]["vs_teacher"] == pytest.approx(1.0, rel=1e-4)  # window 64 ≥ every context
        assert got["narrow", context]["vs_teacher"] == pytest.approx(
            got["narrow", context]["perplexity"] / got["teacher", context]["perplexity"])
    # Cache bytes: the teacher's KV grows with the context, the window hybrid's cache is constant, the baseline
    # holds window + sinks = 10 tokens of the teacher's KV.
    teacher_bytes = [got["teacher", c]["cache_bytes"] for c in CONTEXTS]
    assert teacher_bytes[1] == 2 * teacher_bytes[0] > 0
    assert got["narrow", 32]["cache_bytes"] == got["narrow", 64]["cache_bytes"] > 0
    assert got[BASELINE, 32]["cache_bytes"] == got[BASELINE, 64]["cache_bytes"] == teacher_bytes[0] * 10 // 32


def test_passkey_runs_each_setting_for_the_chosen_models_with_the_seeded_trials(evaluated):
    root, teacher, _, documents = evaluated
    passkey = json.loads((root / "out" / "evaluation.json").read_text())["passkey"]
    settings = [(400, h, v) for h in ("natural", "filler") for v in VARIANTS]  # every variant by default
    assert [(r["model"], r["length"], r["haystack"], r["variant"]) for r in passkey] == [
        (m, *s) for m in ("teacher", BASELINE, "narrow") for s in settings]  # not "wide": not in passkey_models
    assert all(r["trials"] == 2 for r in passkey)
    tokenizer = byte_level_tokenizer()
    for r in passkey[:len(settings)]:  # the teacher's, against trials built here with the same seed
        trials = passkey_trials(tokenizer, documents, 400, 2, r["haystack"], r["variant"], seed=0, keys=2)
        expected = passkey_scores(teacher, trials)
        assert {key: r[key] for key in expected} == pytest.approx(expected, rel=1e-5)


def test_decode_profile_cache_is_constant_for_linear_attention_and_grows_for_the_teacher(evaluated):
    root, _, _, _ = evaluated
    decode = json.loads((root / "out" / "decode.json").read_text())["rows"]
    by_model = {}
    for row in decode:
        by_model.setdefault(row["model"], []).append(row)
    assert [r["context"] for r in by_model["teacher"]] == [40, 160]
    assert by_model["teacher"][1]["cache_bytes"] == 4 * by_model["teacher"][0]["cache_bytes"]
    assert by_model["narrow"][1]["cache_bytes"] == by_model["narrow"][0]["cache_bytes"] > 0
    assert all(r["ms_per_token"] > 0 for r in decode)


def test_the_report_has_every_table_and_the_plot(evaluated):
    root, _, _, _ = evaluated
    report = (root / "out" / "evaluation.md").read_text()
    long_rows = json.loads((root / "out" / "evaluation.json").read_text())["long_context"]
    ppl = {(r["model"], r["context"]): r["perplexity"] for r in long_rows}
    assert "| model | perplexity | × teacher |" in report
    assert f"### Held-out perplexity by context (≥ {SCORED} scored tokens each; × teacher)" in report
    assert "| model | 32 | 64 |" in report
    ratio = ppl["narrow", 32] / ppl["teacher", 32]
    assert f"| narrow | {ppl['narrow', 32]:.3g} ({ratio:.2f}×) | " in report
    assert f"| teacher | {ppl['teacher', 32]:.3g} | {ppl['teacher', 64]:.3g} |" in report
    assert ("### Passkey retrieval (2 trials per setting): greedy accuracy (key log-probability, mean ± s.e. over "
            "trials; share of the key's tokens that are the argmax)") in report
    assert f"| length, haystack, variant | teacher | {BASELINE} | narrow |" in report
    passkey = json.loads((root / "out" / "evaluation.json").read_text())["passkey"]
    cells = [f"{r['accuracy']:.0%} ({r['key_log_prob']:.2f} ± {r['key_log_prob_se']:.2f}; {r['argmax_accuracy']:.0%})"
             for r in passkey if r["haystack"] == "natural" and r["variant"] == "chat"]
    assert f"| 400 natural chat | {' | '.join(cells)} |" in report  # the teacher's beside each model's
    assert "### Decoding cache by context (share of the teacher's)" in report
    assert (root / "out" / "evaluation.png").stat().st_size > 0  # matplotlib is a dev dependency


def test_each_linear_checkpoint_gets_the_numbers_in_its_model_card(evaluated):
    root, _, _, _ = evaluated
    assert not (root / "teacher" / "evaluation.json").exists()  # a softmax checkpoint is left alone
    written = json.loads((root / "out" / "evaluation.json").read_text())
    for label in ("wide", "narrow"):
        record = json.loads((root / label / EVALUATION_FILE).read_text())
        assert record["label"] == label
        for key in ("rows", "long_context", "passkey"):
            assert record[key] == written[key]
        card = (root / label / "README.md").read_text()
        assert "### Against the softmax teacher" in card
        mine = next(r for r in written["rows"] if r["model"] == label)
        assert f"| **{label}** | **{mine['perplexity']:.3g}** |" in card
        assert f"| {BASELINE} |" in card
        assert "#### Held-out perplexity by context" in card and "#### Passkey retrieval" in card
        context = next(r for r in written["long_context"] if r["model"] == label and r["context"] == 64)
        assert f"**{context['perplexity']:.3g} ({context['vs_teacher']:.2f}×)**" in card
    assert "| length, haystack, variant | teacher | SWA(8)+2 sinks | **narrow** |" in (
        root / "narrow" / "README.md").read_text()


def test_a_sparse_memory_variant_is_measured_as_the_model_with_sparse_cache_size_set(evaluated, tmp_path):
    root, _, _, documents = evaluated
    argv = ["--models", f"narrow={root / 'narrow'}", f"wide={root / 'wide'}", "--sparse_cache_sizes", "3",
            "--memory_models", "narrow", "--block_size", str(BLOCK),
            "--max_eval_rows", "2", "--long_context_data", str(root / "texts"), "--document_tokens", "512",
            "--documents_per_source", "2", "--long_contexts", "64", "--long_scored_tokens", str(SCORED),
            "--long_min_rows", str(MIN_ROWS), "--passkey_lengths", "400", "--passkey_trials", "0",
            "--decode_contexts", "40", "--decode_tokens", "1",
            "--update_model_cards", "false", "--output_dir", str(tmp_path / "out")]
    assert evaluate.main(argv) == 0
    long_rows = {r["model"]: r for r in json.loads((tmp_path / "out" / "evaluation.json").read_text())["long_context"]}
    assert sorted(long_rows) == ["narrow", "narrow + memory 3", "wide"]
    windows = perplexity_windows(documents, 64, SCORED, MIN_ROWS)
    with_memory = AutoModelForCausalLM.from_pretrained(root / "narrow", sparse_cache_size=3).eval()
    assert long_rows["narrow + memory 3"]["perplexity"] == pytest.approx(
        second_half_perplexity(with_memory, windows), rel=1e-5)
    assert long_rows["narrow + memory 3"]["perplexity"] != long_rows["narrow"]["perplexity"]
    # The memory's slots make the cache larger, still constant in the context.
    assert long_rows["narrow + memory 3"]["cache_bytes"] > long_rows["narrow"]["cache_bytes"]


def test_head_variants_restore_the_teachers_best_retrieving_heads_and_the_frontier_sets_quality_against_cache(
        evaluated, tmp_path, dataset_cache):
    """`--softmax_head_counts 1`: "narrow + 1 heads" is narrow with the teacher's best retrieving KV head (ranked on
    the data pipeline's passkey prompts) restored; with a memory size too, every combination; the frontier table
    puts each model's perplexity and passkey at the longest context beside its cache share."""
    from hf_linear_attn.head_selection import retrieval_scores, top_heads
    from hf_linear_attn.layer_selection import restore_softmax_heads
    from hf_linear_attn.training.checkpoint_conversion import head_ranking_prompts
    from hf_linear_attn.training.data import byte_level_tokenizer

    root, teacher, _, documents = evaluated
    argv = ["--teacher_name_or_path", str(root / "teacher"), "--models", f"narrow={root / 'narrow'}",
            "--softmax_head_counts", "1",
            "--sparse_cache_sizes", "3", "--head_ranking_prompts", "2", "--head_ranking_length", "400",
            "--baseline_window", "0", "--block_size", str(BLOCK), "--cache_dir", str(dataset_cache),
            "--max_eval_rows", "2", "--long_context_data", str(root / "texts"), "--document_tokens", "512",
            "--documents_per_source", "2", "--long_contexts", "64", "--long_scored_tokens", str(SCORED),
            "--long_min_rows", str(MIN_ROWS), "--passkey_lengths", "400", "--passkey_trials", "2",
            "--passkey_variants", "single", "--decode_contexts", "40", "--decode_tokens", "1",
            "--decode_models", "teacher", "narrow", "--update_model_cards", "false",
            "--output_dir", str(tmp_path / "out")]
    assert evaluate.main(argv) == 0
    record = json.loads((tmp_path / "out" / "evaluation.json").read_text())
    long_rows = {r["model"]: r for r in record["long_context"]}
    assert sorted(long_rows) == ["narrow", "narrow + 1 heads", "narrow + 1 heads + memory 3", "narrow + memory 3",
                                 "teacher"]
    prompts = head_ranking_prompts(byte_level_tokenizer(), DataArguments(block_size=400, cache_dir=str(dataset_cache)),
                                   2)
    heads = top_heads(retrieval_scores(teacher, prompts, progress=False), 1)
    restored = restore_softmax_heads(AutoModelForCausalLM.from_pretrained(root / "narrow"), heads).eval()
    windows = perplexity_windows(documents, 64, SCORED, MIN_ROWS)
    assert long_rows["narrow + 1 heads"]["perplexity"] == pytest.approx(second_half_perplexity(restored, windows),
                                                                        rel=1e-5)
    # A restored head keeps its whole context: the cache grows by its keys and values (2 x 64 tokens x D x 4 bytes).
    head_dim = teacher.config.hidden_size // teacher.config.num_attention_heads
    assert long_rows["narrow + 1 heads"]["cache_bytes"] == long_rows["narrow"]["cache_bytes"] + 2 * 64 * head_dim * 4
    decoded = json.loads((tmp_path / "out" / "decode.json").read_text())["rows"]
    # head variants decode as their model does (not profiled); "narrow + memory 3" is not in --decode_models
    assert {r["model"] for r in decoded} == {"teacher", "narrow"}
    frontier = {r["model"]: r for r in json.loads((tmp_path / "out" / "frontier.json").read_text())["rows"]}
    assert sorted(frontier) == sorted(long_rows)
    for label, row in frontier.items():
        teacher_bytes = long_rows["teacher"]["cache_bytes"]
        assert row["cache_share"] == pytest.approx(long_rows[label]["cache_bytes"] / teacher_bytes)
        assert row["vs_teacher"] == pytest.approx(long_rows[label]["vs_teacher"])
        scores = next(p for p in record["passkey"] if p["model"] == label)
        assert row["passkey_400"] == f"{scores['accuracy']:.0%}, {scores['key_log_prob']:.2f}"
    assert (tmp_path / "out" / "frontier.png").stat().st_size > 0


@pytest.mark.parametrize("shortlist", ["4", "0"])
def test_head_variants_ranked_by_restoration_restore_the_models_own_best_heads(evaluated, tmp_path, dataset_cache,
                                                                              shortlist):
    """`--head_ranking restoration`: "narrow + 1 heads" is narrow with the KV head whose restoration alone raises its
    own log-probability of the key most on the ranking prompts, no teacher needed: measured exactly on every one of
    its 4 recurrent KV heads with `--head_ranking_shortlist 4` (`restoration_gains`), by the first-order estimate
    alone with 0 (`estimated_restoration_gains`)."""
    from hf_linear_attn.head_selection import top_heads
    from hf_linear_attn.layer_selection import estimated_restoration_gains, restoration_gains, restore_softmax_heads
    from hf_linear_attn.training.checkpoint_conversion import head_ranking_prompts
    from hf_linear_attn.training.data import byte_level_tokenizer

    root, _, _, documents = evaluated
    argv = ["--models", f"narrow={root / 'narrow'}", "--softmax_head_counts", "1", "--head_ranking", "restoration",
            "--head_ranking_shortlist", shortlist,
            "--head_ranking_prompts", "2", "--head_ranking_length", "400", "--block_size", str(BLOCK),
            "--cache_dir", str(dataset_cache), "--max_eval_rows", "2", "--long_context_data", str(root / "texts"),
            "--document_tokens", "512", "--documents_per_source", "2", "--long_contexts", "64",
            "--long_scored_tokens", str(SCORED), "--long_min_rows", str(MIN_ROWS), "--passkey_lengths", "400",
            "--passkey_trials", "0",
            "--decode_contexts", "40", "--decode_tokens", "1", "--update_model_cards", "false",
            "--output_dir", str(tmp_path / "out")]
    assert evaluate.main(argv) == 0
    long_rows = {r["model"]: r for r in json.loads((tmp_path / "out" / "evaluation.json").read_text())["long_context"]}
    assert sorted(long_rows) == ["narrow", "narrow + 1 heads"]
    narrow = AutoModelForCausalLM.from_pretrained(root / "narrow").eval()
    prompts = head_ranking_prompts(byte_level_tokenizer(), DataArguments(block_size=400, cache_dir=str(dataset_cache)),
                                   2)
    measure = estimated_restoration_gains if shortlist == "0" else restoration_gains
    heads = top_heads(measure(narrow, prompts, progress=False), 1)
    restored = restore_softmax_heads(narrow, heads).eval()
    windows = perplexity_windows(documents, 64, SCORED, MIN_ROWS)
    assert long_rows["narrow + 1 heads"]["perplexity"] == pytest.approx(second_half_perplexity(restored, windows),
                                                                        rel=1e-5)


def test_head_variants_ranked_by_the_teacher_need_one(tmp_path, capsys):
    write_long_texts(tmp_path / "texts")
    argv = ["--models", "m=x", "--softmax_head_counts", "1", "--long_context_data", str(tmp_path / "texts")]
    with pytest.raises(SystemExit):
        evaluate.main(argv)
    assert "head_ranking teacher needs --teacher_name_or_path" in capsys.readouterr().err


def test_sparse_memory_sizes_need_window_hybrids(evaluated, tmp_path, capsys):
    root, teacher, _, _ = evaluated
    convert_to_linear_attention(teacher, feature_map="hedgehog", feature_dim=8, window_size=0,
                                num_sink_tokens=0).save_pretrained(tmp_path / "plain")
    argv = ["--models", f"plain={tmp_path / 'plain'}", "--sparse_cache_sizes", "4",
            "--long_context_data", str(root / "texts"), "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit):
        evaluate.main(argv)
    assert "model 'plain'" in capsys.readouterr().err and not (tmp_path / "out").exists()


@pytest.mark.parametrize(("model", "counts", "message"), [
    ("narrow", ["5"], r"softmax_head_counts \[5\]: model 'narrow' .* has 4 recurrent KV heads left to restore"),
    ("narrow", ["2", "--head_ranking_shortlist", "5"], r"head_ranking_shortlist 5: model 'narrow' .* has 4"),
    ("teacher", ["1"], "model 'teacher' .* is a 'llama' model, not a linear-attention checkpoint"),
])
def test_head_variants_need_heads_left_to_restore(evaluated, tmp_path, capsys, model, counts, message):
    root, _, _, _ = evaluated
    argv = ["--models", f"{model}={root / model}", "--softmax_head_counts", *counts, "--head_ranking", "restoration",
            "--long_context_data", str(root / "texts"), "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit):
        evaluate.main(argv)
    assert re.search(message, capsys.readouterr().err) and not (tmp_path / "out").exists()


def test_the_chat_variant_needs_a_chat_template_and_says_so_before_any_model_loads(tmp_path, capsys, dataset_cache):
    write_long_texts(tmp_path / "texts")
    tokenizer = byte_level_tokenizer()
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "plain")
    argv = ["--teacher_name_or_path", str(tmp_path / "no-teacher"), "--tokenizer_name", str(tmp_path / "plain"),
            "--long_context_data", str(tmp_path / "texts"), "--document_tokens", "512", "--documents_per_source", "2",
            "--long_contexts", "64", "--long_scored_tokens", str(SCORED), "--passkey_lengths", "400",
            "--block_size", str(BLOCK),
            "--cache_dir", str(dataset_cache), "--output_dir", str(tmp_path / "out")]
    with pytest.raises(SystemExit):
        evaluate.main(argv)
    assert "this tokenizer has none: use the variants 'single' or 'multi'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_missing_long_texts_stop_before_any_model_loads_with_the_prepare_command(tmp_path, capsys):
    # The teacher and model paths do not exist: reaching them would fail differently.
    argv = ["--teacher_name_or_path", str(tmp_path / "no-teacher"), "--models", f"m={tmp_path / 'no-model'}",
            "--long_context_data", str(tmp_path / "nowhere")]
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert error.startswith("error: long_context_data:") and "hf-linear-attn-long-context prepare" in error


def test_perplexity_by_position_is_reported_for_every_model_against_the_teachers(evaluated):
    root, teacher, _, documents = evaluated
    rows = json.loads((root / "out" / "positions.json").read_text())["rows"]
    assert [(r["model"], r["first"], r["end"]) for r in rows] == [
        (m, a, b) for m in ("teacher", BASELINE, "wide", "narrow") for a, b in ((1, 8), (8, 300))]
    by = {(r["model"], r["first"]): r for r in rows}
    narrow = AutoModelForCausalLM.from_pretrained(root / "narrow").eval()

    def bin_perplexity(model, first, end):  # written out: one forward of each document's first 300 tokens
        with torch.no_grad():
            logits = [model(documents[d].input_ids[None, :300]).logits[0] for d in range(3)]
        losses = torch.stack([F.cross_entropy(x[:-1], documents[d].input_ids[1:300], reduction="none")
                              for d, x in enumerate(logits)])  # [3, 299]: position p at column p - 1
        return math.exp(losses[:, first - 1:end - 1].mean().item())

    for first, end in ((1, 8), (8, 300)):
        assert by["teacher", first]["perplexity"] == pytest.approx(bin_perplexity(teacher, first, end), rel=1e-5)
        assert by["narrow", first]["perplexity"] == pytest.approx(bin_perplexity(narrow, first, end), rel=1e-5)
        assert by["narrow", first]["vs_teacher"] == pytest.approx(
            by["narrow", first]["perplexity"] / by["teacher", first]["perplexity"])
    # Within its window (64 tokens) a converted model is the teacher.
    assert by["wide", 1]["vs_teacher"] == pytest.approx(1.0, rel=1e-5)
    assert "from position" in (root / "out" / "positions.md").read_text()


@pytest.mark.parametrize(("extra", "message"), [
    (["--passkey_models", "teacher", "stage 9"], r"passkey_models \['stage 9'\] are not evaluated"),
    (["--decode_models", "stage 9"], r"decode_models \['stage 9'\] are not evaluated"),
    (["--passkey_lengths", "16384"], "raise document_tokens"),
    (["--passkey_haystacks", "noise"], "passkey_haystacks must be"),
    (["--passkey_variants", "chat", "twice"], r"passkey_variants must be a non-empty list of \['chat', 'single'"),
    (["--long_min_rows", "0"], "long_min_rows must be ≥ 1, got 0"),
    (["--long_contexts", "1"], "long_contexts must be"),
    (["--position_bins", "0", "64"], r"position_bins \[0, 64\]: give at least 2 strictly increasing positions"),
    (["--position_bins", "1", "9000"], "up to document_tokens=8192"),
    (["--position_bins", "1", "64", "--position_rows", "9"], r"position_rows must be in \[1, 8\]"),
    (["--models", "teacher=x"], "labels must differ"),
    (["--models", "m=x", "--sparse_cache_sizes", "0"], "sparse_cache_sizes must be distinct sizes ≥ 1"),
    (["--models", "m=x", "--sparse_cache_sizes", "4", "--memory_models", "n"], r"memory_models \['n'\] are not"),
    (["--softmax_head_counts", "2", "2"], "softmax_head_counts must be distinct counts ≥ 1"),
    (["--softmax_head_counts", "0"], "softmax_head_counts must be distinct counts ≥ 1"),
    (["--head_ranking", "kl"], r"head_ranking 'kl': choose one of \['teacher', 'restoration'\]"),
    (["--models", "m=x", "--softmax_head_counts", "2", "--head_ranking_shortlist", "4"],
     "head_ranking_shortlist 4 applies to head variants ranked by restoration"),
    (["--models", "m=x", "--softmax_head_counts", "1", "3", "--head_ranking", "restoration",
      "--head_ranking_shortlist", "2"], "head_ranking_shortlist 2: measure at least the 3 heads"),
])
def test_bad_arguments_are_refused_before_anything_loads(tmp_path, capsys, extra, message):
    write_long_texts(tmp_path / "texts")
    argv = ["--teacher_name_or_path", str(tmp_path / "no-teacher"), "--long_context_data", str(tmp_path / "texts"),
            *extra]
    with pytest.raises(SystemExit):
        evaluate.main(argv)
    assert re.search(message, capsys.readouterr().err)


def test_a_passkey_cell_shows_the_scores_and_a_record_from_before_them_its_accuracy():
    row = {"accuracy": 0.96, "key_log_prob": -0.6417, "key_log_prob_se": 0.083, "argmax_accuracy": 0.993}
    assert passkey_cell(row) == "96% (-0.64 ± 0.08; 99%)"
    assert passkey_cell({"accuracy": 0.6, "trials": 5}) == "60%"
