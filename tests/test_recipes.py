"""Every recipe in configs/ parses with the dataclasses of the script it is written for."""

from pathlib import Path

import pytest

from training.convert import ConversionArguments
from training.data import DataArguments
from training.distill import DistillArguments
from training.finetune import ARGUMENT_CLASSES as FINETUNE_ARGUMENTS
from training.loop import TrainArguments
from training.recipes import parse_recipe_args

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
SCRIPTS = {
    "convert": ConversionArguments,
    "distill": (DistillArguments, DataArguments, TrainArguments),
    "recover": FINETUNE_ARGUMENTS,
}


@pytest.mark.parametrize("recipe", sorted((CONFIGS / "lolcats").glob("*.yaml")), ids=lambda p: p.name)
def test_lolcats_recipes_parse(recipe):
    stage = recipe.stem.rsplit("-", 1)[1]
    parsed = parse_recipe_args(SCRIPTS[stage], ["--config", str(recipe)])
    first = parsed if stage == "convert" else parsed[0]
    assert first.model_name_or_path


def test_recipe_with_an_unknown_key_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("window: 64\n")
    with pytest.raises(SystemExit):
        parse_recipe_args(ConversionArguments, ["--config", str(bad)])
    assert "unknown key(s) ['window']" in capsys.readouterr().err
