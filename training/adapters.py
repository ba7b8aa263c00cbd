"""Merging a saved LoRA adapter into its base checkpoint: `merge_adapter(adapter_dir, output_dir)`.

`training/finetune.py --use_lora --merge_lora false` (the only LoRA route under FSDP / DeepSpeed ZeRO-3, where no
process holds the full weights) saves a PEFT adapter folder: `adapter_config.json`, `adapter_model.safetensors`,
the tokenizer and the run's records. `merge_adapter` turns it into an ordinary checkpoint without building a model:
it reads the base's safetensors one file (shard) at a time, adds `scaling * B @ A` to each targeted weight (in
float32, cast back to the weight's dtype), puts the adapter's full tensors in place of the base's, and writes the
shard under its own name, so the output has the base's layout (same files, same index) and the host memory needed
is one shard, not the model: an 8B bf16 base fits wherever one of its shards does.

The adapter format, as peft (0.17 to 0.21) saves a LoRA adapter on a causal LM:
- `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight` [out, r]: an `nn.Linear` `<module>`
  whose base weight is `<module>.weight` [out, in] (`W += scaling * B @ A`);
- `base_model.model.<module>.lora_embedding_A` [r, num] and `.lora_embedding_B` [dim, r]: an `nn.Embedding`
  (`W += scaling * (B @ A)ᵀ`);
- any other tensor, `base_model.model.<path>` (`modules_to_save`, trained biases with `bias="all"` or
  `"lora_only"`, an embedding saved beside its LoRA), is a full tensor that replaces the base's `<path>` (a wrapped
  module's `.base_layer.` left out of the name), cast to the base tensor's dtype;
- scaling = lora_alpha / r, or lora_alpha / sqrt(r) with `use_rslora`; `rank_pattern` / `alpha_pattern` give r and
  alpha per module, matched as peft matches them (the first key `k` with `(.*\\.)?(k)$` matching the module name).

Only plain LoRA merges this way: an adapter with any other option (DoRA, `fan_in_fan_out`, LoRA biases, target
parameters, layer replication, trainable tokens, aLoRA, a PiSSA / OLoRA / CorDA / LoftQ / LoRA-GA initialisation
that changed the base weights, other peft methods) is refused before anything is read, as is an adapter tensor
with no base weight of its shape. The output folder is written into a hidden temporary folder beside it and renamed
at the end (`staged_folder`), and may not lie inside the adapter or the base folder.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from hf_linear_attn.checkpoint_code import is_project_checkpoint, repair_checkpoint_code
from hf_linear_attn.configuration_linear_attention import InputError, InputNotFoundError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
SUMMARY_FILE = "training_summary.json"  # training.model_card.SUMMARY_FILE, without importing the card's modules
PEFT_PREFIX = "base_model.model."
# Files a tokenizer's save_pretrained writes (besides any file whose name starts with "tokenizer").
TOKENIZER_FILES = ("special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                   "spiece.model", "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json")
TOKENIZER_FOLDERS = ("additional_chat_templates",)
MODEL_FILES = ("config.json", "generation_config.json")
# How a LoRA tensor is named, and how each kind of layer merges.
_LINEAR = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")
_EMBEDDING = re.compile(r"^(?P<module>.+)\.lora_embedding_(?P<part>[AB])$")
# adapter_config.json fields that do not change what a merge computes (the others must be off: `_check_lora_kind`).
_PLAIN_FIELDS = {
    "peft_type", "task_type", "auto_mapping", "base_model_name_or_path", "revision", "inference_mode", "peft_version",
    "r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "target_modules", "exclude_modules",
    "layers_to_transform", "layers_pattern", "lora_dropout", "bias", "modules_to_save", "init_lora_weights",
    "ensure_weight_tying", "megatron_config", "megatron_core", "qalora_group_size", "runtime_config",
    "eva_config", "corda_config", "loftq_config",  # read only by their initialisation, checked by init_lora_weights
}
# Initialisations that leave the base weights as they are (the others fold part of them into the adapter).
_PLAIN_INITS = (True, False, "gaussian", "eva", "orthogonal", "mica")
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
SUPPORTED = ("plain LoRA (peft_type LORA) on nn.Linear and nn.Embedding weights, with any r / lora_alpha, "
             "use_rslora, rank_pattern / alpha_pattern, modules_to_save and bias='none' / 'all' / 'lora_only'")


def is_adapter_folder(folder: str | os.PathLike) -> bool:
    """Whether `folder` holds a PEFT adapter (an adapter_config.json)."""
    return (Path(folder) / ADAPTER_CONFIG).is_file()


def read_adapter_config(adapter_dir: str | os.PathLike) -> dict[str, Any]:
    """The adapter's config, after checking that the folder holds a plain LoRA adapter in safetensors that this
    module merges (ValueError / FileNotFoundError naming what is not, and what is supported)."""
    adapter_dir = Path(adapter_dir)
    if not is_adapter_folder(adapter_dir):
        raise InputNotFoundError(f"{adapter_dir} holds no {ADAPTER_CONFIG}: not a PEFT adapter folder.")
    if not (adapter_dir / ADAPTER_WEIGHTS).is_file():
        raise InputNotFoundError(f"{adapter_dir} holds no {ADAPTER_WEIGHTS} (an adapter saved as a pickle, "
                                "adapter_model.bin, is not read: save it again with safe_serialization=True).")
    config = json.loads((adapter_dir / ADAPTER_CONFIG).read_text())
    _check_lora_kind(config, adapter_dir)
    return config


def _check_lora_kind(config: dict[str, Any], adapter_dir: Path) -> None:
    if config.get("peft_type") != "LORA":
        raise InputError(f"{adapter_dir} is a {config.get('peft_type')!r} adapter; this merges {SUPPORTED}.")
    init = config.get("init_lora_weights", True)
    if init not in _PLAIN_INITS:
        raise InputError(f"{adapter_dir} was initialised with init_lora_weights={init!r}, which changes the base "
                         "weights: save it converted to plain LoRA (peft's path_initial_model_for_weight_conversion) "
                         f"and merge that. This merges {SUPPORTED}.")
    options = {name: value for name, value in config.items() if name not in _PLAIN_FIELDS and value}
    if options:
        listed = ", ".join(f"{name}={value!r}" for name, value in sorted(options.items()))
        raise InputError(f"{adapter_dir} is not a plain LoRA adapter ({listed}); this merges {SUPPORTED}.")
    if config.get("bias", "none") not in ("none", "all", "lora_only"):
        raise InputError(f"{adapter_dir}: bias={config.get('bias')!r}; this merges {SUPPORTED}.")


def pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """What `rank_pattern` / `alpha_pattern` give `module` (a module name of the base model), as peft reads them:
    the first key `k` for which `(.*\\.)?(k)$` matches the whole name, else `default`."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def lora_scaling(config: dict[str, Any], module: str) -> tuple[int, float]:
    """The rank and the scaling of `module`'s LoRA: lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora, with r
    and alpha from `rank_pattern` / `alpha_pattern` where they name the module."""
    rank = pattern_value(config.get("rank_pattern") or {}, module, config["r"])
    alpha = pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
    return rank, alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)


