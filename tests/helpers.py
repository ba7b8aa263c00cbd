"""Plain helpers shared by the test modules (and tests/ddp_worker.py): tiny models, inputs, paths, subprocesses.

Pytest fixtures live in `conftest.py`; everything here is an ordinary function or constant, imported by name
(`from helpers import tiny_model`). No test module imports another test module.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import random
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import hf_linear_attn
from hf_linear_attn import ops_triton_common
from hf_linear_attn.modeling_linear_attention import LinearAttention

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------------------------
# Tiny linear-attention models
# ---------------------------------------------------------------------------------------------------------------

# One model per attention layout the model file has a code path for (feature maps, decays, window, softmax layers).
VARIANTS = {
    "elu": {},
    "relu-unnormalized": {"feature_map": "relu", "normalize": False},
    "identity-fixed-decay": {"feature_map": "identity", "normalize": False, "decay": "fixed",
                             "output_norm": True},
    "elu-scalar-decay": {"decay": "scalar"},
    "t2r-vector-decay": {"feature_map": "t2r", "feature_dim": 8, "decay": "vector", "decay_low_rank_dim": 4},
    "taylor": {"feature_map": "taylor", "head_dim": 4, "hidden_size": 32},
    "hedgehog-window-sinks": {"feature_map": "hedgehog", "feature_dim": 8, "window_size": 5,
                              "num_sink_tokens": 2},
    **{f"hedgehog-window-sinks-{decay}-decay": {"feature_map": "hedgehog", "feature_dim": 8, "window_size": 5,
                                                "num_sink_tokens": 2, "decay": decay, "decay_low_rank_dim": 4}
       for decay in ("fixed", "scalar", "vector")},
    "hedgehog-window-sinks-scalar-decay-sparse-memory": {"feature_map": "hedgehog", "feature_dim": 8, "window_size": 5,
                                                        "num_sink_tokens": 2, "decay": "scalar",
                                                        "sparse_cache_size": 2},
    "qwen3-like-hybrid": {"use_qk_norm": True, "attention_bias": True, "softmax_layers": [0],
                          "tie_word_embeddings": True},
    "delta": {"update_rule": "delta", "feature_map": "identity", "normalize": False},
    "gated-delta-conv": {"update_rule": "delta", "feature_map": "elu", "normalize": False, "decay": "scalar",
                         "conv_size": 4, "output_norm": True, "output_gate": True},
    "gated-delta-window-sinks": {"update_rule": "delta", "feature_map": "identity", "normalize": False,
                                 "decay": "scalar", "conv_size": 4, "output_norm": True, "output_gate": True,
                                 "window_size": 5, "num_sink_tokens": 2},
}


def tiny_config(**overrides) -> hf_linear_attn.LinearAttentionConfig:
    """A 2-layer, hidden-64 model with GQA (4 query heads, 2 KV heads): fast on CPU."""
    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    fields.update(overrides)
    return hf_linear_attn.LinearAttentionConfig(**fields)


def tiny_model(seed: int = 0, **overrides) -> hf_linear_attn.LinearAttentionForCausalLM:
    torch.manual_seed(seed)
    model = hf_linear_attn.LinearAttentionForCausalLM(tiny_config(**overrides))
    if model.config.window_size > 0:
        # A hybrid's decay gate starts data-independent with a = 1 − 1/decay_horizon (its conversion init), which would
        # hide a misplaced decay: give it random weights and a ≈ 0.9 on average, so every step's decay matters.
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, LinearAttention) and module.decay_proj is not None:
                    gate = module.decay_proj[-1] if isinstance(module.decay_proj, torch.nn.Sequential) \
                        else module.decay_proj
                    gate.weight.normal_(0.0, 0.3)
                    gate.bias.fill_(-1.5)
                if isinstance(module, LinearAttention) and module.config.update_rule == "delta":
                    module.window_gate.normal_(0.0, 1.0)  # λ starts at 0, which would hide the delta part
    return model.eval()


def prompts(lengths, vocab=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g) for n in lengths]


def left_pad(seqs, pad_id=0):
    t = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), t), pad_id)
    mask = torch.zeros(len(seqs), t, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, t - len(s):] = s
        mask[row, t - len(s):] = 1
    return ids, mask


# ---------------------------------------------------------------------------------------------------------------
# Softmax teachers for conversion and distillation
# ---------------------------------------------------------------------------------------------------------------

DIMS = dict(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
SOURCES = {
    "llama": (LlamaForCausalLM, LlamaConfig, {
        "attention_bias": True, "mlp_bias": True,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "mistral": (MistralForCausalLM, MistralConfig, {"head_dim": 24, "sliding_window": None}),
    "qwen2": (Qwen2ForCausalLM, Qwen2Config, {"tie_word_embeddings": True}),
    "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 16, "tie_word_embeddings": True}),
}


def teacher(name: str, seed: int = 0):
    model_cls, config_cls, extra = SOURCES[name]
    torch.manual_seed(seed)
    model = model_cls(config_cls(**DIMS, **extra, attn_implementation="sdpa")).eval()
    with torch.no_grad():  # biases and norms start at 0 / 1: make them non-trivial so copying them is tested
        for name_, p in model.named_parameters():
            if name_.endswith("bias") or "norm" in name_:
                p.add_(0.1 * torch.randn_like(p))
    return model


def save_with_tokenizer(model, path):
    """Save a checkpoint with a small word-level tokenizer, as a real source folder has."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(90)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    model.save_pretrained(path)


