"""What every command shares (`training.command_line`): bad input (`hf_linear_attn.InputError`) ends a command with one
`error: ...` line and status 2, any other failure keeps its traceback; renamed arguments keep working for one release
with a FutureWarning, and an old name given with its new one is refused, naming both."""

import re

import pytest
import yaml
from helpers import tiny_args
from transformers import HfArgumentParser

from hf_linear_attn import InputError, InputNotFoundError, InputTypeError
from hf_linear_attn.training import finetune, push_to_hub, stages
from hf_linear_attn.training.checkpoint_conversion import ConversionArguments
from hf_linear_attn.training.command_line import exit_on_bad_input, parse_dataclasses
from hf_linear_attn.training.data import DataArguments
from hf_linear_attn.training.demo import DemoArguments
from hf_linear_attn.training.evaluation import EvaluateArguments
from hf_linear_attn.training.recipes import parse_recipe_args


def test_input_errors_are_the_builtin_errors_their_callers_catch():
    assert issubclass(InputError, ValueError)
    assert issubclass(InputTypeError, InputError) and issubclass(InputTypeError, TypeError)
    assert issubclass(InputNotFoundError, InputError) and issubclass(InputNotFoundError, FileNotFoundError)


def test_bad_input_is_one_error_line_with_its_cause_and_status_2(capsys):
    with pytest.raises(SystemExit) as exit_info, exit_on_bad_input():
        try:
            raise ConnectionError("the server said no")
        except ConnectionError as cause:
            raise InputNotFoundError("--model_name_or_path x: no such folder.") from cause
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == ("error: --model_name_or_path x: no such folder.\n"
                                       "  caused by ConnectionError: the server said no\n")


@pytest.mark.parametrize("error", [ValueError("a shape deep inside torch"), FileNotFoundError("a cache file"),
                                   TypeError("a bug")], ids=lambda error: type(error).__name__)
def test_other_errors_go_through_with_their_traceback(error, capsys):
    with pytest.raises(type(error)) as caught, exit_on_bad_input():
        raise error
    assert caught.value is error
    assert "error:" not in capsys.readouterr().err


def test_a_failure_in_the_middle_of_a_run_keeps_its_traceback(tmp_path, dataset_cache, monkeypatch, capsys):
    """A ValueError raised by what the training loop calls (here the loss, at the third step) is not bad input: the
    command does not turn it into an `error:` line, it propagates with the frames that raised it."""
    calls = []
    loss = stages.causal_lm_loss

    def loss_that_fails_at_step_3(model, batch):
        calls.append(1)
        if len(calls) == 3:
            raise ValueError("shapes that do not broadcast, deep inside a library")
        return loss(model, batch)

    monkeypatch.setattr(stages, "causal_lm_loss", loss_that_fails_at_step_3)
    with pytest.raises(ValueError, match="do not broadcast") as caught:
        finetune.main(tiny_args(tmp_path / "out", dataset_cache, "--max_steps", "5"))
    assert not isinstance(caught.value, InputError)
    assert any(entry.name == "loss_that_fails_at_step_3" for entry in caught.traceback)
    assert len(calls) == 3
    assert not re.search(r"^error:", capsys.readouterr().err, re.MULTILINE)


# Renamed arguments: (argument dataclasses, old name, new name, old value on the command line, the same in a recipe or
# as a keyword, the new argument's value).
RENAMES = [
    ((EvaluateArguments, DataArguments), "teacher", "teacher_name_or_path", ["T"], "T", "T"),
    ((EvaluateArguments, DataArguments), "gguf_file", "teacher_gguf_file", ["m.gguf"], "m.gguf", "m.gguf"),
    ((ConversionArguments, DataArguments), "ranking_prompts", "head_ranking_prompts", ["3"], 3, 3),
    ((ConversionArguments, DataArguments), "ranking_shortlist", "head_ranking_shortlist", ["5"], 5, 5),
    ((DemoArguments,), "softmax_heads_n", "softmax_heads", ["4"], 4, ["auto:4"]),
    ((DemoArguments,), "ranking_prompts", "head_ranking_prompts", ["3"], 3, 3),
    ((DemoArguments,), "ranking_shortlist", "head_ranking_shortlist", ["5"], 5, 5),
    ((DemoArguments,), "frontier_head_counts", "softmax_head_counts", ["2", "6"], [2, 6], [2, 6]),
    ((DemoArguments,), "memory_sizes", "sparse_cache_sizes", ["64"], [64], [64]),
]
RENAME_IDS = [f"{types[0].__name__}.{old}" for types, old, *_ in RENAMES]


