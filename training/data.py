"""Data pipeline: documents from `datasets`, tokenised (cached), packed into fixed-length rows.

Sources, in `DataArguments`: a Hub dataset or local dataset folder (`dataset_name`), local files
(`train_file` / `validation_file`: .txt, .json/.jsonl, .parquet, .csv), or, when neither is given, the
embedded offline corpus `training/corpus/jargon.jsonl` (public domain, see its README). A document is
one record's `text_column`; with `chat_template` that column holds a conversation (a list of
`{"role", "content"}` messages) rendered by the tokenizer's chat template. Without a validation
split, `validation_split_percentage` of the documents are held out (disjoint from training).

Streaming (`stream_documents` = N > 0, with `dataset_name`): the dataset is read as a stream (`datasets`'
`streaming=True`), and only the first N documents of its `train` split are kept, written once into the `datasets`
cache (a `Dataset.from_generator` keyed by the dataset, its configuration, the column and N: a later stage with the
same four reads the cache and streams nothing). A large corpus (a 10B-token sample) is then never downloaded whole
for a run that trains on a few tens of millions of its tokens. The held-out share is drawn from those N documents as
for any source without a validation split, so every stage given the same N holds out the same documents.

Packing. Every document is tokenised and ends with EOS; documents are concatenated and cut into rows
of `block_size` tokens. Each row carries `position_ids` that restart at 0 where a document starts and
at the start of the row (a document cut by a row boundary continues as a fresh piece), and `labels`
equal to the tokens except -100 at every restart, so no token is predicted across a boundary. The
collator stacks rows into `[rows, block_size]` tensors; `training.loop.packed_forward` flattens them
into the one-row layout of `transformers.DataCollatorWithFlattening`, which the model maps to
per-document state resets (no attention or state leaks across documents).

Position offsets (`position_offset` > 0, training rows only). A converted layer's feature maps read q and k after
RoPE, so what they see depends on the absolute position: trained on rows of `block_size` tokens that all start at
position 0, they meet rotations of their low-frequency dimensions beyond `block_size` that they never saw, and the
model degrades there however far its state reaches (the demo's model at 4K–8K, docs/design.md). With an offset,
each document piece of a training row starts at a random position in [0, position_offset] instead (a draw per
row seeded by `validation_split_seed` and the row's index: the same on every run and any number of processes),
at 0 and at position_offset often enough that the first and the last positions are trained on at least as often
as the ones between. Every other part
of the model depends on positions only through their differences (RoPE), so nothing else changes. A document
boundary is then wherever the position does not step by one (as transformers' `find_packed_sequence_indices` reads
it): the offset drawn is never the one that would continue the previous piece. Held-out rows keep positions from 0.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Dataset, DatasetDict, load_dataset
from datasets.exceptions import DatasetGenerationError
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from hf_linear_attn.configuration_linear_attention import InputError, InputNotFoundError

EMBEDDED_CORPUS = Path(__file__).resolve().parent / "corpus" / "jargon.jsonl"
FILE_BUILDERS = {".txt": "text", ".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv"}
TEXT_SAMPLING = ("line", "paragraph", "document")
IGNORE_INDEX = -100
BYTE_SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2 (as the tests' tiny configs expect)
# A ChatML-style template for the embedded byte-level tokenizer (plain-text markers, no special tokens).
BYTE_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass
class DataArguments:
    """Where the documents come from and how they are cut (names follow transformers' run_clm.py)."""

    dataset_name: str | None = field(
        default=None, metadata={"help": "A Hub dataset id or a local dataset folder (load_dataset)."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The dataset's configuration name."})
    stream_documents: int = field(
        default=0,
        metadata={"help": "Read --dataset_name as a stream and keep the first N documents of its train split (cached "
                          "once; the held-out share is drawn from them), so a large corpus is never downloaded whole. "
                          "0: load the dataset whole."},
    )
    train_file: str | None = field(
        default=None, metadata={"help": "Local training documents: .txt, .json/.jsonl, .parquet or .csv."}
    )
    validation_file: str | None = field(
        default=None, metadata={"help": "Local held-out documents (same formats); default: split off train."}
    )
    text_column: str = field(default="text", metadata={"help": "The column holding each document."})
    chat_template: bool = field(
        default=False,
        metadata={"help": "text_column holds conversations (lists of {role, content}); render them with the "
                          "tokenizer's chat template."},
    )
    sample_by: str = field(
        default="line",
        metadata={"help": f"What one document of a .txt file is: one of {TEXT_SAMPLING} (line: run_clm's default; "
                          "paragraph: text between blank lines; document: the whole file)."},
    )
    block_size: int = field(default=512, metadata={"help": "Tokens per packed row."})
    separate_documents: bool = field(
        default=True,
        metadata={"help": "Keep the documents of a row apart (position_ids restart at each document, so attention "
                          "and linear states reset there). False: documents run on within a row (position_ids "
                          "restart only at row starts; EOS separates documents), as in pretraining, so that rows "
                          "longer than the documents still train attention over the whole row."},
    )
    position_offset: int = field(
        default=0,
        metadata={"help": "Training rows only: each document piece starts at a random position in [0, N] instead of "
                          "0, so that feature maps on rotated q/k learn every position up to N + block_size (set N "
                          "to the model's max_position_embeddings - block_size to use them all). 0: off."},
    )
    validation_split_percentage: float = field(
        default=5.0, metadata={"help": "Percent of the documents held out when there is no validation split."}
    )
    validation_split_seed: int = field(
        default=42, metadata={"help": "Seed of that held-out share (and of the position offsets): fixed apart from the "
                                      "training seed, so that every stage and the evaluation hold out the same "
                                      "documents."}
    )
    max_eval_samples: int | None = field(default=None, metadata={"help": "Evaluate on at most this many rows."})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "Processes for tokenisation."})
    cache_dir: str | None = field(
        default=None, metadata={"help": "Where datasets (and their tokenised caches) are stored."}
    )


def check_data_arguments(args: DataArguments) -> None:
    """Raise a clear error for inconsistent or missing data sources, before anything is loaded."""
    if args.dataset_name and (args.train_file or args.validation_file):
        raise InputError("Give either --dataset_name or --train_file/--validation_file, not both.")
    if args.validation_file and not args.train_file:
        raise InputError("--validation_file needs --train_file.")
    if args.stream_documents < 0 or (args.stream_documents > 0 and not args.dataset_name):
        raise InputError(f"--stream_documents {args.stream_documents}: streams --dataset_name (a Hub dataset or a "
                         "local dataset folder); give N ≥ 1 documents with --dataset_name, or 0 to load the source "
                         "whole.")
    for name in ("train_file", "validation_file"):
        path = getattr(args, name)
        if path is None:
            continue
        if not Path(path).is_file():
            raise InputNotFoundError(f"--{name} {path}: no such file.")
        if Path(path).suffix not in FILE_BUILDERS:
            raise InputError(f"--{name} {path}: unsupported file type; use one of {sorted(FILE_BUILDERS)}.")
    if args.train_file and args.validation_file and Path(args.train_file).suffix != Path(args.validation_file).suffix:
        raise InputError("--train_file and --validation_file must have the same file type.")
    if args.sample_by not in TEXT_SAMPLING:
        raise InputError(f"--sample_by {args.sample_by!r}: use one of {TEXT_SAMPLING}.")
    if args.block_size < 2:
        raise InputError(f"--block_size {args.block_size}: a row needs at least 2 tokens.")
    if args.position_offset < 0:
        raise InputError(f"--position_offset {args.position_offset}: must be ≥ 0 (0 switches the offsets off).")
    if not 0 < args.validation_split_percentage < 100:
        raise InputError(f"--validation_split_percentage {args.validation_split_percentage}: must lie in (0, 100).")


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer that needs no download or training: one token per UTF-8 byte (256) after
    `<pad>`, `<s>`, `</s>` (ids 0, 1, 2), with a ChatML-style chat template. Used when a model is
    trained from a config and no `tokenizer_name` is given; `save_pretrained` stores it with the model."""
    vocab = {token: i for i, token in enumerate([*BYTE_SPECIAL_TOKENS, *sorted(pre_tokenizers.ByteLevel.alphabet())])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    pad, bos, eos = BYTE_SPECIAL_TOKENS
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, bos_token=bos, eos_token=eos)
    tokenizer.chat_template = BYTE_CHAT_TEMPLATE
    return tokenizer


def _describe_source(args: DataArguments) -> str:
    if args.dataset_name:
        return f"dataset {args.dataset_name!r}"
    if args.train_file:
        return f"file {args.train_file}"
    return f"the embedded corpus {EMBEDDED_CORPUS.name}"


def dataset_names(args: DataArguments) -> list[str]:
    """What the model was trained on, for the model card (a Hub id, file names, or the embedded corpus)."""
    if args.dataset_name:
        return [args.dataset_name]
    if args.train_file:
        return [Path(args.train_file).name]
    return [f"embedded: {EMBEDDED_CORPUS.name} (The Jargon File 4.4.7, public domain)"]


def _streamed_records(dataset_name: str, config_name: str | None, text_column: str, count: int):
    """The first `count` records of the dataset's train split, read as a stream, with only `text_column` kept."""
    for record in load_dataset(dataset_name, config_name, split="train", streaming=True).take(count):
        if text_column not in record:
            raise InputError(f"--text_column {text_column!r} is not a column of dataset {dataset_name!r}; its columns "
                             f"are {sorted(record)}.")
        yield {text_column: record[text_column]}


def streamed_documents(args: DataArguments) -> Dataset:
    """The first `args.stream_documents` documents of `args.dataset_name`'s train split, streamed once into the
    `datasets` cache (see the module docstring)."""
    try:
        return Dataset.from_generator(_streamed_records, cache_dir=args.cache_dir, gen_kwargs={
            "dataset_name": args.dataset_name, "config_name": args.dataset_config_name,
            "text_column": args.text_column, "count": args.stream_documents})
    except DatasetGenerationError as error:  # datasets wraps what the stream raised
        raise (error.__cause__ or error) from None


def load_documents(args: DataArguments) -> DatasetDict:
    """The raw documents as a DatasetDict with `train` and `validation` splits.

    The validation split is the source's own (`validation`, or `--validation_file`) or, when there is
    none, a `validation_split_percentage` share (drawn with `validation_split_seed`) of the training documents.
    """
    if args.stream_documents:
        raw = DatasetDict(train=streamed_documents(args))
    elif args.dataset_name:
        raw = load_dataset(args.dataset_name, args.dataset_config_name, cache_dir=args.cache_dir)
    else:
        files = {"train": args.train_file or str(EMBEDDED_CORPUS)}
        if args.validation_file:
            files["validation"] = args.validation_file
        for split, path in files.items():
            if Path(path).stat().st_size == 0:
                raise InputError(f"--{split}_file {path} is empty.")
        builder = FILE_BUILDERS[Path(files["train"]).suffix]
        options = {"sample_by": args.sample_by} if builder == "text" else {}
        try:
            raw = load_dataset(builder, data_files=files, cache_dir=args.cache_dir, **options)
        except Exception as error:  # datasets wraps the parser's error (malformed JSON, CSV, ...)
            cause = error.__cause__ or error
            raise InputError(f"{_describe_source(args)} cannot be read as {builder} records: "
                             f"{type(cause).__name__}: {cause}") from None
    if "train" not in raw:
        raise InputError(f"{_describe_source(args)} has no 'train' split (splits: {list(raw)}).")
    columns = raw["train"].column_names
    if args.text_column not in columns:
        raise InputError(
            f"--text_column {args.text_column!r} is not a column of {_describe_source(args)}; its columns are "
            f"{columns}."
        )
    if "validation" not in raw:
        documents = raw["train"].num_rows
        if documents < 2:
            raise InputError(
                f"{_describe_source(args)} holds {documents} document(s): a held-out share needs at least "
                "2; give --validation_file, more documents"
                + (", or --sample_by line (one document per line)" if args.sample_by != "line" else "") + "."
            )
        split = raw["train"].train_test_split(test_size=args.validation_split_percentage / 100,
                                              seed=args.validation_split_seed)
        raw = DatasetDict(train=split["train"], validation=split["test"])
    return DatasetDict(train=raw["train"], validation=raw["validation"])


def _document_texts(batch: dict[str, list], args: DataArguments, tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The documents of a batch of records; empty ones (null, blank text, no messages) are skipped."""
    column = batch[args.text_column]
    for value in column:
        if value and not isinstance(value, list if args.chat_template else str):
            raise InputError(f"--text_column {args.text_column!r} holds a {type(value).__name__} ({str(value)[:60]!r})"
                             f"; expected {'a list of messages' if args.chat_template else 'text'}.")
    if not args.chat_template:
        return [text for text in column if text and text.strip()]
    return [tokenizer.apply_chat_template(messages, tokenize=False) for messages in column if messages]


def _tokenize(batch: dict[str, list], args: DataArguments, tokenizer: PreTrainedTokenizerBase) -> dict[str, list]:
    """Token ids per non-empty document, each ending with EOS."""
    texts = _document_texts(batch, args, tokenizer)
    # A rendered chat already holds the template's special tokens.
    ids = tokenizer(texts, add_special_tokens=not args.chat_template)["input_ids"]
    eos = tokenizer.eos_token_id
    return {"input_ids": [doc if eos is None or (doc and doc[-1] == eos) else [*doc, eos] for doc in ids]}


def pack_documents(
    documents: list[list[int]], block_size: int, separate_documents: bool = True
) -> dict[str, list[list[int]]]:
    """Cut the concatenated documents into rows of `block_size` tokens (the tail that does not fill a
    row is dropped). `position_ids` restart at 0 at each row start and, with `separate_documents`, at each
    document start; `labels` are the tokens with -100 at those restarts."""
    lengths = [len(doc) for doc in documents if doc]
    if not lengths:
        return {"input_ids": [], "labels": [], "position_ids": []}
    tokens = np.fromiter((t for doc in documents for t in doc), dtype=np.int64, count=sum(lengths))
    starts = np.zeros(len(tokens), dtype=bool)
    if separate_documents:
        starts[np.cumsum([0, *lengths[:-1]])] = True
    rows = len(tokens) // block_size
    tokens = tokens[: rows * block_size].reshape(rows, block_size)
    starts = starts[: rows * block_size].reshape(rows, block_size)
    starts[:, 0] = True
    index = np.arange(block_size)
    positions = index - np.maximum.accumulate(np.where(starts, index, 0), axis=1)
    labels = np.where(starts, IGNORE_INDEX, tokens)
    return {"input_ids": tokens.tolist(), "labels": labels.tolist(), "position_ids": positions.tolist()}


def _pack(batch: dict[str, list], block_size: int, separate_documents: bool) -> dict[str, list[list[int]]]:
    return pack_documents(batch["input_ids"], block_size, separate_documents)


def offset_positions(position_ids: list[list[int]], row_indices: list[int], max_offset: int,
                     seed: int) -> list[list[int]]:
    """Packed rows' position_ids (restarting at 0 where a document piece starts) with each piece of ℓ tokens moved
    to start at min(max(0, u), N), u drawn uniformly from [−(ℓ − 1), N + ℓ − 1] (N = max_offset; numpy's generator
    seeded by (seed, row index)). A position p in [ℓ − 1, N] then lies in a piece with probability
    ℓ / (N + 2ℓ − 1), and the first ℓ positions (which every input uses) and the last ℓ (up to N + ℓ − 1) in at
    least as many: a start drawn from [0, N] alone would put position p < ℓ in only (p + 1) / (N + 1) of the
    pieces and the last positions in as few, and both ends would be the least trained. An offset that would make
    a piece continue the previous one's positions is moved on by one, so the boundary stays visible as a step
    other than +1."""
    shifted = []
    for positions, row in zip(position_ids, row_indices, strict=True):
        positions = np.asarray(positions)
        piece = np.cumsum(positions == 0) - 1  # which piece each token belongs to, [L]
        lengths = np.bincount(piece)  # ℓ of each piece
        draws = np.random.default_rng([seed, row]).integers(1 - lengths, max_offset + lengths)
        offsets = np.clip(draws, 0, max_offset)
        ends = np.flatnonzero(np.diff(piece))  # the last token of each piece but the row's last
        for k, end in enumerate(ends, start=1):
            if offsets[k] == offsets[k - 1] + positions[end] + 1:
                offsets[k] = (offsets[k] + 1) % (max_offset + 1)
        shifted.append((positions + offsets[piece]).tolist())
    return shifted


def _offset(batch: dict[str, list], indices: list[int], max_offset: int, seed: int) -> dict[str, list[list[int]]]:
    return {"position_ids": offset_positions(batch["position_ids"], indices, max_offset, seed)}


def check_positions(args: DataArguments, max_position_embeddings: int | None) -> None:
    """Refuse training positions beyond what the model's RoPE was built for (the offsets plus a row); None: the
    config states no limit."""
    if max_position_embeddings is not None and args.position_offset + args.block_size > max_position_embeddings:
        raise InputError(f"--position_offset {args.position_offset} + --block_size {args.block_size} exceeds the "
                         f"model's max_position_embeddings {max_position_embeddings}: lower position_offset to at "
                         f"most {max(0, max_position_embeddings - args.block_size)}.")


def build_datasets(
    args: DataArguments,
    tokenizer: PreTrainedTokenizerBase,
    main_process_first: contextlib.AbstractContextManager | None = None,
) -> DatasetDict:
    """Packed `train` / `validation` rows (`input_ids`, `labels`, `position_ids`, each `block_size` long).

    Tokenisation and packing are `Dataset.map` calls, cached by `datasets` (a second run with the same
    data, tokenizer and block size reads the cache). Pass `accelerator.main_process_first()` as
    `main_process_first` so that one process fills the cache and the others read it.
    """
    if args.chat_template and not tokenizer.chat_template:
        raise InputError("--chat_template was given but the tokenizer has no chat template.")
    with main_process_first or contextlib.nullcontext():
        raw = load_documents(args)
        tokenized = raw.map(
            _tokenize, batched=True, remove_columns=raw["train"].column_names,
            fn_kwargs={"args": args, "tokenizer": tokenizer},
            num_proc=args.preprocessing_num_workers, desc="Tokenising",
        )
        packed = tokenized.map(
            _pack, batched=True, remove_columns=["input_ids"],
            fn_kwargs={"block_size": args.block_size, "separate_documents": args.separate_documents},
            num_proc=args.preprocessing_num_workers,
            desc=f"Packing into rows of {args.block_size}",
        )
        if args.position_offset > 0:
            packed["train"] = packed["train"].map(
                _offset, batched=True, with_indices=True,
                fn_kwargs={"max_offset": args.position_offset, "seed": args.validation_split_seed},
                desc=f"Offsetting training positions by up to {args.position_offset}",
            )
    for split, rows in packed.items():
        if len(rows) == 0:
            raise InputError(
                f"The {split} split of {_describe_source(args)} holds fewer than block_size={args.block_size} "
                "tokens: lower --block_size or add text."
            )
    if args.max_eval_samples is not None:
        packed["validation"] = packed["validation"].select(range(min(args.max_eval_samples, len(packed["validation"]))))
    return packed


def collate_rows(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Stack packed rows into `input_ids`, `labels`, `position_ids` tensors of shape [rows, block_size]."""
    return {key: torch.tensor([row[key] for row in rows], dtype=torch.long) for key in rows[0]}

