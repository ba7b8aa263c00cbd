"""Kernel feature maps φ for linear attention, applied per head to queries and keys after RoPE, and the registry that
makes a map a `LinearAttentionConfig.feature_map` value.

Every map is a `FeatureMap`: built as `cls(num_heads, head_dim, feature_dim)` (F = `feature_dim`, the config's, or
D when unset), it takes `[B, T, H, D]` and returns `[B, T, H, K]` where K is `output_dim`, given by the class's
`output_size(D, F)` (which `feature_output_dim` reads too, so the config knows K without building a map). The
learned maps (`t2r`, `hedgehog`) hold one weight matrix per head and start as the identity (`initialize`) so that a
freshly converted model begins close to its teacher's dot products.

`query_scale` is the factor the attention applies to φ(q): 1/√K by default (as for dot-product attention), 1 for
maps whose outputs are already calibrated (`hedgehog` outputs probabilities, `taylor` folds 1/√D into its
features). With `normalize=True` the factor cancels.

`register_feature_map` is the one place a map is registered, the built-in ones below as much as one defined in a
user's script: the config's check of `feature_map` and `feature_dim`, the delta rule's check, `build_feature_map`
and `feature_output_dim` all read the registry (`FEATURE_MAPS`, `FEATURE_DIM_MAPS`, `DELTA_FEATURE_MAPS` are live
views of it). A registered map's parameters train in attention transfer like every parameter conversion adds
(`LinearAttention.attention_transfer_parameters`). docs/extending.md walks a new map through.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init


class FeatureMap(nn.Module):
    """The base of every feature map: subclasses implement `output_size` and `forward`, and `initialize` when they
    hold parameters. The constructor takes (num_heads, head_dim, feature_dim), the same for every map."""

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int) -> None:
        super().__init__()
        self.output_dim = self.output_size(head_dim, feature_dim)
        self.query_scale = self.output_dim**-0.5

    @staticmethod
    def output_size(head_dim: int, feature_dim: int) -> int:
        """K, the size of φ(x), for heads of size D = `head_dim` and the feature dimension F = `feature_dim`."""
        raise NotImplementedError

    def initialize(self) -> None:
        """Set the map's parameters to where a converted model starts, with `transformers.initialization`'s functions
        (which leave weights loaded from a checkpoint alone); `LinearAttentionPreTrainedModel._init_weights` calls
        it. A map without parameters has nothing to set."""


@dataclass(frozen=True)
class RegisteredFeatureMap:
    """A registry entry: the map's class, whether it takes the config's `feature_dim` F, and whether the delta rule
    (`update_rule="delta"`, which L2-normalises φ(q) and φ(k)) may run on it."""

    cls: type[FeatureMap]
    takes_feature_dim: bool
    delta_rule: bool


# Every map by its `LinearAttentionConfig.feature_map` name, in registration order.
FEATURE_MAP_REGISTRY: dict[str, RegisteredFeatureMap] = {}


def register_feature_map(
    name: str, *, takes_feature_dim: bool = False, delta_rule: bool = False
) -> Callable[[type[FeatureMap]], type[FeatureMap]]:
    """Class decorator: make the `FeatureMap` subclass it decorates the map `LinearAttentionConfig(feature_map=name)`
    builds. `takes_feature_dim`: the map reads the config's `feature_dim` F (the others refuse one). `delta_rule`:
    `update_rule="delta"` may run on it (its φ(q), φ(k) are L2-normalised there: say True only for a map whose output
    direction is what matters). Register a map before a config naming it is built or loaded; registering the same
    class under its name again does nothing, another class under a taken name is refused."""

    def register(cls: type[FeatureMap]) -> type[FeatureMap]:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"register_feature_map: name={name!r} must be a string that is a Python identifier "
                             "(it is a config value and a command-line choice).")
        if not (isinstance(cls, type) and issubclass(cls, FeatureMap)):
            raise TypeError(f"register_feature_map({name!r}) decorates a subclass of FeatureMap, got {cls!r}.")
        missing = [method for method in ("output_size", "forward")
                   if getattr(cls, method) is getattr(FeatureMap, method)]
        if missing:
            raise TypeError(f"register_feature_map({name!r}): {cls.__name__} does not implement {missing}.")
        entry = RegisteredFeatureMap(cls, bool(takes_feature_dim), bool(delta_rule))
        taken = FEATURE_MAP_REGISTRY.get(name)
        if taken is not None and taken != entry:
            raise ValueError(f"register_feature_map: the name {name!r} is taken by {taken.cls.__name__}; pick another.")
        FEATURE_MAP_REGISTRY[name] = entry
        return cls

    return register


class FeatureMapNames(Sequence[str]):
    """The names of the registered maps whose entry satisfies `keep`, read from the registry at every use (so a map
    registered after import is among them): what the config checks a name against."""

    def __init__(self, keep: Callable[[RegisteredFeatureMap], bool] = lambda entry: True) -> None:
        self._keep = keep

    def _names(self) -> list[str]:
        return [name for name, entry in FEATURE_MAP_REGISTRY.items() if self._keep(entry)]

    def __getitem__(self, index):
        return self._names()[index]

    def __len__(self) -> int:
        return len(self._names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __repr__(self) -> str:
        return repr(tuple(self._names()))


FEATURE_MAPS = FeatureMapNames()
FEATURE_DIM_MAPS = FeatureMapNames(lambda entry: entry.takes_feature_dim)
DELTA_FEATURE_MAPS = FeatureMapNames(lambda entry: entry.delta_rule)


def per_head_projection(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x W_h for every head h: x [B, T, H, D], weight [H, D, F] -> [B, T, H, F].

    One batched matrix product over the heads ([H, B·T, D] @ [H, D, F]); `einsum` computes the same but costs
    several microseconds more per call to plan, which a one-token decode step pays twice per layer.
    """
    b, t, heads, dim = x.shape
    z = torch.bmm(x.reshape(b * t, heads, dim).transpose(0, 1), weight)  # [H, B·T, F]
    return z.transpose(0, 1).view(b, t, heads, -1)


