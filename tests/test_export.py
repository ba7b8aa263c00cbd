"""training/export.py (`hf-linear-attn-export`) and `training.adapters`: a LoRA adapter merged shard by shard into its
base (the logits of the adapted base), the scalings peft applies, a checkpoint's code repaired, bad input refused
before anything is written."""

import json
import math
import re
import shutil

import pytest
import torch
from helpers import save_with_tokenizer, tiny_args, tiny_model
from peft import LoraConfig, PeftModel, TaskType, get_peft_model
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from hf_linear_attn.checkpoint_code import checkpoint_code_problems, code_files
from hf_linear_attn.configuration_linear_attention import AUTO_MAP
from hf_linear_attn.training import export, finetune, stages
from hf_linear_attn.training.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, WEIGHTS_INDEX
from hf_linear_attn.training.data import byte_level_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")
IDS = torch.tensor([[1, 5, 9, 17, 33, 65, 4, 8, 12, 90, 3, 7, 21, 44, 60, 2, 11, 19, 25, 6]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits


def tensors(folder) -> dict[str, torch.Tensor]:
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(str(path)))
    return found


def listing(folder) -> dict[str, bytes]:
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


def assert_merged_as_adapted(merged, base, adapter) -> None:
    """The merged checkpoint's logits are those of the adapter on its base, and differ from the base's."""
    adapted = logits(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval())
    plain = logits(AutoModelForCausalLM.from_pretrained(base).eval())
    assert (logits(AutoModelForCausalLM.from_pretrained(merged).eval()) - adapted).abs().max() < 1e-5
    assert (adapted - plain).abs().max() > 1e-3  # the adapter changes something: the check above can fail


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A saved tiny hybrid (Hedgehog + window, as the recipe trains) with the byte-level tokenizer, which reads the
    embedded corpus as text (a word-level one would read it as unknown tokens and train nothing)."""
    folder = tmp_path_factory.mktemp("base")
    tokenizer = byte_level_tokenizer()
    tiny_model(vocab_size=len(tokenizer), feature_map="hedgehog", feature_dim=8, window_size=5,
               num_sink_tokens=2).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def trained_adapter(base, tmp_path_factory, dataset_cache):
    """Two LoRA steps of training/finetune.py on `base`, saved as a PEFT adapter (--merge_lora false)."""
    folder = tmp_path_factory.mktemp("adapter")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    stages.finetune(finetune.parse_args(tiny_args(
        folder, dataset_cache, "--config_name", "", "--model_name_or_path", str(base), "--use_lora",
        "--merge_lora", "false", "--max_steps", "2", "--learning_rate", "0.05", "--lora_target_modules", "q_proj",
        "v_proj", "o_proj", "--warmup_steps", "0")))
    torch.set_num_threads(threads)
    return folder


# A trained adapter, merged --------------------------------------------------------------------------------------


def test_a_trained_adapter_merges_into_a_checkpoint_with_the_adapted_logits(base, trained_adapter, tmp_path, capsys):
    assert json.loads((trained_adapter / ADAPTER_CONFIG).read_text())["base_model_name_or_path"] == str(base)
    merged = tmp_path / "merged"
    assert export.main(["--model_name_or_path", str(trained_adapter), "--output_dir", str(merged)]) == 0
    assert f"into its base: {merged}" in capsys.readouterr().out
    assert_merged_as_adapted(merged, base, trained_adapter)
    names = {path.name for path in merged.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", "training_summary.json",
            "README.md"} <= names
    assert set(code_files()) <= names and not {ADAPTER_CONFIG, ADAPTER_WEIGHTS, "log.jsonl"} & names
    assert json.loads((merged / "config.json").read_text())["auto_map"] == AUTO_MAP
    assert checkpoint_code_problems(merged) == []
    summary = json.loads((merged / "training_summary.json").read_text())
    assert summary["steps"] == 2 and summary["cache_memory"]  # measured now that the folder has a model config
    card = (merged / "README.md").read_text()
    assert "| context (tokens) | this model's cache |" in card and f"# {merged.name}" in card
    # Only the targeted weights changed, each in the base's dtype.
    before, after = tensors(base), tensors(merged)
    assert set(before) == set(after) and all(after[name].dtype == before[name].dtype for name in before)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {name for name in before if name.endswith(("q_proj.weight", "v_proj.weight", "o_proj.weight"))}
    assert not list(tmp_path.glob(".merged*"))  # no temporary folder left


def test_a_sharded_base_merges_shard_by_shard_into_the_same_layout(base, trained_adapter, tmp_path):
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(base).save_pretrained(sharded, max_shard_size="40KB")
    shards = sorted(path.name for path in sharded.glob("*.safetensors"))
    assert len(shards) >= 3 and not (sharded / "model.safetensors").exists()
    merged = tmp_path / "merged"
    export.main(["--model_name_or_path", str(trained_adapter), "--output_dir", str(merged),
                 "--base_model_name_or_path", str(sharded)])
    assert sorted(path.name for path in merged.glob("*.safetensors")) == shards
    assert json.loads((merged / WEIGHTS_INDEX).read_text()) == json.loads((sharded / WEIGHTS_INDEX).read_text())
    touched = set()
    for shard in shards:
        before, after = load_file(str(sharded / shard)), load_file(str(merged / shard))
        assert set(before) == set(after)
        if any(not torch.equal(before[name], after[name]) for name in before):
            touched.add(shard)
        with safe_open(str(sharded / shard), "pt") as a, safe_open(str(merged / shard), "pt") as b:
            assert a.metadata() == b.metadata()
    assert len(touched) >= 2  # the LoRA landed in several shards
    assert (merged / "tokenizer.json").read_bytes() == (trained_adapter / "tokenizer.json").read_bytes()
    assert_merged_as_adapted(merged, sharded, trained_adapter)


# Scalings, patterns and full tensors, exactly as peft applies them ---------------------------------------------

CASES = {
    # r 4, alpha 8 with rsLoRA: 8 / sqrt(4); layer 1's q_proj has rank 2 (8 / sqrt(2)); every v_proj alpha 3 (3 / 2).
    "patterns-rslora-modules_to_save": (
        {}, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_rslora=True,
                 rank_pattern={"layers.1.self_attn.q_proj": 2}, alpha_pattern={"v_proj": 3},
                 modules_to_save=["lm_head"]),
        {"model.layers.0.self_attn.q_proj.weight": 4.0, "model.layers.1.self_attn.q_proj.weight": 8 / math.sqrt(2),
         "model.layers.0.self_attn.v_proj.weight": 1.5, "model.layers.1.self_attn.v_proj.weight": 1.5}),
    # An embedding's LoRA (its weight saved beside it) and every bias trained (bias="all"): alpha / r = 2.
    "embedding-and-biases": (
        {"attention_bias": True}, dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"], bias="all"),
        {"model.embed_tokens.weight": 2.0, "model.layers.0.self_attn.q_proj.weight": 2.0,
         "model.layers.1.self_attn.q_proj.weight": 2.0}),
}


def peft_adapter(folder, base_folder, lora_options, seed=0):
    """An adapter saved by peft with random LoRA B and full tensors (no training): what a trained one looks like."""
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_folder),
                           LoraConfig(task_type=TaskType.CAUSAL_LM, **lora_options))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad and "lora_A" not in name and "lora_embedding_A" not in name:
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_scalings_patterns_and_full_tensors_merge_as_peft_applies_them(case, dtype, tmp_path):
    model_options, lora_options, scalings = CASES[case]
    base_folder = tmp_path / "base"
    save_with_tokenizer(tiny_model(seed=1, **model_options).to(dtype), base_folder)
    adapter = peft_adapter(tmp_path / "adapter", base_folder, lora_options)
    merged = tmp_path / "merged"
    export.main(["--model_name_or_path", str(adapter), "--output_dir", str(merged)])  # base from adapter_config.json
    before, after, saved = tensors(base_folder), tensors(merged), load_file(str(adapter / ADAPTER_WEIGHTS))
    prefix = "base_model.model."
    for name, scaling in scalings.items():
        module = name.removesuffix(".weight")
        if "embed" in name:
            a, b = saved[f"{prefix}{module}.lora_embedding_A"], saved[f"{prefix}{module}.lora_embedding_B"]
            delta = (b.float() @ a.float()).T
        else:
            delta = saved[f"{prefix}{module}.lora_B.weight"].float() @ saved[f"{prefix}{module}.lora_A.weight"].float()
        expected = (before[name].float() + scaling * delta).to(dtype)
        assert after[name].dtype == dtype and torch.equal(after[name], expected), name
    full = {key.removeprefix(prefix).replace(".base_layer", ""): value for key, value in saved.items()
            if ".lora_" not in key}
    assert full  # lm_head (modules_to_save), or the biases and the embedding's own weight
    for name, value in full.items():
        assert torch.equal(after[name], value.to(dtype)), name
    unchanged = set(before) - set(scalings) - set(full)
    assert all(torch.equal(before[name], after[name]) for name in unchanged)
    if dtype == torch.float32:
        assert_merged_as_adapted(merged, base_folder, adapter)


# Repairing a checkpoint's code ---------------------------------------------------------------------------------


def broken_checkpoint(folder):
    """A checkpoint as an older version saved it under FSDP2: torch's FSDP class as its code, the model file gone;
    with a training run's leftovers beside it."""
    save_with_tokenizer(tiny_model(), folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"]["AutoModelForCausalLM"] = "_fsdp_init.FSDPLinearAttentionForCausalLM"
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "_fsdp_init.py").write_text("class FSDPLinearAttentionForCausalLM:  # torch's, not ours\n    pass\n")
    (folder / "modeling_linear_attention.py").unlink()
    (folder / "checkpoint-2").mkdir()
    (folder / "checkpoint-2" / "trainer_state.json").write_text("{}")
    (folder / "log.jsonl").write_text("{}\n")
    return folder


def test_a_checkpoint_with_foreign_code_is_repaired_in_place_or_into_a_copy(tmp_path, capsys):
    source = broken_checkpoint(tmp_path / "broken")
    problems = checkpoint_code_problems(source)
    assert len(problems) >= 3  # the foreign auto_map entry, the foreign file, the missing model file
    weights = (source / "model.safetensors").read_bytes()

    copy = tmp_path / "copy"
    before = listing(source)
    export.main(["--model_name_or_path", str(source), "--output_dir", str(copy)])
    assert f"Copied {source} to {copy}" in capsys.readouterr().out
    assert listing(source) == before  # the source is only read
    assert checkpoint_code_problems(copy) == []
    assert (copy / "model.safetensors").read_bytes() == weights
    assert not {"checkpoint-2", "log.jsonl", "_fsdp_init.py"} & {path.name for path in copy.iterdir()}
    assert (copy / "tokenizer.json").is_file()
    assert type(AutoModelForCausalLM.from_pretrained(copy)).__name__ == "LinearAttentionForCausalLM"

    export.main(["--model_name_or_path", str(source), "--output_dir", str(source)])
    printed = capsys.readouterr().out
    assert "repaired" in printed and all(problem in printed for problem in problems)
    assert checkpoint_code_problems(source) == []
    assert (source / "model.safetensors").read_bytes() == weights
    assert (source / "checkpoint-2").is_dir() and (source / "log.jsonl").is_file()  # in place: nothing else touched
    export.main(["--model_name_or_path", str(source), "--output_dir", str(source)])
    assert "nothing needed changing" in capsys.readouterr().out


# Bad input: a clear error, nothing written ---------------------------------------------------------------------


def _bad_input(case, tmp_path, base, trained_adapter):
    """(arguments, expected error) of each case; the output folder is tmp_path / "out" unless the case says."""
    out = tmp_path / "out"
    adapter = ["--model_name_or_path", str(trained_adapter)]
    if case == "missing base":
        return [*adapter, "--output_dir", str(out), "--base_model_name_or_path", str(tmp_path / "nowhere")], \
            r"base model .*nowhere: no such folder"
    if case == "base without a recorded name":
        copy = tmp_path / "adapter"
        shutil.copytree(trained_adapter, copy)
        config = json.loads((copy / ADAPTER_CONFIG).read_text())
        (copy / ADAPTER_CONFIG).write_text(json.dumps({**config, "base_model_name_or_path": None}))
        return ["--model_name_or_path", str(copy), "--output_dir", str(out)], r"names no base model"
    if case == "base of another model":
        other = tmp_path / "other"
        save_with_tokenizer(tiny_model(num_hidden_layers=1, feature_map="hedgehog", feature_dim=8, window_size=5,
                                       num_sink_tokens=2), other)
        return [*adapter, "--output_dir", str(out), "--base_model_name_or_path", str(other)], \
            r"does not fit the base model(.|\n)*layers\.1\.self_attn\.q_proj\.lora_A\.weight: no base weight " \
            r"model\.layers\.1\.self_attn\.q_proj\.weight"
    if case == "base without safetensors":
        bare = tmp_path / "bare"
        bare.mkdir()
        shutil.copy(base / "config.json", bare)
        return [*adapter, "--output_dir", str(out), "--base_model_name_or_path", str(bare)], \
            r"holds no safetensors weights"
    if case == "DoRA adapter":
        dora = peft_adapter(tmp_path / "dora", base, dict(r=4, lora_alpha=8, target_modules=["q_proj"],
                                                          use_dora=True))
        return ["--model_name_or_path", str(dora), "--output_dir", str(out)], \
            r"not a plain LoRA adapter \(use_dora=True\); this merges plain LoRA"
    if case == "output not empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
        return [*adapter, "--output_dir", str(out)], r"exists and is not empty"
    if case == "output inside the adapter":
        return [*adapter, "--output_dir", str(trained_adapter / "merged")], r"lies inside the adapter folder"
    if case == "neither adapter nor checkpoint":
        llama = tmp_path / "llama"
        llama.mkdir()
        (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
        return ["--model_name_or_path", str(llama), "--output_dir", str(out)], \
            r"neither a PEFT adapter folder .* nor a hf-linear-attn checkpoint"
    raise AssertionError(case)


BAD_INPUT = ["missing base", "base without a recorded name", "base of another model", "base without safetensors",
             "DoRA adapter", "output not empty", "output inside the adapter", "neither adapter nor checkpoint"]


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_refused_before_anything_is_written(case, tmp_path, base, trained_adapter, capsys):
    args, message = _bad_input(case, tmp_path, base, trained_adapter)
    before = {folder: listing(folder) for folder in (tmp_path, base, trained_adapter)}
    capsys.readouterr()  # what setting the case up printed
    with pytest.raises(SystemExit) as exit_:
        export.main(args)
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and error.startswith("error: "), error
    assert re.search(message, error), error
    assert {folder: listing(folder) for folder in before} == before  # nothing written
    assert not [path for folder in before for path in folder.rglob(".*.tmp-*")]  # no temporary folder left
