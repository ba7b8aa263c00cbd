"""Choose which layers of a converted model keep full softmax attention, and restore them.

A converted layer keeps its teacher's q/k/v/o projections (`AttentionProjections`); its linear attention adds
only feature maps, the window gate γ and decay parameters. Turning layer ℓ back into softmax attention is
therefore exact and cheap: a `SoftmaxAttention` built around the *same* projection modules is the teacher's
attention for that layer, and the linear-only parameters are dropped.

    from hf_linear_attn.layer_selection import restore_softmax_layers, select_softmax_layers
    layers, ranking = select_softmax_layers(stage1_model, teacher, held_out_ids, k=4)
    hybrid = restore_softmax_layers(stage1_model, layers)

The ranking measures one layer at a time: for each linear layer ℓ, the mean KL(teacher ‖ student) of the
next-token distributions over every position of the held-out rows with ℓ alone restored, against the
unmodified student's KL (the reference). Layers are ranked by how much restoring them alone lowers that KL.
`select_softmax_layers` keeps the K best of these single-layer measurements: it does not measure layers
jointly (two layers that fix the same error both rank high), which costs L + 1 forward passes per row instead
of a search over layer sets.

This module is library code for conversion scripts; the model file does not import it, so it does not ship
in checkpoints.
"""

from __future__ import annotations

import copy
import json
import os
import re
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers import PretrainedConfig, PreTrainedModel

from .configuration_linear_attention import InputError, LinearAttentionConfig
from .head_selection import RetrievalPrompt
from .modeling_linear_attention import (
    LinearAttention,
    LinearAttentionForCausalLM,
    SoftmaxAttention,
    attention_class,
    causal_softmax_attention,
    scaled_queries,
)

# Positions per slice of the LM head when comparing distributions: bounds the [positions, vocab] temporaries.
KL_CHUNK = 512

# Config fields that may differ between a ranking model and the conversion it stands for.
SELECTION_FIELDS = ("softmax_layers", "softmax_heads", "linear_attention_backend", "base_model_name_or_path",
                    "auto_map", "architectures", "dtype", "torch_dtype", "transformers_version", "_name_or_path")


# ----------------------------------------------------------------------------------------------- arguments
@dataclass(frozen=True)
class SoftmaxLayerSpec:
    """A parsed `softmax_layers` argument: explicit `layers`, or `auto_k` layers chosen by measurement."""

    layers: tuple[int, ...] = ()
    auto_k: int | None = None


SPEC_FORMS = "a list of layer indices ([1, 5, 7]), a comma-separated string (\"1,5,7\") or \"auto:K\""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_softmax_layers(spec: str | Sequence[int | str] | None, num_layers: int) -> SoftmaxLayerSpec:
    """Parse `softmax_layers` for a model of `num_layers` layers.

    Accepted: a list of ints, a string "1,5,7" (commas or spaces), a list of such strings (what a command line
    gives: `--softmax_layers 1 5 7`), None or empty (no softmax layer), or "auto:K" (alone): the K layers that
    matter most, with K in [1, num_layers - 1] (all layers would be the teacher itself). Indices lie in
    [0, num_layers - 1] and are returned sorted without duplicates. Raises ValueError naming `softmax_layers`.
    """
    if not _is_int(num_layers) or num_layers < 1:
        raise InputError(f"num_layers must be a positive integer; got {num_layers!r}.")
    if spec is None:
        return SoftmaxLayerSpec()
    if isinstance(spec, (list, tuple)) and spec and all(isinstance(item, str) for item in spec):
        spec = " ".join(spec)  # a command line's words: name them as typed
    items = [spec] if isinstance(spec, str) else spec
    if not isinstance(items, Sequence):
        raise InputError(f"softmax_layers={spec!r}: expected {SPEC_FORMS}.")
    tokens: list[int | str] = []
    for item in items:
        if isinstance(item, str):
            tokens += [token for token in re.split(r"[,\s]+", item.strip()) if token]
        elif _is_int(item):
            tokens.append(item)
        else:
            raise InputError(f"softmax_layers={spec!r}: {item!r} is not a layer index; expected {SPEC_FORMS}.")
    if any(isinstance(token, str) and token.lower().startswith("auto") for token in tokens):
        return SoftmaxLayerSpec(auto_k=_parse_auto(spec, tokens, num_layers))
    layers = []
    for token in tokens:
        if isinstance(token, str):
            if not re.fullmatch(r"[+-]?\d+", token):
                raise InputError(f"softmax_layers={spec!r}: {token!r} is not a layer index; expected {SPEC_FORMS}.")
            token = int(token)
        if not 0 <= token < num_layers:
            raise InputError(f"softmax_layers={spec!r}: layer {token} does not exist; indices lie in "
                             f"[0, {num_layers - 1}] for a model with {num_layers} layers.")
        layers.append(token)
    return SoftmaxLayerSpec(layers=tuple(sorted(set(layers))))


def _parse_auto(spec: Any, tokens: list[int | str], num_layers: int) -> int:
    match = re.fullmatch(r"auto:([+-]?\d+)", str(tokens[0]).lower()) if len(tokens) == 1 else None
    if match is None:
        raise InputError(f"softmax_layers={spec!r}: the automatic form is exactly \"auto:K\" with an integer K, "
                         f"on its own; expected {SPEC_FORMS}.")
    k = int(match.group(1))
    if num_layers == 1:
        raise InputError(f"softmax_layers={spec!r}: a model with one layer has no layer to choose "
                         "(auto:K keeps at least one linear layer).")
    if k == num_layers:
        raise InputError(f"softmax_layers={spec!r}: K = {num_layers} would restore every layer, which is the "
                         f"teacher itself; K lies in [1, {num_layers - 1}].")
    if not 1 <= k < num_layers:
        raise InputError(f"softmax_layers={spec!r}: K = {k} is out of range; K lies in [1, {num_layers - 1}] "
                         f"for a model with {num_layers} layers.")
    return k


def check_layer_selection(spec: SoftmaxLayerSpec, teacher: Any, ranking_model: Any) -> None:
    """Refuse, before any work, a selection that cannot run: `auto:K` needs a `teacher` (the softmax model the
    KL is measured against) and a `ranking_model` (the linear-attention model measured, after attention
    transfer); a `ranking_model` without `auto:K` would be ignored, so it is refused too."""
    if spec.auto_k is None:
        if ranking_model is not None:
            raise InputError(f"ranking_model={ranking_model!r} is only used with softmax_layers='auto:K'; drop it "
                             "or ask for automatic selection.")
        return
    if teacher is None:
        raise InputError(f"softmax_layers='auto:{spec.auto_k}' needs a teacher: the softmax model whose "
                         "next-token distributions the ranking compares against.")
    if ranking_model is None:
        raise InputError(f"softmax_layers='auto:{spec.auto_k}' needs a ranking_model: a linear-attention "
                         "checkpoint of the same conversion after attention transfer (training/distill.py), "
                         "whose layers are measured one at a time.")


def check_same_conversion(ranking_config: PretrainedConfig, conversion_config: PretrainedConfig) -> None:
    """Refuse a ranking model that is not the given conversion (different architecture or attention options);
    only the fields of `SELECTION_FIELDS` (softmax layers, backend, provenance) may differ."""
    if getattr(ranking_config, "model_type", None) != conversion_config.model_type:
        raise InputError(f"ranking_model is a {getattr(ranking_config, 'model_type', None)!r} model, not a "
                         f"linear-attention conversion ({conversion_config.model_type!r}).")
    mine, theirs = ranking_config.to_dict(), conversion_config.to_dict()
    differ = sorted(key for key in set(mine) | set(theirs)
                    if key not in SELECTION_FIELDS and mine.get(key) != theirs.get(key))
    if differ:
        details = ", ".join(f"{key}: {mine.get(key)!r} vs {theirs.get(key)!r}" for key in differ[:6])
        raise InputError(f"ranking_model is not this conversion; these fields differ (ranking model vs conversion): "
                         f"{details}{' ...' if len(differ) > 6 else ''}.")


