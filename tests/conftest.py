"""Shared fixtures. Everything runs offline on CPU with tiny models."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

# Without a GPU the Triton kernels run in Triton's interpreter. triton reads this when @triton.jit decorates the
# kernels, i.e. when hf_linear_attn.ops_triton is imported: it must be set before the package is.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import hf_linear_attn  # noqa: E402


def tiny_config(**overrides) -> hf_linear_attn.LinearAttentionConfig:
    """A 2-layer, hidden-64 model with GQA (4 query heads, 2 KV heads): fast on CPU."""
    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    fields.update(overrides)
    return hf_linear_attn.LinearAttentionConfig(**fields)


def tiny_model(seed: int = 0, **overrides) -> hf_linear_attn.LinearAttentionForCausalLM:
    torch.manual_seed(seed)
    model = hf_linear_attn.LinearAttentionForCausalLM(tiny_config(**overrides))
    return model.eval()


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield
