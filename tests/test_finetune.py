"""training/finetune.py (`training.stages.finetune`) and its building blocks: recipe parsing, data packing, the loop,
checkpoints, LoRA."""

import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml
from datasets import Dataset
from helpers import (
    ROOT,
    TINY_RECIPE,
    document_pieces,
    read_log,
    script_env,
    tiny_args,
    tiny_model,
    write_documents,
)
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from hf_linear_attn import InputError, InputNotFoundError, LinearAttentionForCausalLM
from hf_linear_attn.training import checkpoints, finetune, loop, stages
from hf_linear_attn.training.data import (
    DataArguments,
    build_datasets,
    byte_level_tokenizer,
    check_data_arguments,
    check_positions,
    collate_rows,
    offset_positions,
    pack_documents,
)
from hf_linear_attn.training.loop import GlobalBatchSampler, TrainArguments, make_accelerator, train
from hf_linear_attn.training.losses import causal_lm_loss, flat_positions, logit_distillation_loss, packed_forward

pytestmark = pytest.mark.usefixtures("single_thread")


def run(*args: str):
    return stages.finetune(finetune.parse_args(list(args)))


def weights(folder) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


def piece_losses(model, rows) -> tuple[float, int]:
    """Summed next-token loss and token count over the document pieces of packed rows (a piece starts wherever
    the position does not step by one), each piece run through the model alone at its own positions: what packing
    must reproduce."""
    total, count = 0.0, 0
    for row in rows:
        ids, positions = row["input_ids"], row["position_ids"]
        starts = [i for i in range(len(ids)) if i == 0 or positions[i] != positions[i - 1] + 1] + [len(ids)]
        for begin, end in zip(starts[:-1], starts[1:], strict=True):
            piece = torch.tensor(ids[begin:end])[None]
            if piece.shape[1] < 2:
                continue
            piece_positions = torch.tensor(positions[begin:end])[None]
            with torch.no_grad():
                logits = model(piece, position_ids=piece_positions, use_cache=False).logits[0, :-1]
            total += F.cross_entropy(logits.float(), piece[0, 1:], reduction="sum").item()
            count += piece.shape[1] - 1
    return total, count


@pytest.fixture(scope="module")
def trained(tmp_path_factory, dataset_cache):
    """A short from-scratch run of the tiny recipe on the embedded corpus, logging to tensorboard."""
    output = tmp_path_factory.mktemp("trained")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    result = run(*tiny_args(output, dataset_cache, "--max_steps", "12", "--report_to", "tensorboard"))
    torch.set_num_threads(threads)
    return output, result


# Recipes and flags ---------------------------------------------------------------------------------


def test_recipe_fields_and_command_line_overrides(tmp_path, capsys):
    model_args, data_args, train_args, hub_args = finetune.parse_args(
        ["--config", str(TINY_RECIPE), "--learning_rate", "0.5", "--use_lora", "--lora_target_modules", "q_proj"]
    )
    recipe = yaml.safe_load(TINY_RECIPE.read_text())
    # a shipped recipe's `configs/...` file is read from the installed package, wherever the command runs
    assert Path(model_args.config_name) == ROOT / recipe["config_name"] and Path(model_args.config_name).is_absolute()
    assert data_args.block_size == recipe["block_size"] and train_args.max_steps == recipe["max_steps"]
    assert train_args.learning_rate == 0.5  # the flag wins over the recipe
    assert model_args.use_lora and model_args.lora_target_modules == ["q_proj"]
    assert hub_args.license == recipe["license"]
    # Without a recipe: the dataclass defaults (run_clm names).
    model_args, data_args, train_args, _ = finetune.parse_args(["--model_name_or_path", "x", "--block_size", "32"])
    assert model_args.model_name_or_path == "x" and data_args.block_size == 32 and train_args.max_steps == -1
    with pytest.raises(SystemExit) as exit_:  # as argparse refuses a bad flag: usage, one `error: ...` line, status 2
        finetune.parse_args(["--no_such_flag", "1"])
    assert exit_.value.code == 2 and "error: unrecognized arguments: --no_such_flag 1" in capsys.readouterr().err


# Bad input: every case fails with a clear error before training starts -----------------------------