# The base checkpoint ---------------------------------------------------------------------------------------------


def resolve_base(name: str | None, adapter_dir: Path) -> Path:
    """The local folder of the base checkpoint `name`: a folder, or a Hub id found by snapshot_download (the local
    cache only under HF_HUB_OFFLINE=1). ValueError naming it when there is none."""
    if not name:
        raise InputError(f"{adapter_dir}/{ADAPTER_CONFIG} names no base model (base_model_name_or_path): pass the "
                         "base checkpoint the adapter was trained on (--base_model_name_or_path).")
    if Path(name).is_dir():
        return Path(name)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError

    from hf_linear_attn.training.model_card import is_hub_id

    if not is_hub_id(name):
        raise InputError(f"base model {name}: no such folder (nor a Hub id); pass the base checkpoint the adapter "
                         "was trained on (--base_model_name_or_path).")
    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.py", "*.txt", "*.model",
                                                            "*.jinja", "*.tiktoken"]))
    except (OSError, ValueError, HfHubHTTPError) as error:
        raise InputError(f"base model {name}: neither a local folder nor a Hub model that can be downloaded or "
                         f"found in the local cache ({type(error).__name__}: {error}); pass the base checkpoint the "
                         "adapter was trained on (--base_model_name_or_path).") from None


def base_shards(base_dir: Path) -> dict[str, list[str]]:
    """Safetensors file name -> the tensor names it holds, for the base's `model.safetensors` or the shards its
    `model.safetensors.index.json` lists (FileNotFoundError when it has neither, or a listed shard is missing)."""
    if (base_dir / WEIGHTS_FILE).is_file():
        with safe_open(str(base_dir / WEIGHTS_FILE), framework="pt") as weights:
            return {WEIGHTS_FILE: list(weights.keys())}
    if not (base_dir / WEIGHTS_INDEX).is_file():
        raise InputNotFoundError(f"base model {base_dir} holds no safetensors weights ({WEIGHTS_FILE} or "
                                f"{WEIGHTS_INDEX}); a base saved otherwise must first be saved again with "
                                "save_pretrained (safetensors).")
    shards: dict[str, list[str]] = {}
    for key, file in json.loads((base_dir / WEIGHTS_INDEX).read_text())["weight_map"].items():
        shards.setdefault(file, []).append(key)
    if missing := sorted(file for file in shards if not (base_dir / file).is_file()):
        raise InputNotFoundError(f"base model {base_dir}: {WEIGHTS_INDEX} lists shards that are missing: {missing}.")
    return shards


