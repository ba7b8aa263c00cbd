"""Upload a saved linear-attention checkpoint to the Hub with a generated model card.

    python training/push_to_hub.py --model_name_or_path CHECKPOINT --hub_model_id USER/NAME \
        [--hub_private_repo] [--license apache-2.0] [--commit_message TEXT]
    hf-linear-attn-push --model_name_or_path CHECKPOINT --hub_model_id USER/NAME ...   # the same, installed

CHECKPOINT is a folder written by `training/finetune.py` (or any `save_pretrained` of a
`LinearAttentionForCausalLM`): weights (safetensors), the code files `auto_map` points to, tokenizer
and `training_summary.json`. The model card is rendered into `CHECKPOINT/README.md` and, once the Hub
has validated its metadata, everything but training leftovers is uploaded in one commit
(`training.hub.push_to_hub`). The flags are named as `training/finetune.py --push_to_hub`'s (transformers'
TrainingArguments). The Hub address and token come from the usual `HF_ENDPOINT` / `HF_TOKEN` (or `hf auth login`).

The earlier form `CHECKPOINT REPO_ID [--private]` still works for one release, with a FutureWarning.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from hf_linear_attn.configuration_linear_attention import InputError
from hf_linear_attn.training.command_line import check_deprecated, exit_on_bad_input, parse_dataclasses, renamed
from hf_linear_attn.training.hub import push_to_hub

POSITIONAL_FLAGS = ("--model_name_or_path", "--hub_model_id")  # what the earlier positional CHECKPOINT REPO_ID are


@renamed(private="hub_private_repo")
@dataclass
class PushArguments:
    model_name_or_path: str = field(metadata={"help": "The saved model folder."})
    hub_model_id: str = field(metadata={"help": "Repository id, e.g. `user/my-model`."})
    hub_private_repo: bool = field(default=False, metadata={"help": "Create the repository as private."})
    license: str | None = field(default=None, metadata={
        "help": "Licence id for the card; default: the recorded or base model's one."})
    commit_message: str = field(default="Upload linear-attention model", metadata={"help": "The commit's message."})


def flags_for_positionals(argv: list[str]) -> list[str]:
    """`argv` with the earlier form's leading positional CHECKPOINT and REPO_ID given as their flags (a FutureWarning
    each); InputError when a flag gives the same argument too."""
    positionals = list(itertools.takewhile(lambda token: not token.startswith("-"), argv))[: len(POSITIONAL_FLAGS)]
    rest = argv[len(positionals):]
    flags = []
    for flag, value in zip(POSITIONAL_FLAGS, positionals, strict=False):
        given = any(token == flag or token.startswith(f"{flag}=") for token in rest)
        check_deprecated(f"the positional {flag.removeprefix('--').upper()}", flag, given, 3)
        flags += [flag, value]
    return flags + rest


def main(argv: list[str] | None = None) -> int:
    parser = HfArgumentParser(PushArguments, description=__doc__.split("\n\n")[0])
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv = flags_for_positionals(argv)
    except InputError as error:
        parser.error(str(error))
    (args,) = parse_dataclasses(parser, argv)
    with exit_on_bad_input():
        url = push_to_hub(args.model_name_or_path, args.hub_model_id, private=args.hub_private_repo,
                          license=args.license, commit_message=args.commit_message)
    print(f"Pushed {args.model_name_or_path} to {args.hub_model_id}: {url}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
