"""How far a model reads: perplexity against context past its trained positions, on the held-out long texts.

One window of the longest length from each held-out text (`training.long_context_data`: KJV, Austen), every position
scored; at each length L the perplexity over the window's first L tokens and over its last quarter (tokens
[3L/4, L), where the far context is read). A model whose every position's rotation is fixed (any RoPE but `dynamic`
/ `longrope`) runs one forward of the longest window and each shorter length is its prefix (a causal model predicts a
token from the tokens before it only); a length-dependent RoPE gets one forward per length. The loss is taken in
slices of the final hidden states, so a 32K window's logits never exist at once.

Each linear-attention model is measured as saved and with each of `--position_caps` (`rope_position_cap`: a number,
or `none` to remove it); each softmax model as saved and with each of `--rope_scalings` (type:factor, `yarn:4`
`dynamic:2`: the teacher's own ways past its `max_position_embeddings`). `--within N` adds, per model and length,
the perplexity of the same tokens (all of them, and the last quarter) read within N tokens (the first N whole, then
windows of N each scoring its last N / 2 tokens): the text's difficulty with the context the model was trained on,
against which reading the whole window is judged (perplexity at L over within-N at L is 1 for a model that neither
gains nor loses by reading further; the ratio to the first 4K also holds how hard each part of the text is).
`--within_offset P` also reads those same windows at positions P, P + 1, ... instead of 0, 1, ...: the same tokens
and context at positions past the trained ones, which tells what the positions cost from what the far context
costs. Report `reach.*`.

    python -m benchmarks.bench_reach --models teacher=outputs/demo/teacher "stage 2=outputs/demo/stage2" \\
        --lengths 4096 8192 16384 32768 --position_caps none 8192 --within 8192
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

import hf_linear_attn  # noqa: F401  (registers the linear-attention classes with the Auto classes)
from benchmarks.common import machine, write_report
from hf_linear_attn.configuration_linear_attention import LENGTH_DEPENDENT_ROPE_TYPES, InputError, LinearAttentionConfig
from hf_linear_attn.training.command_line import exit_on_bad_input, parse_dataclasses
from hf_linear_attn.training.long_context_data import DEFAULT_DATA_DIR, load_texts, long_documents
from hf_linear_attn.training.report import log_log_plot

# The RoPE scalings a softmax model is read with (`--rope_scalings`): those that need no more than a factor and the
# trained length.
SCALING_TYPES = ("linear", "dynamic", "yarn")


@dataclass
class ReachArguments:
    models: list[str] = field(default_factory=list, metadata={"help": "label=path of each model (the first one's "
                                                                       "tokenizer is used)."})
    lengths: list[int] = field(default_factory=lambda: [4096, 8192, 16384, 32768],
                               metadata={"help": "Context lengths; the longest is each text's window."})
    position_caps: list[str] = field(default_factory=list, metadata={
        "help": "Also measure each linear-attention model with rope_position_cap set to each of these (a number "
                "≥ 2, or 'none' to remove it)."})
    rope_scalings: list[str] = field(default_factory=list, metadata={
        "help": "Also measure each softmax model (not a linear-attention one) with each of these RoPE scalings, "
                f"type:factor with a type of {SCALING_TYPES} and a factor ≥ 1 (e.g. yarn:4 dynamic:2), from its "
                "max_position_embeddings."})
    within: int = field(default=0, metadata={"help": "Also score each length's last quarter within this many tokens "
                                                     "(0: skip)."})
    within_offset: int = field(default=0, metadata={
        "help": "With --within: also read the same windows at positions starting here (0: skip)."})
    slice_tokens: int = field(default=2048, metadata={"help": "Positions per slice of the loss."})
    long_context_data: str = DEFAULT_DATA_DIR
    output_dir: str = "outputs/bench"


def check_arguments(args: ReachArguments) -> dict[str, str]:
    """The models as {label: path}; ValueError on anything the run could not use, before any model is loaded."""
    models = dict(item.split("=", 1) for item in args.models if "=" in item)
    if not args.models or len(models) != len(args.models):
        raise InputError(f"--models takes label=path items, got {args.models}")
    if not args.lengths or min(args.lengths) < 8 or len(set(args.lengths)) != len(args.lengths):
        raise InputError(f"--lengths must be distinct lengths ≥ 8 tokens, got {args.lengths}")
    for cap in args.position_caps:
        if cap != "none" and not (cap.isdigit() and int(cap) >= 2):
            raise InputError(f"--position_caps takes numbers ≥ 2 or 'none', got {cap!r}")
    longer = [length for length in args.lengths if length > args.within]  # the lengths read within N
    if args.within and (args.within < 2 or args.within % 2 or any(length % (args.within // 2) for length in longer)):
        raise InputError(f"--within {args.within}: an even number whose half divides every length above it "
                         f"({longer})")
    if args.within_offset < 0 or (args.within_offset and not args.within):
        raise InputError(f"--within_offset {args.within_offset}: a position ≥ 0, and only with --within")
    for scaling in args.rope_scalings:
        kind, _, factor = scaling.partition(":")
        try:
            valid = kind in SCALING_TYPES and float(factor) >= 1
        except ValueError:
            valid = False
        if not valid:
            raise InputError(f"--rope_scalings takes type:factor items with a type of {SCALING_TYPES} and a factor "
                             f"≥ 1, got {scaling!r}")
    if args.slice_tokens < 1:
        raise InputError(f"--slice_tokens must be ≥ 1, got {args.slice_tokens}")
    return models


@torch.no_grad()
def position_losses(model, ids: torch.Tensor, slice_tokens: int, first_position: int = 0) -> torch.Tensor:
    """float64 [T - 1]: the next-token loss at every position of one row ids [1, T] read at positions
    `first_position`, `first_position` + 1, ..., the LM head applied to `slice_tokens` positions of the final hidden
    states at a time."""
    positions = torch.arange(first_position, first_position + ids.shape[1], device=ids.device)[None]
    hidden = model.get_decoder()(input_ids=ids, position_ids=positions).last_hidden_state[0, :-1]
    head, target = model.get_output_embeddings(), ids[0, 1:]
    return torch.cat([F.cross_entropy(head(hidden[i:i + slice_tokens]).float(), target[i:i + slice_tokens],
                                      reduction="none").double() for i in range(0, len(target), slice_tokens)])


def within_losses(model, ids: torch.Tensor, args: ReachArguments, first_position: int) -> torch.Tensor:
    """float64 [T - 1]: the loss of every token of ids [1, T] read within `args.within` tokens: the first window's
    tokens from their start, every later token in windows of `args.within` that score their last half (so each token
    is read with half a window to a whole window of context), the windows at positions from `first_position`."""
    n, half = args.within, args.within // 2
    losses = [position_losses(model, ids[:, :n], args.slice_tokens, first_position)]
    losses += [position_losses(model, ids[:, start - half:start + half], args.slice_tokens, first_position)[-half:]
               for start in range(n, ids.shape[1], half)]
    return torch.cat(losses)


def variants(path: str, caps: list[str], scalings: list[str]) -> list[tuple[str, dict]]:
    """(variant name, from_pretrained overrides) of one model: as saved, for a linear-attention checkpoint with each
    cap, and for a softmax one with each RoPE scaling (type:factor) from its trained length."""
    config = AutoConfig.from_pretrained(path)
    found = [("as saved", {})]
    if isinstance(config, LinearAttentionConfig):
        found += [(f"cap {cap}", {"rope_position_cap": None if cap == "none" else int(cap)}) for cap in caps]
    else:
        for scaling in scalings:
            kind, factor = scaling.split(":")
            rope = {**config.rope_parameters, "rope_type": kind, "factor": float(factor),
                    "original_max_position_embeddings": config.max_position_embeddings}
            found.append((f"{kind} ×{factor}", {"rope_parameters": rope}))
    return found


def main(argv: list[str] | None = None) -> int:
    (args,) = parse_dataclasses(HfArgumentParser(ReachArguments), argv)
    with exit_on_bad_input():
        models = check_arguments(args)
        texts = load_texts(args.long_context_data)
    tokenizer = AutoTokenizer.from_pretrained(next(iter(models.values())))
    longest = max(args.lengths)
    documents = long_documents(tokenizer, texts, document_tokens=longest, documents_per_source=1)
    print(f"{machine()}; one window of {longest:,} tokens from each of {[d.source for d in documents]}")
    rows = []
    for label, path in models.items():
        for variant, overrides in variants(path, args.position_caps, args.rope_scalings):
            model = AutoModelForCausalLM.from_pretrained(path, **overrides).eval()
            rope_type = (getattr(model.config, "rope_parameters", None) or {}).get("rope_type")
            for document in documents:
                ids = document.input_ids[None]
                whole = None
                if rope_type not in LENGTH_DEPENDENT_ROPE_TYPES:
                    whole = position_losses(model, ids, args.slice_tokens)
                reads = {}  # each token read within N, at positions from 0 (and from the offset)
                if args.within and longest > args.within:
                    reads["within"] = within_losses(model, ids, args, 0)
                    if args.within_offset:
                        reads["within_offset"] = within_losses(model, ids, args, args.within_offset)
                for length in sorted(args.lengths):
                    losses = whole[:length - 1] if whole is not None else \
                        position_losses(model, ids[:, :length], args.slice_tokens)
                    row = {"model": label, "variant": variant, "text": document.source, "length": length,
                           "perplexity": math.exp(losses.mean().item()),
                           "last_quarter": math.exp(losses[-(length // 4):].mean().item())}
                    for key, within in reads.items():
                        if length > args.within:
                            row[key] = math.exp(within[:length - 1].mean().item())
                            row[f"last_quarter_{key}"] = math.exp(within[length - 1 - length // 4:length - 1].mean()
                                                                  .item())
                    rows.append(row)
                    within = f" (within {args.within:,}: {row['within']:.2f}, {row['last_quarter_within']:.2f})" \
                        if "within" in row else ""
                    print(f"  {label} ({variant}) {document.source} @{length}: {row['perplexity']:.2f}, last quarter "
                          f"{row['last_quarter']:.2f}{within}", flush=True)
            del model
    columns = {"model": "model", "variant": "variant", "text": "text", "length": "context",
               "perplexity": "perplexity", "last_quarter": "last quarter",
               "within": f"within {args.within:,}", "last_quarter_within": f"last quarter within {args.within:,}"}
    if args.within_offset:
        at = f"within {args.within:,} at positions from {args.within_offset:,}"
        columns["within_offset"], columns["last_quarter_within_offset"] = at, f"last quarter {at}"
    plot = log_log_plot(rows, "length", "context tokens", [("perplexity", "held-out perplexity"),
                                                            ("last_quarter", "perplexity, last quarter")],
                        line=lambda row: f"{row['model']} ({row['variant']}), {row['text']}")
    write_report(rows, columns, args.output_dir, "reach", plot, meta={"args": asdict(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