# ----------------------------------------------------------------------------------------------- restoring
def softmax_twin(attention: LinearAttention) -> SoftmaxAttention:
    """A `SoftmaxAttention` for the same layer that shares `attention`'s projection modules (q/k/v/o and, with
    `use_qk_norm`, the q/k norms): no weight is copied, and the linear-only parameters are left out."""
    with torch.device("meta"):  # allocate nothing: every parameter is replaced by the shared module below
        twin = SoftmaxAttention(attention.config, attention.layer_idx)
    for name, _ in list(twin.named_children()):
        setattr(twin, name, getattr(attention, name))
    return twin


def _checked_layers(model: Any, layers: Any) -> list[int]:
    if not isinstance(model, LinearAttentionForCausalLM):
        raise TypeError(f"model must be a LinearAttentionForCausalLM; got {type(model).__name__}.")
    num_layers = model.config.num_hidden_layers
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(f"layers must be a list of layer indices; got {layers!r}.")
    bad = [index for index in layers if not _is_int(index) or not 0 <= index < num_layers]
    if bad:
        raise InputError(f"layers={list(layers)!r}: {bad} are not layer indices; indices are integers in "
                         f"[0, {num_layers - 1}] for this {num_layers}-layer model.")
    return sorted(set(layers))


def restore_softmax_layers(
    model: LinearAttentionForCausalLM, layers: Sequence[int], inplace: bool = False
) -> LinearAttentionForCausalLM:
    """`model` with `layers` turned into full softmax attention (a deep copy, or `model` itself when `inplace`).

    Each restored layer keeps its q/k/v/o weights (shared with the new `SoftmaxAttention`) and loses its feature
    maps, window gate and decay parameters; `config.softmax_layers` becomes the sorted union of the old and new
    softmax layers. Layers already softmax stay as they are. With every layer restored the model computes
    exactly what the softmax teacher it was converted from computes.
    """
    layers = _checked_layers(model, layers)
    model = model if inplace else copy.deepcopy(model)
    decoder_layers = model.model.layers
    for index in layers:
        if isinstance(decoder_layers[index].self_attn, LinearAttention):
            decoder_layers[index].self_attn = softmax_twin(decoder_layers[index].self_attn)
    model.config.softmax_layers = sorted(set(model.config.softmax_layers) | set(layers))
    # (a layer's softmax heads are part of its softmax attention now)
    model.config.softmax_heads = {i: h for i, h in model.config.softmax_heads.items() if i not in layers}
    return model


def restore_softmax_heads(
    model: LinearAttentionForCausalLM, heads: dict[int, Sequence[int]], inplace: bool = False
) -> LinearAttentionForCausalLM:
    """`model` with the KV heads `heads` ({layer: [kv_head, ...]}) turned into full softmax attention with their query
    groups (a deep copy, or `model` itself when `inplace`): `config.softmax_heads` gains them (with the heads a layer
    had already), and each listed layer becomes its kind's class with softmax heads (`SoftmaxHeadsMixin`) around the
    *same* modules and parameters, none copied or changed. In a converted model a restored head then computes its
    teacher's attention; the other heads compute what they computed before. Raises, before anything changes, for
    another model type and for what the config refuses (indices out of range, repeated heads, a layer in
    softmax_layers)."""
    if not isinstance(model, LinearAttentionForCausalLM):
        raise TypeError(f"model must be a LinearAttentionForCausalLM; got {type(model).__name__}.")
    if not isinstance(heads, dict):
        raise TypeError(f"heads must be a dict {{layer: [kv_head, ...]}}; got {heads!r}.")
    config = _config_with_heads(model.config, heads)
    model = model if inplace else copy.deepcopy(model)
    model.config.softmax_heads = config.softmax_heads
    for index in [layer for layer in config.softmax_heads if layer in heads]:
        decoder_layer = model.model.layers[index]
        decoder_layer.self_attn = with_softmax_heads(decoder_layer.self_attn, model.config)
    return model


def _config_with_heads(config: PretrainedConfig, heads: dict[int, Sequence[int]]) -> PretrainedConfig:
    """A new config of `config`'s class whose `softmax_heads` adds `heads` ({layer: [kv_head, ...]}) to the heads each
    layer keeps already; building it checks every index (range, repeats, softmax layers)."""
    merged = dict(config.softmax_heads)
    for layer, listed in heads.items():
        merged[layer] = [*merged.get(layer, []), *listed] if isinstance(listed, (list, tuple)) else listed
    return type(config).from_dict({**config.to_dict(), "softmax_heads": merged})


def with_softmax_heads(attention: LinearAttention, config: PretrainedConfig) -> LinearAttention:
    """The attention of `attention`'s layer with the softmax heads `config` lists for it, around `attention`'s own
    modules and parameters (shared, as `softmax_twin` shares the projections)."""
    with torch.device("meta"):  # allocate nothing: every parameter is replaced by the shared one below
        mixed = attention_class(config, attention.layer_idx)(config, attention.layer_idx)
    for name, _ in [*mixed.named_children(), *mixed.named_parameters(recurse=False)]:
        setattr(mixed, name, getattr(attention, name))
    return mixed.train(attention.training)


@contextmanager
def _restored(model: LinearAttentionForCausalLM, index: int) -> Iterator[None]:
    """Layer `index` of `model` as softmax attention inside the block, the original module put back after."""
    decoder_layer = model.model.layers[index]
    linear = decoder_layer.self_attn
    decoder_layer.self_attn = softmax_twin(linear)
    try:
        yield
    finally:
        decoder_layer.self_attn = linear


# ----------------------------------------------------------------------------------------------- ranking
def _checked_rows(rows: Any, vocab_size: int) -> torch.Tensor:
    if not isinstance(rows, torch.Tensor):
        try:
            rows = torch.tensor(rows)
        except (TypeError, ValueError) as error:
            raise InputError(f"rows must be token ids [N, L] (a tensor or equal-length lists): {error}") from error
    if rows.dim() != 2 or rows.numel() == 0:
        raise InputError(f"rows must be token ids of shape [N, L] with N, L >= 1; got shape {list(rows.shape)}.")
    if rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
        raise InputError(f"rows must hold integer token ids; got dtype {rows.dtype}.")
    if int(rows.min()) < 0 or int(rows.max()) >= vocab_size:
        raise InputError(f"rows hold token ids outside [0, {vocab_size - 1}] (min {int(rows.min())}, max "
                         f"{int(rows.max())}): they are not ids of this vocabulary.")
    return rows.long()


def _check_pair(student: Any, teacher: Any) -> list[int]:
    """The student's linear layers, after checking that the two models can be compared."""
    if not isinstance(student, LinearAttentionForCausalLM):
        raise TypeError(f"student must be a LinearAttentionForCausalLM; got {type(student).__name__}.")
    if not isinstance(teacher, PreTrainedModel):
        raise TypeError(f"teacher must be a transformers PreTrainedModel; got {type(teacher).__name__}.")
    if teacher.config.vocab_size != student.config.vocab_size:
        raise InputError(f"teacher and student have different vocabularies ({teacher.config.vocab_size} vs "
                         f"{student.config.vocab_size} tokens): the student was not converted from this teacher.")
    linear = [i for i, layer in enumerate(student.model.layers) if isinstance(layer.self_attn, LinearAttention)]
    if not linear:
        raise InputError("student has no linear-attention layer to rank: every layer is softmax already.")
    return linear


