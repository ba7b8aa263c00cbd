"""Attention transfer (LoLCATs stage 1): each linear-attention layer learns to reproduce the softmax
attention of the teacher layer it replaced.

    with AttentionTransfer(model) as transfer:  # model: a LinearAttentionForCausalLM
        prepared = accelerator.prepare(model)   # or the model itself: hooks fire however it is called
        output = prepared(input_ids, use_cache=False, logits_to_keep=1)
        output.loss.backward()                  # Σ over layers of the per-layer MSE below
        transfer.layer_losses                   # the per-layer terms of that forward

While installed, every `LinearAttention` layer also computes, from its own (frozen) q/k/v, the causal
softmax attention the teacher computed: `causal_softmax_attention(q, k, v)` [B, T, H, D], under
`no_grad`. Its loss is the mean squared error of the layer's per-head output (after the output norm,
i.e. what `o_proj` receives) against that teacher output, in fp32, over real tokens; and the teacher's
output, not the layer's, goes on into `o_proj`, so every layer learns from exactly the inputs it will see
(teacher forcing). The model's forward returns the sum of the layer terms as `output.loss`: the loss is an
output of the forward, so a wrapper that calls it (DistributedDataParallel, accelerate's autocast)
sees it like any other loss. Run the forward through the wrapper: DDP synchronises the gradients of a
forward only when it ran through DDP, and the ranks drift apart otherwise.

With `window_dropout` = p > 0 (window layers only), each window layer's softmax window shrinks, in a training
forward with probability p, to a size drawn uniformly from 1 .. window_size − 1 for that forward (sinks kept): the
linear part then has to carry keys the window would have covered, where the teacher's attention mass is large, so it
cannot learn to stay idle behind the window. The draws come from the torch RNG once per model forward (so resumed
runs, which restore it, draw the same; a layer recomputed in backward keeps its draw); evaluation forwards draw
nothing.

It is all forward hooks, removed on leaving the `with` block: the model's code and its checkpoints hold
no training state, and parameter names stay as they are (checkpoints saved meanwhile load as usual).
The teacher's q/k/v are recomputed from the layer's input (a few frozen projections per layer), with the
layer's own `project`, so they are exactly the ones the layer uses.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers.utils import ModelOutput

from hf_linear_attn.configuration_linear_attention import InputError
from hf_linear_attn.modeling_linear_attention import (
    LinearAttention,
    LinearAttentionForCausalLM,
    causal_softmax_attention,
)
from hf_linear_attn.training.loop import select_trainable, train_only
from hf_linear_attn.training.losses import packed_forward

_LAYER_SIGNATURE = inspect.signature(LinearAttention.forward)


def transfer_layers(model: nn.Module) -> list[LinearAttention]:
    """The layers attention transfer trains: every LinearAttention (softmax layers are teachers already)."""
    return [module for module in model.modules() if isinstance(module, LinearAttention)]


def select_transfer_parameters(model: nn.Module, patterns: Sequence[str] | None = None) -> list[str]:
    """Make exactly what attention transfer trains trainable, every other parameter frozen, and return the names:
    with `patterns` (`--trainable_parameters`), the parameters one of those regexes matches; without, what the
    linear-attention layers declare (`LinearAttention.attention_transfer_parameters`: the parameters conversion
    adds, feature maps registered outside the package included). Raises when that is nothing."""
    if patterns is not None:
        return select_trainable(model, patterns)
    names = [f"{prefix}.{name}" for prefix, layer in model.named_modules() if isinstance(layer, LinearAttention)
             for name in layer.attention_transfer_parameters()]
    if not names:
        config = model.config
        raise InputError(f"The linear-attention layers have no parameter attention transfer trains (feature_map "
                         f"{config.feature_map!r}, decay {config.decay!r}, window_size {config.window_size}, "
                         f"update_rule {config.update_rule!r}): convert with a learned feature map (t2r, hedgehog), a "
                         "data-dependent decay (scalar, vector), a window or the delta rule, or name the parameters "
                         "to train with --trainable_parameters.")
    return train_only(model, names)


class AttentionTransfer:
    """Context manager: while entered, `model`'s linear-attention layers learn from their softmax teachers
    and `model`'s forward returns the transfer loss as `output.loss` (see the module docstring)."""

    def __init__(self, model: nn.Module, window_dropout: float = 0.0) -> None:
        if not isinstance(model, LinearAttentionForCausalLM):
            raise TypeError(f"model must be a LinearAttentionForCausalLM (its output carries the transfer loss); "
                            f"got {type(model).__name__}.")
        self.model = model
        self.layers = transfer_layers(model)
        if not self.layers:
            raise InputError("model has no linear-attention layer to transfer attention to (all are softmax_layers).")
        check_window_dropout(window_dropout, model.config)
        self.window_dropout = window_dropout
        self._full_windows = [layer.window_size for layer in self.layers]  # each layer's own, put back after
        self.windows = list(self._full_windows)  # the window of each layer in this forward (`_start` draws it)
        self.layer_losses: list[torch.Tensor | None] = [None] * len(self.layers)
        self._teachers: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    def __enter__(self) -> AttentionTransfer:
        if self._handles:
            raise RuntimeError("This AttentionTransfer is already installed.")
        self._handles.append(self.model.register_forward_pre_hook(self._start, with_kwargs=True))
        self._handles.append(self.model.register_forward_hook(self._finish))
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(partial(self._teach, index), with_kwargs=True))
            self._handles.append(layer.o_proj.register_forward_pre_hook(partial(self._compare, index)))
        return self

    def __exit__(self, *exc_info: object) -> None:
        for layer, window in zip(self.layers, self._full_windows, strict=True):
            layer.window_size = window
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._teachers.clear()

    def _start(self, model: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if kwargs.get("labels") is not None:
            raise ValueError("labels: attention transfer's loss is layer-local and needs no labels; pass none.")
        if kwargs.get("return_dict") is False:
            raise ValueError("return_dict=False: attention transfer returns its loss in the output object; "
                             "leave return_dict unset.")
        self.layer_losses = [None] * len(self.layers)
        self.windows = list(self._full_windows)
        if self.window_dropout > 0 and model.training:
            for index, window in enumerate(self._full_windows):
                if window > 1 and torch.rand(()).item() < self.window_dropout:
                    self.windows[index] = int(torch.randint(1, window, ()).item())

    def _teach(self, index: int, layer: LinearAttention, args: tuple, kwargs: dict[str, Any]) -> None:
        """Before the layer runs: its teacher's output [B, T, H, D] from the same q/k/v."""
        call = _LAYER_SIGNATURE.bind(layer, *args, **kwargs)
        call.apply_defaults()
        inputs = call.arguments
        if inputs["cache_layer"] is not None:  # checked before the layer does any work
            raise ValueError("Attention transfer runs without a cache: call the model with use_cache=False.")
        mask = inputs["attention_mask"]  # None or bool [B, T]: without a cache there are no past positions
        with torch.no_grad():
            q, k, v = layer.project(inputs["hidden_states"], inputs["position_embeddings"])
            teacher = causal_softmax_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, inputs["cu_seqlens"]
            ).transpose(1, 2)
        self._teachers[index] = (teacher, mask)
        layer.window_size = self.windows[index]

    def _compare(self, index: int, o_proj: nn.Module, args: tuple) -> tuple[torch.Tensor]:
        """Before `o_proj`: record the layer's MSE against its teacher and hand the teacher's output on."""
        (output,) = args  # [B, T, H * D]: the layer's per-head output, after its output norm
        self.layers[index].window_size = self._full_windows[index]
        teacher, mask = self._teachers.pop(index)
        error = (output.reshape(teacher.shape).float() - teacher.float()).pow(2)
        if mask is not None:
            error = error[mask]
        self.layer_losses[index] = error.mean()
        return (teacher.reshape(output.shape),)

    def _finish(self, model: nn.Module, args: tuple, output: ModelOutput) -> ModelOutput:
        return dataclasses.replace(output, loss=torch.stack(self.layer_losses).sum())


