"""The long held-out texts of the long-context evaluation and what is built from them: the texts prepared from
Debian packages, long documents cut from them, passkey prompts, and the prompts written as the data of the lm-eval
needle tasks (configs/lm_eval/needles). The measurements on them are `training.long_context_metrics`'; the command
line that prepares the texts and writes the needle data is `hf-linear-attn-long-context`.

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

Passkey prompts of length L: exactly L tokens (preamble, haystack with the needle(s) inserted at token level,
question), the asked-for needle at depth (i + 0.5) / trials in trial i, the answer " " + the key right after the
prompt. Variants (`passkey_trials`): `chat`, asked in the tokenizer's chat template, is the one the instruct
teacher passes (docs/design.md, "The retrieval evaluation"); `single` and `multi` are harder.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from hf_linear_attn.configuration_linear_attention import InputError, InputNotFoundError
from hf_linear_attn.head_selection import RetrievalPrompt

DEFAULT_DATA_DIR = "outputs/long_context_data"
PREPARE_COMMAND = "hf-linear-attn-long-context prepare"
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


def austen_novels(root: Path) -> list[dict]:
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


def kjv_books(root: Path) -> list[dict]:
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
    "kjv": (("bible-kjv", "bible-kjv-text"), kjv_books),
    "austen": (("r-cran-janeaustenr",), austen_novels),
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
        raise InputNotFoundError(f"data_dir {str(data_dir)!r} lacks the long-context texts {missing}: run "
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
        raise InputError(f"document_tokens and documents_per_source must be ≥ 1, got {document_tokens} and "
                         f"{documents_per_source}")
    per_source = []
    for source, records in texts.items():
        ids: list[int] = []
        for i, record in enumerate(records):
            ids += tokenizer(("\n\n" if i else "") + record["text"], add_special_tokens=False).input_ids
        available = len(ids) // document_tokens
        if available < documents_per_source:
            raise InputError(f"source {source!r} has {len(ids)} tokens: fewer than documents_per_source="
                             f"{documents_per_source} documents of document_tokens={document_tokens}")
        picks = [(2 * i + 1) * available // (2 * documents_per_source) for i in range(documents_per_source)]
        per_source.append([LongDocument(source, k, torch.tensor(ids[k * document_tokens:(k + 1) * document_tokens]))
                           for k in picks])
    return [document for group in zip(*per_source, strict=True) for document in group]



# --------------------------------------------------------------------------------------------- passkey retrieval

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PREAMBLE = ("There is important information hidden inside a lot of irrelevant text. Find it and memorize it. "
            "I will quiz you about it.\n\n")
DOORS = ("red", "green", "blue", "amber", "violet", "silver", "black", "white")
# "chat" (the default) is the one an instruct teacher passes; "single" and "multi" are harder.
VARIANTS = ("chat", "single", "multi")
# The wording head ranking asks in (`training.checkpoint_conversion.head_ranking_prompts`), which no evaluated variant
# uses (nor is it one the evaluation accepts): heads chosen on it are judged on phrasings they were not chosen on.
RANKING_VARIANT = "ranking"
RANKING_PREAMBLE = "Read the notes below. One number in them will be needed at the end.\n\n"
HAYSTACKS = ("natural", "filler")
_MARKER = "\x00haystack\x00"


@dataclass(frozen=True)
class PasskeyTrial:
    input_ids: torch.Tensor  # [1, length]
    answer: str  # the digits a correct model generates
    needle_start: int  # position of the asked-for needle's first token in input_ids
    depth: float  # the requested depth of that needle in the haystack (0: first, 1: last)
    answer_ids: torch.Tensor  # [1, K]: the tokens that answer, as they follow the prompt (" " + the key's digits)

    def retrieval_prompt(self) -> RetrievalPrompt:
        """The trial teacher-forced, for ranking heads by retrieval: the prompt followed by the answer's tokens, with
        where the needle states those same tokens (their first occurrence from the needle's start). ValueError when
        the needle, tokenized on its own, holds them differently (a tokenizer that merges the key with what precedes
        it)."""
        answer, row = self.answer_ids[0].tolist(), self.input_ids[0].tolist()
        start = next((i for i in range(self.needle_start, len(row) - len(answer) + 1)
                      if row[i:i + len(answer)] == answer), None)
        if start is None:
            raise InputError(f"the answer's tokens {answer} do not appear in the prompt after its needle (position "
                             f"{self.needle_start}): this tokenizer splits the key differently inside the needle")
        ids = torch.cat([self.input_ids, self.answer_ids], dim=1)
        return RetrievalPrompt(ids, (start, start + len(answer)), (ids.shape[1] - len(answer), ids.shape[1]))


def passkey_prompt(tokenizer, haystack_ids: list[int], length: int, needles: list[tuple[float, str]],
                   question: str, head: str = PREAMBLE) -> tuple[torch.Tensor, list[int]]:
    """Token ids [1, length]: `head`, the first tokens of `haystack_ids` with each (depth, text) needle
    inserted after round(depth × haystack tokens) of them, then `question`. Also the needles' start positions.
    Pieces are tokenized separately and concatenated, so the needle sits exactly where asked."""
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    needle_ids = [(depth, encode(text)) for depth, text in sorted(needles, key=lambda n: n[0])]
    head_ids, tail = encode(head), encode(question)
    budget = length - len(head_ids) - len(tail) - sum(len(ids) for _, ids in needle_ids)
    if budget < 1 or len(haystack_ids) < budget:
        raise InputError(f"a passkey prompt of length {length} leaves {budget} haystack tokens "
                         f"(haystack has {len(haystack_ids)}); use a longer length or haystack")
    ids, starts, taken = list(head_ids), [], 0
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


def chat_frame(tokenizer, question: str, answer_start: str, preamble: str = PREAMBLE) -> tuple[str, str]:
    """(text before the haystack, text after it) of a prompt that is one user turn of the tokenizer's chat
    template (`preamble`, the haystack, `question`), then the opening of the assistant's turn and `answer_start`.
    ValueError for a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise InputError("the 'chat' passkey variant asks in the tokenizer's chat template and this tokenizer has "
                         "none: use the variants 'single' or 'multi'")
    text = tokenizer.apply_chat_template([{"role": "user", "content": preamble + _MARKER + question}],
                                         tokenize=False, add_generation_prompt=True)
    head, _, tail = text.partition(_MARKER)
    return head, tail + answer_start


def passkey_trials(tokenizer, documents: list[LongDocument], length: int, trials: int, haystack: str, variant: str,
                   seed: int = 0, keys: int = 4) -> list[PasskeyTrial]:
    """`trials` prompts of `length` tokens. The asked-for needle of trial i sits at depth (i + 0.5) / trials
    (evenly spread); keys (5 digits) and haystack offsets come from `seed`. `haystack`: "natural" (a window of
    the long documents, document i mod count) or "filler" (a repeated sentence block). `variant`:
    - "chat": one secret pass key, stated twice in a paragraph of its own, asked for in the tokenizer's chat
      template (the user's turn; the assistant's starts "The secret pass key is");
    - "single": one pass key stated twice inside the running text, asked for in plain text;
    - "multi": `keys` doors with a key each, the others at random depths, one door asked for in plain text;
    - RANKING_VARIANT (head ranking's, never evaluated): one code stated once in other words, asked for in plain
      text in the even trials and in the chat template (when the tokenizer has one) in the odd ones.
    The answer of every variant is " " + the key, right after the prompt."""
    if trials < 1:
        raise InputError(f"passkey trials must be ≥ 1, got {trials}")
    if haystack not in HAYSTACKS:
        raise InputError(f"haystack must be one of {list(HAYSTACKS)}, got {haystack!r}")
    if variant not in (*VARIANTS, RANKING_VARIANT):
        raise InputError(f"variant must be one of {list(VARIANTS)}, got {variant!r}")
    if variant == "multi" and not 2 <= keys <= len(DOORS):
        raise InputError(f"keys must be in [2, {len(DOORS)}] for the multi-key variant, got {keys}")
    head, question = PREAMBLE, " What is the pass key? The pass key is"
    if variant == "chat":
        head, question = chat_frame(tokenizer, "\n\nWhat is the secret pass key?", "The secret pass key is")
    ranking_frames = [(RANKING_PREAMBLE, " Which code opens the archive room? The code is")]
    if variant == RANKING_VARIANT and getattr(tokenizer, "chat_template", None):
        ranking_frames.append(chat_frame(tokenizer, "\n\nWhich code opens the archive room?", "The code is",
                                         RANKING_PREAMBLE))
    rng = random.Random(f"{seed}/{length}/{haystack}/{variant}")
    encode = lambda text: tokenizer(text, add_special_tokens=False).input_ids  # noqa: E731
    filler = encode(FILLER * (length // 8 + 2))
    result = []
    for i in range(trials):
        depth = (i + 0.5) / trials
        if haystack == "natural":
            document = documents[i % len(documents)].input_ids.tolist()
            start = rng.randrange(max(len(document) - length, 0) + 1)
            source = document[start:]
        else:
            source = filler
        if variant == "multi":
            doors = rng.sample(DOORS, keys)
            values = [str(rng.randint(10000, 99999)) for _ in doors]
            needles = [(depth if j == 0 else rng.random(), f" The pass key of the {door} door is {value}. ")
                       for j, (door, value) in enumerate(zip(doors, values, strict=True))]
            key = values[0]
            question = f" What is the pass key of the {doors[0]} door? The pass key of the {doors[0]} door is"
        elif variant == RANKING_VARIANT:
            key = str(rng.randint(10000, 99999))
            head, question = ranking_frames[i % len(ranking_frames)]
            needles = [(depth, f" (The code of the archive room is {key}.) ")]
        else:
            key = str(rng.randint(10000, 99999))
            needle = (f"\n\nThe secret pass key is {key}. Remember it: the secret pass key is {key}.\n\n"
                      if variant == "chat"
                      else f" The pass key is {key}. Remember it. {key} is the pass key. ")
            needles = [(depth, needle)]
        ids, starts = passkey_prompt(tokenizer, source, length, needles, question, head)
        result.append(PasskeyTrial(ids, key, starts[0], depth, torch.tensor([encode(" " + key)])))
    return result

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
        raise InputError(f"needles need at least one length and trials ≥ 1, got lengths={list(lengths)} and "
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