@pytest.mark.parametrize("types, old, new, words, value, expected", RENAMES, ids=RENAME_IDS)
def test_an_old_name_still_works_and_warns(types, old, new, words, value, expected, tmp_path):
    with pytest.warns(FutureWarning, match=f"--{old} is deprecated .* use --{new}"):
        parsed = parse_recipe_args(types, [f"--{old}", *words])
    assert getattr(parsed[0], new) == expected
    if len(words) == 1:  # the --flag=value form too
        with pytest.warns(FutureWarning, match=f"--{old} is deprecated"):
            assert getattr(parse_recipe_args(types, [f"--{old}={words[0]}"])[0], new) == expected
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({old: value}))
    with pytest.warns(FutureWarning, match=f"{old} is deprecated .* use {new}"):
        assert getattr(parse_recipe_args(types, ["--config", str(recipe)])[0], new) == expected
    with pytest.warns(FutureWarning, match=f"{old} is deprecated .* use {new}"):
        assert getattr(types[0](**{old: value}), new) == expected


@pytest.mark.parametrize("types, old, new, words, value, expected", RENAMES, ids=RENAME_IDS)
def test_an_old_name_with_its_new_one_is_refused_naming_both(types, old, new, words, value, expected, tmp_path,
                                                              capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_recipe_args(types, [f"--{old}", *words, f"--{new}", *map(str, expected if isinstance(expected, list)
                                                                      else [expected])])
    assert exit_info.value.code == 2
    assert f"error: --{old} and --{new} are the same argument" in capsys.readouterr().err
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({old: value, new: expected}))
    with pytest.raises(SystemExit):
        parse_recipe_args(types, ["--config", str(recipe)])
    assert f"{old} and {new} are the same argument" in capsys.readouterr().err
    with pytest.raises(InputError, match=f"{old} and {new} are the same argument .* give only {new}"):
        types[0](**{old: value, new: expected})


def test_the_demo_without_softmax_heads_under_the_old_name():
    with pytest.warns(FutureWarning):
        parsed = parse_recipe_args(DemoArguments, ["--softmax_heads_n", "0", "--ranking_prompts", "2"])
    assert parsed.softmax_heads == [""] and parsed.head_ranking_prompts == 2  # no head: empty words are skipped


def test_the_push_takes_flags_and_still_its_earlier_positional_arguments(monkeypatch, capsys, tmp_path):
    pushed = []
    monkeypatch.setattr(push_to_hub, "push_to_hub",
                        lambda folder, repo_id, **options: pushed.append((folder, repo_id, options)) or "url")
    assert push_to_hub.main(["--model_name_or_path", str(tmp_path), "--hub_model_id", "me/model",
                             "--hub_private_repo", "--license", "mit"]) == 0
    with pytest.warns(FutureWarning) as warned:
        assert push_to_hub.main([str(tmp_path), "me/model", "--private", "--license", "mit"]) == 0
    assert sorted(str(warning.message).split(" is deprecated")[0] for warning in warned) == [
        "--private", "the positional HUB_MODEL_ID", "the positional MODEL_NAME_OR_PATH"]
    assert pushed[0] == pushed[1] == (str(tmp_path), "me/model", {"private": True, "license": "mit",
                                                                  "commit_message": "Upload linear-attention model"})
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info, pytest.warns(FutureWarning, match="positional MODEL_NAME_OR_PATH"):
        push_to_hub.main([str(tmp_path), "me/model", "--hub_model_id", "me/other"])
    assert exit_info.value.code == 2
    assert "the positional HUB_MODEL_ID and --hub_model_id are the same argument" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        push_to_hub.main(["--model_name_or_path", str(tmp_path)])  # the repository is required
    assert "--hub_model_id" in capsys.readouterr().err
    assert len(pushed) == 2


def test_renamed_flags_leave_the_other_flags_in_place():
    parser = HfArgumentParser(DemoArguments)
    with pytest.warns(FutureWarning):
        (parsed,) = parse_dataclasses(parser, ["--memory_sizes", "8", "16", "--softmax_heads_n", "2", "--lora_r", "4",
                                               "--ranking_shortlist=9"])
    assert (parsed.sparse_cache_sizes, parsed.softmax_heads, parsed.lora_r, parsed.head_ranking_shortlist) == (
        [8, 16], ["auto:2"], 4, 9)


def test_a_recipe_value_of_the_wrong_type_is_one_error_line(tmp_path, capsys):
    """A recipe's values reach the config unconverted; one of the wrong type is bad input like any other
    (`InputTypeError`, a TypeError too), not a traceback."""
    from hf_linear_attn.training import demo

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("feature_dim: [32]\n")
    with pytest.raises(SystemExit) as exit_info:
        demo.main(["--config", str(recipe), "--output_dir", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: invalid `feature_dim`=[32] (list)")
    assert not (tmp_path / "out").exists()