def _kl_sum(student: LinearAttentionForCausalLM, hidden: torch.Tensor, teacher_log_probs: torch.Tensor) -> float:
    """Σ over positions of KL(teacher ‖ student) from the student's final normed hidden states [L, hidden] and
    the teacher's log-probabilities [L, vocab], a slice of positions at a time (fp32, summed in fp64)."""
    total = torch.zeros((), dtype=torch.float64, device=hidden.device)  # read once, at the end (one host sync)
    for start in range(0, hidden.shape[0], KL_CHUNK):
        logits = student.lm_head(hidden[start:start + KL_CHUNK]).float()
        log_p = teacher_log_probs[start:start + KL_CHUNK]
        total += (log_p.exp() * (log_p - F.log_softmax(logits, dim=-1))).sum().double()
    return total.item()


def _tail(student: LinearAttentionForCausalLM, hidden: torch.Tensor, start: int) -> torch.Tensor:
    """The decoder from layer `start` on, for one unpadded row: the input of layer `start` [1, L, hidden] ->
    the final normed hidden states [L, hidden] (what `LinearAttentionModel.forward` does without cache or mask)."""
    positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
    position_embeddings = student.model.rotary_emb.rotation(hidden, positions)
    for layer in student.model.layers[start:]:
        hidden = layer(hidden, position_embeddings)
    return student.model.norm(hidden)[0]


@torch.no_grad()
def rank_softmax_layers(
    student: LinearAttentionForCausalLM, teacher: PreTrainedModel, rows: torch.Tensor | Sequence[Sequence[int]]
) -> list[dict[str, Any]]:
    """Rank the student's linear layers by how much restoring each one alone to softmax lowers the mean
    KL(teacher ‖ student) of next-token distributions over every position of `rows` (token ids [N, L], each
    row one unpadded sequence run with batch 1; a long row measures long-range behaviour).

    Returns one dict per linear layer, most useful first (ties by layer index): `layer`, `kl` (with that layer
    restored), `kl_reduction` (reference − kl), `relative_reduction` (kl_reduction / reference) and
    `reference_kl` (the unmodified student). Deterministic for given models and rows. The student is left as
    it was: each layer is swapped for a `softmax_twin` sharing its weights and swapped back. Layers before ℓ
    are unchanged by restoring ℓ, so each measurement reruns the decoder from layer ℓ on.
    """
    linear_layers = _check_pair(student, teacher)
    rows = _checked_rows(rows, student.config.vocab_size)
    modes = (student.training, teacher.training)
    student.eval()
    teacher.eval()
    device, teacher_device = student.lm_head.weight.device, next(teacher.parameters()).device
    reference, restored = 0.0, dict.fromkeys(linear_layers, 0.0)
    bar = tqdm(total=len(rows) * len(linear_layers), desc="Ranking softmax layers", unit="layer")
    try:
        for row in rows:
            ids = row[None]
            teacher_logits = teacher(input_ids=ids.to(teacher_device)).logits[0]
            teacher_log_probs = F.log_softmax(teacher_logits.float(), dim=-1).to(device)  # [L, vocab]
            del teacher_logits
            inputs = student.model(input_ids=ids.to(device), use_cache=False, output_hidden_states=True).hidden_states
            reference += _kl_sum(student, inputs[-1][0], teacher_log_probs)  # inputs[ℓ]: the input of layer ℓ
            for index in linear_layers:
                with _restored(student, index):
                    restored[index] += _kl_sum(student, _tail(student, inputs[index], index), teacher_log_probs)
                bar.update()
    finally:
        bar.close()
        student.train(modes[0])
        teacher.train(modes[1])
    tokens = rows.numel()
    reference /= tokens
    ranking = [{"layer": index, "kl": total / tokens, "kl_reduction": reference - total / tokens,
                "relative_reduction": (reference - total / tokens) / reference if reference > 0 else 0.0,
                "reference_kl": reference} for index, total in restored.items()]
    return sorted(ranking, key=lambda entry: (-entry["kl_reduction"], entry["layer"]))