# The plan: what happens to which base tensor ---------------------------------------------------------------------


@dataclass(frozen=True)
class LoraUpdate:
    """`W += scaling * B @ A` (transposed for an embedding) on one base weight."""

    a_key: str
    b_key: str
    scaling: float
    embedding: bool


@dataclass
class MergePlan:
    """Every change to the base, by base tensor name, checked against the base's names, shapes and dtypes."""

    shards: dict[str, list[str]]  # base file -> its tensor names
    replacements: dict[str, str] = field(default_factory=dict)  # base name -> adapter name of a full tensor
    updates: dict[str, LoraUpdate] = field(default_factory=dict)  # base name -> its LoRA


def plan_merge(adapter_dir: Path, base_dir: Path, config: dict[str, Any]) -> MergePlan:
    """Map every tensor of the adapter to the base tensor it changes; ValueError naming the adapter tensors with
    no base weight, of another shape or rank than the base and config say, or of a layer kind not merged."""
    plan = MergePlan(base_shards(base_dir))
    shapes, dtypes = {}, {}
    for file, keys in plan.shards.items():
        with safe_open(str(base_dir / file), framework="pt") as weights:
            for key in keys:
                tensor = weights.get_slice(key)
                shapes[key], dtypes[key] = list(tensor.get_shape()), tensor.get_dtype()
    with safe_open(str(adapter_dir / ADAPTER_WEIGHTS), framework="pt") as adapter:
        adapter_shapes = {key: list(adapter.get_slice(key).get_shape()) for key in adapter.keys()}  # noqa: SIM118
    if foreign := sorted(key for key in adapter_shapes if not key.startswith(PEFT_PREFIX)):
        raise InputError(f"{adapter_dir}/{ADAPTER_WEIGHTS} holds tensors outside {PEFT_PREFIX!r}: {foreign[:5]}; "
                         f"not an adapter of a causal LM as peft saves it. This merges {SUPPORTED}.")
    pairs: dict[str, dict[str, str]] = {}  # module -> {"A": key, "B": key, "kind": linear / embedding}
    problems = []
    for key in adapter_shapes:
        name = key[len(PEFT_PREFIX):]
        match = _LINEAR.match(name) or _EMBEDDING.match(name)
        if match:
            kind = "linear" if match.re is _LINEAR else "embedding"
            pairs.setdefault(match["module"], {"kind": kind})[match["part"]] = key
        elif ".lora_" in name:
            problems.append(f"{key}: a LoRA tensor of a kind this does not merge")
        else:
            plan.replacements[re.sub(r"\.base_layer(?=\.)", "", name)] = key
    for base_key, key in plan.replacements.items():
        if base_key not in shapes:
            problems.append(f"{key}: no base weight {base_key}")
        elif adapter_shapes[key] != shapes[base_key]:
            problems.append(f"{key}: shape {adapter_shapes[key]}, base weight {base_key} {shapes[base_key]}")
    for module, pair in pairs.items():
        base_key = f"{module}.weight"
        if "A" not in pair or "B" not in pair:
            problems.append(f"{module}: lora_{'A' if 'A' not in pair else 'B'} missing")
            continue
        a_shape, b_shape = adapter_shapes[pair["A"]], adapter_shapes[pair["B"]]
        if len(a_shape) != 2 or len(b_shape) != 2:
            problems.append(f"{pair['A']}: a {len(a_shape)}-d LoRA (a convolution), not merged")
            continue
        rank, scaling = lora_scaling(config, module)
        embedding = pair["kind"] == "embedding"
        delta_shape = [a_shape[1], b_shape[0]] if embedding else [b_shape[0], a_shape[1]]
        if base_key not in shapes:
            problems.append(f"{pair['A']}: no base weight {base_key}")
        elif a_shape[0] != rank or b_shape[1] != rank:
            problems.append(f"{module}: lora_A {a_shape} and lora_B {b_shape}, but rank {rank} in {ADAPTER_CONFIG}")
        elif delta_shape != shapes[base_key]:
            problems.append(f"{module}: B @ A is {delta_shape}, base weight {base_key} {shapes[base_key]}")
        elif dtypes[base_key] not in _FLOAT_DTYPES:
            problems.append(f"{module}: base weight {base_key} is {dtypes[base_key]} (quantized?), not a float")
        else:
            plan.updates[base_key] = LoraUpdate(pair["A"], pair["B"], scaling, embedding)
    if problems:
        listed = "".join(f"\n  {problem}" for problem in problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise InputError(f"{adapter_dir} does not fit the base model {base_dir} (an adapter of another model?):"
                         f"{listed}{more}")
    return plan


# The output folder -----------------------------------------------------------------------------------------------


def check_output_dir(output_dir: str | os.PathLike, **sources: str | os.PathLike) -> Path:
    """The resolved output folder, after checking that it is empty or absent and lies inside none of `sources`
    (label -> folder; the output is written beside itself, so inside a source it would write into it)."""
    output = Path(output_dir).resolve()
    for label, source in sources.items():
        source = Path(source).resolve()
        if output == source or source in output.parents:
            relation = "is" if output == source else "lies inside"
            raise InputError(f"output folder {output_dir} {relation} the {label} {source}, which is only read: "
                             "choose a folder outside it.")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise InputError(f"output folder {output_dir} exists and is not empty: choose a new or empty folder.")
    return output


@contextlib.contextmanager
def staged_folder(output: Path) -> Iterator[Path]:
    """A hidden temporary folder beside `output` to write into; renamed to `output` (absent or empty, as
    `check_output_dir` checked) when the block ends, deleted if it raises: a failed or interrupted write leaves no
    `output` behind."""
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    try:
        yield staging
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)  # mkdtemp's folder is private; the output is an ordinary folder
        if output.exists():
            output.rmdir()
        staging.rename(output)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def tokenizer_files(folder: Path) -> list[Path]:
    """The files and folders a tokenizer's save_pretrained leaves in `folder`."""
    return sorted(path for path in folder.iterdir()
                  if (path.is_file() and (path.name.startswith("tokenizer") or path.name in TOKENIZER_FILES))
                  or (path.is_dir() and path.name in TOKENIZER_FOLDERS))


