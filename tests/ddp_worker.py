"""Run by tests/test_ddp.py under `accelerate launch`: fine-tune with the given flags, then save this
rank's trained parameters to OUTPUT_DIR/rank{RANK}.pt so the test can compare the ranks."""

import os
import sys
from pathlib import Path

import torch

from training import finetune

args = finetune.parse_args(sys.argv[1:])
result = finetune.run(args)
model = getattr(result.model, "module", result.model)  # unwrap DistributedDataParallel
parameters = {name: p.detach().cpu() for name, p in model.named_parameters()}
torch.save(parameters, Path(args[2].output_dir) / f"rank{os.environ['RANK']}.pt")