def check_window_dropout(window_dropout: Any, config: Any) -> None:
    """ValueError unless `window_dropout` is a probability in [0, 1) and, when > 0, `config` has a sliding window
    of at least 2 tokens to shrink."""
    if isinstance(window_dropout, bool) or not isinstance(window_dropout, (int, float)) or not 0 <= window_dropout < 1:
        raise InputError(f"window_dropout={window_dropout!r}: give a probability in [0, 1) (0: the window always "
                         "whole).")
    if window_dropout > 0 and getattr(config, "window_size", 0) < 2:
        raise InputError(f"window_dropout={window_dropout}: the model has no sliding window to shrink (window_size "
                         f"{getattr(config, 'window_size', 0)}; it needs ≥ 2); give 0.")


def attention_transfer_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """`training.loop`'s loss function for attention transfer: the transfer loss as (loss [rows], weight [rows]).

    `model` is the prepared (wrapped) model, run inside `AttentionTransfer`. The batch's packed rows run as one
    row, documents kept apart; every row gets the batch's loss with weight 1, so the loop's weighted mean is
    that loss. The LM head plays no part in it: it runs on one position only."""
    rows = batch["input_ids"].shape[0]
    output = packed_forward(model, batch, logits_to_keep=1)
    if output.loss is None:
        raise RuntimeError("attention_transfer_loss needs the model inside `with AttentionTransfer(model):`.")
    return output.loss.expand(rows), torch.ones(rows, device=output.loss.device)