def _bad_input_cases(tmp_path, cache):
    docs = write_documents(tmp_path / "docs.jsonl")
    typo = tmp_path / "typo.yaml"
    typo.write_text("learning_rat: 0.1\n")
    llama = tmp_path / "llama"
    LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                vocab_size=300).save_pretrained(llama)
    incomplete = tmp_path / "out-incomplete" / "checkpoint-3"
    incomplete.mkdir(parents=True)
    (incomplete / "model.safetensors").write_bytes(b"partial")
    occupied = tmp_path / "occupied"
    (occupied / "checkpoint-2").mkdir(parents=True)
    (occupied / "checkpoint-2" / checkpoints.STATE_FILE).write_text(json.dumps({"global_step": 2}))
    teacher = tmp_path / "teacher"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 vocab_size=300)).save_pretrained(teacher)
    out = tmp_path / "out"
    return {
        "missing file": (InputNotFoundError, "no such file",
                         tiny_args(out, cache, "--train_file", str(tmp_path / "missing.jsonl"))),
        "unknown column": (InputError, "'body' is not a column",
                           tiny_args(out, cache, "--train_file", str(docs), "--text_column", "body")),
        "unknown recipe key": (SystemExit, r"typo.yaml: unknown key\(s\) \['learning_rat'\]", ["--config", str(typo)]),
        "not linear attention": (InputError, "'llama' model, not a linear-attention",
                                 tiny_args(out, cache, "--config_name", "", "--model_name_or_path", str(llama))),
        "lora targets": (InputError, r"\['qkv'\] match no module",
                         tiny_args(out, cache, "--use_lora", "--lora_target_modules", "q_proj", "qkv")),
        "trainable pattern": (InputError, "'nothing_like_this' matches no parameter",
                              tiny_args(out, cache, "--trainable_parameters", "nothing_like_this")),
        "incomplete resume folder": (InputError, "not a complete checkpoint",
                                     tiny_args(out, cache, "--resume_from_checkpoint", str(incomplete))),
        "nothing to resume": (InputNotFoundError, "no complete checkpoint",
                              tiny_args(out, cache, "--resume_from_checkpoint", "latest")),
        "earlier run in output_dir": (InputError, "already holds checkpoints", tiny_args(occupied, cache)),
        "no model": (InputError, "exactly one of", tiny_args(out, cache, "--model_name_or_path", "x")),
        "push without repo": (InputError, "needs --hub_model_id", tiny_args(out, cache, "--push_to_hub")),
        "bf16 weights that train": (InputError, "weights that train stay float32",
                                    tiny_args(out, cache, "--dtype", "bfloat16")),
        "teacher vocabulary": (InputError, "teacher .* predicts 300 tokens but the model 259",
                               tiny_args(out, cache, "--teacher_name_or_path", str(teacher))),
        "kl weight": (InputError, r"--kl_weight must be in \[0, 1\], got 1.5",
                      tiny_args(out, cache, "--teacher_name_or_path", str(teacher), "--kl_weight", "1.5")),
        "gguf without teacher": (InputError, "--teacher_gguf_file names a file inside",
                                 tiny_args(out, cache, "--teacher_gguf_file", "model.gguf")),
        "window weight": (InputError, r"`--set_window_weight`=1.5 .* strictly between 0 and 1",
                          tiny_args(out, cache, "--set_window_weight", "1.5")),
        "config override": (InputError, r"--config_overrides 'no_such_field=1'",
                            tiny_args(out, cache, "--config_overrides", "no_such_field=1")),
        "window weight without window": (InputError, r"`--set_window_weight`=0.9 .* this model has none",
                                         tiny_args(out, cache, "--set_window_weight", "0.9", "--config_overrides",
                                                   "window_size=0,num_sink_tokens=0")),
        "saved position cap": (InputError, r"rope_position_cap 4096: an int from 2 to .* \(2048\)",
                               tiny_args(out, cache, "--saved_rope_position_cap", "4096")),
        "saved position cap on an adapter": (InputError, "an unmerged LoRA adapter saves none",
                                             tiny_args(out, cache, "--saved_rope_position_cap", "64", "--use_lora",
                                                       "--merge_lora", "false")),
    }


@pytest.mark.parametrize("case", ["missing file", "unknown column", "unknown recipe key", "not linear attention",
                                  "lora targets", "trainable pattern", "incomplete resume folder",
                                  "nothing to resume", "earlier run in output_dir", "no model", "push without repo",
                                  "bf16 weights that train", "teacher vocabulary", "kl weight",
                                  "gguf without teacher", "window weight", "window weight without window",
                                  "config override", "saved position cap", "saved position cap on an adapter"])
def test_bad_input_fails_before_training(case, tmp_path, dataset_cache, monkeypatch, capsys):
    def no_training(*args, **kwargs):
        raise AssertionError("training started")

    monkeypatch.setattr(stages, "train", no_training)
    error, message, args = _bad_input_cases(tmp_path, dataset_cache)[case]
    with pytest.raises(error) as caught:
        run(*args)
    # Command-line errors exit with argparse's usage message; the others raise.
    assert re.search(message, capsys.readouterr().err if error is SystemExit else str(caught.value))
    assert not (tmp_path / "out" / "log.jsonl").exists()


# Data --------------------------------------------------------------------------------------------------


def test_packing_marks_documents_and_rows():
    packed = pack_documents([[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]], block_size=4)
    assert packed["input_ids"] == [[5, 6, 7, 8], [9, 10, 11, 12]]  # the tail (13, 14) fills no row
    assert packed["position_ids"] == [[0, 1, 2, 0], [0, 0, 1, 2]]  # restart per document and per row
    assert packed["labels"] == [[-100, 6, 7, -100], [-100, -100, 11, 12]]


def test_packing_can_run_documents_on_within_a_row():
    """separate_documents=False: long rows of short documents, as pretraining packs them; only rows restart."""
    packed = pack_documents([[5, 6, 7], [8, 9], [10, 11, 12, 13, 14]], block_size=4, separate_documents=False)
    assert packed["input_ids"] == [[5, 6, 7, 8], [9, 10, 11, 12]]
    assert packed["position_ids"] == [[0, 1, 2, 3], [0, 1, 2, 3]]
    assert packed["labels"] == [[-100, 6, 7, 8], [-100, 10, 11, 12]]


def test_packed_rows_keep_documents_apart():
    """The loss over packed rows equals the loss of every document piece run alone: no state or
    attention crosses a boundary (LoLCATs window + Hedgehog and decayed variants)."""
    docs = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in (9, 30, 2, 17, 25, 40)]
    rows = Dataset.from_dict(pack_documents(docs, block_size=32))
    for variant in ({"feature_map": "hedgehog", "feature_dim": 8, "window_size": 4, "num_sink_tokens": 1},
                    {"feature_map": "identity", "normalize": False, "decay": "scalar", "softmax_layers": [1]}):
        model = tiny_model(**variant)
        with torch.no_grad():
            loss_sum, count = causal_lm_loss(model, collate_rows(list(rows)))
        expected_sum, expected_count = piece_losses(model, rows)
        assert int(count.sum()) == expected_count
        torch.testing.assert_close(loss_sum.sum().item(), expected_sum, rtol=1e-5, atol=1e-4)