@contextmanager
def _head_restored(model: LinearAttentionForCausalLM, index: int, head: int) -> Iterator[None]:
    """KV head `head` of layer `index` (a recurrent layer) restored to softmax with its query group inside the block
    (`with_softmax_heads` around the same modules, beside the heads the layer keeps already); the layer's own module
    and the config are put back after."""
    decoder_layer = model.model.layers[index]
    attention = decoder_layer.self_attn
    decoder_layer.self_attn = with_softmax_heads(attention, _config_with_heads(model.config, {index: [head]}))
    try:
        yield
    finally:
        decoder_layer.self_attn = attention


def _answer_log_prob(student: LinearAttentionForCausalLM, hidden: torch.Tensor, prompt: RetrievalPrompt
                     ) -> torch.Tensor:
    """Mean log-probability of `prompt`'s answer tokens, teacher-forced, from the final normed hidden states
    [L, hidden]: a 0-d fp32 tensor (differentiable when `hidden` is)."""
    a0, a1 = prompt.answer
    log_probs = F.log_softmax(student.lm_head(hidden[a0 - 1 : a1 - 1]).float(), dim=-1)  # [answer, vocab]
    answer = prompt.input_ids[0, a0:a1].to(log_probs.device)
    return log_probs.gather(-1, answer[:, None]).mean()


def recurrent_kv_heads(model: Any) -> list[tuple[int, int]]:
    """The (layer, KV head) pairs of the recurrent layers of `model` (a LinearAttentionForCausalLM, or its config:
    a checkpoint's is enough to count them before loading it) that are not exact already (not softmax heads): the
    heads that can be restored."""
    if isinstance(model, LinearAttentionForCausalLM):
        config = model.config
    elif isinstance(model, LinearAttentionConfig):
        config = model
    else:
        raise TypeError(f"model must be a LinearAttentionForCausalLM or a LinearAttentionConfig; got "
                        f"{type(model).__name__}.")
    return [(index, head) for index in range(config.num_hidden_layers) if config.layer_kind(index) != "softmax"
            for head in range(config.num_key_value_heads) if head not in config.softmax_heads_of(index)]


def _restoration_candidates(student: Any, prompts: Sequence[RetrievalPrompt]) -> list[tuple[int, int]]:
    """`recurrent_kv_heads(student)`, after checking the arguments of the restoration measures."""
    candidates = recurrent_kv_heads(student)
    if not prompts:
        raise InputError("restoration gains need at least one prompt")
    if not candidates:
        raise InputError("student has no recurrent KV head to restore: every head is softmax already.")
    return candidates


def _zero_at(student: LinearAttentionForCausalLM, candidates: list[tuple[int, int]]) -> torch.Tensor:
    """[L, H_kv] fp32: 0 at the `candidates` (layer, KV head), −inf elsewhere (heads not measured)."""
    config = student.config
    scores = torch.full((config.num_hidden_layers, config.num_key_value_heads), float("-inf"))
    for index, head in candidates:
        scores[index, head] = 0.0
    return scores