# ---------------------------------------------------------------------------------------------------------------
# Attention-op inputs and comparisons
# ---------------------------------------------------------------------------------------------------------------


def make_inputs(
    decay: str | None,
    normalize: bool,
    length: int,
    key_dim: int,
    value_dim: int,
    *,
    batch: int = 2,
    heads: int = 2,
    with_state: bool = False,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> dict[str, torch.Tensor | None]:
    """Random leaf tensors for linear_attention. Normalised runs get positive, feature-like q, k and state
    so the denominators stay away from 0."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    def feature(*shape: int) -> torch.Tensor:
        return randn(*shape).sigmoid() if normalize else randn(*shape)

    q, k = feature(batch, length, heads, key_dim), feature(batch, length, heads, key_dim)
    v = randn(batch, length, heads, value_dim)
    if decay == "fixed":  # RetNet: γ_h = 1 − 2^(−5−h)
        gamma = 1 - 2.0 ** (-5 - torch.arange(heads, dtype=dtype))
        log_decay = gamma.log().expand(batch, length, heads).clone()
    elif decay == "scalar":
        log_decay = F.logsigmoid(randn(batch, length, heads) * 2 + 2)
    elif decay == "vector":
        log_decay = F.logsigmoid(randn(batch, length, heads, key_dim) * 2 + 2)
    else:
        log_decay = None
    state = None
    if with_state:
        state = randn(batch, heads, key_dim, value_dim + int(normalize))
        state = state.abs() if normalize else state
    tensors = {"q": q, "k": k, "v": v, "log_decay": log_decay, "initial_state": state}
    return {name: None if x is None else x.requires_grad_() for name, x in tensors.items()}


def make_window_inputs(
    length: int, *, batch: int = 2, heads: int = 2, dtype: torch.dtype = torch.float64, seed: int = 0,
    decay: str | None = None,
) -> dict[str, torch.Tensor]:
    """Random leaf tensors for window_attention (D = 8, V = 5, F = 6); positive features, as a feature map gives.
    decay "scalar" or "vector" adds a log_decay [B, T, H] or [B, T, H, F] (a mostly between 0.7 and 1)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    tensors = {
        "q": randn(batch, length, heads, 8),
        "k": randn(batch, length, heads, 8),
        "v": randn(batch, length, heads, 5),
        "q_feat": randn(batch, length, heads, 6).sigmoid(),
        "k_feat": randn(batch, length, heads, 6).sigmoid(),
        "window_gate": randn(heads),
    }
    if decay is not None:
        shape = {"scalar": (batch, length, heads), "vector": (batch, length, heads, 6)}[decay]
        tensors["log_decay"] = F.logsigmoid(randn(*shape) * 2 + 3)
    return {name: x.requires_grad_() for name, x in tensors.items()}


def window_initial_state(batch: int = 2, heads: int = 2, seed: int = 1) -> torch.Tensor:
    """A non-negative window_attention linear state [B, H, F, V + 1] (matching `make_window_inputs`), as folded
    keys of positive features produce."""
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(batch, heads, 6, 6, generator=gen, dtype=torch.float64).requires_grad_()


def triton_test_device() -> str:
    """Where a Triton test module runs its kernels: "cuda" on a GPU, else "cpu" under the Triton interpreter
    (tests/conftest.py sets TRITON_INTERPRET=1 before hf_linear_attn is imported). Skips the calling module
    without triton, or without either."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        return "cuda"
    if not ops_triton_common.INTERPRET:
        pytest.skip("no GPU, and TRITON_INTERPRET=1 was not set before importing hf_linear_attn",
                    allow_module_level=True)
    return "cpu"


def triton_modules() -> list[ModuleType]:
    """Every Triton module of the package (`ops_triton_*.py`), imported."""
    names = [module.name for module in pkgutil.iter_modules(hf_linear_attn.__path__)]
    return [importlib.import_module(f"hf_linear_attn.{name}") for name in names if name.startswith("ops_triton_")]


def make_delta_rule_inputs(
    length: int, *, decay: bool = True, with_state: bool = False, batch: int = 2, heads: int = 2, key_dim: int = 8,
    value_dim: int = 5, seed: int = 0,
) -> dict[str, torch.Tensor | None]:
    """float64 tensors for delta_rule_attention: unit keys, β in (0, 1), log decays mostly near 0."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {
        "q": randn(batch, length, heads, key_dim),
        "k": F.normalize(randn(batch, length, heads, key_dim), dim=-1),
        "v": randn(batch, length, heads, value_dim),
        "beta": randn(batch, length, heads).sigmoid(),
        "log_decay": F.logsigmoid(randn(batch, length, heads) * 2 + 3) if decay else None,
        "initial_state": randn(batch, heads, key_dim, value_dim) if with_state else None,
    }