def test_position_offsets_move_each_piece_and_keep_its_boundaries():
    """Each document piece starts at a draw in [0, max_offset] and steps by one inside; a piece never continues the
    previous piece's positions (a small range forces the draws that would); the draws depend only on the seed and
    the row's index."""
    docs = [list(range(3, 3 + n)) for n in (5, 1, 7, 2, 9, 3, 4, 6, 2, 8)] * 6
    packed = pack_documents(docs, block_size=12)
    rows = list(range(len(packed["position_ids"])))
    shifted = offset_positions(packed["position_ids"], rows, max_offset=2, seed=0)
    continued = 0
    for before, after in zip(packed["position_ids"], shifted, strict=True):
        for i, (p, q) in enumerate(zip(before, after, strict=True)):
            if p == 0:
                assert 0 <= q <= 2
                continued += i > 0 and q == after[i - 1] + 1
            else:
                assert q == after[i - 1] + 1
    assert continued == 0
    assert offset_positions(packed["position_ids"], rows, 2, seed=0) == shifted
    assert offset_positions(packed["position_ids"], rows, 2, seed=1) != shifted
    wide = offset_positions(packed["position_ids"], rows, 1000, seed=0)
    assert len({row[0] for row in wide}) > len(rows) // 2  # rows draw their own offsets
    assert offset_positions(packed["position_ids"][3:4], [3], 1000, seed=0) == wide[3:4]


def test_position_offsets_train_the_first_and_last_positions_no_less_than_the_others():
    """Rows of L tokens offset by up to N: how often each position lies in a row matches the draw min(max(0, u), N),
    u uniform on [-(L - 1), N + L - 1] (counted over every u), within sampling error; the first L positions and the
    last L at least as often as any between."""
    block, max_offset, rows = 8, 24, 4000
    shifted = np.array(offset_positions([list(range(block))] * rows, list(range(rows)), max_offset, seed=0))
    covered = np.zeros(max_offset + block)
    for row in shifted:
        covered[row] += 1
    starts = [min(max(0, u), max_offset) for u in range(1 - block, max_offset + block)]
    expected = np.array([sum(s <= p < s + block for s in starts) for p in range(max_offset + block)]) / len(starts)
    np.testing.assert_allclose(covered / rows, expected, atol=0.03)
    middle = expected[block:max_offset].max()
    assert expected[:block].min() >= middle and expected[max_offset:].min() >= middle


def test_flattened_rows_stay_apart_when_a_row_would_continue_the_previous_one():
    positions = torch.tensor([[5, 6, 7], [8, 9, 10], [0, 1, 2], [3, 4, 5]])
    assert flat_positions(positions).tolist() == [[5, 6, 7, 7, 8, 9, 0, 1, 2, 2, 3, 4]]
    assert flat_positions(positions[:1]).tolist() == [[5, 6, 7]]


def test_offset_rows_keep_documents_apart_in_the_student_and_a_transformers_teacher():
    """Packed rows whose pieces start at offsets (`offset_positions`, flattened by `packed_forward`): the loss equals
    every piece run alone at its own positions, for the model and for a Llama teacher (transformers' masking reads
    the same boundaries)."""
    docs = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            for n in (9, 30, 2, 17, 25, 40)]
    for separate in (True, False):
        packed = pack_documents(docs, block_size=32, separate_documents=separate)
        indices = list(range(len(packed["position_ids"])))
        packed["position_ids"] = offset_positions(packed["position_ids"], indices, max_offset=90, seed=3)
        packed["position_ids"][1] = [p - packed["position_ids"][1][0] + packed["position_ids"][0][-1] + 1
                                     for p in packed["position_ids"][1]]  # row 1 would continue row 0
        rows = Dataset.from_dict(packed)
        teacher = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                               max_position_embeddings=256)).eval()
        for model in (tiny_model(feature_map="hedgehog", feature_dim=8, window_size=4, num_sink_tokens=1,
                                 decay="scalar", softmax_layers=[1]), teacher):
            with torch.no_grad():
                loss_sum, count = causal_lm_loss(model, collate_rows(list(rows)))
            expected_sum, expected_count = piece_losses(model, rows)
            assert int(count.sum()) == expected_count
            torch.testing.assert_close(loss_sum.sum().item(), expected_sum, rtol=1e-5, atol=1e-4)


def test_training_rows_get_position_offsets_and_held_out_rows_do_not(tmp_path):
    (tmp_path / "train.txt").write_text("\n".join(f"line {i} of the training text" for i in range(200)))
    args = DataArguments(train_file=str(tmp_path / "train.txt"), block_size=16, position_offset=500,
                         cache_dir=str(tmp_path / "cache"))
    rows = build_datasets(args, byte_level_tokenizer())
    assert max(row["position_ids"][0] for row in rows["train"]) > 0
    assert all(row["position_ids"][0] == 0 for row in rows["validation"])
    assert max(max(row["position_ids"]) for row in rows["train"]) <= 500 + 15


def test_position_offsets_beyond_the_model_are_refused():
    with pytest.raises(ValueError, match="position_offset -1: must be ≥ 0"):
        check_data_arguments(DataArguments(position_offset=-1))
    with pytest.raises(ValueError, match=r"exceeds the model's max_position_embeddings 2048: lower position_offset "
                                         r"to at most 1536"):
        check_positions(DataArguments(block_size=512, position_offset=1537), 2048)
    check_positions(DataArguments(block_size=512, position_offset=1536), 2048)
    check_positions(DataArguments(block_size=512, position_offset=10**6), None)


def micro_batches(sampler, count):
    """The first `count` index lists a sampler yields."""
    return list(itertools.islice(iter(sampler), count))


