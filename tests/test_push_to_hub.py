"""Pushing to the Hub, for real, against a local server speaking the Hub HTTP API (tests/hub_server.py)."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, script_env, stranger_logits, tiny_args, tiny_model
from hub_server import HubServer, card_metadata_errors
from huggingface_hub import ModelCard
from transformers import AutoModelForCausalLM

from hf_linear_attn.training.model_card import render_model_card


@pytest.fixture
def hub():
    with HubServer() as server:
        yield server


def test_finetune_pushes_and_the_hub_copy_gives_identical_logits(hub, tmp_path, dataset_cache, monkeypatch, capsys):
    from hf_linear_attn.training.push_to_hub import main as push_to_hub_main

    env = script_env(**hub.env(tmp_path / "home"))
    out = tmp_path / "out"
    train = subprocess.run(
        [sys.executable, "training/finetune.py",
         *tiny_args(out, dataset_cache, "--max_steps", "2", "--push_to_hub", "--hub_model_id", "someone/tiny-linear")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert train.returncode == 0, train.stderr[-3000:]
    # training/push_to_hub.py's main runs in this process, as `env` would set the Hub up for it: a subprocess spends
    # ~9 s importing on the suite's slow machine. The training run and the download (no hf_linear_attn) stay apart.
    hub.use_in_this_process(monkeypatch, tmp_path / "home")
    assert push_to_hub_main(["--model_name_or_path", str(out), "--hub_model_id", "someone/tiny-linear-mit",
                             "--license", "mit"]) == 0
    assert "someone/tiny-linear-mit" in capsys.readouterr().out
    assert hub.validations and all(errors == [] for errors in hub.validations)  # the Hub check of each card ran
    with pytest.raises(SystemExit) as rejected:
        push_to_hub_main(["--model_name_or_path", str(out), "--hub_model_id", "someone/rejected",
                          "--license", "my-own-licence"])
    assert rejected.value.code != 0 and "my-own-licence" in capsys.readouterr().err
    assert "someone/rejected" not in hub.repos  # the card is validated before the repository is created

    files = set(hub.repos["someone/tiny-linear"].files)
    assert {"config.json", "model.safetensors", "modeling_linear_attention.py", "configuration_linear_attention.py",
            "tokenizer.json", "README.md", "training_summary.json"} <= files
    assert not any(name.startswith(("checkpoint-", "runs/")) or name == "log.jsonl" for name in files)

    # Downloaded where hf_linear_attn is not installed, with trust_remote_code=True (the code travels with the weights).
    ids = torch.randint(3, 259, (2, 40), generator=torch.Generator().manual_seed(0))
    downloaded = stranger_logits(tmp_path / "stranger", ids, "someone/tiny-linear", "someone/tiny-linear-mit",
                                 **hub.env(tmp_path / "home"))
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(out).eval()(ids).logits
    for repo, logits in downloaded.items():
        assert torch.equal(logits, expected), repo

    # The card: metadata the Hub accepts, model-index with the run's held-out metrics, licence.
    summary = json.loads((out / "training_summary.json").read_text())
    for repo, license in (("someone/tiny-linear", "apache-2.0"), ("someone/tiny-linear-mit", "mit")):
        text = hub.repos[repo].files["README.md"].decode()
        assert card_metadata_errors(text) == []
        card = ModelCard(text)
        assert card.data.license == license
        assert card.data.model_name == repo
        results = {result.metric_type: result.metric_value for result in card.data.eval_results}
        assert results["perplexity"] == pytest.approx(summary["eval"]["perplexity"], rel=1e-5)
        assert results["loss"] == pytest.approx(summary["eval"]["eval_loss"], rel=1e-5)
        assert f'from_pretrained("{repo}", trust_remote_code=True)' in text
        assert "| 4,096 |" in text  # the measured memory table


def test_card_validation_rejects_bad_metadata():
    assert card_metadata_errors("---\nlicense: not-a-licence\n---\n# x\n")
    assert card_metadata_errors("---\nmodel-index:\n- name: x\n  results:\n  - task: {}\n---\n")
    assert card_metadata_errors("# no metadata\n")


def test_card_of_a_converted_checkpoint_inherits_the_source_licence(tmp_path):
    source = tmp_path / "softmax-source"
    source.mkdir()
    (source / "README.md").write_text("---\nlicense: llama3.2\n---\n# A softmax model\n")
    model = tiny_model(feature_map="hedgehog", feature_dim=8, window_size=4, softmax_layers=[1])
    model.config.base_model_name_or_path = str(source)
    model.save_pretrained(tmp_path / "converted")
    card = render_model_card(tmp_path / "converted", repo_id="someone/converted")
    assert card.data.license == "llama3.2" and "inherited from the base model" in card.text
    assert f"converted from the softmax model **{source}**" in card.text
    assert card.data.base_model is None  # a local path is no Hub id
    assert "full-softmax layers | 1 |" in card.text
    assert "the 1 full-softmax layer (layer 1), 2 KV heads each" in card.text
    assert render_model_card(tmp_path / "converted", license="mit").data.license == "mit"


def test_a_failed_push_leaves_the_folder_and_the_hub_as_they_were(hub, tmp_path, monkeypatch):
    from huggingface_hub import HfApi, constants

    from hf_linear_attn.training.hub import push_to_hub

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    folder = tmp_path / "model"
    tiny_model().save_pretrained(folder)
    (folder / "README.md").write_text("my own notes\n")
    with pytest.raises(ValueError, match="my-own-licence"):
        push_to_hub(folder, "someone/refused", license="my-own-licence")
    assert hub.repos == {} and hub.validations  # refused by the Hub's check, before any repository exists

    def offline(*args, **kwargs):
        raise ConnectionError("the network went away")

    monkeypatch.setattr(HfApi, "upload_folder", offline)
    with pytest.raises(ConnectionError):
        push_to_hub(folder, "someone/unreachable", license="mit")
    assert (folder / "README.md").read_text() == "my own notes\n"
    (folder / "README.md").unlink()
    with pytest.raises(ConnectionError):
        push_to_hub(folder, "someone/unreachable", license="mit")
    assert not (folder / "README.md").exists()


def test_a_folder_that_would_not_load_from_the_hub_is_refused_before_the_hub_is_asked(hub, tmp_path, monkeypatch):
    """A LoRA adapter folder, and a checkpoint whose remote code is an engine's (as an older version saved FSDP2
    runs): a clear error naming the command that fixes it, and no request reaches the Hub."""
    from hf_linear_attn.training.hub import push_to_hub

    hub.use_in_this_process(monkeypatch, tmp_path / "home")
    broken = tmp_path / "broken"
    tiny_model().save_pretrained(broken)
    config = json.loads((broken / "config.json").read_text())
    config["auto_map"]["AutoModelForCausalLM"] = "_fsdp_init.FSDPLinearAttentionForCausalLM"
    (broken / "config.json").write_text(json.dumps(config))
    (broken / "_fsdp_init.py").write_text("# torch's file\n")
    with pytest.raises(ValueError, match=rf"_fsdp_init.*hf-linear-attn-export --model_name_or_path {broken} "
                                         rf"--output_dir {broken}"):
        push_to_hub(broken, "someone/broken", license="mit")
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="LoRA adapter, not a model: merge it into its base first"):
        push_to_hub(adapter, "someone/adapter", license="mit")
    assert hub.requests == [] and hub.repos == {}
