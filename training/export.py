"""Turn a training output into an ordinary checkpoint: merge a LoRA adapter, or repair a checkpoint's code.

    python training/export.py --model_name_or_path ADAPTER --output_dir MERGED [--base_model_name_or_path BASE]
    python training/export.py --model_name_or_path CHECKPOINT --output_dir CHECKPOINT     # repair in place
    python training/export.py --model_name_or_path CHECKPOINT --output_dir COPY          # a repaired copy
    hf-linear-attn-export ...                                                            # the same, installed

ADAPTER is a PEFT adapter folder (adapter_config.json), as `training/finetune.py --use_lora --merge_lora false`
saves it (the only LoRA route under FSDP / ZeRO-3): it is merged into its base checkpoint (`--base_model_name_or_path`,
else the base the adapter config names; a folder or a Hub id in the local cache) shard by shard, without loading a
model (`training.adapters.merge_adapter`): MERGED holds the base's safetensors files with the LoRA added (same files,
same index), the base's config, the tokenizer, the run's training_summary.json and, for a hf-linear-attn base, the
package's code files, auto_map and a model card. Only plain LoRA is merged (DoRA and other variants are refused).

CHECKPOINT is a full hf-linear-attn checkpoint (config.json of model_type linear_attention). With `--output_dir`
the same folder, its config.json's auto_map and its code files are rewritten from this version where they are not
the package's (`hf_linear_attn.checkpoint_code.repair_checkpoint_code`; the weights are not touched), and what
changed is printed. With another folder, its files (not its `checkpoint-*` subfolders, runs/ or log.jsonl) are copied
there and the copy is repaired. Either way the output folder is written into a hidden temporary folder beside it and
renamed when complete; it must be new or empty, and may not lie inside an input folder.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_linear_attn.checkpoint_code import is_project_checkpoint, repair_checkpoint_code
from hf_linear_attn.configuration_linear_attention import InputError, InputNotFoundError
from hf_linear_attn.training.adapters import (
    check_output_dir,
    copy_into,
    is_adapter_folder,
    merge_adapter,
    staged_folder,
)
from hf_linear_attn.training.checkpoints import RUN_FILES
from hf_linear_attn.training.command_line import exit_on_bad_input


def export_checkpoint(source: Path, output_dir: str) -> list[str]:
    """Repair the hf-linear-attn checkpoint `source` in place (`output_dir` is `source`) or into a copy at
    `output_dir` (its top-level files but training leftovers); returns what the repair changed."""
    if Path(output_dir).resolve() == source.resolve():
        return repair_checkpoint_code(source)
    output = check_output_dir(output_dir, **{"checkpoint folder": source})
    with staged_folder(output) as staging:
        copy_into([path for path in sorted(source.iterdir())
                   if path.is_file() and not path.name.startswith(".") and path.name not in RUN_FILES], staging)
        return repair_checkpoint_code(staging)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model_name_or_path", required=True,
                        help="A PEFT adapter folder to merge, or a full hf-linear-attn checkpoint to repair.")
    parser.add_argument("--output_dir", required=True,
                        help="Where the checkpoint goes: a new or empty folder, or the checkpoint's own folder to "
                             "repair it in place.")
    parser.add_argument("--base_model_name_or_path", default=None,
                        help="Adapters only: the base checkpoint to merge into (default: the one adapter_config.json "
                             "names).")
    args = parser.parse_args(argv)
    source = Path(args.model_name_or_path)
    with exit_on_bad_input():
        if is_adapter_folder(source):
            output = merge_adapter(source, args.output_dir, args.base_model_name_or_path)
            print(f"Merged the adapter {source} into its base: {output}")
            return 0
        if not source.is_dir():
            raise InputNotFoundError(f"--model_name_or_path {source}: no such folder.")
        if not is_project_checkpoint(source):
            raise InputError(f"--model_name_or_path {source} is neither a PEFT adapter folder (adapter_config.json) "
                             "nor a hf-linear-attn checkpoint (config.json of model_type 'linear_attention').")
        if args.base_model_name_or_path is not None:
            raise InputError(f"--base_model_name_or_path is for adapters only; {source} is a full checkpoint.")
        changes = export_checkpoint(source, args.output_dir)
    in_place = Path(args.output_dir).resolve() == source.resolve()
    done = f"{source}" if in_place else f"Copied {source} to {args.output_dir}; its"
    if changes:
        print(f"{done} checkpoint code repaired:" + "".join(f"\n  {change}" for change in changes))
    else:
        print(f"{done} checkpoint code is this version's: nothing needed changing.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
