"""Model cards for saved linear-attention checkpoints, rendered from `training/model_card.md`.

`write_model_card(folder)` fills the Jinja template `training/model_card.md` through
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

Writing a card runs no model: it renders what the runs recorded. The memory table is measured, not
estimated, by `training.measure.cache_memory` (a model with this checkpoint's attention layout and tiny
embeddings and MLPs runs at two short contexts; every cache part is constant or linear in the tokens, so
longer contexts follow from those two, as its tests check against real prefills) when
`write_training_summary` or the evaluation records a run; a checkpoint with neither record gets no table.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import yaml
from hf_linear_attn.training.data import dataset_names
from hf_linear_attn.training.measure import cache_memory
from hf_linear_attn.training.report import format_cell, markdown_table
from huggingface_hub import EvalResult, ModelCard, ModelCardData
from safetensors import safe_open

import hf_linear_attn

TEMPLATE = Path(__file__).resolve().parent / "model_card.md"
SUMMARY_FILE = "training_summary.json"
EVALUATION_FILE = "evaluation.json"
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def write_training_summary(output_dir: str | Path, *, script: str, base_model: str | None, data_args: Any,
                           result: Any, recipe: dict[str, Any], license: str | None = None) -> None:
    """`OUTPUT_DIR/training_summary.json` for the model card: `script` that trained, the checkpoint it started
    from, the data (`training.data.DataArguments`), steps / tokens / held-out metrics (`training.loop.TrainResult`),
    the recipe as run, the licence given (None: the card inherits the base model's) and, when the folder
    holds a model config (not a PEFT adapter), its measured cache memory (`training.measure.cache_memory`)."""
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


def _human_bytes(count: int) -> str:
    if count < 1024:
        return f"{count} B"
    exponent = min(int(math.log(count, 1024)), 3)
    return f"{count / 1024**exponent:,.1f} {('KiB', 'MiB', 'GiB')[exponent - 1]}"


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
            lambda r, t: _human_bytes(r["cache_bytes"]) + (f" ({r['cache_bytes'] / t['cache_bytes']:.0%})" if t else "")
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


def render_model_card(folder: str | Path, repo_id: str | None = None, license: str | None = None) -> ModelCard:
    """The model card of the checkpoint in `folder` (see the module docstring); `repo_id` names the
    repository in the loading snippets (default: the folder)."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{folder} holds no config.json: not a saved model checkpoint.")
    config = json.loads(config_file.read_text())
    if config.get("model_type") != hf_linear_attn.LinearAttentionConfig.model_type:
        raise ValueError(f"{folder} holds a {config.get('model_type')!r} checkpoint, not a linear-attention model.")
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
    measured = summary.get("cache_memory") or evaluation.get("cache_memory") or []
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
        growing=growing_cache(config),
        num_parameters=_num_parameters(folder),
        cache_rows=[{"tokens": r["tokens"], "linear": _human_bytes(r["linear_bytes"]),
                     "softmax": _human_bytes(r["softmax_bytes"])} for r in measured],
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


def growing_cache(config: dict[str, Any]) -> str | None:
    """What in a model's decoding cache grows with the context, in words (None: nothing does): the full-softmax
    layers' key/value cache and the softmax heads' (`softmax_heads`). The states, windows, convolution inputs and
    the sparse memory are of a fixed size."""
    parts = []
    if layers := config.get("softmax_layers"):
        parts.append(f"the full-softmax layers ({', '.join(map(str, layers))})")
    if heads := {layer: kv for layer, kv in (config.get("softmax_heads") or {}).items() if kv}:
        count = sum(len(kv) for kv in heads.values())
        parts.append(f"the {count} softmax KV head{'s' * (count != 1)} in {len(heads)} "
                     f"layer{'s' * (len(heads) != 1)} (`softmax_heads`)")
    return " and ".join(parts) or None


def write_model_card(folder: str | Path, repo_id: str | None = None, license: str | None = None) -> ModelCard:
    """Render the card (see `render_model_card`) and save it as `folder/README.md`."""
    card = render_model_card(folder, repo_id, license)
    card.save(Path(folder) / "README.md")
    return card