def outputs_and_grads(attention, inputs: dict[str, torch.Tensor | None], **kwargs) -> list[torch.Tensor]:
    """attention(**inputs, output_final_state=True, **kwargs)'s output, final state and the gradients of a fixed
    random weighting of both w.r.t. every input tensor."""
    o, state = attention(**inputs, output_final_state=True, **kwargs)
    gen = torch.Generator().manual_seed(123)
    loss = sum((x.double() * torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device)).sum()
               for x in (o, state))
    return [o, state, *torch.autograd.grad(loss, [x for x in inputs.values() if x is not None])]


def assert_all_close(actual: list[torch.Tensor], expected: list[torch.Tensor], tol: float) -> None:
    """Each pair agrees to `tol` relative to the expected tensor's largest magnitude (at least 1)."""
    for a, e in zip(actual, expected, strict=True):
        assert a.shape == e.shape and a.dtype == e.dtype
        assert torch.isfinite(a).all()
        scale = max(1.0, e.abs().max().item())
        assert (a - e).abs().max().item() <= tol * scale


def assert_close_in_float64(actual: list[torch.Tensor], expected: list[torch.Tensor], tol: float) -> None:
    """Each pair agrees to `tol` relative to the expected tensor's largest magnitude (at least 1), compared in
    float64 on the CPU: the tensors of a pair may differ in dtype and device."""
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected, strict=True):
        a, e = a.detach().double().cpu(), e.detach().double().cpu()
        assert a.shape == e.shape
        assert torch.isfinite(a).all()
        assert (a - e).abs().max().item() <= tol * max(1.0, e.abs().max().item())


# ---------------------------------------------------------------------------------------------------------------
# Scripts run as subprocesses, and the training recipe they run
# ---------------------------------------------------------------------------------------------------------------

TINY_RECIPE = ROOT / "configs" / "finetune_tiny.yaml"
WORDS = ("state", "kernel", "feature", "window", "decay", "token", "chunk", "head", "cache", "linear", "softmax",
         "gate", "query", "key", "value", "sink", "layer", "norm", "map", "memory")


def script_env(**extra: str) -> dict[str, str]:
    """Environment of script subprocesses: offline, one thread per process (2 cores shared by several)."""
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1",
            **extra}