def copy_into(paths: list[Path], folder: Path) -> None:
    for path in paths:
        if path.is_dir():
            shutil.copytree(path, folder / path.name)
        else:
            shutil.copy2(path, folder / path.name)


# The merge -------------------------------------------------------------------------------------------------------


def merge_shard(base_file: Path, output_file: Path, plan: MergePlan, adapter: Any) -> None:
    """Write `base_file` with the plan's changes to its tensors as `output_file` (same names, dtypes, metadata);
    `adapter` is the adapter's open safetensors file. Holds one shard in memory."""
    with safe_open(str(base_file), framework="pt") as weights:
        metadata = weights.metadata()
        tensors = {key: weights.get_tensor(key) for key in weights.keys()}  # noqa: SIM118
    for key in tensors.keys() & plan.replacements.keys():
        tensors[key] = adapter.get_tensor(plan.replacements[key]).to(tensors[key].dtype).contiguous()
    for key in tensors.keys() & plan.updates.keys():
        update, weight = plan.updates[key], tensors[key]
        delta = adapter.get_tensor(update.b_key).float() @ adapter.get_tensor(update.a_key).float()
        if update.embedding:
            delta = delta.T
        tensors[key] = (weight.float() + update.scaling * delta).to(weight.dtype).contiguous()
    save_file(tensors, str(output_file), metadata=metadata)