def estimated_restoration_gains(student: LinearAttentionForCausalLM, prompts: Sequence[RetrievalPrompt],
                                progress: bool = True) -> torch.Tensor:
    """[L, H_kv] fp32: the first-order estimate of `restoration_gains`, for every recurrent KV head at once, from one
    forward and one backward pass per prompt; −inf for the heads that are exact already.

    Restoring KV head h of layer ℓ replaces its query group's outputs o [T, G, V] (the input of o_proj) by the
    exact softmax attention of the same q, k, v, s [T, G, V]; the answer's mean log-probability f then changes by
    about ⟨∂f/∂o, s − o⟩, summed over positions, the group's query heads and V (a Taylor step of the whole change:
    "attribution patching"). It is exact for a change small against the model's curvature, and it ranks heads much
    like the measurement where the change is large (`restoration_gains` with `shortlist` measures the best of this
    ranking exactly). The student is left as it was (no parameter gradient is kept)."""
    candidates = _restoration_candidates(student, prompts)
    layers = sorted({index for index, _ in candidates})
    config = student.config
    groups = config.num_attention_heads // config.num_key_value_heads
    device = student.lm_head.weight.device
    estimates = _zero_at(student, candidates)
    mode = student.training
    student.eval()
    captured: dict[int, dict[str, Any]] = {index: {} for index in layers}

    def attention_input(index):
        def hook(module, args):
            captured[index]["input"] = (args[0].detach(), args[1])  # the Rotation: built without a graph
        return hook

    def output_before_o_proj(index):
        def hook(module, args):
            captured[index]["output"] = args[0]  # [B·T, H·V], in the graph
        return hook

    def differentiable(module, args, output):  # the graph starts at the embeddings, not at the parameters
        return output.detach().requires_grad_()

    flags = [(parameter, parameter.requires_grad) for parameter in student.parameters()]
    for parameter, _ in flags:
        parameter.requires_grad_(False)  # no parameter gradient is needed: nothing of theirs is kept for backward
    handles = [student.model.embed_tokens.register_forward_hook(differentiable)]
    for index in layers:
        attention = student.model.layers[index].self_attn
        handles.append(attention.register_forward_pre_hook(attention_input(index)))
        handles.append(attention.o_proj.register_forward_pre_hook(output_before_o_proj(index)))
    try:
        for prompt in tqdm(prompts, desc="Estimating restoration gains", unit="prompt", disable=not progress):
            with torch.enable_grad():
                hidden = student.model(input_ids=prompt.input_ids.to(device), use_cache=False).last_hidden_state
                outputs = [captured[index].pop("output") for index in layers]
                gradients = torch.autograd.grad(_answer_log_prob(student, hidden[0], prompt), outputs)
            with torch.no_grad():
                for index, output, gradient in zip(layers, outputs, gradients, strict=True):
                    attention = student.model.layers[index].self_attn
                    normed, position_embeddings = captured[index].pop("input")
                    q, k, v = attention.rotated_qkv(normed, position_embeddings, None, None, None)
                    q = scaled_queries(q, position_embeddings)  # as a restored head's, past the trained positions
                    q, k, v = (x.transpose(1, 2) for x in (q, k, v))  # [1, ·, T, D]
                    exact = causal_softmax_attention(q, k, v).transpose(1, 2)  # [1, T, H, V]
                    change = exact.reshape(output.shape).to(output.dtype) - output.detach()  # [T, H·V]
                    per_head = (gradient * change).float().view(-1, config.num_key_value_heads, groups, exact.shape[-1])
                    per_head = per_head.sum(dim=(0, 2, 3))  # [H_kv]
                    for head in range(config.num_key_value_heads):
                        if estimates[index, head] != float("-inf"):
                            estimates[index, head] += per_head[head].item() / len(prompts)
    finally:
        for handle in handles:
            handle.remove()
        for parameter, flag in flags:
            parameter.requires_grad_(flag)
        student.train(mode)
    return estimates