class ElementwiseFeatureMap(FeatureMap):
    """φ(x) = f(x) element-wise; K = D, no parameters. Each subclass is one f (`function`)."""

    @staticmethod
    def function(x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def output_size(head_dim: int, feature_dim: int) -> int:
        return head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function(x)


@register_feature_map("elu", delta_rule=True)
class EluFeatureMap(ElementwiseFeatureMap):
    """φ(x) = elu(x) + 1 (Katharopoulos et al. 2020): positive, so the normaliser never vanishes."""

    @staticmethod
    def function(x: torch.Tensor) -> torch.Tensor:
        return F.elu(x) + 1.0


@register_feature_map("relu", delta_rule=True)
class ReluFeatureMap(ElementwiseFeatureMap):
    """φ(x) = relu(x)."""

    @staticmethod
    def function(x: torch.Tensor) -> torch.Tensor:
        return F.relu(x)


@register_feature_map("identity", delta_rule=True)
class IdentityFeatureMap(ElementwiseFeatureMap):
    """φ(x) = x: plain (un-kernelised) linear attention, as in GLA / RetNet with decay."""

    @staticmethod
    def function(x: torch.Tensor) -> torch.Tensor:
        return x


@register_feature_map("t2r", takes_feature_dim=True, delta_rule=True)
class T2RFeatureMap(FeatureMap):
    """Learned φ(x) = relu(x W_h + b_h) per head (Kasai et al. 2021, "T2R"); K = feature_dim."""

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int) -> None:
        super().__init__(num_heads, head_dim, feature_dim)
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, feature_dim))  # [H, D, F]
        self.bias = nn.Parameter(torch.empty(num_heads, feature_dim))  # [H, F]

    @staticmethod
    def output_size(head_dim: int, feature_dim: int) -> int:
        return feature_dim

    def initialize(self) -> None:
        """The identity (rectangular when F != D), no bias: φ(q)·φ(k) starts as a monotone function of q·k."""
        heads, d, f = self.weight.shape
        init.copy_(self.weight, torch.eye(d, f).expand(heads, d, f))
        init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(per_head_projection(x, self.weight) + self.bias)


@register_feature_map("hedgehog", takes_feature_dim=True, delta_rule=True)
class HedgehogFeatureMap(FeatureMap):
    """Learned spiky map (Zhang et al. 2024, as LoLCATs uses it): z = x W_h per head,
    φ(x) = [softmax(z), softmax(-z)] with the two halves normalised separately; K = 2·feature_dim.

    The softmax is taken in fp32: its outputs are probabilities whose products carry the
    attention weights, and bf16 rounding there visibly blurs the "spikes".
    """

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int) -> None:
        super().__init__(num_heads, head_dim, feature_dim)
        self.weight = nn.Parameter(torch.empty(num_heads, head_dim, feature_dim))  # [H, D, F]
        self.query_scale = 1.0

    @staticmethod
    def output_size(head_dim: int, feature_dim: int) -> int:
        return 2 * feature_dim

    def initialize(self) -> None:
        """The identity (rectangular when F != D)."""
        heads, d, f = self.weight.shape
        init.copy_(self.weight, torch.eye(d, f).expand(heads, d, f))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = per_head_projection(x, self.weight).float()
        # Both halves in one softmax over the last dimension of [B, T, H, 2, F].
        return torch.stack((z, z.neg()), dim=-2).softmax(dim=-1).flatten(-2).to(x.dtype)


# Not for the delta rule: its 1 + D + D² features approximate exp(q·k), which L2-normalising breaks, and its state
# would be (1 + D + D²) × D.
@register_feature_map("taylor")
class TaylorFeatureMap(FeatureMap):
    """Second-order Taylor map (as in Based): φ(q)·φ(k) = 1 + s + s²/2 with s = q·k/√D ≈ exp(s).

    φ(x) = [1, x / D^¼, vec(x xᵀ) / (√2 · √D)], so K = 1 + D + D². Keep D small (≤ 32).
    """

    def __init__(self, num_heads: int, head_dim: int, feature_dim: int) -> None:
        super().__init__(num_heads, head_dim, feature_dim)
        self.head_dim = head_dim
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


def _registered(name: str) -> RegisteredFeatureMap:
    if name not in FEATURE_MAP_REGISTRY:
        raise ValueError(f"unknown feature_map {name!r}; allowed: {', '.join(FEATURE_MAPS)} (a map defined "
                         "elsewhere is registered first, with hf_linear_attn.register_feature_map)")
    return FEATURE_MAP_REGISTRY[name]


def feature_output_dim(name: str, head_dim: int, feature_dim: int | None = None) -> int:
    """K, the size of φ(x) that the map `name` gives for heads of size D (F = `feature_dim`, default D)."""
    return _registered(name).cls.output_size(head_dim, feature_dim or head_dim)


def build_feature_map(name: str, num_heads: int, head_dim: int, feature_dim: int | None) -> FeatureMap:
    """The feature map called `name` (a `LinearAttentionConfig.feature_map` value) for one layer."""
    return _registered(name).cls(num_heads, head_dim, feature_dim or head_dim)
