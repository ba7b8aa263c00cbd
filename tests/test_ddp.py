"""Two-process CPU DDP (gloo) with `accelerate launch` and the shipped accelerate config."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import launch_command_parser
from helpers import ROOT, read_log, save_with_tokenizer, script_env, teacher, tiny_args
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_linear_attn.modeling_linear_attention as modeling
from hf_linear_attn import convert_to_linear_attention
from hf_linear_attn.training import checkpoints

ACCELERATE = Path(sys.executable).parent / "accelerate"
CONFIG = ROOT / "configs" / "accelerate" / "cpu_ddp_2proc.yaml"


def launch_two_ranks(*worker_args: str) -> None:
    """`tests/ddp_worker.py WORKER_ARGS` on two gloo ranks, as `accelerate launch` with the shipped config, on a free
    port (0: accelerate picks one; on its default, launches of parallel test workers collide)."""
    command = [str(ACCELERATE), "launch", "--config_file", str(CONFIG), "--main_process_port", "0",
               str(ROOT / "tests" / "ddp_worker.py"), *worker_args]
    result = subprocess.run(command, cwd=ROOT, env=script_env(ACCELERATE_USE_CPU="1"), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]


def test_two_rank_gloo_ddp_trains_in_step_and_saves_a_loadable_checkpoint(tmp_path, dataset_cache):
    out = tmp_path / "ddp"
    launch_two_ranks("finetune", *tiny_args(out, dataset_cache, "--max_steps", "4", "--save_steps", "2",
                                            "--save_total_limit", "1"))

    rank0, rank1 = (torch.load(out / f"rank{rank}.pt") for rank in (0, 1))
    assert rank0.keys() == rank1.keys()
    for name, tensor in rank0.items():
        assert torch.equal(tensor, rank1[name]), f"ranks disagree on {name}"

    # Both ranks fed the step: 4 steps x 2 processes x 4 rows x 64 tokens.
    assert read_log(out)[-2]["tokens_seen"] == 4 * 2 * 4 * 64
    # The final model and the last checkpoint hold the parameters the ranks agree on.
    saved = AutoModelForCausalLM.from_pretrained(out)
    for name, tensor in saved.named_parameters():
        assert torch.equal(tensor, rank0[name]), name
    (last,) = checkpoints.complete_checkpoints(out)
    assert last.name == "checkpoint-4"
    names = {p.name for p in last.iterdir()}  # each rank keeps its RNG state as JSON, none as a pickle
    assert {"rng_state_0.json", "rng_state_1.json"} <= names and not any(n.startswith("random_states") for n in names)
    state = load_file(str(last / "model.safetensors"))
    assert state.keys() == rank0.keys()
    assert all(torch.equal(state[name], rank0[name]) for name in rank0)
    assert checkpoints.read_trainer_state(last)["geometry"]["num_processes"] == 2


def test_two_rank_gloo_ddp_distillation_trains_the_feature_maps_in_step(tmp_path):
    """Attention transfer's loss goes through the DDP-wrapped forward: the ranks see different rows and still
    end with the same feature maps, changed from the converted model's, with a finite loss that falls."""
    student = convert_to_linear_attention(teacher("llama"), feature_map="hedgehog", feature_dim=8, window_size=4,
                                          num_sink_tokens=1)
    save_with_tokenizer(student, tmp_path / "converted")
    generator = torch.Generator().manual_seed(0)
    lines = [" ".join(f"w{j}" for j in torch.randint(0, 90, (60,), generator=generator).tolist()) for _ in range(20)]
    (tmp_path / "train.txt").write_text("\n".join(lines[:16]) + "\n")
    (tmp_path / "valid.txt").write_text("\n".join(lines[16:]) + "\n")
    out = tmp_path / "distilled"
    launch_two_ranks("distill", "--model_name_or_path", str(tmp_path / "converted"), "--output_dir", str(out),
                     "--train_file", str(tmp_path / "train.txt"), "--validation_file", str(tmp_path / "valid.txt"),
                     "--block_size", "48", "--max_eval_samples", "4", "--max_steps", "6",
                     "--per_device_train_batch_size", "2", "--learning_rate", "3e-2", "--lr_scheduler_type",
                     "constant", "--warmup_steps", "0", "--logging_steps", "1", "--report_to", "none")

    rank0, rank1 = (torch.load(out / f"rank{rank}.pt") for rank in (0, 1))
    converted = dict(student.named_parameters())
    changed = set()
    for name, tensor in rank0.items():
        assert torch.equal(tensor, rank1[name]), f"ranks disagree on {name}"
        if not torch.equal(tensor, converted[name]):
            changed.add(name)
    assert changed and all("feature_map" in name or "window_gate" in name for name in changed), changed
    steps = [record for record in read_log(out) if "loss" in record]
    assert [record["step"] for record in steps] == [1, 2, 3, 4, 5, 6]
    assert steps[-1]["tokens_seen"] == 6 * 2 * 2 * 48  # both ranks fed every step
    losses = torch.tensor([record["loss"] for record in steps])
    assert losses.isfinite().all() and losses[-2:].mean() < losses[:2].mean(), losses


@pytest.mark.parametrize("path", sorted((ROOT / "configs" / "accelerate").glob("*.yaml")), ids=lambda p: p.stem)
def test_accelerate_configs_use_only_real_options(path):
    """Each shipped config loads in accelerate (unknown top-level keys raise) and every FSDP / DeepSpeed
    option in it is one `accelerate launch` reads (a misspelt one would be ignored silently)."""
    config = load_config_from_file(str(path))
    options = {action.dest for action in launch_command_parser()._actions}
    raw = yaml.safe_load(path.read_text())
    for section in ("fsdp_config", "deepspeed_config"):
        assert set(raw.get(section) or {}) <= options, section
    if config.fsdp_config:
        assert config.fsdp_config["fsdp_version"] == 2
        assert config.fsdp_config["fsdp_state_dict_type"] == "SHARDED_STATE_DICT"
        assert hasattr(modeling, config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"])