def merge_adapter(adapter_dir: str | os.PathLike, output_dir: str | os.PathLike,
                  base_model_name_or_path: str | None = None) -> Path:
    """Merge the LoRA adapter saved in `adapter_dir` into its base checkpoint (`base_model_name_or_path`, else the
    adapter config's `base_model_name_or_path`; a folder or a Hub id in the local cache) and write the result to
    `output_dir` as an ordinary checkpoint: the base's safetensors files merged one at a time (same names and
    index), the base's config.json / generation_config.json and code files, the tokenizer (the adapter folder's if
    it has one, else the base's) and the adapter folder's training_summary.json. A hf-linear-attn base also gets
    this version's code files and auto_map (`repair_checkpoint_code`), its measured cache memory in the summary
    and a model card. Every input is checked before anything is written (ValueError / FileNotFoundError naming
    it); the folder appears complete or not at all. Returns the output folder."""
    adapter_dir = Path(adapter_dir)
    config = read_adapter_config(adapter_dir)
    check_output_dir(output_dir, **{"adapter folder": adapter_dir})
    base_name = base_model_name_or_path or config.get("base_model_name_or_path")
    base_dir = resolve_base(base_name, adapter_dir)
    output = check_output_dir(output_dir, **{"adapter folder": adapter_dir, "base model folder": base_dir})
    if not (base_dir / "config.json").is_file():
        raise InputNotFoundError(f"base model {base_dir} holds no config.json: not a saved model checkpoint.")
    plan = plan_merge(adapter_dir, base_dir, config)
    project = is_project_checkpoint(base_dir)
    tokenizer_source = adapter_dir if tokenizer_files(adapter_dir) else base_dir
    with staged_folder(output) as staging:
        with safe_open(str(adapter_dir / ADAPTER_WEIGHTS), framework="pt") as adapter:
            for file in tqdm(plan.shards, desc=f"Merging {adapter_dir.name} into {base_name}", unit="shard"):
                merge_shard(base_dir / file, staging / file, plan, adapter)
        if (base_dir / WEIGHTS_INDEX).is_file() and not (base_dir / WEIGHTS_FILE).is_file():
            shutil.copy2(base_dir / WEIGHTS_INDEX, staging / WEIGHTS_INDEX)
        copy_into([base_dir / name for name in MODEL_FILES if (base_dir / name).is_file()], staging)
        copy_into(sorted(base_dir.glob("*.py")), staging)  # a custom-code base's auto_map names them
        copy_into(tokenizer_files(tokenizer_source), staging)
        if (adapter_dir / SUMMARY_FILE).is_file():
            copy_into([adapter_dir / SUMMARY_FILE], staging)
        if project:
            repair_checkpoint_code(staging)
            _record_cache_memory(staging)
    if project:
        _write_card(Path(output_dir))
    return output


def _record_cache_memory(folder: Path) -> None:
    """An adapter run's summary has no cache memory (its folder had no model config): measure it now that it has."""
    summary_file = folder / SUMMARY_FILE
    if not summary_file.is_file():
        return
    summary = json.loads(summary_file.read_text())
    if summary.get("cache_memory") is None:
        from hf_linear_attn.training.measure import cache_memory

        summary["cache_memory"] = cache_memory(json.loads((folder / "config.json").read_text()))
        summary_file.write_text(json.dumps(summary, indent=2))


def _write_card(output: Path) -> None:
    """The model card, rendered in the folder's final place (the card names the folder it is in); a card that
    fails removes the folder again, so the merge still leaves a complete output or none."""
    from hf_linear_attn.training.model_card import write_model_card

    try:
        write_model_card(output)
    except BaseException:
        shutil.rmtree(output, ignore_errors=True)
        raise
