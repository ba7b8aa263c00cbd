"""Long-context measurements of causal LMs: the held-out long texts, perplexity against context length, passkey
retrieval, and cache bytes at each length. `training.evaluation` (`training/evaluate.py`) runs them on the
teacher, its sliding-window baseline and each model; this module's own command line prepares the texts, and
writes the passkey prompts as the data of the lm-eval needle tasks (configs/lm_eval/needles):

    python -m training.long_context prepare [--data_dir outputs/long_context_data]     # once; `make long-context-data`
    python -m training.long_context needles --tokenizer_name MODEL [--output_dir outputs/lm_eval_needles]

Held-out text: two long public-domain texts that no training stage of the project reads, from Debian
packages (`prepare` fetches them with `apt-get download` + `dpkg-deb -x`, no root needed, into `data_dir`):
- `kjv`: the King James Bible (`bible-kjv-text` data, printed by the `bible` program of `bible-kjv`), one
  record per book;
- `austen`: Jane Austen's six novels (`r-cran-janeaustenr`, an R data file read by `read_r_strings`), one
  record per novel.
Evaluation never touches the network: without the data it stops with an error naming the prepare command.

Each source becomes one token stream (books in order, separated by blank lines), cut into documents of
`document_tokens` tokens; `documents_per_source` of them, evenly spaced over the stream, are kept (so the
KJV's are not all Genesis). Everything is deterministic: no sampling anywhere but the passkey keys, which come
from `seed`.

Perplexity at context L: rows of L consecutive document tokens (row r is window r // D, not overlapping, of
document r % D of the D documents), added until `scored_tokens` tokens are scored. Each row scores its second
half, positions L // 2 .. L - 1, every token predicted from all tokens before it in the row: each scored token
has at least L / 2 tokens of context, so a model that uses context can only gain from a longer L. The rows are
the same for every model at a given L (they are different windows at different L: compare models at one L, and
each model's trend over L).

Passkey retrieval at length L: prompts of exactly L tokens (preamble, haystack with the needle(s) inserted at
token level, question), the asked-for needle at depth (i + 0.5) / trials in trial i; greedy decoding; a trial
counts when the first run of digits of the continuation is exactly the key.

Every model is a `PreTrainedModel` (the teacher, a converted linear-attention checkpoint, ...) or a
`WindowBaseline`: a softmax model restricted by an attention mask to a sliding window plus sink tokens (the
training-free baseline). Each is run on one row at a time, without padding, so linear models take their
chunked path.
"""

from __future__ import annotations

import inspect
import json
import math
import random
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoTokenizer, DynamicCache, HfArgumentParser, PreTrainedModel

from training.measure import cache_bytes_by_context

DEFAULT_DATA_DIR = "outputs/long_context_data"
PREPARE_COMMAND = "python -m training.long_context prepare"
SOURCES = ("kjv", "austen")


# --------------------------------------------------------------------------------------------- held-out texts

def read_r_strings(data: bytes) -> list[str | None]:
    """The character vector held by one R serialization (format 2 or 3, XDR), as R's lazy-load databases
    store each object: "X\\n", the version header, then a STRSXP of CHARSXPs (None for NA)."""
    if data[:2] != b"X\n":
        raise ValueError("not an XDR R serialization (expected it to start with 'X\\n')")
    offset = 2
    version = struct.unpack_from(">i", data, offset)[0]
    offset += 12
    if version == 3:  # a native-encoding name follows the header
        offset += 4 + struct.unpack_from(">i", data, offset)[0]
    flags, count = struct.unpack_from(">ii", data, offset)
    offset += 8
    if flags & 0xFF != 16:
        raise ValueError(f"expected a character vector (STRSXP, type 16), got type {flags & 0xFF}")
    strings: list[str | None] = []
    for _ in range(count):
        flags, size = struct.unpack_from(">ii", data, offset)
        offset += 8
        if flags & 0xFF != 9:
            raise ValueError(f"expected a string (CHARSXP, type 9), got type {flags & 0xFF}")
        if size < 0:
            strings.append(None)
            continue
        strings.append(data[offset:offset + size].decode("utf-8" if flags & (1 << 15) else "latin-1"))
        offset += size
    return strings