@torch.no_grad()
def restoration_gains(student: LinearAttentionForCausalLM, prompts: Sequence[RetrievalPrompt],
                      progress: bool = True, shortlist: int | None = None) -> torch.Tensor:
    """[L, H_kv] fp32: for each KV head of the student's recurrent layers, how much restoring it alone to exact
    softmax attention (with its query group) raises the mean log-probability of the answer's tokens of `prompts`
    (teacher-forced retrieval prompts, `head_selection.RetrievalPrompt`), averaged over the prompts; −inf for the
    heads that are exact already (softmax layers, softmax heads), so that `head_selection.top_heads` never picks them.

    The converted model's own measure, beside the teacher's `retrieval_scores`: it counts what the head's recurrent
    part fails to carry in *this* model, not how much the teacher leans on the head. One forward of the model per
    prompt, then per candidate head the decoder from its layer on (`_tail`). With `shortlist` = M, only the M heads
    that `estimated_restoration_gains` ranks best are measured (one forward and backward per prompt first, then M
    tails instead of one per recurrent head); the others are −inf too. The student is left as it was."""
    candidates = _restoration_candidates(student, prompts)
    if shortlist is not None:
        if not _is_int(shortlist) or not 1 <= shortlist <= len(candidates):
            raise InputError(f"shortlist={shortlist!r}: give a number of KV heads in [1, {len(candidates)}] (the "
                             "student's recurrent KV heads), or None to measure every one")
        estimates = estimated_restoration_gains(student, prompts, progress=progress)
        candidates = sorted(candidates, key=lambda lh: (-float(estimates[lh]), lh))[:shortlist]
    device = student.lm_head.weight.device
    gains = _zero_at(student, candidates)
    mode = student.training
    student.eval()
    bar = tqdm(total=len(prompts) * len(candidates), desc="Restoring heads one at a time", unit="head",
               disable=not progress)
    try:
        for prompt in prompts:
            ids = prompt.input_ids.to(device)
            inputs = student.model(input_ids=ids, use_cache=False, output_hidden_states=True).hidden_states
            reference = _answer_log_prob(student, inputs[-1][0], prompt).item()  # inputs[ℓ]: the input of layer ℓ
            for index, head in candidates:
                with _head_restored(student, index, head):
                    restored = _answer_log_prob(student, _tail(student, inputs[index], index), prompt).item()
                gains[index, head] += (restored - reference) / len(prompts)
                bar.update()
    finally:
        bar.close()
        student.train(mode)
    return gains


def select_softmax_layers(
    student: LinearAttentionForCausalLM, teacher: PreTrainedModel, rows: torch.Tensor | Sequence[Sequence[int]],
    k: int,
) -> tuple[list[int], list[dict[str, Any]]]:
    """The `k` layers whose restoration alone lowers the KL to the teacher most (sorted), and the full ranking
    (`rank_softmax_layers`). Greedy over single-layer measurements, not a joint search over layer sets.

    `k` lies in [1, number of linear layers − 1]: at least one layer stays linear (all restored would be the
    teacher). Checked before any forward pass.
    """
    linear_layers = _check_pair(student, teacher)
    if not _is_int(k) or not 1 <= k < len(linear_layers):
        raise InputError(f"k={k!r}: choose an integer in [1, {len(linear_layers) - 1}]; the student has "
                         f"{len(linear_layers)} linear layers and at least one must stay linear.")
    ranking = rank_softmax_layers(student, teacher, rows)
    return sorted(entry["layer"] for entry in ranking[:k]), ranking


KL_MEASURE = "mean KL(teacher || student) of next-token distributions with one layer restored to softmax"


def write_ranking(path: str | os.PathLike, ranking: list[dict[str, Any]], measure: str = KL_MEASURE,
                  **details: Any) -> Path:
    """Write `{"measure": measure, **details, "ranking": ranking}` as JSON to `path` atomically (a temporary file
    in the same folder, renamed over `path`): a reader sees the old file or the whole new one, never a part."""
    path = Path(path)
    text = json.dumps({
        "measure": measure,
        **details,
        "ranking": ranking,
    }, indent=2)  # serialised before anything is written: a value JSON cannot hold fails here
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text + "\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    return path


__all__ = [
    "SoftmaxLayerSpec",
    "check_layer_selection",
    "check_same_conversion",
    "estimated_restoration_gains",
    "parse_softmax_layers",
    "rank_softmax_layers",
    "recurrent_kv_heads",
    "restore_softmax_heads",
    "restore_softmax_layers",
    "restoration_gains",
    "select_softmax_layers",
    "softmax_twin",
    "write_ranking",
]
