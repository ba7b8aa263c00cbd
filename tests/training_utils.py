"""Helpers shared by the training tests (test_finetune, test_ddp, test_push_to_hub, ddp_worker)."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

TINY_RECIPE = ROOT / "configs" / "finetune_tiny.yaml"
WORDS = ("state", "kernel", "feature", "window", "decay", "token", "chunk", "head", "cache", "linear", "softmax",
         "gate", "query", "key", "value", "sink", "layer", "norm", "map", "memory")


def tiny_args(output_dir: Path, cache_dir: Path, *extra: str) -> list[str]:
    """Command-line arguments of a seconds-long run of the tiny recipe (overrides come last and win)."""
    return ["--config", str(TINY_RECIPE), "--output_dir", str(output_dir), "--cache_dir", str(cache_dir),
            "--report_to", "none", "--block_size", "64", "--per_device_train_batch_size", "4",
            "--per_device_eval_batch_size", "4", "--max_eval_samples", "8", "--logging_steps", "1",
            "--eval_steps", "0", "--save_steps", "0", "--warmup_steps", "2", *extra]


def write_documents(path: Path, count: int = 60, seed: int = 0) -> Path:
    """A JSONL file of `count` short synthetic documents (field `text`)."""
    rng = random.Random(seed)
    with path.open("w") as stream:
        for _ in range(count):
            text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 25))).capitalize() + "."
            stream.write(json.dumps({"text": text}) + "\n")
    return path


def document_pieces(rows: dict[str, torch.Tensor]):
    """Each document of packed rows (`input_ids` / `position_ids` [rows, L], position_ids restarting at 0 at
    every document) that has a token to predict, as a [1, n] tensor of ids, n ≥ 2."""
    for ids, positions in zip(rows["input_ids"], rows["position_ids"], strict=True):
        starts = [*(positions == 0).nonzero().flatten().tolist(), len(ids)]
        for begin, end in zip(starts[:-1], starts[1:], strict=True):
            if end - begin >= 2:
                yield ids[begin:end][None]


def script_env(**extra: str) -> dict[str, str]:
    """Environment of script subprocesses: offline, one thread per process (2 cores shared by several)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            **extra}


def read_log(output_dir: Path) -> list[dict[str, Any]]:
    """The run's `log.jsonl` records without the timing field (which differs between runs)."""
    records = [json.loads(line) for line in (Path(output_dir) / "log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in record.items() if k != "tokens_per_second"} for record in records]


@pytest.fixture
def single_thread():
    """Run torch single-threaded, as the script subprocesses do (same numerics, no oversubscription)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def dataset_cache(tmp_path_factory) -> Path:
    """One `datasets` cache for the session, so tokenised data is reused between runs."""
    return tmp_path_factory.mktemp("datasets-cache")
