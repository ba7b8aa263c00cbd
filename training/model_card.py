"""Model cards for saved linear-attention checkpoints, rendered from the template `model_cards/model_card.md`.

`write_model_card(folder)` fills the Jinja template `model_cards/model_card.md` through
`huggingface_hub.ModelCard.from_template` and writes `folder/README.md`. Its inputs are the folder's
`config.json`, its safetensors headers (parameter count) and `training_summary.json`, which
`write_training_summary` writes at the end of a `training/finetune.py` or `training/distill.py` run:
script, base model, datasets, steps, tokens seen, held-out metrics, licence and the full recipe. A
converted checkpoint also names its softmax source in `config.base_model_name_or_path`.
`evaluation.json`, which `training/evaluate.py` writes into every linear-attention checkpoint it
evaluates, adds the comparison with the softmax teacher and its sliding-window baseline (short held-out
perplexity; long-context perplexity, passkey retrieval (greedy accuracy, the key's log-probability and argmax
accuracy, beside the teacher's) and cache bytes by context; decode cache bytes and latency, as measured). The
metadata (`ModelCardData`) carries licence, base model (the first of these two that is a Hub id), datasets, tags
and the evaluation as model-index results. The licence is, in order: the one given, the one the run recorded, or
the one in the card of the fine-tuned or the source model (read locally or from the Hub).

The memory section is the one part computed when the card is written, from the config alone
(`cache_memory_statement`): what the decoding cache holds, part by part, as the cache counts its own bytes after a
model with this checkpoint's attention layout and tiny embeddings and MLPs has read two short contexts — what grows
with the context (full-softmax layers, softmax heads) and by how many bytes a token, what is constant (recurrent
state, convolution inputs, window, sparse memory) — and the totals at `CARD_CONTEXTS` tokens in the checkpoint's dtype
(tests/test_model_card_memory.py checks every statement against the cache of a real model). Every other section
renders what the runs recorded.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from safetensors import safe_open

import hf_linear_attn
from hf_linear_attn.cache_linear_attention import MEMORY_FIELDS, LinearStateLayer
from hf_linear_attn.training.data import dataset_names
from hf_linear_attn.training.measure import (
    cache_memory,
    checkpoint_dtype,
    layout_cache,
    layout_model,
    layout_probe,
    softmax_cache_bytes,
)
from hf_linear_attn.training.report import format_cell, markdown_table

# The top-level `model_cards/` folder of a checkout, beside `training/`; the wheel installs it as
# `hf_linear_attn/model_cards/`, beside `hf_linear_attn/training/`, so the same relative path finds it in both.
TEMPLATE = Path(__file__).resolve().parent.parent / "model_cards" / "model_card.md"
SUMMARY_FILE = "training_summary.json"
EVALUATION_FILE = "evaluation.json"
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def write_training_summary(output_dir: str | Path, *, script: str, base_model: str | None, data_args: Any,
                           result: Any, recipe: dict[str, Any], license: str | None = None) -> None:
    """`OUTPUT_DIR/training_summary.json` for the model card: `script` that trained, the checkpoint it started
    from, the data (`training.data.DataArguments`), steps / tokens / held-out metrics (`training.loop.TrainResult`),
    the recipe as run, the licence given (None: the card inherits the base model's) and, when the folder
    holds a model config (not a PEFT adapter), its cache bytes at two contexts (`training.measure.cache_memory`;
    the card computes its own memory statement, `cache_memory_statement`)."""
    config_file = Path(output_dir) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else None
    summary = {
        "script": script,
        "base_model": base_model,
        "dataset_name": data_args.dataset_name,
        "datasets": dataset_names(data_args),
        "steps": result.global_step,
        "tokens_seen": result.tokens_seen,
        "eval": result.eval_metrics,
        "license": license,
        "recipe": recipe,
        "cache_memory": cache_memory(config) if config is not None else None,
    }
    (Path(output_dir) / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))


def is_hub_id(name: str | None) -> bool:
    """True for names that look like Hub repo ids and are not local paths."""
    return bool(name) and not Path(name).exists() and bool(_HUB_ID.match(name))


def inherited_license(base_model: str | None) -> str | None:
    """The licence in the card of `base_model` (a local folder or a Hub id), or None if unknown."""
    if not base_model:
        return None
    local = Path(base_model) / "README.md"
    try:
        card = ModelCard.load(local if local.is_file() else base_model)
    except (OSError, ValueError):  # no card, offline, not on the Hub
        return None
    return card.data.license


def human_bytes(count: int) -> str:
    """`count` bytes for a reader: "512 B", "1.5 KiB", "44.7 MiB", "1.4 GiB"."""
    if count < 1024:
        return f"{count} B"
    exponent = min(int(math.log(count, 1024)), 3)
    return f"{count / 1024**exponent:,.1f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"


def exact_bytes(count: int) -> str:
    """`count` bytes exactly, and for a reader past 1 KiB: "512 B", "9,216 B (9.0 KiB)"."""
    return f"{count:,} B" + (f" ({human_bytes(count)})" if count >= 1024 else "")


def long_context_tables(evaluation: dict[str, Any], label: str | None = None) -> dict[str, str]:
    """{title: Markdown table} of the long-context part of an evaluation record (what `training.evaluation`
    measured): perplexity by context with its ratio to the teacher's, passkey scores (`passkey_cell`) per length,
    haystack and variant with the models (the teacher first) side by side, and cache bytes by context with their
    share of the teacher's. The row (or column) of model `label` is in bold. A part that was not measured gives
    no table."""
    long_rows, passkey = evaluation.get("long_context") or [], evaluation.get("passkey") or []
    bold = lambda text, model: f"**{text}**" if model == label else text  # noqa: E731
    tables = {}

    def by_model(value: Any) -> str:
        """Rows: models; columns: contexts; cells: value(row, the teacher's row at that context)."""
        contexts = sorted({r["context"] for r in long_rows})
        teacher = {r["context"]: r for r in long_rows if r["model"] == "teacher"}
        rows = {}
        for r in long_rows:
            cell = value(r, teacher.get(r["context"]) if r["model"] != "teacher" else None)
            rows.setdefault(r["model"], {"model": bold(r["model"], r["model"])})[r["context"]] = bold(cell, r["model"])
        return markdown_table(list(rows.values()), {"model": "model", **{c: f"{c:,}" for c in contexts}})

    if long_rows:
        scored = min(r["scored_tokens"] for r in long_rows)
        tables[f"Held-out perplexity by context (≥ {scored:,} scored tokens each; × teacher)"] = by_model(
            lambda r, t: format_cell(r["perplexity"]) + (f" ({r['perplexity'] / t['perplexity']:.2f}×)" if t else ""))
        if all("last_quarter_perplexity" in r for r in long_rows):  # records before it was measured lack it
            tables["Perplexity over the last quarter of each window, where the far context is read"] = by_model(
                lambda r, t: format_cell(r["last_quarter_perplexity"]))
        tables["Decoding cache by context (share of the teacher's)"] = by_model(
            lambda r, t: human_bytes(r["cache_bytes"]) + (f" ({r['cache_bytes'] / t['cache_bytes']:.0%})" if t else "")
        )
    if passkey:
        models = list(dict.fromkeys(r["model"] for r in passkey))
        rows = {}
        for r in passkey:
            setting = (r["length"], r["haystack"], r["variant"])
            rows.setdefault(setting, {"setting": f"{r['length']:,} {r['haystack']} {r['variant']}"})[r["model"]] = bold(
                passkey_cell(r), r["model"])
        trials = sorted({r["trials"] for r in passkey})
        title = (f"Passkey retrieval ({' / '.join(map(str, trials))} trials per setting): greedy accuracy (key "
                 "log-probability, mean ± s.e. over trials; share of the key's tokens that are the argmax)")
        tables[title] = markdown_table(list(rows.values()), {"setting": "length, haystack, variant",
                                                             **{m: bold(m, m) for m in models}})
    return tables


def passkey_cell(row: dict[str, Any]) -> str:
    """One passkey measurement as "accuracy (log-prob ± s.e.; argmax accuracy)"; a record written before the
    teacher-forced scores existed has the accuracy alone."""
    if "key_log_prob" not in row:
        return f"{row['accuracy']:.0%}"
    return (f"{row['accuracy']:.0%} ({row['key_log_prob']:.2f} ± {row['key_log_prob_se']:.2f}; "
            f"{row['argmax_accuracy']:.0%})")


def comparison_tables(evaluation: dict[str, Any]) -> dict[str, Any]:
    """The template's view of an `evaluation.json`: header and formatted rows of the quality and decode
    tables and the long-context tables (`long_context_tables`), with this checkpoint's rows marked in bold."""
    quality, decode, label = evaluation["rows"], evaluation["decode"], evaluation["label"]
    keys = ["perplexity", "vs_teacher"]

    def row(cells: list[Any], mine: bool) -> list[str]:
        return [f"**{format_cell(c)}**" if mine else format_cell(c) for c in cells]

    return {
        "quality_header": ["model", "perplexity", "× teacher"],
        "quality_rows": [row([r["model"], *(r.get(k) for k in keys)], r["model"] == label) for r in quality],
        "long_context": long_context_tables(evaluation, label),
        "decode_rows": [row([r["model"], r["context"], r["cache_bytes"], r["ms_per_token"]], r["model"] == label)
                        for r in decode],
        "rows_evaluated": evaluation.get("eval_rows"),
        "block_size": evaluation.get("block_size"),
        "machine": evaluation.get("machine"),
    }


def _num_parameters(folder: Path) -> int:
    """Parameters stored in the folder's safetensors files (read from their headers only)."""
    total = 0
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as weights:
            total += sum(math.prod(weights.get_slice(key).get_shape()) for key in weights.keys())  # noqa: SIM118
    return total


# Context lengths at which a card states the cache's total bytes.
CARD_CONTEXTS = (4096, 32768)

# The part of a card's memory statement each tensor of a `LinearAttentionCache` layer belongs to: a full-softmax
# layer's keys and values, and the `TENSORS` of the linear-attention layers' kinds.
CACHE_PARTS = {
    "keys": "softmax layers", "values": "softmax layers",
    "head_keys": "softmax heads", "head_values": "softmax heads",
    "state": "recurrent state",
    "conv_inputs": "convolution inputs",
    **dict.fromkeys(("window_keys", "window_values", "window_mask", "window_beta", "window_log_decay"), "window"),
    **dict.fromkeys(MEMORY_FIELDS.values(), "sparse memory"),
}


@dataclass(frozen=True)
class CachePart:
    """One part of a decoding cache: what it holds, in words, and its bytes after T tokens of one sequence,
    `constant_bytes + T * bytes_per_token`."""

    what: str
    constant_bytes: int
    bytes_per_token: int


@dataclass(frozen=True)
class CacheMemory:
    """The decoding cache of one sequence, part by part (`cache_memory_statement`): its total bytes at `contexts` and
    those of the key/value cache of a softmax model of the same shape (`softmax_bytes`), weights in `dtype`."""

    dtype: str
    parts: tuple[CachePart, ...]
    contexts: tuple[int, ...]
    softmax_bytes: tuple[int, ...]

    @property
    def growing(self) -> list[CachePart]:
        """The parts that grow with the context (none: the cache has one size at every context)."""
        return [part for part in self.parts if part.bytes_per_token]

    @property
    def constant(self) -> list[CachePart]:
        """The parts with bytes that do not depend on the context."""
        return [part for part in self.parts if part.constant_bytes]

    @property
    def bytes_per_token(self) -> int:
        return sum(part.bytes_per_token for part in self.parts)

    @property
    def constant_bytes(self) -> int:
        return sum(part.constant_bytes for part in self.parts)

    def total(self, tokens: int) -> int:
        """Bytes of the cache after `tokens` tokens."""
        return self.constant_bytes + tokens * self.bytes_per_token

    @property
    def rows(self) -> list[dict[str, int]]:
        """Per context: its `tokens`, this cache's `bytes` and the softmax model's `softmax_bytes`."""
        return [{"tokens": tokens, "bytes": self.total(tokens), "softmax_bytes": softmax}
                for tokens, softmax in zip(self.contexts, self.softmax_bytes, strict=True)]


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'s' * (number != 1)}"


def _cache_parts(cache: hf_linear_attn.LinearAttentionCache) -> dict[str, tuple[int, list[Any]]]:
    """Per part of `cache` (`CACHE_PARTS`): its bytes, tensor by tensor as the cache counts them (`nbytes`), and the
    cache layers holding it."""
    parts: dict[str, tuple[int, list[Any]]] = {}
    for layer in cache.layers:
        is_state = isinstance(layer, LinearStateLayer)
        tensors = layer.tensors() if is_state else {"keys": layer.keys, "values": layer.values}
        held: dict[str, int] = {}
        for name, tensor in tensors.items():
            if name not in CACHE_PARTS:
                raise KeyError(f"the cache tensor {name!r} belongs to no part of the memory statement: add it to "
                               "training.model_card.CACHE_PARTS")
            held[CACHE_PARTS[name]] = held.get(CACHE_PARTS[name], 0) + tensor.numel() * tensor.element_size()
        for part, size in held.items():
            total, layers = parts.get(part, (0, []))
            parts[part] = (total + size, [*layers, layer])
    return parts


def _part_description(part: str, layers: list[Any], config: hf_linear_attn.LinearAttentionConfig) -> str:
    """What `part` of the cache of a model with `config` holds, in words, held by the cache layers `layers`."""
    held_in = f"in {_count(len(layers), 'layer')}"
    if part == "softmax layers":
        indices = ", ".join(map(str, config.softmax_layers))
        return (f"the keys and values of the {_count(len(layers), 'full-softmax layer')} "
                f"({'layer' if len(layers) == 1 else 'layers'} {indices}), {config.num_key_value_heads} KV heads each")
    if part == "softmax heads":
        heads = sum(len(kv_heads) for kv_heads in config.softmax_heads.values())
        return f"the keys and values of the {_count(heads, 'softmax KV head')} {held_in} (`softmax_heads`)"
    if part == "recurrent state":
        return f"the recurrent state {held_in}"
    if part == "convolution inputs":
        return f"the short convolution's last {config.conv_size - 1} inputs {held_in}"
    if part == "window":
        return (f"the keys and values of the last {layers[0].ring_size} positions and "
                f"{_count(config.num_sink_tokens, 'sink token')} {held_in}")
    return f"the sparse exact memory's {config.sparse_cache_size} slots per KV head {held_in} (`sparse_cache_size`)"


def cache_memory_statement(config: dict[str, Any], contexts: tuple[int, ...] = CARD_CONTEXTS) -> CacheMemory:
    """What the decoding cache of one sequence of a model with `config` (a linear-attention config as a dict) holds in
    the checkpoint's dtype, part by part: what grows with the context (the full-softmax layers' and the softmax
    heads' keys and values), by how many bytes a token, and what does not (the recurrent state, the convolution
    inputs, the window, the sparse memory's slots), with the totals at `contexts`.

    The bytes are the cache's own (`LinearAttentionCache.nbytes`, tensor by tensor) after a model with this
    attention layout and tiny embeddings (`training.measure.layout_model`) has read `p` and `2p` tokens
    (`layout_probe`): past `p`, each part is constant or grows by the same bytes a token, so the two give its
    constant and its bytes a token."""
    if not contexts or not all(isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0
                               for tokens in contexts):
        raise hf_linear_attn.InputError(f"contexts must be positive numbers of tokens, got {contexts!r}")
    dtype = checkpoint_dtype(config)
    model = layout_model(config, dtype)
    probe = layout_probe(model.config)
    short, long = (_cache_parts(layout_cache(model, tokens)) for tokens in (probe, 2 * probe))
    parts = []
    for part, (size, layers) in short.items():
        per_token = (long[part][0] - size) // probe
        parts.append(CachePart(_part_description(part, layers, model.config), size - probe * per_token, per_token))
    shape = hf_linear_attn.LinearAttentionConfig.from_dict(config)
    return CacheMemory(dtype=str(dtype).removeprefix("torch."), parts=tuple(parts), contexts=tuple(contexts),
                       softmax_bytes=tuple(softmax_cache_bytes(shape, tokens, dtype) for tokens in contexts))


def render_model_card(folder: str | Path, repo_id: str | None = None, license: str | None = None,
                      memory_contexts: tuple[int, ...] = CARD_CONTEXTS) -> ModelCard:
    """The model card of the checkpoint in `folder` (see the module docstring); `repo_id` names the
    repository in the loading snippets (default: the folder); the memory section states the cache's totals at
    `memory_contexts` tokens (`cache_memory_statement`)."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise hf_linear_attn.InputNotFoundError(f"{folder} holds no config.json: not a saved model checkpoint.")
    config = json.loads(config_file.read_text())
    if config.get("model_type") != hf_linear_attn.LinearAttentionConfig.model_type:
        raise hf_linear_attn.InputError(f"{folder} holds a {config.get('model_type')!r} checkpoint, not a "
                                        "linear-attention model.")
    summary_file = folder / SUMMARY_FILE
    summary = json.loads(summary_file.read_text()) if summary_file.is_file() else {}
    base_model = summary.get("base_model")  # the checkpoint this run fine-tuned
    converted_from = config.get("base_model_name_or_path")  # the softmax model it was converted from
    hub_base = next((name for name in (base_model, converted_from) if is_hub_id(name)), None)
    recorded_license = license or summary.get("license")
    final_license = recorded_license or inherited_license(base_model) or inherited_license(converted_from)
    model_name = repo_id or folder.name
    dataset_id = summary.get("dataset_name")
    eval_metrics = summary.get("eval") or {}
    data_label = ", ".join(summary.get("datasets") or []) or "held-out text"
    eval_results = [
        EvalResult(task_type="text-generation", dataset_type=dataset_id or "custom", dataset_name=data_label,
                   dataset_split="validation", metric_type=name if name == "perplexity" else "loss",
                   metric_name=name, metric_value=round(value, 6))
        for name, value in eval_metrics.items()
    ]
    evaluation_file = folder / EVALUATION_FILE
    evaluation = json.loads(evaluation_file.read_text()) if evaluation_file.is_file() else {}
    comparison = comparison_tables(evaluation) if evaluation else None
    card_data = ModelCardData(
        license=final_license,
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["linear-attention", "hf-linear-attn", f"feature-map-{config['feature_map']}"],
        base_model=hub_base,
        datasets=[dataset_id] if is_hub_id(dataset_id) else None,
        model_name=model_name,
        eval_results=eval_results or None,
    )
    recipe = summary.get("recipe")
    return ModelCard.from_template(
        card_data,
        template_path=str(TEMPLATE),
        model_name=model_name,
        repo_id=repo_id or str(folder),
        base_model=base_model,
        converted_from=converted_from,
        config=config,
        memory=cache_memory_statement(config, memory_contexts),
        human_bytes=human_bytes,
        exact_bytes=exact_bytes,
        num_parameters=_num_parameters(folder),
        datasets=summary.get("datasets"),
        steps=summary.get("steps"),
        tokens_seen=summary.get("tokens_seen"),
        recipe_yaml=yaml.safe_dump(recipe, sort_keys=False) if recipe else None,
        script=summary.get("script", "training/finetune.py"),
        eval_metrics=eval_metrics,
        comparison=comparison,
        license=final_license,
        license_inherited=final_license is not None and recorded_license is None,
    )

def write_model_card(folder: str | Path, repo_id: str | None = None, license: str | None = None) -> ModelCard:
    """Render the card (see `render_model_card`) and save it as `folder/README.md`."""
    card = render_model_card(folder, repo_id, license)
    card.save(Path(folder) / "README.md")
    return card