def test_each_optimizer_step_takes_the_same_rows_however_the_global_batch_is_split():
    """A global batch of 8 rows over 1, 2 or 4 processes and 1, 2 or 4 micro-batches: each optimizer step's rows
    are the same (a step across an epoch end may hold a row twice), the processes' slices split them, and each
    epoch (its own order, fixed by seed and epoch only) runs on into the next. A later start continues the stream."""
    size, steps = 21, 7  # 7 steps of 8 rows: 56 rows, over 2 epoch ends mid-step
    torch.manual_seed(100)  # the global RNG plays no part
    one = [sorted(batch) for batch in micro_batches(GlobalBatchSampler(size, 3, 8, 1, 1, 0), steps)]
    orders = [GlobalBatchSampler(size, 3, 8, 1, 1, 0).epoch_order(epoch) for epoch in range(3)]
    assert sorted(orders[0]) == list(range(size)) and orders[0] != orders[1]
    stream = [row for order in orders for row in order]
    assert one == [sorted(stream[8 * s: 8 * s + 8]) for s in range(steps)]
    for processes, per_device, accumulation in ((2, 4, 1), (2, 2, 2), (4, 2, 1), (4, 1, 2), (1, 2, 4)):
        ranks = [micro_batches(GlobalBatchSampler(size, 3, per_device, accumulation, processes, rank),
                               steps * accumulation) for rank in range(processes)]
        for step in range(steps):
            rows = [row for batches in ranks for batch in batches[step * accumulation:(step + 1) * accumulation]
                    for row in batch]
            assert all(len(batch) == per_device for batches in ranks for batch in batches)
            assert sorted(rows) == one[step]
        last = processes - 1
        later = micro_batches(GlobalBatchSampler(size, 3, per_device, accumulation, processes, last, start_step=3),
                              accumulation)
        assert later == ranks[last][3 * accumulation:4 * accumulation]


def test_text_files_chat_templates_and_the_tokenisation_cache(tmp_path, dataset_cache):
    tokenizer = byte_level_tokenizer()
    text = tmp_path / "book.txt"
    text.write_text("\n\n".join(f"Paragraph {i}: " + "linear state " * 20 for i in range(40)))
    args = DataArguments(train_file=str(text), block_size=32, cache_dir=str(dataset_cache))
    first = build_datasets(args, tokenizer)
    second = build_datasets(args, tokenizer)
    assert first["train"]._fingerprint == second["train"]._fingerprint  # the cached map is reused
    assert first["train"].cache_files == second["train"].cache_files
    starts = sum(row.count(0) for row in first["train"]["position_ids"])
    assert starts > len(first["train"])  # paragraphs are documents: more restarts than rows

    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                      {"role": "assistant", "content": f"answer {i}"}]}) + "\n"
                             for i in range(60)))
    args = DataArguments(train_file=str(chats), text_column="messages", chat_template=True, block_size=32,
                         cache_dir=str(dataset_cache))
    rows = build_datasets(args, tokenizer)
    decoded = tokenizer.decode(rows["train"][0]["input_ids"])
    assert "<|im_start|>user\nquestion" in decoded or "<|im_start|>assistant\nanswer" in decoded


# Training, evaluation, saving -------------------------------------------------------------------------


def test_trains_evaluates_and_saves_an_ordinary_checkpoint(trained, dataset_cache):
    output, result = trained
    log = read_log(output)
    losses = [r["loss"] for r in log if "loss" in r]
    assert len(losses) == 12 and losses[-1] < losses[0] - 0.5
    assert result.tokens_seen == 12 * 4 * 64 and log[-2]["tokens_seen"] == result.tokens_seen
    assert result.eval_metrics["perplexity"] == pytest.approx(torch.tensor(result.eval_metrics["eval_loss"]).exp())
    assert any(path.name.startswith("events.out.tfevents") for path in (output / "runs").rglob("*"))

    # The final folder is an ordinary checkpoint: model (with code), tokenizer, card and run summary.
    model = AutoModelForCausalLM.from_pretrained(output).eval()
    assert type(model) is LinearAttentionForCausalLM
    tokenizer = AutoTokenizer.from_pretrained(output)
    assert tokenizer.decode(tokenizer("Jargon")["input_ids"]) == "Jargon"
    assert (output / "modeling_linear_attention.py").exists() and (output / "README.md").exists()
    summary = json.loads((output / "training_summary.json").read_text())
    assert summary["steps"] == 12 and summary["recipe"]["max_steps"] == 12

    # The reported eval loss is the exact token mean over the held-out rows, each document alone.
    model_args, data_args, train_args, _ = finetune.parse_args(tiny_args(output, dataset_cache))
    rows = build_datasets(data_args, tokenizer)["validation"]
    total, count = piece_losses(model, rows)
    assert result.eval_metrics["eval_loss"] == pytest.approx(total / count, rel=1e-5)


def test_resume_after_sigkill_reproduces_the_loss_curve(tmp_path, dataset_cache):
    """A run killed with SIGKILL and resumed from `latest` logs exactly the losses of an uninterrupted
    run, step by step, across epoch ends (same data order, optimizer, scheduler and RNG state)."""
    docs = write_documents(tmp_path / "docs.jsonl")
    common = ["--train_file", str(docs), "--max_steps", "24", "--gradient_accumulation_steps", "2",
              "--save_steps", "3", "--save_total_limit", "2", "--eval_steps", "8"]
    killed = tmp_path / "killed"
    process = subprocess.Popen([sys.executable, "training/finetune.py", *tiny_args(killed, dataset_cache, *common)],
                               cwd=ROOT, env=script_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (killed / "log.jsonl").exists() or len(read_log(killed)) < 10:
        assert process.poll() is None, "the run ended before it could be killed"
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.02)
    os.kill(process.pid, signal.SIGKILL)
    assert process.wait() == -signal.SIGKILL
    interrupted_at = max(r["step"] for r in read_log(killed))
    resume_from = checkpoints.complete_checkpoints(killed)[-1]
    assert 0 < checkpoints.read_trainer_state(resume_from)["global_step"] <= interrupted_at < 24
    assert not list(resume_from.glob("random_states_*")) and (resume_from / "rng_state_0.json").is_file()

    resumed = run(*tiny_args(killed, dataset_cache, *common, "--resume_from_checkpoint", "latest"))
    uninterrupted = run(*tiny_args(tmp_path / "uninterrupted", dataset_cache, *common))
    assert resumed.global_step == uninterrupted.global_step == 24
    assert read_log(killed) == read_log(tmp_path / "uninterrupted")
    assert resumed.tokens_seen == uninterrupted.tokens_seen
    for name, tensor in weights(tmp_path / "uninterrupted").items():
        assert torch.equal(weights(killed)[name], tensor), name


