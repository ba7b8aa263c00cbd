"""Losses over packed rows, and their item-weighted mean: what training minimises and evaluation reports.

A loss is a `LossFn`, `loss_fn(model, batch) -> (loss_sum, count)`: `batch` holds `[rows, block_size]`
tensors (`input_ids`, `labels`, `position_ids`, as `training.data.collate_rows` stacks packed rows);
it returns per-row tensors `[rows]`: the summed loss and the number of items it sums over (tokens,
heads x tokens, ...). Per-row values let a distributed evaluation drop the rows it repeats to even out
the last batch; `weighted_mean` turns any number of them into Σ loss / Σ count.

- `packed_forward`: the model on packed rows as one flattened row, documents kept apart.
- `token_cross_entropy`: next-token cross-entropy of every position (the one definition every
  cross-entropy here uses).
- `causal_lm_loss`: next-token cross-entropy per row.
- `logit_distillation_loss(teacher, w, T)`: (1 − w)·CE + w·T²·KL(teacher ‖ model) per row.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hf_linear_attn.training.data import IGNORE_INDEX

LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, torch.Tensor]]


def flat_positions(position_ids: torch.Tensor) -> torch.Tensor:
    """position_ids [rows, L] of packed rows -> [1, rows * L], every row still a document piece of its own: a
    piece starts wherever the position does not step by one, so a row whose first position would continue the
    previous row's last (rows with position offsets, `training.data.offset_positions`) moves down by one."""
    rows = position_ids.clone()
    for r in range(1, len(rows)):
        if rows[r, 0] == rows[r - 1, -1] + 1:  # (then rows[r, 0] ≥ 1)
            rows[r] -= 1
    return rows.reshape(1, -1)


def packed_forward(model: nn.Module, batch: dict[str, torch.Tensor], **kwargs: Any) -> Any:
    """Run `model` on packed rows `[rows, block_size]` as one row (DataCollatorWithFlattening's layout):
    position_ids that do not step by one (a restart at 0, or an offset piece) mark the documents, which the model
    keeps apart. Returns the output, whose tensors have the flattened length rows * block_size."""
    return model(
        input_ids=batch["input_ids"].reshape(1, -1),
        position_ids=flat_positions(batch["position_ids"]),
        use_cache=False,
        **kwargs,
    )


def token_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, in float32, of every position but the last: logits `[rows, L, V]` predict
    labels `[rows, L]` shifted by one. Returns `[rows, L - 1]`, 0 where the label is IGNORE_INDEX."""
    return F.cross_entropy(logits[:, :-1].float().transpose(1, 2), labels[:, 1:], ignore_index=IGNORE_INDEX,
                           reduction="none")


def predicted_tokens(labels: torch.Tensor) -> torch.Tensor:
    """bool `[rows, L - 1]`: which next-token predictions of labels `[rows, L]` count."""
    return labels[:, 1:] != IGNORE_INDEX


def causal_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token cross-entropy per packed row: (summed loss [rows], predicted tokens [rows])."""
    rows, length = batch["input_ids"].shape
    logits = packed_forward(model, batch).logits.reshape(rows, length, -1)
    return token_cross_entropy(logits, batch["labels"]).sum(dim=1), predicted_tokens(batch["labels"]).sum(dim=1)


def logit_distillation_loss(teacher: nn.Module, kl_weight: float, temperature: float,
                            teacher_precision: Callable[[], AbstractContextManager] = nullcontext) -> LossFn:
    """A loop loss: per packed row, Σ over predicted tokens of (1 − w)·CE + w·T²·KL(teacher ‖ model), with
    both distributions at temperature T (T² keeps the gradient scale of the KL term independent of T), and
    the number of those tokens. The teacher sees the same packed rows, documents kept apart, inside
    `teacher_precision()` (e.g. `accelerator.autocast`, so that it runs in the student's mixed precision)."""

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        rows, length = batch["input_ids"].shape
        predicted = predicted_tokens(batch["labels"])
        logits = packed_forward(model, batch).logits.reshape(rows, length, -1)  # [rows, L, V]
        with torch.no_grad(), teacher_precision():
            target = packed_forward(teacher, batch).logits.reshape(rows, length, -1)[:, :-1].float()
        token_loss = torch.zeros(predicted.shape, device=logits.device)
        if kl_weight < 1:
            token_loss = token_loss + (1 - kl_weight) * token_cross_entropy(logits, batch["labels"])
        if kl_weight > 0:
            log_model = F.log_softmax(logits[:, :-1].float() / temperature, dim=-1)
            log_teacher = F.log_softmax(target / temperature, dim=-1)
            kl = (log_teacher.exp() * (log_teacher - log_model)).sum(-1)  # [rows, L-1]
            token_loss = token_loss + kl_weight * temperature**2 * kl.masked_fill(~predicted, 0.0)
        return token_loss.sum(dim=1), predicted.sum(dim=1)

    return loss_fn


def weighted_mean(losses: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Σ loss_sum / Σ count over `(loss_sum, count)` pairs of per-row tensors, accumulated in float64: the
    item-weighted mean loss of every row given (0.0 when nothing is counted)."""
    total = count = torch.zeros((), dtype=torch.float64)
    for loss_sum, items in losses:
        total = total + loss_sum.detach().double().sum().cpu()
        count = count + items.detach().double().sum().cpu()
    return (total / count.clamp(min=1)).item()