def _austen_novels(root: Path) -> list[dict]:
    """The novels of the janeaustenr package: its data/Rdata.rdb is a run of zlib blocks (a 4-byte length, then
    the compressed serialization of one novel's lines). Paragraphs are re-joined into single lines."""
    blob = (root / "usr/lib/R/site-library/janeaustenr/data/Rdata.rdb").read_bytes()
    novels, offset = [], 0
    while offset < len(blob):
        decompressor = zlib.decompressobj()
        lines = read_r_strings(decompressor.decompress(blob[offset + 4:]))
        offset = len(blob) - len(decompressor.unused_data)
        paragraphs, current = [], []
        for line in [*(line or "" for line in lines), ""]:
            if line.strip():
                current.append(line.strip())
            elif current:
                paragraphs.append(" ".join(current))
                current = []
        novels.append({"title": paragraphs[0].title(), "text": "\n\n".join(paragraphs)})
    return novels


_VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def _kjv_books(root: Path) -> list[dict]:
    """The KJV as printed by the package's own `bible` program (plain format: "Ge1:1 In the beginning ..."),
    verses of a chapter joined into one paragraph."""
    printed = subprocess.run([str(root / "usr/bin/bible"), "-p", str(root / "usr/lib"), "-f", "Gen1:1-Rev22:21"],
                             capture_output=True, text=True, check=True).stdout
    books: dict[str, dict[str, list[str]]] = {}
    for line in printed.splitlines():
        match = _VERSE.match(line)
        if match:
            book, chapter, _, verse = match.groups()
            books.setdefault(book, {}).setdefault(chapter, []).append(verse.strip())
    if len(books) != 66:
        raise RuntimeError(f"the bible program printed {len(books)} books, expected 66")
    return [{"title": book, "text": "\n\n".join(" ".join(verses) for verses in chapters.values())}
            for book, chapters in books.items()]


_PACKAGES: dict[str, tuple[tuple[str, ...], Callable[[Path], list[dict]]]] = {
    "kjv": (("bible-kjv", "bible-kjv-text"), _kjv_books),
    "austen": (("r-cran-janeaustenr",), _austen_novels),
}


def prepare(data_dir: str | Path = DEFAULT_DATA_DIR) -> list[Path]:
    """Fetch the held-out texts (needs `apt-get`, `dpkg-deb` and the Debian package mirror) and write
    `DATA_DIR/<source>.jsonl`, one {"title", "text"} record per book. Returns the files written."""
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"{tool} not found: preparing the long-context texts needs Debian's package tools")
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for source, (packages, extract) in _PACKAGES.items():
        with tempfile.TemporaryDirectory() as work:
            work = Path(work)
            subprocess.run(["apt-get", "download", *packages], cwd=work, check=True, capture_output=True)
            for deb in sorted(work.glob("*.deb")):
                subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "root")], check=True)
            records = extract(work / "root")
        path = data_dir / f"{source}.jsonl"
        partial = path.with_suffix(".partial")
        partial.write_text("".join(json.dumps(record) + "\n" for record in records))
        partial.replace(path)
        written.append(path)
    return written


def check_texts(data_dir: str | Path = DEFAULT_DATA_DIR) -> None:
    """FileNotFoundError naming the prepare command unless every source is prepared in `data_dir`."""
    data_dir = Path(data_dir)
    missing = [source for source in SOURCES if not (data_dir / f"{source}.jsonl").is_file()]
    if missing:
        raise FileNotFoundError(f"data_dir {str(data_dir)!r} lacks the long-context texts {missing}: run "
                                f"`{PREPARE_COMMAND} --data_dir {data_dir}` once (it fetches Debian packages; "
                                f"`make long-context-data` does it for the default folder)")


