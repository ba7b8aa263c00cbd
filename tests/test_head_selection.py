"""Ranking KV heads by retrieval (hf_linear_attn.head_selection) against attention weights computed the slow way."""

import pytest
import torch
from helpers import SOURCES, teacher

from hf_linear_attn.head_selection import RetrievalPrompt, retrieval_scores, top_heads


def copy_prompt(length: int = 40, needle_at: int = 9, answer_tokens: int = 3, seed: int = 0) -> RetrievalPrompt:
    """Random tokens in which `answer_tokens` tokens at `needle_at` are repeated at the very end."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 90, (1, length), generator=generator)
    ids[0, -answer_tokens:] = ids[0, needle_at:needle_at + answer_tokens]
    return RetrievalPrompt(ids, (needle_at, needle_at + answer_tokens), (length - answer_tokens, length))


def eager_needle_mass(model, prompt: RetrievalPrompt) -> torch.Tensor:
    """[L, H_kv]: the slow way, from the full attention matrices of an eager forward."""
    model.set_attn_implementation("eager")
    try:
        attentions = model(input_ids=prompt.input_ids, output_attentions=True).attentions  # L x [1, H, T, T]
    finally:
        model.set_attn_implementation("sdpa")
    rows = range(prompt.answer[0] - 1, prompt.answer[1] - 1)
    masses = []
    for weights in attentions:
        per_head = weights[0, :, list(rows), prompt.needle[0]:prompt.needle[1]].sum(-1).mean(-1)  # [H]
        masses.append(per_head.view(model.config.num_key_value_heads, -1).mean(-1))
    return torch.stack(masses)


@pytest.mark.parametrize("source", sorted(SOURCES))
def test_scores_are_the_needle_mass_of_the_attention_matrices(source):
    model = teacher(source)
    prompts = [copy_prompt(seed=0), copy_prompt(length=33, needle_at=4, answer_tokens=2, seed=1)]
    with torch.no_grad():
        expected = sum(eager_needle_mass(model, p) for p in prompts) / len(prompts)
        before = model(input_ids=prompts[0].input_ids).logits
    scores = retrieval_scores(model, prompts, progress=False)
    assert scores.shape == (model.config.num_hidden_layers, model.config.num_key_value_heads)
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=1e-4)
    # The model is left as it was: same attention implementation, same outputs, no probe state on its modules.
    assert model.config._attn_implementation == "sdpa"
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=prompts[0].input_ids).logits, before)
    assert not any(hasattr(m, "_retrieval_probe") for m in model.modules())


def test_top_heads_orders_by_score_and_skips_excluded_layers():
    scores = torch.tensor([[0.1, 0.9, 0.3], [0.8, 0.2, 0.7], [0.95, 0.0, 0.0]])
    assert top_heads(scores, 3) == {0: [1], 1: [0], 2: [0]}
    assert top_heads(scores, 3, exclude_layers=[2]) == {0: [1], 1: [0, 2]}
    assert top_heads(scores, 0) == {}
    assert top_heads(scores, 2, taken={2: [0], 0: [1]}) == {1: [0, 2]}
    with pytest.raises(ValueError, match=r"n must be in \[0, 6\]"):
        top_heads(scores, 7, exclude_layers=[0])


@pytest.mark.parametrize("needle, answer, match", [
    ((5, 8), (37, 40), "same"),              # different tokens at the two places
    ((5, 8), (36, 39), "must end the prompt"),
    ((38, 40), (38, 40), "must lie before"),
    ((5, 7), (37, 40), "same"),               # lengths differ
])
def test_bad_prompts_are_refused(needle, answer, match):
    ids = torch.arange(40)[None] + 3
    with pytest.raises(ValueError, match=match):
        RetrievalPrompt(ids, needle, answer)


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="one row"):
        RetrievalPrompt(torch.zeros(2, 10, dtype=torch.long), (0, 1), (9, 10))
    with pytest.raises(ValueError, match="at least one prompt"):
        retrieval_scores(teacher("llama"), [])
    from helpers import tiny_model
    with pytest.raises(ValueError, match="AttentionInterface"):
        retrieval_scores(tiny_model(), [copy_prompt()])
