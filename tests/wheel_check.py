"""The built wheel as a user meets it (`make test-wheel`): run by the python of a clean venv where only the wheel
(with its `train` extra) is installed, from a folder outside the checkout.

    python wheel_check.py --wheel dist/hf_linear_attn-VERSION-py3-none-any.whl

Checks, stopping at the first failure with a message and status 1:
1. the wheel holds nothing but `hf_linear_attn/...` and its `.dist-info` (no top-level `training`, `benchmarks`);
2. every console command of the distribution answers `--help`;
3. a tiny softmax Llama, converted, distilled for two steps on the embedded corpus and evaluated with the installed
   commands, offline; a shipped recipe runs by name (`--config finetune_tiny`), with no checkout anywhere.
Not a pytest module: it runs outside the checkout, with nothing of the tests importable.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import zipfile
from importlib.metadata import distribution
from pathlib import Path

ALLOWED_TOP_LEVEL = "hf_linear_attn"
COMMANDS_DIR = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


def fail(message: str) -> None:
    print(f"wheel check failed: {message}", file=sys.stderr)
    raise SystemExit(1)


def run(command: list[str]) -> str:
    result = subprocess.run(command, capture_output=True, text=True, env=ENV, timeout=600)
    if result.returncode != 0:
        fail(f"`{' '.join(command)}` exited with {result.returncode}:\n{result.stdout[-2000:]}{result.stderr[-4000:]}")
    return result.stdout


def check_wheel_names(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    foreign = sorted({name.split("/")[0] for name in names} - {ALLOWED_TOP_LEVEL}
                     - {name.split("/")[0] for name in names if name.split("/")[0].endswith(".dist-info")
                        and name.startswith("hf_linear_attn-")})
    if foreign:
        fail(f"the wheel installs names other than {ALLOWED_TOP_LEVEL}: {foreign}")
    for needed in ("hf_linear_attn/training/corpus/jargon.jsonl", "hf_linear_attn/configs/demo.yaml",
                   "hf_linear_attn/model_cards/model_card.md", "hf_linear_attn/py.typed"):
        if needed not in names:
            fail(f"the wheel lacks {needed}")
    print(f"wheel: {len(names)} files, all under {ALLOWED_TOP_LEVEL}/ or its .dist-info")


def console_commands() -> list[str]:
    commands = sorted(entry.name for entry in distribution("hf-linear-attn").entry_points
                      if entry.group == "console_scripts")
    if not commands:
        fail("the distribution declares no console commands")
    return commands


def tiny_teacher(folder: Path) -> None:
    """A two-layer Llama with the package's byte-level tokenizer, saved as a softmax checkpoint."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_linear_attn.training.data import byte_level_tokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)


def long_texts(folder: Path) -> None:
    """Stand-ins for the prepared long texts (the evaluation's two sources, two records each)."""
    folder.mkdir(parents=True)
    words = ("state", "kernel", "window", "decay", "token", "chunk", "cache", "memory")
    for s, source in enumerate(("kjv", "austen")):
        records = [{"title": f"{source} {r}", "text": " ".join(words[(5 * i + 3 * r + s) % len(words)]
                                                                for i in range(300))} for r in range(2)]
        (folder / f"{source}.jsonl").write_text("".join(json.dumps(record) + "\n" for record in records))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, required=True)
    parser.add_argument("--work_dir", type=Path, default=Path("work"))
    args = parser.parse_args(argv)
    check_wheel_names(args.wheel)
    for command in console_commands():
        if "usage" not in run([str(COMMANDS_DIR / command), "--help"]).lower():
            fail(f"{command} --help printed no usage")
    print(f"--help: {len(console_commands())} commands answer")

    work = args.work_dir
    tiny_teacher(work / "teacher")
    long_texts(work / "texts")
    bin_ = str(COMMANDS_DIR)
    run([f"{bin_}/hf-linear-attn-convert", "--model_name_or_path", str(work / "teacher"), "--output_dir",
         str(work / "converted"), "--feature_dim", "8", "--window_size", "8", "--num_sink_tokens", "1"])
    run([f"{bin_}/hf-linear-attn-distill", "--model_name_or_path", str(work / "converted"), "--output_dir",
         str(work / "stage1"), "--max_steps", "2", "--block_size", "32", "--report_to", "none",
         "--cache_dir", str(work / "data_cache")])
    run([f"{bin_}/hf-linear-attn-evaluate", "--teacher_name_or_path", str(work / "teacher"), "--models",
         f"stage1={work / 'stage1'}", "--block_size", "32", "--max_eval_rows", "2", "--long_context_data",
         str(work / "texts"), "--document_tokens", "640", "--documents_per_source", "2", "--long_contexts", "64",
         "--long_scored_tokens", "128", "--long_min_rows", "1", "--passkey_lengths", "600", "--passkey_trials", "1",
         "--passkey_keys", "2", "--decode_contexts", "32", "--decode_tokens", "1", "--output_dir",
         str(work / "evaluation"), "--cache_dir", str(work / "data_cache")])
    if not (work / "evaluation" / "evaluation.json").is_file():
        fail("the evaluation wrote no evaluation.json")
    run([f"{bin_}/hf-linear-attn-finetune", "--config", "finetune_tiny", "--output_dir", str(work / "tiny"),
         "--max_steps", "2", "--block_size", "32", "--eval_steps", "0", "--save_steps", "0", "--report_to", "none",
         "--cache_dir", str(work / "data_cache")])
    if not (work / "tiny" / "config.json").is_file():
        fail("the shipped recipe finetune_tiny wrote no model")
    print("convert -> distill -> evaluate, and the shipped recipe finetune_tiny by name: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
