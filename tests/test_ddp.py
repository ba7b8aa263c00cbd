"""Two-process CPU DDP (gloo) with `accelerate launch` and the shipped accelerate config."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import launch_command_parser
from helpers import ROOT, read_log, script_env, tiny_args
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import hf_linear_attn.modeling_linear_attention as modeling
from training import checkpoints

ACCELERATE = Path(sys.executable).parent / "accelerate"
CONFIG = ROOT / "configs" / "accelerate" / "cpu_ddp_2proc.yaml"


def test_two_rank_gloo_ddp_trains_in_step_and_saves_a_loadable_checkpoint(tmp_path, dataset_cache):
    out = tmp_path / "ddp"
    command = [str(ACCELERATE), "launch", "--config_file", str(CONFIG), str(ROOT / "tests" / "ddp_worker.py"),
               *tiny_args(out, dataset_cache, "--max_steps", "4", "--save_steps", "2", "--save_total_limit", "1")]
    result = subprocess.run(command, cwd=ROOT, env=script_env(ACCELERATE_USE_CPU="1"), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]

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
    assert {"random_states_0.pkl", "random_states_1.pkl"} <= {p.name for p in last.iterdir()}
    state = load_file(str(last / "model.safetensors"))
    assert state.keys() == rank0.keys()
    assert all(torch.equal(state[name], rank0[name]) for name in rank0)
    assert checkpoints.read_trainer_state(last)["geometry"]["num_processes"] == 2


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