def run_python(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`python ARGS` from the repository root without TRITON_INTERPRET (kernels compile for a GPU, or triton is
    absent); output captured as text."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=timeout)


def assert_runs_without_triton(code: str, triton_call: str) -> None:
    """In a fresh Python where `import triton` fails, `code` runs, and then `triton_call` (an op call with
    backend="triton") raises a ValueError that says the triton package is needed."""
    program = "\n".join([
        "import sys",
        "sys.modules['triton'] = None  # `import triton` raises ImportError",
        textwrap.dedent(code),
        "try:",
        f"    {triton_call}",
        "except ValueError as error:",
        "    assert 'needs the triton package' in str(error), error",
        "else:",
        "    raise AssertionError(\"backend 'triton' ran without triton\")",
    ])
    result = run_python("-c", program)
    assert result.returncode == 0, result.stderr[-2000:]


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run `benchmarks/SCRIPT` with `args` from the repository root; output captured as text."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", MALLOC_MMAP_THRESHOLD_="65536")  # as the scripts re-exec with
    return subprocess.run([sys.executable, "-m", f"benchmarks.{Path(script).stem}", *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=ROOT)


def benchmark_module(script: str):
    """The module `benchmarks.NAME` of `benchmarks/NAME.py`, imported into this process, so a test calls its
    `main(argv)`: a subprocess spends most of a tiny run importing torch and transformers (~9 s each on the suite's
    slow machine)."""
    return importlib.import_module(f"benchmarks.{Path(script).stem}")


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


def read_log(output_dir: Path) -> list[dict[str, Any]]:
    """The run's `log.jsonl` records without the timing field (which differs between runs)."""
    records = [json.loads(line) for line in (Path(output_dir) / "log.jsonl").read_text().splitlines()]
    return [{k: v for k, v in record.items() if k != "tokens_per_second"} for record in records]


def with_resets(log_decay: torch.Tensor, seed: int = 3) -> torch.Tensor:
    """log_decay with about one step in six (and, for vector decay, some key dims) set to −inf (a full reset),
    one in six to ≤ −1e30, and step 0 of every row reset; a leaf again."""
    draw = torch.rand(log_decay.shape, generator=torch.Generator().manual_seed(seed), dtype=log_decay.dtype)
    log_decay = torch.where(draw < 2 / 6, -1e30 * (1 + draw), log_decay.detach())
    log_decay = torch.where(draw < 1 / 6, -torch.inf, log_decay)
    log_decay[:, 0] = -torch.inf
    return log_decay.requires_grad_()


# ---------------------------------------------------------------------------------------------------------------
# Servers started by the tests on 127.0.0.1
# ---------------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(server: subprocess.Popen, url: str, name: str, timeout: float) -> None:
    """Poll `url`/health until it answers 200; fail with the server's last stderr if it exits, or after `timeout` s."""
    import requests

    deadline = time.time() + timeout
    while True:
        assert server.poll() is None, f"{name} exited: {server.stderr.read()[-3000:]}"
        assert time.time() < deadline, f"{name} did not come up within {timeout:.0f} s"
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(1)


# Checkpoints as a Hub user without hf-linear-attn meets them
# ---------------------------------------------------------------------------------------------------------------

# In a fresh Python where `hf_linear_attn` does not import, with torch's FSDP imported (as in the
# process that trained: an engine's sources copied as "remote code" then fail to register their operators again):
# loads each folder with trust_remote_code=True, checks that the class is the folder's copy, and saves the logits.
STRANGER = textwrap.dedent(
    """
    import sys
    sys.modules["hf_linear_attn"] = None  # `import hf_linear_attn` (and its `training`) fails, as where not installed
    import torch
    import torch.distributed.fsdp  # noqa: F401
    from transformers import AutoModelForCausalLM

    ids, logits = torch.load(sys.argv[1]), {}
    for folder in sys.argv[3:]:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            logits[folder] = model(ids).logits
        model.generate(ids[:, :4], max_new_tokens=2, do_sample=False)
    torch.save(logits, sys.argv[2])
    """
)
# What a model folder written by the training scripts may hold besides the code files and `checkpoint-*` folders.
MODEL_FOLDER_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                      "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "README.md",
                      "training_summary.json", "log.jsonl", "runs"}


def stranger_logits(work: Path, ids: torch.Tensor, *folders: str | Path, **env: str) -> dict[str, torch.Tensor]:
    """The logits of `ids` from each checkpoint (a folder, or a repository id with `env` pointing at a Hub), loaded
    (`STRANGER`) in a subprocess run from the empty folder `work`, with a modules cache of its own; keyed by
    `str(folder)`."""
    work.mkdir(parents=True)
    torch.save(ids, work / "ids.pt")
    result = subprocess.run([sys.executable, "-c", STRANGER, str(work / "ids.pt"), str(work / "logits.pt"),
                             *map(str, folders)], cwd=work,
                            env=script_env(HF_MODULES_CACHE=str(work / "modules"), **env),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(work / "logits.pt")


def assert_ordinary_checkpoint(folder: Path) -> None:
    """`folder` is a model repository as the Hub needs it: config.json's `auto_map` names this package's classes, the
    code files are exactly this package's (no engine's), every other file is one a model folder holds."""
    from hf_linear_attn.checkpoint_code import code_files
    from hf_linear_attn.configuration_linear_attention import AUTO_MAP

    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"] == AUTO_MAP and config["architectures"] == ["LinearAttentionForCausalLM"], config
    names = {path.name for path in folder.iterdir() if not path.name.startswith("checkpoint-")}
    assert {name for name in names if name.endswith(".py")} == code_files().keys()
    assert {"config.json", "model.safetensors"} <= names - code_files().keys() <= MODEL_FOLDER_FILES, names
