"""Kernel feature maps φ for linear attention, applied per head to queries and keys after RoPE.

Every map takes `[B, T, H, D]` and returns `[B, T, H, K]` where K is `output_dim`, given by the class's
`output_size(D, F)` (which `feature_output_dim` reads too, so the config knows K without a map). The learned
maps (`t2r`, `hedgehog`) hold one weight matrix per head and start as the identity so that a
freshly converted model begins close to its teacher's dot products.

`query_scale` is the factor the attention applies to φ(q): 1/√K for the plain maps (as for
dot-product attention), 1 for maps whose outputs are already calibrated (`hedgehog` outputs
probabilities, `taylor` folds 1/√D into its features). With `normalize=True` the factor cancels.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

# The fixed element-wise maps (K = D).
ELEMENTWISE_MAPS = {
    "elu": lambda x: F.elu(x) + 1.0,  # Katharopoulos et al. 2020: positive, so the normaliser never vanishes
    "relu": F.relu,
    "identity": lambda x: x,  # plain (un-kernelised) linear attention, as in GLA / RetNet with decay
}


def per_head_projection(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W_h for every head h: x [B, T, H, D], weight [H, D, F] -> [B, T, H, F].

    One batched matrix product over the heads ([H, B·T, D] @ [H, D, F]); `einsum` computes the same but costs
    several microseconds more per call to plan, which a one-token decode step pays twice per layer.
    """
    b, t, heads, dim = x.shape
    z = torch.bmm(x.reshape(b * t, heads, dim).transpose(0, 1), weight)  # [H, B·T, F]
    return z.transpose(0, 1).view(b, t, heads, -1)


class ElementwiseFeatureMap(nn.Module):
    """φ(x) = f(x) element-wise, for f in `ELEMENTWISE_MAPS`; K = D, no parameters."""

    def __init__(self, name: str, head_dim: int) -> None:
        super().__init__()
        self.name = name
        self.fn = ELEMENTWISE_MAPS[name]
        self.output_dim = self.output_size(head_dim, head_dim)
        self.query_scale = head_dim**-0.5

    @staticmethod
    def output_size(head_dim: int, feature_dim: int) -> int:
        return head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x)

    def extra_repr(self) -> str:
        return self.name


class TaylorFeatureMap(nn.Module):
    """Second-order Taylor map (as in Based): φ(q)·φ(k) = 1 + s + s²/2 with s = q·k/√D ≈ exp(s).

    φ(x) = [1, x / D^¼, vec(x xᵀ) / (√2 · √D)], so K = 1 + D + D². Keep D small (≤ 32).
    """

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.output_dim = self.output_size(head_dim, head_dim)
        self.query_scale = 1.0

    @staticmethod
    def output_size(head_dim: int, feature_dim: int) -> int:
        return 1 + head_dim + head_dim * head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = self.head_dim
        first = x / d**0.25  # [B, T, H, D]
        second = (x.unsqueeze(-1) * x.unsqueeze(-2)).flatten(-2) / math.sqrt(2.0 * d)  # [B, T, H, D*D]
        ones = torch.ones_like(x[..., :1])
        return torch.cat([ones, first, second], dim=-1)


class T2RFeatureMap(nn.Module):
    """Learned φ(x) = relu(x W_h + b_h) per head (Kasai et al. 2021, "T2R"); K = feature_dim."""

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, feature_dim))  # [H, D, F]
        self.bias = nn.Parameter(torch.empty(num_heads, feature_dim))  # [H, F]
        self.output_dim = self.output_size(head_dim, feature_dim)
        self.query_scale = feature_dim**-0.5

    @staticmethod
    def output_size(head_dim: int, feature_dim: int) -> int:
        return feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(per_head_projection(x, self.weight) + self.bias)


class HedgehogFeatureMap(nn.Module):
    """Learned spiky map (Zhang et al. 2024, as LoLCATs uses it): z = x W_h per head,
    φ(x) = [softmax(z), softmax(-z)] with the two halves normalised separately; K = 2·feature_dim.

    The softmax is taken in fp32: its outputs are probabilities whose products carry the
    attention weights, and bf16 rounding there visibly blurs the "spikes".
    """

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, feature_dim))  # [H, D, F]
        self.output_dim = self.output_size(head_dim, feature_dim)
        self.query_scale = 1.0

    @staticmethod
    def output_size(head_dim: int, feature_dim: int) -> int:
        return 2 * feature_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = per_head_projection(x, self.weight).float()
        # Both halves in one softmax over the last dimension of [B, T, H, 2, F].
        return torch.stack((z, z.neg()), dim=-2).softmax(dim=-1).flatten(-2).to(x.dtype)


# Every map by its `LinearAttentionConfig.feature_map` name; the learned ones take a feature dimension F.
FEATURE_MAP_CLASSES: dict[str, type[nn.Module]] = {
    **dict.fromkeys(ELEMENTWISE_MAPS, ElementwiseFeatureMap),
    "t2r": T2RFeatureMap,
    "hedgehog": HedgehogFeatureMap,
    "taylor": TaylorFeatureMap,
}
LEARNED_FEATURE_MAPS = ("t2r", "hedgehog")


def feature_output_dim(name: str, head_dim: int, feature_dim: int | None = None) -> int:
    """K, the size of φ(x) that the map `name` gives for heads of size D (F = `feature_dim`, default D)."""
    return FEATURE_MAP_CLASSES[name].output_size(head_dim, feature_dim or head_dim)


def build_feature_map(name: str, num_heads: int, head_dim: int, feature_dim: int | None) -> nn.Module:
    """The feature map called `name` (a `LinearAttentionConfig.feature_map` value) for one layer."""
    if name not in FEATURE_MAP_CLASSES:
        raise ValueError(f"unknown feature_map {name!r}; allowed: {', '.join(FEATURE_MAP_CLASSES)}")
    if name in ELEMENTWISE_MAPS:
        return ElementwiseFeatureMap(name, head_dim)
    if name == "taylor":
        return TaylorFeatureMap(head_dim)
    return FEATURE_MAP_CLASSES[name](num_heads, head_dim, feature_dim or head_dim)
