"""Upload a saved linear-attention checkpoint to the Hub with a generated model card.

    python training/push_to_hub.py CHECKPOINT REPO_ID [--private] [--license apache-2.0]
    hf-linear-attn-push CHECKPOINT REPO_ID ...           # the same, installed as a command

CHECKPOINT is a folder written by `training/finetune.py` (or any `save_pretrained` of a
`LinearAttentionForCausalLM`): weights (safetensors), the code files `auto_map` points to, tokenizer
and `training_summary.json`. The model card is rendered into `CHECKPOINT/README.md` and, once the Hub
has validated its metadata, everything but training leftovers is uploaded in one commit
(`training.hub.push_to_hub`). The Hub address and token come from the usual `HF_ENDPOINT` /
`HF_TOKEN` (or `hf auth login`).
"""

from __future__ import annotations

import argparse

from hf_linear_attn.training.command_line import exit_on_bad_input
from hf_linear_attn.training.hub import push_to_hub


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="The saved model folder.")
    parser.add_argument("repo_id", help="Repository id, e.g. user/my-model.")
    parser.add_argument("--private", action="store_true", help="Create the repository as private.")
    parser.add_argument("--license", default=None, help="Licence id; default: the recorded or base model's one.")
    parser.add_argument("--commit_message", default="Upload linear-attention model")
    args = parser.parse_args(argv)
    with exit_on_bad_input():
        url = push_to_hub(args.checkpoint, args.repo_id, private=args.private, license=args.license,
                          commit_message=args.commit_message)
    print(f"Pushed {args.checkpoint} to {args.repo_id}: {url}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
