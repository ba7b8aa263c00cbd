"""The shipped recipes (YAML), installed as data of `hf_linear_attn.configs`: a command given `--config NAME` that is
no file runs the recipe of that name from here (`hf_linear_attn.training.recipes`)."""
