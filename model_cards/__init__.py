"""The model card template (`model_card.md`, rendered by `hf_linear_attn.training.model_card`) and an example card
rendered from the demo's final model; installed as `hf_linear_attn.model_cards`."""