def load_texts(data_dir: str | Path = DEFAULT_DATA_DIR) -> dict[str, list[dict]]:
    """{source: [{"title", "text"}, ...]} for every source prepared in `data_dir` (no network)."""
    check_texts(data_dir)
    data_dir = Path(data_dir)
    return {source: [json.loads(line) for line in (data_dir / f"{source}.jsonl").read_text().splitlines()]
            for source in SOURCES}


@dataclass(frozen=True)
class LongDocument:
    source: str
    index: int  # which piece of the source's token stream
    input_ids: torch.Tensor  # [document_tokens]


def long_documents(tokenizer, texts: dict[str, list[dict]], document_tokens: int = 8192,
                   documents_per_source: int = 4) -> list[LongDocument]:
    """Cut each source's token stream (its records in order, joined by blank lines, no special tokens) into
    consecutive pieces of `document_tokens` tokens and keep `documents_per_source` of them, evenly spaced;
    the result alternates sources (source 1's first, source 2's first, source 1's second, ...)."""
    if document_tokens < 1 or documents_per_source < 1:
        raise ValueError(f"document_tokens and documents_per_source must be ≥ 1, got {document_tokens} and "
                         f"{documents_per_source}")
    per_source = []
    for source, records in texts.items():
        ids: list[int] = []
        for i, record in enumerate(records):
            ids += tokenizer(("\n\n" if i else "") + record["text"], add_special_tokens=False).input_ids
        available = len(ids) // document_tokens
        if available < documents_per_source:
            raise ValueError(f"source {source!r} has {len(ids)} tokens: fewer than documents_per_source="
                             f"{documents_per_source} documents of document_tokens={document_tokens}")
        picks = [(2 * i + 1) * available // (2 * documents_per_source) for i in range(documents_per_source)]
        per_source.append([LongDocument(source, k, torch.tensor(ids[k * document_tokens:(k + 1) * document_tokens]))
                           for k in picks])
    return [document for group in zip(*per_source, strict=True) for document in group]


# --------------------------------------------------------------------------------------------- running models

def document_mask(position_ids: torch.Tensor, window: int = 0, sinks: int = 0) -> torch.Tensor:
    """bool [rows, 1, L, L] for packed rows: causal, within each document (position_ids restart at 0), and with
    `window` > 0 only the last `window` positions of the document plus its first `sinks`."""
    length = position_ids.shape[1]
    document = (position_ids == 0).cumsum(-1)  # [rows, L]
    index = torch.arange(length, device=position_ids.device)
    allowed = (index[None, :, None] >= index[None, None, :]) & (document[:, :, None] == document[:, None, :])
    if window > 0:
        distance = position_ids[:, :, None] - position_ids[:, None, :]
        allowed &= (distance < window) | (position_ids[:, None, :] < sinks)
    return allowed[:, None]


@dataclass
class WindowBaseline:
    """The training-free baseline: a softmax `model` whose every position sees only the last `window` positions
    and the first `sinks` of its document (an attention mask, `document_mask`)."""
    model: PreTrainedModel
    window: int = 64
    sinks: int = 4

    def mask(self, positions: torch.Tensor) -> torch.Tensor:
        """bool [rows, 1, L, L] for positions [rows, L] (restarting at 0 where a packed document starts)."""
        return document_mask(positions, self.window, self.sinks)


def model_device(model) -> torch.device:
    """Where the weights of a model (or of a `WindowBaseline`'s model) are; rows are moved there."""
    parameter = next((model.model if isinstance(model, WindowBaseline) else model).parameters(), None)
    return torch.device("cpu") if parameter is None else parameter.device


def next_token_logits(model, input_ids: torch.Tensor, logits_to_keep: int = 0) -> torch.Tensor:
    """Logits [1, T', vocab] of one unpadded row `input_ids` [1, T] (T' = T, or the last `logits_to_keep`)."""
    input_ids = input_ids.to(model_device(model))
    if isinstance(model, WindowBaseline):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return model.model(input_ids=input_ids, attention_mask=model.mask(positions), position_ids=positions,
                           logits_to_keep=logits_to_keep).logits
    return model(input_ids=input_ids, logits_to_keep=logits_to_keep).logits


def greedy_generate(model, input_ids: torch.Tensor, max_new_tokens: int, tokenizer) -> list[int]:
    """Greedy continuation of one row `input_ids` [1, T]: `generate()` for a plain model; for a `WindowBaseline`
    a cached decoding loop whose every step gets its row of the window mask."""
    input_ids = input_ids.to(model_device(model))
    if not isinstance(model, WindowBaseline):
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=tokenizer.eos_token_id)
        return out[0, input_ids.shape[1]:].tolist()
    # transformers renamed `past_key_values` to `cache` in 5.24; older releases would silently ignore `cache`.
    name = "cache" if "cache" in inspect.signature(model.model.forward).parameters else "past_key_values"
    cache = {name: DynamicCache(config=model.model.config)}
    length = input_ids.shape[1]
    positions = torch.arange(length + max_new_tokens, device=input_ids.device)[None]
    mask = model.mask(positions)  # [1, 1, N, N]: row t is what position t sees
    logits = model.model(input_ids=input_ids, attention_mask=mask[:, :, :length, :length],
                         position_ids=positions[:, :length], use_cache=True, logits_to_keep=1, **cache).logits
    generated = []
    for step in range(max_new_tokens):
        token = int(logits[0, -1].argmax())
        generated.append(token)
        if token == tokenizer.eos_token_id or step == max_new_tokens - 1:
            break
        t = length + step
        logits = model.model(input_ids=input_ids.new_tensor([[token]]), attention_mask=mask[:, :, t:t + 1, :t + 1],
                             position_ids=positions[:, t:t + 1], use_cache=True, **cache).logits
    return generated


def cache_bytes_at(model, contexts: list[int]) -> list[int]:
    """Bytes of the decoding cache after each of `contexts` tokens (`training.measure.cache_bytes_by_context`,
    from the layout). For a `WindowBaseline`: the KV of at most `window + sinks` tokens, what a ring buffer would
    hold."""
    if isinstance(model, WindowBaseline):
        return cache_bytes_by_context(model.model, [min(n, model.window + model.sinks) for n in contexts])
    return cache_bytes_by_context(model, contexts)


# --------------------------------------------------------------------------------------------- perplexity

def perplexity_windows(documents: list[LongDocument], context: int, scored_tokens: int,
                       max_rows: int | None = None) -> list[torch.Tensor]:
    """The rows [1, context] scored at `context`: enough to score `scored_tokens` tokens (each row scores its last
    `context - context // 2`), at most `max_rows`. Row r is window r // len(documents) (consecutive, not
    overlapping) of document r % len(documents), so the rows spread over every document."""
    if context < 2:
        raise ValueError(f"context must be ≥ 2, got {context}")
    rows = math.ceil(scored_tokens / (context - context // 2))
    if max_rows is not None:
        rows = min(rows, max_rows)
    per_document = min(len(d.input_ids) for d in documents) // context
    if rows > per_document * len(documents):
        raise ValueError(f"context {context} needs {rows} rows; the documents hold {per_document * len(documents)} "
                         f"(use longer or more documents, or fewer scored_tokens)")
    return [documents[r % len(documents)].input_ids[None, (r // len(documents)) * context:
                                                     (r // len(documents) + 1) * context] for r in range(rows)]


@torch.no_grad()
def scored_loss(model, row: torch.Tensor) -> tuple[float, int]:
    """(summed next-token loss, tokens) over the scored tokens of one row [1, L]: positions L // 2 .. L - 1, each
    predicted from every token before it in the row (so from at least L // 2 tokens of context)."""
    length = row.shape[1]
    first = length // 2
    logits = next_token_logits(model, row, logits_to_keep=length - first + 1)[0, :-1].float()
    return F.cross_entropy(logits, row[0, first:].to(logits.device), reduction="sum").item(), length - first


def perplexity_by_context(models: dict[str, object], documents: list[LongDocument], contexts: list[int],
                          scored_tokens: int = 8192, max_rows: int | None = None,
                          log: Callable[[str], None] = print) -> list[dict]:
    """Held-out perplexity of every model at every context: the same rows, and so the same scored token positions,
    for every model at a given context. One row per (model, context)."""
    results = []
    for context in contexts:
        windows = perplexity_windows(documents, context, scored_tokens, max_rows)
        for label, model in models.items():
            total, count = 0.0, 0
            for row in windows:
                loss, tokens = scored_loss(model, row)
                total, count = total + loss, count + tokens
            results.append({"model": label, "context": context, "rows": len(windows), "scored_tokens": count,
                            "perplexity": math.exp(total / count)})
            log(f"  perplexity @{context}: {label} {results[-1]['perplexity']:.2f}")
    return results


# --------------------------------------------------------------------------------------------- passkey retrieval

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PREAMBLE = ("There is important information hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about it.\n\n")
DOORS = ("red", "green", "blue", "amber", "violet", "silver", "black", "white")


@dataclass(frozen=True)
class PasskeyTrial:
    input_ids: torch.Tensor  # [1, length]
    answer: str  # the digits a correct model generates
    needle_start: int  # position of the asked-for needle's first token in input_ids
    depth: float  # the requested depth of that needle in the haystack (0: first, 1: last)


def passkey_prompt(tokenizer, haystack_ids: list[int], length: int, needles: list[tuple[float, str]],
                   question: str) -> tuple[torch.Tensor, list[int]]:
    """Token ids [1, length]: the preamble, the first tokens of `haystack_ids` with each (depth, text) needle
    inserted after round(depth × haystack tokens) of them, then `question`. Also the needles' start positions.
    Pieces are tokenized separately and concatenated, so the needle sits exactly where asked."""
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    needle_ids = [(depth, encode(text)) for depth, text in sorted(needles, key=lambda n: n[0])]
    head, tail = encode(PREAMBLE), encode(question)
    budget = length - len(head) - len(tail) - sum(len(ids) for _, ids in needle_ids)
    if budget < 1 or len(haystack_ids) < budget:
        raise ValueError(f"a passkey prompt of length {length} leaves {budget} haystack tokens "
                         f"(haystack has {len(haystack_ids)}); use a longer length or haystack")
    ids, starts, taken = list(head), [], 0
    for depth, piece in needle_ids:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"needle depth must be in [0, 1], got {depth}")
        cut = round(depth * budget)
        ids += haystack_ids[taken:cut]
        taken = cut
        starts.append(len(ids))
        ids += piece
    ids += haystack_ids[taken:budget] + tail
    order = sorted(range(len(needles)), key=lambda i: needles[i][0])
    return torch.tensor([ids]), [starts[order.index(i)] for i in range(len(needles))]


def passkey_trials(tokenizer, documents: list[LongDocument], length: int, trials: int, haystack: str, variant: str,
                   seed: int = 0, keys: int = 4) -> list[PasskeyTrial]:
    """`trials` prompts of `length` tokens. The asked-for needle of trial i sits at depth (i + 0.5) / trials
    (evenly spread); keys (5 digits) and haystack offsets come from `seed`. `haystack`: "natural" (a window of
    the long documents, document i mod count) or "filler" (a repeated sentence block). `variant`: "single" (one
    pass key) or "multi" (`keys` doors with a key each, the others at random depths; one door is asked for)."""
    if haystack not in ("natural", "filler"):
        raise ValueError(f"haystack must be 'natural' or 'filler', got {haystack!r}")
    if variant not in ("single", "multi"):
        raise ValueError(f"variant must be 'single' or 'multi', got {variant!r}")
    if variant == "multi" and not 2 <= keys <= len(DOORS):
        raise ValueError(f"keys must be in [2, {len(DOORS)}] for the multi-key variant, got {keys}")
    rng = random.Random(f"{seed}/{length}/{haystack}/{variant}")
    filler = tokenizer(FILLER * (length // 8 + 2), add_special_tokens=False).input_ids
    result = []
    for i in range(trials):
        depth = (i + 0.5) / trials
        if haystack == "natural":
            document = documents[i % len(documents)].input_ids.tolist()
            start = rng.randrange(max(len(document) - length, 0) + 1)
            source = document[start:]
        else:
            source = filler
        if variant == "single":
            key = str(rng.randint(10000, 99999))
            needles = [(depth, f" The pass key is {key}. Remember it. {key} is the pass key. ")]
            question = " What is the pass key? The pass key is"
        else:
            doors = rng.sample(DOORS, keys)
            values = [str(rng.randint(10000, 99999)) for _ in doors]
            needles = [(depth if j == 0 else rng.random(), f" The pass key of the {door} door is {value}. ")
                       for j, (door, value) in enumerate(zip(doors, values, strict=True))]
            key = values[0]
            question = f" What is the pass key of the {doors[0]} door? The pass key of the {doors[0]} door is"
        ids, starts = passkey_prompt(tokenizer, source, length, needles, question)
        result.append(PasskeyTrial(ids, key, starts[0], depth))
    return result


def answer_matches(generated: str, answer: str) -> bool:
    """True when the first run of digits in the generated text is exactly the answer."""
    digits = re.search(r"\d+", generated)
    return digits is not None and digits.group() == answer


@torch.no_grad()
def passkey_accuracy(model, tokenizer, trials: list[PasskeyTrial]) -> float:
    """Share of trials whose greedy continuation (answer digits + 3 tokens) starts with the right digits."""
    hits = 0
    for trial in trials:
        new = greedy_generate(model, trial.input_ids, len(trial.answer) + 3, tokenizer)
        hits += answer_matches(tokenizer.decode(new, skip_special_tokens=True), trial.answer)
    return hits / len(trials)


# --------------------------------------------------------------------------------------------- lm-eval needle data

DEFAULT_NEEDLES_DIR = "outputs/lm_eval_needles"
NEEDLE_LENGTHS = (1024, 2048, 4096)


def needle_records(tokenizer, trials: list[PasskeyTrial]) -> list[dict]:
    """The passkey trials as the text lm-eval-harness reads (it tokenizes the prompt again), one record each:
    `prompt` (the decoded prompt), `answer`, `depth`, `length` (the trial's tokens) and `tokens` (the prompt's
    tokens when the text is tokenized again, without special tokens: `length` unless the tokenizer merges
    across the boundaries of the separately tokenized pieces)."""
    records = []
    for trial in trials:
        text = tokenizer.decode(trial.input_ids[0], clean_up_tokenization_spaces=False)
        records.append({"prompt": text, "answer": trial.answer, "depth": trial.depth,
                        "length": trial.input_ids.shape[1],
                        "tokens": len(tokenizer(text, add_special_tokens=False).input_ids)})
    return records


def write_needles(tokenizer, documents: list[LongDocument], output_dir: str | Path = DEFAULT_NEEDLES_DIR,
                  lengths: tuple[int, ...] | list[int] = NEEDLE_LENGTHS, trials: int = 20, seed: int = 0,
                  keys: int = 4) -> list[Path]:
    """The data of the local lm-eval needle tasks (configs/lm_eval/needles): `OUTPUT_DIR/<variant>_<haystack>_
    <length>.jsonl` for every variant, haystack and length, the `needle_records` of `passkey_trials` (the same
    prompts as the evaluation's with the same `trials`, `seed` and `keys`). Every prompt is built before a file
    is written. Returns the files written."""
    if not lengths or trials < 1:
        raise ValueError(f"needles need at least one length and trials ≥ 1, got lengths={list(lengths)} and "
                         f"trials={trials}")
    files = {f"{variant}_{haystack}_{length}.jsonl": needle_records(
        tokenizer, passkey_trials(tokenizer, documents, length, trials, haystack, variant, seed, keys))
        for length in lengths for variant in ("single", "multi") for haystack in ("natural", "filler")}
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, records in files.items():
        path = output_dir / name
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
        written.append(path)
    return written


# --------------------------------------------------------------------------------------------- command line

@dataclass
class PrepareArguments:
    data_dir: str = field(default=DEFAULT_DATA_DIR, metadata={"help": "Where to write <source>.jsonl."})


@dataclass
class NeedleArguments:
    tokenizer_name: str = field(metadata={"help": "The model (folder or Hub id) whose tokenizer the prompts' "
                                                  "lengths are counted in: the one to evaluate."})
    data_dir: str = field(default=DEFAULT_DATA_DIR, metadata={"help": f"The long texts (`{PREPARE_COMMAND}`)."})
    output_dir: str = field(default=DEFAULT_NEEDLES_DIR, metadata={
        "help": "Where to write <variant>_<haystack>_<length>.jsonl (the tasks of configs/lm_eval/needles read "
                f"{DEFAULT_NEEDLES_DIR}, relative to the directory lm_eval runs in)."})
    lengths: list[int] = field(default_factory=lambda: list(NEEDLE_LENGTHS), metadata={
        "help": "Prompt tokens (the tasks exist for 1024, 2048 and 4096)."})
    trials: int = field(default=20, metadata={"help": "Prompts per length, haystack and variant."})
    seed: int = field(default=0, metadata={"help": "Seed of the keys and haystack offsets."})
    keys: int = field(default=4, metadata={"help": "Doors of the multi-key variant."})
    document_tokens: int = field(default=8192, metadata={"help": "Tokens per long document (≥ every length)."})
    documents_per_source: int = field(default=4, metadata={"help": "Long documents taken from each text."})


COMMANDS = ("prepare", "needles")


def main(argv: list[str]) -> int:
    """`prepare [--data_dir DIR]` or `needles --tokenizer_name MODEL [...]`; prints `error: ...` and returns 2
    for any other command. Evaluation is `training/evaluate.py` (its `--long_context_data` reads what `prepare`
    writes); `needles` writes the data of the lm-eval tasks in configs/lm_eval/needles."""
    command, argv = (argv[0], argv[1:]) if argv else ("", [])
    if command not in COMMANDS:
        print(f"error: the commands are {' and '.join(COMMANDS)}, got {command!r} (evaluate with `python "
              "training/evaluate.py --teacher SRC --models label=DIR ...`)", file=sys.stderr)
        return 2
    if command == "prepare":
        (args,) = HfArgumentParser(PrepareArguments).parse_args_into_dataclasses(argv)
        for path in prepare(args.data_dir):
            print(f"wrote {path}")
        return 0
    (args,) = HfArgumentParser(NeedleArguments).parse_args_into_dataclasses(argv)
    texts = load_texts(args.data_dir)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    documents = long_documents(tokenizer, texts, args.document_tokens, args.documents_per_source)
    for path in write_needles(tokenizer, documents, args.output_dir, args.lengths, args.trials, args.seed,
                              args.keys):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        changed = sum(record["tokens"] != record["length"] for record in records)
        print(f"wrote {path}: {len(records)} prompts" + (f", {changed} of them tokenized again to another length "
                                                         "(merges across their pieces)" if changed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
