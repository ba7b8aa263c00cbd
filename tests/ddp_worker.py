"""Run by tests/test_ddp.py under `accelerate launch` as `ddp_worker.py STAGE FLAGS...`: fine-tune
(STAGE `finetune`) or distil (STAGE `distill`) with the given flags, then save this rank's trained
parameters to OUTPUT_DIR/rank{RANK}.pt so the test can compare the ranks."""

import os
import sys
from pathlib import Path

import torch

from hf_linear_attn.training import finetune, stages
from hf_linear_attn.training.data import DataArguments
from hf_linear_attn.training.loop import TrainArguments
from hf_linear_attn.training.recipes import parse_recipe_args

stage, argv = sys.argv[1], sys.argv[2:]
if stage == "distill":
    args = parse_recipe_args((stages.DistillArguments, DataArguments, TrainArguments), argv)
    result = stages.distill(*args)
else:
    args = finetune.parse_args(argv)
    result = stages.finetune(args)
model = getattr(result.model, "module", result.model)  # unwrap DistributedDataParallel
parameters = {name: p.detach().cpu() for name, p in model.named_parameters()}
torch.save(parameters, Path(args[2].output_dir) / f"rank{os.environ['RANK']}.pt")