def test_checkpoints_are_atomic_and_only_the_last_k_are_kept(tmp_path, dataset_cache, monkeypatch):
    out = tmp_path / "out"
    run(*tiny_args(out, dataset_cache, "--max_steps", "6", "--save_steps", "2", "--save_total_limit", "2"))
    assert [p.name for p in checkpoints.complete_checkpoints(out)] == ["checkpoint-4", "checkpoint-6"]
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint-4", "checkpoint-6"]

    # A save that dies after writing its files but before the commit (rename) leaves no checkpoint-8.
    def crash(path):
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(checkpoints, "_fsync_tree", crash)
    with pytest.raises(KeyboardInterrupt):
        run(*tiny_args(out, dataset_cache, "--max_steps", "8", "--save_steps", "2", "--save_total_limit", "2",
                       "--resume_from_checkpoint", "latest"))
    monkeypatch.undo()
    assert (out / ".tmp-checkpoint-8" / "model.safetensors").exists() and not (out / "checkpoint-8").exists()
    # Folders that look like checkpoints but were not committed: no trainer state, or a torn one.
    (out / "checkpoint-10").mkdir()
    (out / "checkpoint-10" / "model.safetensors").write_bytes(b"torn")
    (out / "checkpoint-12").mkdir()
    (out / "checkpoint-12" / checkpoints.STATE_FILE).write_text('{"global_step": 1')
    assert checkpoints.resolve_resume_checkpoint(out, "latest").name == "checkpoint-6"

    result = run(*tiny_args(out, dataset_cache, "--max_steps", "8", "--save_steps", "2", "--save_total_limit", "2",
                            "--resume_from_checkpoint", "latest"))
    assert result.global_step == 8
    assert [p.name for p in checkpoints.complete_checkpoints(out)] == ["checkpoint-6", "checkpoint-8"]
    assert not (out / ".tmp-checkpoint-8").exists()  # leftovers of the interrupted save are cleaned up


def test_gradient_checkpointing_accumulation_and_mixed_precision(tmp_path, dataset_cache):
    common = ["--max_steps", "3", "--gradient_accumulation_steps", "2"]
    plain = run(*tiny_args(tmp_path / "plain", dataset_cache, *common))
    checkpointed = run(*tiny_args(tmp_path / "ckpt", dataset_cache, *common, "--gradient_checkpointing"))
    bf16 = run(*tiny_args(tmp_path / "bf16", dataset_cache, *common, "--mixed_precision", "bf16"))
    losses = [[r["loss"] for r in result.log_history if "loss" in r] for result in (plain, checkpointed, bf16)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-6)  # recomputation changes nothing
    assert losses[2] == pytest.approx(losses[0], abs=0.05)  # bf16 autocast: close, not equal
    assert plain.tokens_seen == 3 * 2 * 4 * 64


# What trains --------------------------------------------------------------------------------------------


def test_lora_trains_only_adapters_and_merges_into_the_weights(trained, tmp_path, dataset_cache):
    base, _ = trained
    args = ["--config_name", "", "--model_name_or_path", str(base), "--max_steps", "3", "--learning_rate", "0.01",
            "--use_lora", "--lora_target_modules", "q_proj", "v_proj"]
    run(*tiny_args(tmp_path / "merged", dataset_cache, *args, "--trainable_parameters", "window_gate"))
    before, after = weights(base), weights(tmp_path / "merged")
    assert set(before) == set(after)  # merged: a plain checkpoint, no LoRA tensors
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    expected = {n for n in before if n.endswith(("q_proj.weight", "v_proj.weight", "window_gate"))}
    assert changed == expected
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "merged")) is LinearAttentionForCausalLM

    # A bf16 frozen base with float32 adapters, saved as a PEFT adapter.
    run(*tiny_args(tmp_path / "adapter", dataset_cache, *args, "--merge_lora", "false", "--dtype", "bfloat16"))
    from peft import PeftModel

    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), tmp_path / "adapter")
    assert any("lora_B" in name and param.abs().sum() > 0 for name, param in adapted.named_parameters())
    assert not (tmp_path / "adapter" / "model.safetensors").exists()


def test_set_window_weight_sets_gamma_before_a_lora_run_that_keeps_it(trained, tmp_path, dataset_cache):
    base, _ = trained
    run(*tiny_args(tmp_path / "out", dataset_cache, "--config_name", "", "--model_name_or_path", str(base),
                   "--max_steps", "1", "--use_lora", "--set_window_weight", "0.9"))
    gates = {name: value for name, value in weights(tmp_path / "out").items() if name.endswith("window_gate")}
    assert gates and all(torch.allclose(torch.sigmoid(gate), torch.full_like(gate, 0.9)) for gate in gates.values())
    assert not any(torch.allclose(torch.sigmoid(weights(base)[name]), torch.full_like(gate, 0.9))
                   for name, gate in gates.items())  # it was elsewhere before
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "out").config.window_weight == 0.9


def test_saved_rope_position_cap_is_written_into_the_saved_model_and_leaves_training_as_it_was(trained, tmp_path,
                                                                                               dataset_cache):
    base, _ = trained
    args = ("--config_name", "", "--model_name_or_path", str(base), "--max_steps", "2", "--use_lora")
    run(*tiny_args(tmp_path / "plain", dataset_cache, *args))
    run(*tiny_args(tmp_path / "capped", dataset_cache, *args, "--saved_rope_position_cap", "24"))
    assert AutoConfig.from_pretrained(base).rope_position_cap != 24
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "capped").config.rope_position_cap == 24
    plain, capped = weights(tmp_path / "plain"), weights(tmp_path / "capped")
    assert plain.keys() == capped.keys() and all(torch.equal(plain[name], capped[name]) for name in plain)
    ids = torch.randint(3, 259, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # positions past 24 now read with the slow rotations held: another output there only
        a, b = (AutoModelForCausalLM.from_pretrained(tmp_path / name)(ids).logits for name in ("plain", "capped"))
    torch.testing.assert_close(a[:, :24], b[:, :24])
    assert not torch.allclose(a[:, 24:], b[:, 24:])


# Logit distillation (stage 2's optional KL to the teacher) -------------------------------------------------


def tiny_teacher(vocab_size: int = 259) -> LlamaForCausalLM:
    torch.manual_seed(7)
    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab_size)).eval()


