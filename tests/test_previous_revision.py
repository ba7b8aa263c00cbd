"""Checkpoints saved by an earlier revision load into the current code and compute what that revision computed.

`tests/fixtures/previous_revision/<variant>/` holds one tiny model per attention variant (`helpers.VARIANTS`), saved
by the revision named in its `revision.txt` (the last one before the attention layer was split into one class per
kind) together with what that revision computed from it (`expected.safetensors`: the logits of a left-padded batch,
greedy tokens with the cache, the cache's bytes). A refactoring that renames a parameter, drops a buffer or changes
the math fails here. Tokens and cache bytes must be equal; logits equal up to 1e-6 (on the machine that wrote them
they are equal bit for bit; another CPU may round a matrix product differently).

To freeze the current revision instead (only when the saved format or the math changes on purpose):
`python tests/test_previous_revision.py` from the repository root rewrites the folder.
"""

import subprocess
from pathlib import Path

import pytest
import torch
from helpers import VARIANTS, left_pad, prompts, tiny_model
from safetensors.torch import load_file, save_file

import hf_linear_attn

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "previous_revision"
# Smaller than helpers.tiny_config (the checkpoints are committed); each variant keeps its own overrides.
DIMS = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2)


def revision_outputs(model: hf_linear_attn.LinearAttentionForCausalLM) -> dict[str, torch.Tensor]:
    """What a revision must reproduce from a checkpoint: the logits of a left-padded batch of three prompts (3 to 19
    tokens, longer than the variants' window of 5), 6 greedy tokens after it with the cache, the cache's bytes."""
    ids, mask = left_pad(prompts([19, 3, 11], vocab=model.config.vocab_size, seed=7))
    with torch.no_grad():
        logits = model.eval()(ids, attention_mask=mask).logits
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                   return_dict_in_generate=True, pad_token_id=0)
    cache = getattr(generated, "cache", None) or generated.past_key_values
    return {"logits": logits, "tokens": generated.sequences, "cache_bytes": torch.tensor(cache.nbytes())}


def test_every_variant_has_a_checkpoint():
    assert sorted(p.name for p in FIXTURES.iterdir() if p.is_dir()) == sorted(VARIANTS)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_checkpoint_of_previous_revision_gives_its_outputs(variant):
    folder = FIXTURES / variant
    model, info = hf_linear_attn.LinearAttentionForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched parameter
    expected = load_file(folder / "expected.safetensors")
    actual = revision_outputs(model)
    torch.testing.assert_close(actual["logits"], expected["logits"], rtol=0, atol=1e-6)
    assert torch.equal(actual["tokens"], expected["tokens"])
    assert int(actual["cache_bytes"]) == int(expected["cache_bytes"])


def write_fixtures() -> None:
    """Save every variant's checkpoint (without its code files: the test reads it with the current code) and its
    outputs under this revision."""
    for name, overrides in VARIANTS.items():
        fields = {**DIMS, **overrides}
        if "head_dim" in overrides:  # taylor's small head keeps hidden = heads × head_dim
            fields["hidden_size"] = fields["num_attention_heads"] * overrides["head_dim"]
        model = tiny_model(seed=0, **fields)
        folder = FIXTURES / name
        model.save_pretrained(folder)
        for code in folder.glob("*.py"):
            code.unlink()
        save_file(revision_outputs(model), folder / "expected.safetensors")
    revision = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
    (FIXTURES / "revision.txt").write_text(revision)


if __name__ == "__main__":
    write_fixtures()
