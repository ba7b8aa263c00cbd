"""The command line of the long-context evaluation's data (`training.long_context_data`): it prepares the held-out
long texts, and writes the passkey prompts as the data of the lm-eval needle tasks (configs/lm_eval/needles). The
measurements are `training.long_context_metrics`', run by `training/evaluate.py`.

    hf-linear-attn-long-context prepare [--data_dir outputs/long_context_data]     # once; `make long-context-data`
    hf-linear-attn-long-context needles --tokenizer_name MODEL [--output_dir outputs/lm_eval_needles]
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from transformers import AutoTokenizer, HfArgumentParser

from hf_linear_attn.configuration_linear_attention import InputError
from hf_linear_attn.training.command_line import exit_on_bad_input, parse_dataclasses
from hf_linear_attn.training.long_context_data import (
    DEFAULT_DATA_DIR,
    DEFAULT_NEEDLES_DIR,
    NEEDLE_LENGTHS,
    PREPARE_COMMAND,
    load_texts,
    long_documents,
    prepare,
    write_needles,
)


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


def main(argv: list[str] | None = None) -> int:
    """`prepare [--data_dir DIR]` or `needles --tokenizer_name MODEL [...]`; bad input (another command, texts not
    prepared) prints `error: ...` and exits with status 2. Evaluation is `training/evaluate.py` (its
    `--long_context_data` reads what `prepare` writes); `needles` writes the data of the lm-eval tasks in
    configs/lm_eval/needles."""
    argv = list(sys.argv[1:] if argv is None else argv)
    command, argv = (argv[0], argv[1:]) if argv else ("", [])
    if command in ("-h", "--help"):
        print(f"usage: hf-linear-attn-long-context {{{','.join(COMMANDS)}}} [--help] [flags]\n\n{__doc__}")
        return 0
    with exit_on_bad_input():
        if command not in COMMANDS:
            raise InputError(f"the commands are {' and '.join(COMMANDS)}, got {command!r} (evaluate with `python "
                             "training/evaluate.py --teacher_name_or_path SRC --models label=DIR ...`)")
        if command == "prepare":
            (args,) = parse_dataclasses(HfArgumentParser(PrepareArguments), argv)
            for path in prepare(args.data_dir):
                print(f"wrote {path}")
            return 0
        (args,) = parse_dataclasses(HfArgumentParser(NeedleArguments), argv)
        texts = load_texts(args.data_dir)
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
        documents = long_documents(tokenizer, texts, args.document_tokens, args.documents_per_source)
        written = write_needles(tokenizer, documents, args.output_dir, args.lengths, args.trials, args.seed,
                                args.keys)
    for path in written:
        records = [json.loads(line) for line in path.read_text().splitlines()]
        changed = sum(record["tokens"] != record["length"] for record in records)
        print(f"wrote {path}: {len(records)} prompts" + (f", {changed} of them tokenized again to another length "
                                                         "(merges across their pieces)" if changed else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
