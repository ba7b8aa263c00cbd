"""Scoring of the local lm-eval needle tasks in this folder: RULER-style needle-in-a-haystack retrieval that runs
offline. Their data is the passkey prompts of `training.long_context_data` (`passkey_trials`: the needle's depth
spread evenly over the trials, natural or filler haystack, one key or several keyed doors of which one is
asked for) as text, written for the tokenizer of the model to evaluate:

    hf-linear-attn-long-context needles --tokenizer_name DIR     # outputs/lm_eval_needles/*.jsonl
    lm_eval --model hf --model_args pretrained=DIR,trust_remote_code=True,add_bos_token=False \
        --tasks needle --include_path configs/lm_eval --batch_size 1                # from the repository root

Tasks `needle_<variant>_<haystack>_<1k|2k|4k>` (variants `single`, `multi`; haystacks `natural`, `filler`),
grouped by length as `needle_1k`, `needle_2k`, `needle_4k` and all together as `needle`. A prompt counts when
the first run of digits of the greedy continuation (8 tokens: the 5 digits + 3) is exactly the key:
`training.long_context_metrics.answer_matches`, as the evaluation's passkey accuracy.
"""

from __future__ import annotations

from hf_linear_attn.training.long_context_metrics import answer_matches


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """{"acc": 1.0 or 0.0} for one prompt: whether the continuation `results[0]` answers `doc["answer"]`."""
    return {"acc": float(answer_matches(results[0], doc["answer"]))}