def test_logit_distillation_loss_is_cross_entropy_plus_kl_per_document():
    """Against a direct computation on each document alone: packing must keep documents apart for the
    teacher too, and the loss must be (1 − w)·CE + w·T²·KL(teacher ‖ model) per predicted token."""
    student, teacher = tiny_model(vocab_size=259).eval(), tiny_teacher()
    docs = [torch.randint(3, 259, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (9, 30, 17, 40)]
    batch = collate_rows(list(Dataset.from_dict(pack_documents(docs, block_size=32))))
    weight, temperature = 0.3, 2.0
    with torch.no_grad():
        loss_sum, tokens = logit_distillation_loss(teacher, weight, temperature)(student, batch)
        expected, expected_tokens = 0.0, 0
        for piece in document_pieces(batch):
            logits, target = student(piece).logits[0, :-1], teacher(piece).logits[0, :-1]
            ce = F.cross_entropy(logits, piece[0, 1:], reduction="sum")
            kl = F.kl_div(F.log_softmax(logits / temperature, -1), F.log_softmax(target / temperature, -1),
                          log_target=True, reduction="sum")
            expected += ((1 - weight) * ce + weight * temperature**2 * kl).item()
            expected_tokens += piece.shape[1] - 1
        assert tokens.sum().item() == expected_tokens
        assert loss_sum.sum().item() == pytest.approx(expected, rel=1e-5)
        plain_sum, _ = causal_lm_loss(student, batch)
        only_ce, _ = logit_distillation_loss(teacher, 0.0, temperature)(student, batch)
    torch.testing.assert_close(only_ce, plain_sum)


def test_the_teacher_runs_in_the_precision_it_is_given():
    """Stage 2 passes `accelerator.autocast`: under bf16 the teacher's logits are those of its bf16-autocast
    forward, not of an fp32 one (which would cost the bf16 speed-up on the teacher's half of the work)."""
    student, teacher = tiny_model(vocab_size=259).eval(), tiny_teacher()
    batch = collate_rows(list(Dataset.from_dict(pack_documents([list(range(3, 35))], block_size=32))))
    bf16 = partial(torch.autocast, "cpu", dtype=torch.bfloat16)
    with torch.no_grad():
        plain, _ = logit_distillation_loss(teacher, 1.0, 1.0)(student, batch)
        autocast, _ = logit_distillation_loss(teacher, 1.0, 1.0, teacher_precision=bf16)(student, batch)
        logits = student(batch["input_ids"]).logits[0, :-1]
        with bf16():
            target = teacher(batch["input_ids"]).logits[0, :-1].float()
        expected = F.kl_div(F.log_softmax(logits, -1), F.log_softmax(target, -1), log_target=True, reduction="sum")
    assert autocast.sum().item() == pytest.approx(expected.item(), rel=1e-5)
    assert autocast.sum().item() != pytest.approx(plain.sum().item(), rel=1e-5)


@pytest.mark.parametrize("native", [True, False])
def test_auto_mixed_precision_is_bf16_where_the_device_has_it(native, tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "native_bf16", lambda: native)
    args = loop.TrainArguments(output_dir=str(tmp_path / "out"), max_steps=1, mixed_precision="auto")
    loop.check_train_arguments(args)
    assert args.mixed_precision == ("bf16" if native else "no")
    with pytest.raises(ValueError, match="use no, fp16, bf16 or auto"):
        loop.check_train_arguments(loop.TrainArguments(output_dir=str(tmp_path / "out"), max_steps=1,
                                                       mixed_precision="fp8"))


def test_kl_to_the_teacher_trains_towards_it_and_evaluation_stays_perplexity(trained, tmp_path, dataset_cache):
    base, _ = trained
    teacher_dir = tmp_path / "teacher"
    tiny_teacher().save_pretrained(teacher_dir)
    out = tmp_path / "distilled"
    args = finetune.parse_args(tiny_args(out, dataset_cache, "--config_name", "", "--model_name_or_path", str(base),
                                         "--teacher_name_or_path", str(teacher_dir), "--kl_weight", "1",
                                         "--max_steps", "8", "--learning_rate", "0.01"))
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = collate_rows(list(build_datasets(args[1], tokenizer)["validation"]))
    kl_only = logit_distillation_loss(tiny_teacher(), 1.0, 1.0)

    def mean_kl(model):
        with torch.no_grad():
            loss_sum, tokens = kl_only(model.eval(), rows)
        return loss_sum.sum().item() / tokens.sum().item()

    result = stages.finetune(args)
    before, after = AutoModelForCausalLM.from_pretrained(base), AutoModelForCausalLM.from_pretrained(out)
    assert mean_kl(after) < 0.9 * mean_kl(before)
    # Held-out metrics are next-token cross-entropy of the trained model, not the KL objective.
    ce_sum, ce_tokens = causal_lm_loss(after.eval(), rows)
    assert result.eval_metrics["eval_loss"] == pytest.approx(ce_sum.sum().item() / ce_tokens.sum().item(), rel=1e-5)
    assert result.eval_metrics["perplexity"] == pytest.approx(math.exp(result.eval_metrics["eval_loss"]))
    recipe = json.loads((out / "training_summary.json").read_text())["recipe"]
    assert recipe["teacher_name_or_path"] == str(teacher_dir) and recipe["kl_weight"] == 1.0


def test_train_api_with_a_custom_loss_and_selected_parameters(tmp_path):
    """What distillation builds on: its own loss, only feature maps and window gates train."""
    model = tiny_model(feature_map="hedgehog", feature_dim=8, window_size=4, num_sink_tokens=1).train()
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    docs = [torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in range(5, 60)]
    rows = Dataset.from_dict(pack_documents(docs, block_size=32))

    def logit_energy(model, batch):  # per row: summed mean squared logit, and the number of tokens
        logits = packed_forward(model, batch).logits
        per_token = logits.reshape(*batch["input_ids"].shape, -1).pow(2).mean(-1)
        return per_token.sum(1), torch.full_like(per_token[:, 0], per_token.shape[1])

    args = TrainArguments(output_dir=str(tmp_path), max_steps=6, learning_rate=0.05, per_device_train_batch_size=4,
                          logging_steps=1, report_to="none", lr_scheduler_type="constant")
    accelerator = make_accelerator(args)
    result = train(model, rows, rows, args, accelerator, loss_fn=logit_energy,
                   trainable=[r"feature_map", r"window_gate"], run_name="distill", perplexity=False)
    accelerator.end_training()
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, initial[name])}
    assert changed and all("feature_map" in name or "window_gate" in name for name in changed)
    assert {name for name in initial if "window_gate" in name} <= changed
    assert set(result.eval_metrics) == {"eval_loss"}
    losses = [r["loss"] for r in result.log_history if "loss" in r]
    assert losses[-1] < losses[0]


# Resuming: exact with dropout, damaged checkpoints named, nothing that runs code ---------------------------------


def _lora_dropout_args(base, *extra):
    return ["--config_name", "", "--model_name_or_path", str(base), "--use_lora", "--lora_dropout", "0.3",
            "--learning_rate", "0.01", "--max_steps", "6", "--save_steps", "2", "--save_total_limit", "3", *extra]


def test_resume_with_dropout_follows_the_uninterrupted_run(trained, tmp_path, dataset_cache):
    """LoRA dropout draws from the RNGs every step: a run resumed from checkpoint-2 (in a process whose RNGs
    have moved on) logs exactly the losses of the uninterrupted run and ends with the same weights."""
    base, _ = trained
    uninterrupted = tmp_path / "uninterrupted"
    run(*tiny_args(uninterrupted, dataset_cache, *_lora_dropout_args(base)))
    resumed = tmp_path / "resumed"
    run(*tiny_args(resumed, dataset_cache, *_lora_dropout_args(base)))
    for step in (4, 6):
        shutil.rmtree(resumed / f"checkpoint-{step}")
    torch.rand(1000)  # the resumed process's generators are elsewhere
    run(*tiny_args(resumed, dataset_cache, *_lora_dropout_args(base, "--resume_from_checkpoint", "latest")))
    assert read_log(resumed) == read_log(uninterrupted)
    for name, tensor in weights(uninterrupted).items():
        assert torch.equal(weights(resumed)[name], tensor), name


@pytest.fixture
def three_checkpoints(tmp_path, dataset_cache):
    """A finished 6-step run with checkpoints at steps 2, 4 and 6, and the flags that resume it."""
    out = tmp_path / "out"
    common = tiny_args(out, dataset_cache, "--max_steps", "6", "--save_steps", "2", "--save_total_limit", "3")
    run(*common)
    return out, common


def test_a_damaged_checkpoint_is_named_and_latest_falls_back(three_checkpoints, caplog):
    out, common = three_checkpoints
    optimizer = out / "checkpoint-6" / "optimizer.bin"
    optimizer.write_bytes(optimizer.read_bytes()[:100])  # truncated, as by a full disk
    with pytest.raises(ValueError, match=r"checkpoint-6 is not a complete checkpoint: optimizer.bin is truncated"):
        run(*common, "--resume_from_checkpoint", str(out / "checkpoint-6"))
    with caplog.at_level("WARNING"):
        result = run(*common, "--resume_from_checkpoint", "latest")
    assert "skipping checkpoint-6: optimizer.bin is truncated" in caplog.text
    assert "resuming from checkpoint-4" in caplog.text
    assert result.global_step == 6 and [r["step"] for r in read_log(out) if "loss" in r] == [1, 2, 3, 4, 5, 6]

    # A truncated RNG state is never skipped silently: named, and `latest` falls back past it.
    rng = out / "checkpoint-4" / "rng_state_0.json"
    rng.write_text(rng.read_text()[:50])
    with pytest.raises(ValueError, match="rng_state_0.json is truncated"):
        run(*common, "--resume_from_checkpoint", str(out / "checkpoint-4"))
    # Damaged but of the listed size: loading it fails, naming the file.
    text = (out / "checkpoint-6" / "rng_state_0.json").read_text()
    (out / "checkpoint-6" / "rng_state_0.json").write_text("{" + " " * (len(text) - 2) + "}")
    with pytest.raises(ValueError, match="rng_state_0.json is missing or damaged"):
        run(*common, "--resume_from_checkpoint", str(out / "checkpoint-6"))


def test_a_resumed_checkpoint_is_verified_once(three_checkpoints, monkeypatch):
    out, common = three_checkpoints
    verified = []
    check = checkpoints.checkpoint_problem
    monkeypatch.setattr(checkpoints, "checkpoint_problem", lambda path: verified.append(path.name) or check(path))
    assert run(*common, "--max_steps", "7", "--resume_from_checkpoint", "latest").global_step == 7
    assert verified == ["checkpoint-6"]


PAYLOAD = textwrap.dedent(
    """
    import os, pickle, sys, torch

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {sys.argv[2]}",))

    torch.save({"state": Payload()}, sys.argv[1])
    """
)


@pytest.mark.parametrize("target", ["custom_checkpoint_0.pkl", "optimizer.bin", "random_states_0.pkl"])
def test_resuming_never_runs_code_from_a_checkpoint(three_checkpoints, tmp_path, target):
    """A crafted pickle in a checkpoint (a scheduler state as accelerate would pickle it, the optimizer state, the
    RNG state), even with the file list updated to match, is refused with a clear error; its code never runs."""
    out, common = three_checkpoints
    checkpoint, marker = out / "checkpoint-6", tmp_path / "code-ran"
    subprocess.run([sys.executable, "-c", PAYLOAD, str(checkpoint / target), str(marker)], check=True)
    state = checkpoints.read_trainer_state(checkpoint)
    state["files"][target] = (checkpoint / target).stat().st_size
    (checkpoint / checkpoints.STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(ValueError, match=rf"{target} is not a plain-data pickle .*posix.system.*could run code"):
        run(*common, "--max_steps", "8", "--resume_from_checkpoint", str(checkpoint))
    assert not marker.exists()
    # The checkpoint as an older version wrote it (no file list, the scheduler pickled): refused, not loaded.
    del state["files"]
    (checkpoint / checkpoints.STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(ValueError, match="could run code"):
        run(*common, "--max_steps", "8", "--resume_from_checkpoint", str(checkpoint))
    assert not marker.exists()


# The output folder: an earlier run is never lost by accident ----------------------------------------------------


def test_an_earlier_run_is_refused_kept_on_bad_input_and_replaced_only_once_the_new_run_has_a_checkpoint(
        tmp_path, dataset_cache, monkeypatch):
    out = tmp_path / "out"
    first = tiny_args(out, dataset_cache, "--max_steps", "4", "--save_steps", "2", "--save_total_limit", "3")
    run(*first)
    before = {path.name: path.stat().st_mtime_ns for path in out.iterdir()}
    finished = tmp_path / "finished"  # a run without checkpoints: its final model and summary
    run(*tiny_args(finished, dataset_cache, "--max_steps", "1"))
    with pytest.raises(ValueError, match=r"already holds a finished run \(config.json, log.jsonl, training_summary"):
        run(*tiny_args(finished, dataset_cache, "--max_steps", "1"))

    # Bad input found only once the model is loaded: the earlier run is untouched.
    with pytest.raises(ValueError, match="match no module"):
        run(*first, "--overwrite_output_dir", "--use_lora", "--lora_target_modules", "qkv")
    # A new run that fails before its first checkpoint: the earlier run is put back.
    def fails(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(loop, "_optimizer_step", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        run(*first, "--overwrite_output_dir")
    monkeypatch.undo()
    assert {path.name: path.stat().st_mtime_ns for path in out.iterdir()} == before
    assert [p.name for p in checkpoints.complete_checkpoints(out)] == ["checkpoint-2", "checkpoint-4"]

    # Replaced: the new run's checkpoints and log only, nothing set aside left behind.
    run(*tiny_args(out, dataset_cache, "--max_steps", "3", "--save_steps", "3", "--overwrite_output_dir"))
    assert [p.name for p in checkpoints.complete_checkpoints(out)] == ["checkpoint-3"]
    assert [r["step"] for r in read_log(out) if "loss" in r] == [1, 2, 3]
    assert not [p for p in out.iterdir() if p.name.startswith(".")]


def _drop_weight(folder, name: str, extra: bool = False) -> None:
    state = weights(folder)
    if extra:
        state["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(2, 2)
    else:
        del state[name]
    from safetensors.torch import save_file

    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_training_refuses_a_checkpoint_with_missing_or_unexpected_weights(trained, tmp_path, dataset_cache):
    base, _ = trained
    for case, extra in (("missing", False), ("unexpected", True)):
        broken = tmp_path / case
        shutil.copytree(base, broken, ignore=shutil.ignore_patterns("checkpoint-*", "runs"))
        _drop_weight(broken, "model.norm.weight", extra=extra)
        expected = r"is missing weights \['model.norm.weight'\]" if case == "missing" else (
            r"has unexpected weights \['model.layers.0.self_attn.extra_proj.weight'\]")
        with pytest.raises(ValueError, match=expected):
            run(*tiny_args(tmp_path / f"out-{case}", dataset_cache, "--config_name", "", "--model_name_or_path",
                           str(broken), "--max_steps", "1"))
        assert not (tmp_path / f"out-{case}" / "log.jsonl").exists()


# Data sources that are empty, unreadable or too small -----------------------------------------------------------


def test_text_files_are_one_document_per_line_and_bad_sources_are_clear_errors(tmp_path, dataset_cache):
    tokenizer = byte_level_tokenizer()
    lines = tmp_path / "lines.txt"  # no blank line: one document per line, as run_clm reads it
    lines.write_text("".join(f"Line {i}: " + "linear state " * 12 + "\n" for i in range(40)))
    rows = build_datasets(DataArguments(train_file=str(lines), block_size=32, cache_dir=str(dataset_cache)), tokenizer)
    assert len(rows["validation"]) > 0
    assert sum(row.count(0) for row in rows["train"]["position_ids"]) > len(rows["train"])

    def fails(name: str, content: str, **options) -> str:
        path = tmp_path / name
        path.write_text(content)
        with pytest.raises(ValueError) as caught:
            build_datasets(DataArguments(train_file=str(path), block_size=32, cache_dir=str(dataset_cache),
                                         **options), tokenizer)
        return str(caught.value)

    assert "is empty" in fails("empty.txt", "")
    assert "is empty" in fails("empty.jsonl", "")
    assert "holds 1 document(s): a held-out share needs at least 2" in fails("one.txt", "Only one line.\n")
    assert "--sample_by line" in fails("book.txt", "No blank line.\nSo one paragraph.\n", sample_by="paragraph")
    assert "cannot be read as json records" in fails("broken.jsonl", '{"text": "fine"}\n{"text": broken\n')
    assert "holds a int ('7'); expected text" in fails("numbers.jsonl", '{"text": 7}\n{"text": 8}\n')
    # Blank records (null, empty or whitespace text) are skipped; the rest trains.
    blank = tmp_path / "blank.jsonl"
    blank.write_text("".join(json.dumps({"text": text}) + "\n"
                             for text in [None, "", "  ", *("linear state " * 10 for _ in range(30))]))
    rows = build_datasets(DataArguments(train_file=str(blank), block_size=32, cache_dir=str(dataset_cache)), tokenizer)
    assert len(rows["train"]) > 0
