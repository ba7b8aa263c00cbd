"""LinearAttentionModel / LinearAttentionForCausalLM: a Llama-style decoder with linear attention.

One file per model, in the spirit of transformers' `modeling_llama.py`. Shapes are written
`[B, T, H, D]`: batch, time, heads, head dim. The attention math lives in `ops.py` (one
functional entry point, several backends); this file only projects, applies RoPE and feature
maps, builds decays, and handles padding.

Padding rule: at pad positions φ(k), v and the log-decay are zeroed *after* the feature map and gate,
so a pad step leaves the recurrent state exactly unchanged; window and softmax layers mask a pad as a key.
Any mask pattern follows from this (left or right padding, holes between real tokens), with or without a
cache. The sliding window is defined over positions, pads included: a hole inside it removes one key, so
prefill, chunked prefill and token-by-token decode (whose cache keeps the last window_size *positions*)
see the same keys. The repository's docs/design.md derives the rule.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import DynamicLayer
from transformers.generation import GenerationMode
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update

from .backends import BACKENDS  # noqa: F401 (see below)
from .cache_linear_attention import (
    DeltaWindowStateLayer,
    LinearAttentionCache,
    LinearStateLayer,
    SparseWindowStateLayer,
    WindowStateLayer,
    config_fingerprint,
)
from .configuration_linear_attention import (
    AUTO_MAP,
    LinearAttentionConfig,
    check_has_window_weight,
    check_sparse_cache_size,
    check_window_weight,
)
from .feature_maps import FeatureMap, build_feature_map
from .ops import (
    delta_rule_attention,
    delta_window_attention_step,
    linear_attention,
    linear_attention_step,
    window_attention,
    window_attention_step,
)

# A checkpoint's code is this file plus the files it imports relatively. transformers 5.5 copies only the
# *direct* relative imports of the model file when loading remote code from a local folder (later releases
# follow imports transitively), so the modules that `ops.py` builds on are named here as well.
from .ops_chunked import chunk_linear_attention  # noqa: F401
from .ops_common import CHUNK_SIZE  # noqa: F401
from .ops_decode import window_decode_step  # noqa: F401
from .ops_delta_rule import window_delta_rule  # noqa: F401
from .ops_delta_rule_chunked import chunk_delta_rule  # noqa: F401
from .ops_reference import recurrent_linear_attention  # noqa: F401
from .ops_sparse_memory import MEMORY_BLOCK_SIZE, block_end
from .ops_triton_common import HAS_TRITON  # noqa: F401
from .ops_triton_decode import triton_window_decode_step  # noqa: F401
from .ops_triton_delta_rule import triton_delta_rule  # noqa: F401
from .ops_triton_linear import triton_linear_attention  # noqa: F401
from .ops_triton_window import triton_window_attention  # noqa: F401

# GLA divides the log-sigmoid gate by 16 so that freshly initialised decays stay close to 1
# (logsigmoid(0) / 16 ≈ -0.043, i.e. a ≈ 0.96 per token) and long-range memory survives init.
GATE_LOGIT_NORMALIZER = 16.0
# Fixed decay γ_h = 1 - 2^(-E-h) for head h: RetNet's E = 5 (horizons 1 / (1 - γ) of 32, 64, ... tokens) in linear
# layers. In the window hybrid the decay starts when a key leaves the window, and the linear part exists for what
# lies beyond it: E = 8 starts at a 256-token horizon (4x the usual 64-token window; 9 heads reach 65536).
RETNET_DECAY_EXPONENT = 5
HYBRID_DECAY_EXPONENT = 8
# transformers 5.24 renamed `past_key_values` to `cache` in model outputs and in generate()'s model kwargs;
# use whichever name the installed release reads, or the cache is silently dropped between steps.
OUTPUT_CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"
GENERATE_CACHE_KEY = (
    "cache" if "cache" in inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    else "past_key_values"
)

class LinearAttentionRMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in fp32 (as Llama's)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:  # one composite op with the same bits as the lines below (fewer dispatches)
            return F.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * x.to(dtype)


class LinearAttentionRotaryEmbedding(nn.Module):
    """cos/sin tables for RoPE, any `rope_type` transformers knows (default, llama3, yarn, ...), as Llama's.

    The class name and the `original_inv_freq` buffer follow transformers' convention so that
    `PreTrainedModel._init_weights` recomputes these non-persistent buffers after a meta-device load.
    `dynamic` and `longrope` recompute `inv_freq` from the longest position of each call (transformers'
    `dynamic_rope_update`, which reads `max_seq_len_cached` and `original_max_seq_len`), so a long input
    gets the rescaled frequencies and a short one the original ones.
    """

    def __init__(self, config: LinearAttentionConfig) -> None:
        super().__init__()
        self.config = config
        self.max_seq_len_cached = self.original_max_seq_len = config.max_position_embeddings
        self.rope_type = config.rope_parameters["rope_type"]
        init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = init_fn(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def angles(self, position_ids: torch.Tensor) -> torch.Tensor:
        """position_ids [B, T] -> fp32 angles [B, T, D / 2]: position × frequency, with `rope_position_cap` the
        angle of each frequency that does not complete a turn within the cap held at its value at the last position
        below it (the other frequencies' angles, every value of which training saw, are left to grow)."""
        inv_freq = self.inv_freq.to(device=position_ids.device, dtype=torch.float)
        angles = position_ids[..., None].float() * inv_freq
        cap = self.config.rope_position_cap  # read at every call: a cap set on the loaded config holds at once
        if cap is None:
            return angles
        last = (cap - 1) * inv_freq
        return torch.minimum(angles, torch.where(last < 2 * math.pi, last, torch.inf))

    @staticmethod
    def compute_default_rope_parameters(config: LinearAttentionConfig, **kwargs) -> tuple[torch.Tensor, float]:
        base = config.rope_parameters["rope_theta"]
        dim = config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @torch.no_grad()
    @dynamic_rope_update
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids [B, T] -> cos, sin [B, T, D], in x's dtype.
        freqs = self.angles(position_ids.to(x.device))
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)

    def rotation(self, x: torch.Tensor, position_ids: torch.Tensor) -> Rotation:
        """The `position_embeddings` every layer takes (`Rotation`): `forward`'s cos and sin as `apply_rotary` reads
        them, [B, T, 1, D] each, the sin with its first half negated, and the exact attention's query scale. Made once
        per model forward, not per layer."""
        cos, sin = self(x, position_ids)
        half = sin.shape[-1] // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        return Rotation(cos.unsqueeze(2), signed_sin.unsqueeze(2), self.query_scale(position_ids.to(x.device)))

    def query_scale(self, position_ids: torch.Tensor) -> torch.Tensor | None:
        """position_ids [B, T] -> fp32 [B, T, 1, 1]: the factor of the softmax layers' and heads' queries,
        1 + β ln((p + 1) / max_position_embeddings) past the trained positions and 1 within them
        (`softmax_log_length_scale` β, read at every call); None when β is 0."""
        beta = self.config.softmax_log_length_scale
        if not beta:
            return None
        trained = self.config.max_position_embeddings
        keys = (position_ids.float() + 1).clamp(min=trained)  # how many keys the query at p reads, from `trained` on
        return (1 + beta * torch.log(keys / trained))[..., None, None]


class Rotation(NamedTuple):
    """The `position_embeddings` of every layer (`LinearAttentionRotaryEmbedding.rotation`): RoPE's tables as
    `apply_rotary` takes them, cos and signed_sin [B, T, 1, D], and `query_scale`, fp32 [B, T, 1, 1] or None, the
    factor of the exact softmax attention's queries past the trained positions (`scaled_queries`)."""

    cos: torch.Tensor
    signed_sin: torch.Tensor
    query_scale: torch.Tensor | None


def scaled_queries(q: torch.Tensor, rotation: Rotation) -> torch.Tensor:
    """The queries q [B, T, h, D] of softmax attention (a softmax layer's, or a layer's softmax heads') times the
    rotation's `query_scale` (`softmax_log_length_scale`); q itself when there is none."""
    return q if rotation.query_scale is None else q * rotation.query_scale.to(q.dtype)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q [B, T, H, D] and k [B, T, H_kv, D] with the tables of `rotation` [B, T, 1, D] (Llama's half-split
    convention). Llama's x·cos + rotate_half(x)·sin with rotate_half(x) = [−x₂, x₁] is x·cos + roll(x)·sin with
    roll(x) = [x₂, x₁] and the sign moved into the table: the same products and sum, bit for bit, in 4 ops a tensor
    instead of 7 (a decode step runs them in every layer)."""
    half = q.shape[-1] // 2
    return q * cos + q.roll(half, -1) * signed_sin, k * cos + k.roll(half, -1) * signed_sin


class LinearAttentionMLP(nn.Module):
    """SwiGLU feed-forward: down(act(gate(x)) * up(x))."""

    def __init__(self, config: LinearAttentionConfig) -> None:
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=config.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=config.mlp_bias)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])  # [B·T, hidden]: 2-D inputs go straight to one matrix product each
        return self.down_proj(self.act_fn(self.gate_proj(flat)) * self.up_proj(flat)).view(x.shape)


class AttentionProjections(nn.Module):
    """q/k/v/o projections shared by both attention kinds, with optional q/k RMSNorm and RoPE.

    `project` returns q [B, T, H, D] and k, v [B, T, H_kv, D] (GQA: H_kv KV heads); caches store
    the H_kv heads and `repeat_kv` widens them to H when attention runs per query head.
    """

    def __init__(self, config: LinearAttentionConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        h, d = config.hidden_size, config.head_dim
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.attention_out_bias)
        # Optional submodules are None when absent (a failed attribute lookup on a module costs microseconds).
        self.q_norm = self.k_norm = None
        if config.use_qk_norm:
            self.q_norm = LinearAttentionRMSNorm(d, eps=config.rms_norm_eps)
            self.k_norm = LinearAttentionRMSNorm(d, eps=config.rms_norm_eps)

    def project_unrotated(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, T, H, D], k, v [B, T, H_kv, D] before RoPE (after the q/k norms)."""
        b, t, _ = x.shape
        x = x.reshape(b * t, -1)  # [B·T, hidden]: a 2-D input goes straight to one matrix product
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def project(
        self, x: torch.Tensor, position_embeddings: Rotation
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v as the softmax teacher computes them: `project_unrotated`, then RoPE on q and k."""
        q, k, v = self.project_unrotated(x)
        return *apply_rotary(q, k, position_embeddings.cos, position_embeddings.signed_sin), v

    def project_out(self, o: torch.Tensor) -> torch.Tensor:
        """o [B, T, H, V] -> o_proj of its heads concatenated, [B, T, hidden] (a 2-D product, as in `project`)."""
        b, t = o.shape[:2]
        return self.o_proj(o.reshape(b * t, -1)).view(b, t, -1)

    def repeat_kv(self, x: torch.Tensor, dim: int = 2) -> torch.Tensor:
        """[.., H_kv, ..] -> [.., H, ..] along `dim`: each KV head serves H / H_kv query heads."""
        groups = self.num_heads // self.num_kv_heads
        return x if groups == 1 else x.repeat_interleave(groups, dim=dim)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, past: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution over time: y_t = Σ_j weight[:, 0, j] · x_{t − W + 1 + j}, per channel.

    x [B, T, C]; weight [C, 1, W]; past None (zeros: the sequence starts here) or the W − 1 inputs before x,
    [B, W − 1, C]. Returns y [B, T, C] and the last W − 1 inputs [B, W − 1, C] (what a cache carries on).
    """
    width = weight.shape[-1]
    if past is None:
        past = x.new_zeros(x.shape[0], width - 1, x.shape[2])
    inputs = torch.cat([past.to(x.dtype), x], dim=1)  # [B, W − 1 + T, C]
    if x.shape[1] == 1:  # a decode step: one weighted sum of W inputs (cheaper than setting up a convolution)
        y = (inputs * weight[:, 0].t()).sum(1, keepdim=True)
    else:
        y = F.conv1d(inputs.transpose(1, 2), weight, groups=x.shape[2]).transpose(1, 2)
    return y, inputs[:, inputs.shape[1] - (width - 1) :]


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / ‖x‖ over the last dimension, computed in fp32 (a zero vector stays zero)."""
    return F.normalize(x.float(), dim=-1, eps=eps).to(x.dtype)


class LinearAttention(AttentionProjections):
    """What every attention kind with a recurrent state shares; one subclass per kind implements `attend`.

    Per layer: q/k/v projections (+ q/k norms), the optional short convolution (`conv_size`), RoPE, the kind's
    attention (`attend`: additive linear, delta rule, window hybrid, delta rule behind a window) with its optional
    output norm and output gate, and o_proj. The parts are built here, for every kind, in one order (parameter
    names and state-dict keys are those of the checkpoints; the order keeps seeded initialisations as they were):
    the feature maps φ, the decay gate (`decay_proj`, None without a data-dependent decay), the window mix
    (`window_gate`, window kinds), the output norm (`o_norm`), the write strength (`beta_proj`, delta kinds), the
    short convolution (`qkv_conv`) and the output gate (`g_proj`).

    What is whose is decided here, by part name: the `TEACHER_PARTS` are the softmax layer's (conversion copies them),
    every other parameter of the layer is one conversion adds (`added_parameters`: a part added to a kind, or the
    parameters of a registered feature map, counts without being listed), and attention transfer trains the added
    ones but for `ATTENTION_TRANSFER_FROZEN` (`attention_transfer_parameters`).
    """

    # The softmax teacher's parts: attention transfer recomputes the teacher's attention from them, so they stay as
    # they are there.
    TEACHER_PARTS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
    # Added parts that attention transfer leaves at their start: the output norm's gains (1), which the later stages
    # train with the rest of the model.
    ATTENTION_TRANSFER_FROZEN = ("o_norm",)

    def __init__(self, config: LinearAttentionConfig, layer_idx: int) -> None:
        super().__init__(config)
        self.layer_idx = layer_idx
        self.config = config
        h, heads = config.hidden_size, config.num_attention_heads
        self.feature_map_q = build_feature_map(config.feature_map, heads, config.head_dim, config.feature_dim)
        self.feature_map_k = build_feature_map(config.feature_map, heads, config.head_dim, config.feature_dim)
        self.key_dim = self.feature_map_q.output_dim  # K: key side of the state
        # What the layer's weights were built for, read once (transformers' config attribute access costs about a
        # microsecond, which a one-token decode step would pay a dozen times per layer). The backend and the sparse
        # memory size stay read from the config: a loaded model may switch them.
        self.decay = config.decay
        self.window_size, self.num_sink_tokens = config.window_size, config.num_sink_tokens
        self.decay_proj = None  # optional submodules are None when absent (as AttentionProjections' norms)
        if config.decay == "scalar":
            self.decay_proj = nn.Linear(h, heads, bias=True)
        elif config.decay == "vector":
            self.decay_proj = nn.Sequential(
                nn.Linear(h, config.decay_low_rank_dim, bias=False),
                nn.Linear(config.decay_low_rank_dim, heads * self.key_dim, bias=True),
            )
        if config.window_size > 0:
            # Per head, what mixes the window's softmax with the state part: γ_h = sigmoid(window_gate[h]) weighs the
            # softmax part against the linear part (additive); λ_h = window_gate[h] weighs the delta part (delta rule).
            self.window_gate = nn.Parameter(torch.zeros(heads))
        self.o_norm = self.qkv_conv = self.g_proj = None
        if config.output_norm:
            self.o_norm = LinearAttentionRMSNorm(config.head_dim, eps=config.rms_norm_eps)
        if config.update_rule == "delta":
            self.beta_proj = nn.Linear(h, heads, bias=False)  # β_t = sigmoid(x W_β), the write strength per head
        if config.conv_size > 0:
            # One depthwise causal convolution over the concatenated q, k, v channels (H + 2 H_kv heads of D).
            channels = (heads + 2 * self.num_kv_heads) * config.head_dim
            self.qkv_conv = nn.Conv1d(channels, channels, config.conv_size, groups=channels, bias=False)
        if config.output_gate:
            self.g_proj = nn.Linear(h, heads * config.head_dim, bias=False)

    def added_parameters(self) -> dict[str, nn.Parameter]:
        """Name (within the layer) -> parameter of every parameter conversion adds: all but the `TEACHER_PARTS`'."""
        return {name: parameter for name, parameter in self.named_parameters()
                if name.split(".", 1)[0] not in self.TEACHER_PARTS}

    def attention_transfer_parameters(self) -> dict[str, nn.Parameter]:
        """Name (within the layer) -> parameter of what attention transfer (stage 1) trains by default: the added
        parameters but the `ATTENTION_TRANSFER_FROZEN` parts'."""
        return {name: parameter for name, parameter in self.added_parameters().items()
                if name.split(".", 1)[0] not in self.ATTENTION_TRANSFER_FROZEN}

    def log_decay(self, x: torch.Tensor) -> torch.Tensor | None:
        """log a_t ≤ 0: None, [B, T, H] (fixed, scalar) or [B, T, H, K] (vector), in fp32."""
        b, t, _ = x.shape
        heads = self.num_heads
        if self.decay == "none":
            return None
        if self.decay == "fixed":
            # γ_h = 1 - 2^(-E-h), a constant per head (computed, not stored: nothing to load); E as documented above.
            first = HYBRID_DECAY_EXPONENT if self.window_size > 0 else RETNET_DECAY_EXPONENT
            exponents = -first - torch.arange(heads, device=x.device, dtype=torch.float32)
            return torch.log1p(-torch.exp2(exponents)).expand(b, t, heads)
        gate = self.decay_proj(x).float()
        log_a = F.logsigmoid(gate) / GATE_LOGIT_NORMALIZER
        if self.decay == "vector":
            return log_a.view(b, t, heads, self.key_dim)
        return log_a

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Rotation,
        attention_mask: torch.Tensor | None = None,
        cache_layer: LinearStateLayer | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states [B, T, hidden] -> [B, T, hidden].

        attention_mask: None or bool [B, past + T] (True = real token) over the cached and new positions.
        cache_layer: this layer's slot of a LinearAttentionCache, read and then advanced by T positions.
        cu_seqlens: None or [N + 1] boundaries of N documents packed into a batch of one (no cache).
        """
        t = hidden_states.shape[1]
        new_mask = None if attention_mask is None else attention_mask[:, -t:]  # [B, T]
        q, k, v = self.rotated_qkv(hidden_states, position_embeddings, new_mask, cache_layer, cu_seqlens)
        return self.project_out(self.attend(hidden_states, q, k, v, new_mask, cache_layer, cu_seqlens))

    def rotated_qkv(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Rotation,
        new_mask: torch.Tensor | None,
        cache_layer: LinearStateLayer | None,
        cu_seqlens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, T, H, D], k, v [B, T, H_kv, D] as the layer's attention takes them: projected, through the short
        convolution (which reads and stores its inputs in the cache) when there is one, and rotated."""
        q, k, v = self.project_unrotated(hidden_states)
        if self.qkv_conv is not None:
            q, k, v = self.short_conv(q, k, v, new_mask, cache_layer, cu_seqlens)
        return *apply_rotary(q, k, position_embeddings.cos, position_embeddings.signed_sin), v

    def attend(
        self,
        hidden_states: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        new_mask: torch.Tensor | None,
        cache_layer: LinearStateLayer | None,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """The attention of the layer's kind, output norm and gate included: o [B, T, H, V] before o_proj.

        hidden_states [B, T, hidden] (the layer's input, for the gates); q [B, T, H, D], k, v [B, T, H_kv, D] after
        the short convolution and RoPE; new_mask None or bool [B, T]; cache_layer the kind's cache state or None;
        cu_seqlens None or the packed documents' boundaries (no cache)."""
        raise NotImplementedError(f"{type(self).__name__} is the shared base: build one of its kinds "
                                  "(attention_class picks it from the config)")

    def normed_and_gated(self, o: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """o [B, T, H, V] after the optional output norm and output gate (Gated DeltaNet's RMSNorm(o) · silu(x W_g),
        per channel); hidden_states [B, T, hidden] are the layer's inputs."""
        if self.o_norm is not None:
            o = self.o_norm(o)
        if self.g_proj is not None:
            o = o * F.silu(self.g_proj(hidden_states)).view_as(o)
        return o

    def short_conv(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        new_mask: torch.Tensor | None,
        cache_layer: LinearStateLayer | None,
        cu_seqlens: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The causal depthwise convolution over time on q [B, T, H, D] and k, v [B, T, H_kv, D] (same shapes out).

        Pads enter as zeros, so they leak nothing into the tokens after them: a left-padded row convolves
        exactly as the row alone (whose start is zero-padded too). Like the window, the convolution counts
        positions, pads included: a hole inside a prompt is a zero input. With a cache, the last conv_size − 1
        inputs continue from the previous call; packed documents (cu_seqlens) convolve one at a time.
        """
        b, t = q.shape[:2]
        x = torch.cat([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], dim=-1)  # [B, T, C]
        if new_mask is not None:
            x = x * new_mask[..., None].to(x.dtype)
        weight = self.qkv_conv.weight
        if cu_seqlens is not None:
            bounds = cu_seqlens.tolist()
            y = torch.cat([causal_conv1d(x[:, i:j], weight)[0]
                           for i, j in zip(bounds[:-1], bounds[1:], strict=True) if j > i], dim=1)
        else:
            y, last_inputs = causal_conv1d(x, weight, None if cache_layer is None else cache_layer.conv_inputs)
            if cache_layer is not None:
                cache_layer.store_conv_inputs(last_inputs)
        sizes = [q.shape[2] * self.head_dim, k.shape[2] * self.head_dim, v.shape[2] * self.head_dim]
        return tuple(part.reshape(b, t, -1, self.head_dim) for part in y.split(sizes, dim=-1))

    def key_features(self, k: torch.Tensor) -> torch.Tensor:
        """φ of the window hybrid's keys: k [B, T, H_kv, D] (after RoPE) -> [B, T, H, F], φ_h for every query head.
        The cache stores no features: the layer recomputes them with this of the cached keys it folds (the ring's,
        the sparse memory's slots)."""
        return self.feature_map_k(self.repeat_kv(k))

    def recurrent_op(
        self,
        op: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
        q: torch.Tensor,
        *inputs: torch.Tensor | None,
        cache_layer: LinearStateLayer | None,
        cu_seqlens: torch.Tensor | None,
        **options,
    ) -> torch.Tensor:
        """`op(q, *inputs, **options)` (linear_attention or delta_rule_attention) started from the cached state and
        with the config's backend; with a cache, the state it ends with is stored and the cache advanced."""
        o, state = op(
            q, *inputs, **options,
            initial_state=None if cache_layer is None else cache_layer.state,
            output_final_state=cache_layer is not None,
            cu_seqlens=cu_seqlens,
            backend=self.config.linear_attention_backend,
        )
        if cache_layer is not None:
            cache_layer.store_state(state)
            cache_layer.advance(q.shape[1], q.device)
        return o

    def _decode_step(self, q: torch.Tensor, cache_layer: LinearStateLayer | None, cu_seqlens) -> bool:
        """Whether this call is one token after a filled cache with backend "auto": the lean fixed-shape step
        (the ops' direct forms, reached with any other backend, are its twins)."""
        return (
            q.shape[1] == 1 and cache_layer is not None and cache_layer.has_state and cu_seqlens is None
            and self.config.linear_attention_backend == "auto"
        )


class AdditiveLinearAttention(LinearAttention):
    """Linear attention, optionally decayed and normalised (config kind "linear"): `linear_attention` from the
    cached state, or `linear_attention_step` for one token after it."""

    def attend(
        self,
        hidden_states: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        new_mask: torch.Tensor | None,
        cache_layer: LinearStateLayer | None,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """(Decayed) linear attention from the cached state (or per packed document), then the output norm and gate:
        o [B, T, H, V]."""
        q_feat, k_feat = self.feature_map_q(q), self.feature_map_k(self.repeat_kv(k))  # [B, T, H, K]
        log_decay = self.log_decay(hidden_states)
        if new_mask is not None:
            # Pads leave the state untouched: zero φ(k), v and log a after the maps (elu(0)+1 = 1).
            keep = new_mask[:, :, None, None]
            k_feat = k_feat * keep.to(k_feat.dtype)
            v = v * keep.to(v.dtype)
            if log_decay is not None:
                log_decay = log_decay * (keep if log_decay.dim() == 4 else keep[..., 0]).to(log_decay.dtype)
        if self._decode_step(q, cache_layer, cu_seqlens):
            o = linear_attention_step(q_feat, k_feat, v, log_decay, cache_layer.state,
                                      scale=self.feature_map_q.query_scale, normalize=self.config.normalize)
            cache_layer.advance(1, q.device)
        else:
            o = self.recurrent_op(linear_attention, q_feat, k_feat, v, log_decay,
                                  scale=self.feature_map_q.query_scale, normalize=self.config.normalize,
                                  cache_layer=cache_layer, cu_seqlens=cu_seqlens)
        return self.normed_and_gated(o, hidden_states)


class DeltaRuleAttention(LinearAttention):
    """The delta rule (DeltaNet; Gated DeltaNet with a decay, the short convolution and the output gate; config kind
    "delta"): `delta_rule_attention` on L2-normalised features from the cached state."""

    def attend(
        self,
        hidden_states: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        new_mask: torch.Tensor | None,
        cache_layer: LinearStateLayer | None,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """The delta rule from the cached state (or per packed document), then the output norm and gate:
        o [B, T, H, V].

        q̂, β and log a come from `delta_rule_inputs`, k̂ from `delta_keys`. Pads set β = 0 and log a = 0, so a pad
        step is S ← 1 · (I − 0) S + 0 = S: the state is exactly unchanged.
        """
        q, beta, log_decay = self.delta_rule_inputs(hidden_states, q, new_mask)
        k = self.delta_keys(k)
        if new_mask is not None:
            beta = beta * new_mask[:, :, None].to(beta.dtype)
        o = self.recurrent_op(delta_rule_attention, q, k, v, beta, log_decay, scale=self.key_dim**-0.5,
                              cache_layer=cache_layer, cu_seqlens=cu_seqlens)
        return self.normed_and_gated(o, hidden_states)

    def delta_rule_inputs(
        self, hidden_states: torch.Tensor, q: torch.Tensor, new_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """What the delta rule reads of a layer's input besides its keys (`delta_keys`): q̂ [B, T, H, K] (φ after
        RoPE, then L2-normalised: unit queries keep the read-out bounded), β [B, T, H] fp32, and log a [B, T, H] or
        None, 0 at pad steps (a pad decays nothing)."""
        q_hat = l2_normalize(self.feature_map_q(q))
        beta = torch.sigmoid(self.beta_proj(hidden_states).float())
        log_decay = self.log_decay(hidden_states)
        if log_decay is not None and new_mask is not None:
            log_decay = log_decay * new_mask[:, :, None].to(log_decay.dtype)
        return q_hat, beta, log_decay

    def delta_keys(self, k: torch.Tensor) -> torch.Tensor:
        """k̂ of keys k [B, T, H_kv, D] (after RoPE): φ(k) [B, T, H, K] L2-normalised, as the delta rule writes
        (the op needs unit keys). The delta window's cache keeps the raw keys and recomputes k̂ of those that
        enter the state."""
        return l2_normalize(self.key_features(k))


class DeltaWindowAttention(DeltaRuleAttention):
    """The delta rule behind a sliding window (config kind "delta_window"): exact softmax over the window and sinks
    plus λ · the delta-rule state of the tokens that have left the window, `window_attention(update_rule="delta")`
    (its inputs q̂, k̂, β and log a are the delta rule's)."""

    def attend(
        self,
        hidden_states: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        new_mask: torch.Tensor | None,
        cache_layer: DeltaWindowStateLayer | None,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """o_t = softmax_t + λ_h · gate_t(norm(S_tᵀ (K^-½ q̂_t))), λ = window_gate: o [B, T, H, V] (the output norm
        and gate act on the state part only, `state_output`). With a cache, the retained sinks and window run in front
        of the new tokens (k̂ recomputed from their keys, their β from the cache); one token after a filled cache with
        backend "auto" runs `delta_window_attention_step` on the cache's slots instead."""
        q_hat, beta, log_decay = self.delta_rule_inputs(hidden_states, q, new_mask)

        def state_output(read: torch.Tensor) -> torch.Tensor:
            return self.normed_and_gated(read, hidden_states)

        if self._decode_step(q, cache_layer, cu_seqlens):
            return self.decode_step(q, k, v, q_hat, beta, log_decay, new_mask, cache_layer, state_output)
        key_mask, state = new_mask, None  # over every key: [retained sinks and window,] new tokens
        if cache_layer is not None and cache_layer.has_state:
            retained_k, retained_v, retained_mask = cache_layer.retained()
            k, v = torch.cat([retained_k, k], dim=1), torch.cat([retained_v, v], dim=1)
            beta = torch.cat([cache_layer.retained_beta(), beta], dim=1)
            key_mask = torch.cat([retained_mask, _all_real(new_mask, q)], dim=1)
            if log_decay is not None:  # (their steps have already decayed the state)
                log_decay = torch.cat([log_decay.new_zeros(*retained_mask.shape, log_decay.shape[2]), log_decay], 1)
            state = cache_layer.state
        o, state = window_attention(
            q, k, v, q_hat, self.delta_keys(k), self.window_gate, window_size=self.window_size,
            num_sink_tokens=self.num_sink_tokens, log_decay=log_decay, key_padding_mask=key_mask,
            initial_state=state, output_final_state=cache_layer is not None, cu_seqlens=cu_seqlens,
            update_rule="delta", beta=beta, state_output=state_output, backend=self.config.linear_attention_backend)
        if cache_layer is not None:
            cache_layer.store_state(state)
            cache_layer.advance(q.shape[1], q.device)
            cache_layer.store_window(k, v, _all_real(key_mask, k), beta)
        return o

    def decode_step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_hat: torch.Tensor,
        beta: torch.Tensor,
        log_decay: torch.Tensor | None,
        real: torch.Tensor | None,
        cache_layer: DeltaWindowStateLayer,
        state_output: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """One token after a filled cache, fixed-shape and in place: o [B, 1, H, V]. The token (k, v, β) takes the ring
        slot of the one leaving the window, which enters the state with its own β and k̂ recomputed from its cached key
        (`delta_window_attention_step` then updates the state, reads it and the softmax row over the slots)."""
        (leaving_k, leaving_v, leaving_real), leaving_beta = cache_layer.push(k, v, real, beta)
        o = delta_window_attention_step(
            q, q_hat, log_decay, cache_layer.state, *cache_layer.slots(), self.delta_keys(leaving_k), leaving_v,
            leaving_beta, leaving_real,
            self.window_gate, real, scale=self.head_dim**-0.5, state_output=state_output)
        cache_layer.advance(1, q.device)
        return o


class WindowHybridAttention(LinearAttention):
    """The sliding-window softmax + linear hybrid (LoLCATs; config kind "window"), optionally with a decayed linear
    part and the sparse exact memory (`sparse_cache_size`, read from the config at every call: a loaded model may
    switch it): `window_attention` from the cache's retained sinks, window and state, or `window_attention_step`
    for one token after it."""

    def attend(
        self,
        hidden_states: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        new_mask: torch.Tensor | None,
        cache_layer: WindowStateLayer | None,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """The window hybrid, then the output norm and gate: o [B, T, H, V].

        The decay (None or [B, T, H] / [B, T, H, F] of the new tokens) acts on the linear part from the step a key
        leaves the window on, and is zeroed at pads so that a pad leaves the state unchanged. With a cache, the new
        tokens run behind the retained raw keys/values (sinks + the last positions) from the folded linear state,
        and the retained positions get log decay 0 (their steps have already decayed that state), or with the
        sparse memory their own log decays (they decay the folds at the block end); afterwards the cache keeps the
        new sinks and window and the state of everything older, so memory stays constant.
        """
        b, t = q.shape[:2]
        log_decay = self.log_decay(hidden_states)
        if new_mask is not None and log_decay is not None:
            log_decay = log_decay.masked_fill(~new_mask.reshape(b, t, *[1] * (log_decay.dim() - 2)), 0.0)
        q_feat = self.feature_map_q(q)  # [B, T, H, F]
        if self._decode_step(q, cache_layer, cu_seqlens):
            o = self.decode_step(q, k, v, q_feat, log_decay, new_mask, cache_layer)
        else:
            o = self.prefill(q, k, v, q_feat, log_decay, new_mask, cache_layer, cu_seqlens)
        return self.normed_and_gated(o, hidden_states)

    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_feat: torch.Tensor,
        log_decay: torch.Tensor | None,
        new_mask: torch.Tensor | None,
        cache_layer: WindowStateLayer | None,
        cu_seqlens: torch.Tensor | None,
    ) -> torch.Tensor:
        """Any number of tokens, behind the cache's retained tokens if it holds any: o [B, T, H, V]."""
        t = q.shape[1]
        sparse = self.config.sparse_cache_size > 0
        key_mask, state, memory, start = new_mask, None, None, 0  # key_mask over every key, retained ones first
        if cache_layer is not None and cache_layer.has_state:
            # The retained tokens run in front of the new ones (their features recomputed with the new ones' below).
            retained_k, retained_v, retained_mask = cache_layer.retained()
            k, v = torch.cat([retained_k, k], dim=1), torch.cat([retained_v, v], dim=1)
            if log_decay is not None:
                if sparse:
                    retained = cache_layer.retained_log_decay().to(log_decay.dtype)
                    retained = retained if log_decay.dim() == 4 else retained[..., 0]
                else:  # their steps have already decayed the state
                    retained = log_decay.new_zeros(*retained_mask.shape, *log_decay.shape[2:])
                log_decay = torch.cat([retained, log_decay], dim=1)
            key_mask = torch.cat([retained_mask, _all_real(new_mask, q)], dim=1)  # the retained slots may hold pads
            state = cache_layer.state
            start = cache_layer.get_seq_length() - (k.shape[1] - t)  # input index i is absolute position i + start
        memory_options = {}
        if sparse:
            memory_options = dict(memory_size=self.config.sparse_cache_size, key_feature_map=self.key_features,
                                  memory=None if cache_layer is None else cache_layer.memory(), start_position=start)
        o, state, *memory = window_attention(
            q, k, v, q_feat, self.key_features(k), self.window_gate, window_size=self.window_size,
            num_sink_tokens=self.num_sink_tokens, scale=self.head_dim**-0.5, log_decay=log_decay,
            key_padding_mask=key_mask, initial_state=state, output_final_state=cache_layer is not None,
            cu_seqlens=cu_seqlens, backend=self.config.linear_attention_backend, **memory_options)
        if cache_layer is not None:
            cache_layer.store_state(state)
            cache_layer.advance(t, q.device)
            if sparse:
                cache_layer.store_memory(memory[0])
                cache_layer.store_window(k, v, _all_real(key_mask, k), log_decay)
            else:
                cache_layer.store_window(k, v, _all_real(key_mask, k))
        return o

    def decode_step(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_feat: torch.Tensor,
        log_decay: torch.Tensor | None,
        real: torch.Tensor | None,
        cache_layer: WindowStateLayer,
    ) -> torch.Tensor:
        """One token after a filled cache, fixed-shape and in place: o [B, 1, H, V].

        The token takes the ring slot of the one leaving the window (position p − w), which folds into the state with
        the features φ computed of its cached key (the step computes no φ of its own token: it folds only when it
        leaves); then `window_attention_step` decays the state, folds, and reads the softmax row over the slots and
        the state with one normaliser. With the sparse memory nothing folds before the block end: the softmax row
        covers the sinks, the ring from the block start's window on and the memory slots, and at a block end the
        memory is re-chosen (`memory_block_end`).
        """
        if isinstance(cache_layer, SparseWindowStateLayer):  # (the model checked the cache against the config)
            cache_layer.push(k, v, real, log_decay)
            if log_decay is not None:
                cache_layer.decay_memory(log_decay[:, 0])
            memory = cache_layer.memory()
            o = window_attention_step(
                q, q_feat, log_decay, cache_layer.state, *cache_layer.slots(), None, None, None, self.window_gate,
                real, scale=self.head_dim**-0.5, memory_keys=memory.keys, memory_values=memory.values,
                memory_mask=memory.mask)
            self.memory_block_end(cache_layer)
        else:
            leaving_k, leaving_v, leaving_real = cache_layer.push(k, v, real)
            o = window_attention_step(
                q, q_feat, log_decay, cache_layer.state, *cache_layer.slots(), self.key_features(leaving_k),
                leaving_v, leaving_real, self.window_gate, real, scale=self.head_dim**-0.5)
        cache_layer.advance(1, q.device)
        return o

    def memory_block_end(self, cache_layer: SparseWindowStateLayer) -> None:
        """After a decode step's query (before `advance`): if it ends a block, re-score the memory and the R ring
        tokens that left the window during the block (`SparseWindowStateLayer.ending_block`), keep the best m and fold
        the rest into the state, in place. Eager, it returns at once between block ends (one read of the position);
        traced (compile, export), it is computed at every step and kept only at a block end, so that the step has no
        branch on a tensor's value."""
        position = cache_layer.seen  # 0-d: the query's position
        ends = (position + 1) % MEMORY_BLOCK_SIZE == 0
        if not _tracing() and not bool(ends):
            return
        block = cache_layer.ending_block(position)
        memory = block.memory._replace(values=F.pad(block.memory.values, (0, 1), value=1.0))
        state, memory = block_end(
            cache_layer.state, memory, block.keys.transpose(1, 2), F.pad(block.values, (0, 1), value=1.0),
            self.key_features(block.keys).transpose(1, 2),  # φ [B, H, R, F], recomputed: the cache keeps none
            block.positions, block.log_decay, block.valid, self.key_features,
        )
        cache_layer.store_block(state, memory._replace(values=memory.values[..., :-1]), where=ends)


def _all_real(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """`mask`, or an all-True bool [B, T] with the batch, length and device of `like` ([B, T, ...]) when it is None."""
    return mask if mask is not None else torch.ones(like.shape[:2], dtype=torch.bool, device=like.device)


def hybrid_decay_gate_bias(horizon: float) -> float:
    """The gate logit b with logsigmoid(b) / GATE_LOGIT_NORMALIZER = log(1 - 1/horizon), i.e. a = 1 - 1/horizon
    (about 4.85 for 2048)."""
    target = (1.0 - 1.0 / horizon) ** GATE_LOGIT_NORMALIZER  # sigmoid(b)
    return math.log(target / (1.0 - target))


def window_gate_logit(weight: float) -> float:
    """The `window_gate` logit of an additive window hybrid whose γ = sigmoid(window_gate) is `weight`."""
    return math.log(weight / (1.0 - weight))


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of one query per sequence (a decode step): q [B, H, 1, D] against every key of
    k, v [B, H_kv, S, D] -> [B, H, 1, D]; attention_mask None or bool [B, S] (True = real key; the last key, the
    query's own, is always seen).

    The H / H_kv query heads that share a key/value head go in as the rows of one product, so each cached key and
    value is read once. SDPA's grouped-query path is bandwidth-bound the other way: on CPU (fp32, 16K keys, 9 query
    heads over 3 KV heads) it took 2-2.6x as long, which at 16K was most of what the demo's model spent on its
    softmax layers and heads per token.
    """
    b, h, _, d = q.shape
    h_kv = k.shape[1]
    scores = q.reshape(b, h_kv, h // h_kv, d) @ k.transpose(2, 3) * d**-0.5  # [B, H_kv, H / H_kv, S]
    if attention_mask is not None:
        seen = attention_mask.clone()
        seen[:, -1] = True
        scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
    return (scores.softmax(-1) @ v).reshape(b, h, 1, d)


def causal_softmax_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal softmax attention: q [B, H, T, D] against k, v [B, H_kv, past + T, D] -> [B, H, T, D].

    H is a multiple of H_kv (grouped-query attention: SDPA shares each key/value head without copying it).
    attention_mask: None or bool [B, past + T] (True = real key). cu_seqlens: None or [N + 1] boundaries of
    packed documents (no past): attention stays inside each document.
    """
    t, total = q.shape[2], k.shape[2]
    sdpa = functools.partial(F.scaled_dot_product_attention, enable_gqa=q.shape[1] != k.shape[1])
    if cu_seqlens is not None:
        document = torch.bucketize(torch.arange(t, device=q.device), cu_seqlens[1:], right=True)  # [T]
        allowed = (document[:, None] == document[None, :]).tril()  # block-diagonal causal [T, T]
        return sdpa(q, k, v, attn_mask=allowed)
    if attention_mask is None and total == t:
        return sdpa(q, k, v, is_causal=True)
    if t == 1 and q.dtype == torch.float32:  # a decode step (in half precision the product would round the scores)
        return one_query_attention(q, k, v, attention_mask)
    if attention_mask is None and t == 1:
        return sdpa(q, k, v)
    query_pos = torch.arange(total - t, total, device=q.device)[:, None]
    allowed = torch.arange(total, device=q.device) <= query_pos  # [T, past + T], causal
    if attention_mask is not None:
        allowed = allowed & attention_mask[:, None, None, :]  # [B, 1, T, past + T]
        # A pad query may have no real key to its left; let it see itself so softmax stays finite.
        allowed = allowed | (torch.arange(total, device=q.device) == query_pos)
    return sdpa(q, k, v, attn_mask=allowed)


class SoftmaxAttention(AttentionProjections):
    """Ordinary causal softmax attention, for the layers listed in `config.softmax_layers`."""

    def __init__(self, config: LinearAttentionConfig, layer_idx: int) -> None:
        super().__init__(config)
        self.layer_idx = layer_idx

    def scaled_qkv(
        self, x: torch.Tensor, position_embeddings: Rotation
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, T, H, D], k, v [B, T, H_kv, D] as this layer attends with them: `project`, the queries scaled past
        the trained positions (`scaled_queries`)."""
        q, k, v = self.project(x, position_embeddings)
        return scaled_queries(q, position_embeddings), k, v

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Rotation,
        attention_mask: torch.Tensor | None = None,
        cache_layer: DynamicLayer | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states [B, T, hidden] -> [B, T, hidden]; attention_mask None or bool [B, past + T];
        cu_seqlens None or [N + 1] packed-document boundaries (attention stays within each document)."""
        q, k, v = (x.transpose(1, 2) for x in self.scaled_qkv(hidden_states, position_embeddings))  # [B, ·, T, D]
        if cache_layer is not None:
            k, v = cache_layer.update(k, v)  # [B, H_kv, past + T, D]
        o = causal_softmax_attention(q, k, v, attention_mask, cu_seqlens)
        return self.project_out(o.transpose(1, 2))


class SoftmaxHeadsMixin:
    """Softmax heads inside a layer of a recurrent kind (`config.softmax_heads`), combined with the kind's class (the
    `*WithSoftmaxHeads` classes below): the listed KV heads and their query groups keep exact causal softmax attention
    over the whole context, the other heads are the kind's, and the parameters and state-dict keys are the kind's (so
    heads are restored on a converted or trained checkpoint by its config alone).

    The kind's `attend` runs on every head as usual (its output for the softmax heads is dropped: every backend,
    decode step, packed document and training path of the kind stays as it is); then the softmax heads' outputs
    replace those heads: `causal_softmax_attention` of their q (after the short convolution, if any, and RoPE)
    against their keys and values over the whole context, the cached ones first (the cache layer keeps them, a
    `SoftmaxHeadsState`), with the padding mask and packed documents as `SoftmaxAttention` honours them. They bypass
    the output norm and gate: in a converted model they compute exactly the teacher's attention for those heads.
    """

    def __init__(self, config: LinearAttentionConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        groups = config.num_attention_heads // config.num_key_value_heads
        self.softmax_kv_heads = list(config.softmax_heads_of(layer_idx))
        self.softmax_query_heads = [h * groups + g for h in self.softmax_kv_heads for g in range(groups)]

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Rotation,
        attention_mask: torch.Tensor | None = None,
        cache_layer: LinearStateLayer | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`LinearAttention.forward`, the softmax heads' outputs put in place of the kind's for them before o_proj."""
        t = hidden_states.shape[1]
        new_mask = None if attention_mask is None else attention_mask[:, -t:]  # [B, T]
        q, k, v = self.rotated_qkv(hidden_states, position_embeddings, new_mask, cache_layer, cu_seqlens)
        o = self.attend(hidden_states, q, k, v, new_mask, cache_layer, cu_seqlens)  # [B, T, H, V]
        q_heads = scaled_queries(q[:, :, self.softmax_query_heads], position_embeddings).transpose(1, 2)  # [B, h, T, D]
        k_heads, v_heads = (x[:, :, self.softmax_kv_heads].transpose(1, 2) for x in (k, v))  # [B, h_kv, T, D]
        if cache_layer is not None:
            k_heads, v_heads = cache_layer.update_softmax_heads(k_heads, v_heads)  # [B, h_kv, past + T, D]
        softmax = causal_softmax_attention(q_heads, k_heads, v_heads, attention_mask, cu_seqlens).transpose(1, 2)
        index = torch.tensor(self.softmax_query_heads, device=o.device)
        return self.project_out(o.index_copy(2, index, softmax.to(o.dtype)))


class AdditiveLinearAttentionWithSoftmaxHeads(SoftmaxHeadsMixin, AdditiveLinearAttention):
    """Kind "linear" with softmax heads (`SoftmaxHeadsMixin`)."""


class DeltaRuleAttentionWithSoftmaxHeads(SoftmaxHeadsMixin, DeltaRuleAttention):
    """Kind "delta" with softmax heads (`SoftmaxHeadsMixin`)."""


class WindowHybridAttentionWithSoftmaxHeads(SoftmaxHeadsMixin, WindowHybridAttention):
    """Kind "window" with softmax heads (`SoftmaxHeadsMixin`)."""


class DeltaWindowAttentionWithSoftmaxHeads(SoftmaxHeadsMixin, DeltaWindowAttention):
    """Kind "delta_window" with softmax heads (`SoftmaxHeadsMixin`)."""


# The attention class of each layer kind (`LinearAttentionConfig.layer_kind` decides a layer's kind), and of each
# recurrent kind with softmax heads (`config.softmax_heads`); `attention_class` picks a layer's.
ATTENTION_CLASSES: dict[str, type[nn.Module]] = {
    "softmax": SoftmaxAttention,
    "linear": AdditiveLinearAttention,
    "delta": DeltaRuleAttention,
    "window": WindowHybridAttention,
    "delta_window": DeltaWindowAttention,
}
SOFTMAX_HEADS_CLASSES: dict[str, type[nn.Module]] = {
    "linear": AdditiveLinearAttentionWithSoftmaxHeads,
    "delta": DeltaRuleAttentionWithSoftmaxHeads,
    "window": WindowHybridAttentionWithSoftmaxHeads,
    "delta_window": DeltaWindowAttentionWithSoftmaxHeads,
}


def attention_class(config: LinearAttentionConfig, layer_idx: int) -> type[nn.Module]:
    """The attention class of layer `layer_idx`: its kind's, with softmax heads when the config lists some."""
    kind = config.layer_kind(layer_idx)
    return (SOFTMAX_HEADS_CLASSES if config.softmax_heads_of(layer_idx) else ATTENTION_CLASSES)[kind]


class LinearAttentionDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: LinearAttentionConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = attention_class(config, layer_idx)(config, layer_idx)
        self.mlp = LinearAttentionMLP(config)
        self.input_layernorm = LinearAttentionRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LinearAttentionRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: Rotation,
        attention_mask: torch.Tensor | None = None,
        cache_layer: LinearStateLayer | DynamicLayer | None = None,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings, attention_mask, cache_layer, cu_seqlens
        )
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LinearAttentionPreTrainedModel(PreTrainedModel):
    config_class = LinearAttentionConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LinearAttentionDecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        # Each feature map sets its own start (the learned built-in ones: the identity, rectangular when F != D, so
        # that a converted model's φ(q)·φ(k) begins as a monotone function of the teacher's q·k).
        if isinstance(module, FeatureMap):
            module.initialize()
        elif isinstance(module, (WindowHybridAttention, DeltaWindowAttention)):
            if isinstance(module, WindowHybridAttention):  # γ = sigmoid(window_gate) = window_weight
                init.constant_(module.window_gate, window_gate_logit(self.config.window_weight))
            else:
                init.zeros_(module.window_gate)  # λ = 0: the delta rule's state part starts switched off
            if module.decay_proj is not None:
                # Data-independent at init: a = sigmoid(bias)^(1/16) = 1 - 1/decay_horizon for every token (the
                # gate's last projection zero, its bias set to match); attention transfer learns where to forget.
                # Only the gate's last projection is zeroed: vector decay's low-rank input projection keeps its
                # random init, so that the zeroed weights still receive gradients.
                gate = module.decay_proj[-1] if isinstance(module.decay_proj, nn.Sequential) else module.decay_proj
                init.zeros_(gate.weight)
                init.constant_(gate.bias, hybrid_decay_gate_bias(self.config.decay_horizon))
        if isinstance(module, LinearAttention) and module.qkv_conv is not None:
            # The short convolution starts near the identity (last tap 1, the others N(0, initializer_range)):
            # each token first sees its own q/k/v. Conversion sets the exact identity (`conversion.py`).
            weight = module.qkv_conv.weight
            start = torch.randn(weight.shape, device=weight.device) * self.config.initializer_range
            start[:, :, -1] += 1.0
            init.copy_(weight, start.to(weight.dtype))

    # transformers' flag for a model whose state cannot be rolled back to an earlier prefix (its common tests
    # read it; releases before 5.25 also refuse assisted decoding on it, which `_validate_generation_mode` below
    # now does up front on every release).
    _is_stateful = True

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # A DynamicCache would hold growing K/V for layers that have none; never let generate make one.
        return False

    def save_pretrained(self, save_directory, *args, **kwargs):  # noqa: D102 - same as PreTrainedModel
        # transformers writes only the class being saved into `auto_map`; a Hub checkpoint must
        # resolve all three Auto classes with trust_remote_code=True.
        self.config.auto_map = dict(AUTO_MAP)
        # An engine may have swapped this model's class for a subclass of its own (FSDP2's `fully_shard` makes
        # `FSDPLinearAttentionForCausalLM`, defined in torch): transformers would name that class in `auto_map` and
        # copy its source files, torch's, as the model's code. The save runs as this file's class, whatever wraps it.
        engine_class = type(self)
        self.__class__ = next(cls for cls in engine_class.__mro__ if cls.__module__ == __name__)
        try:
            return super().save_pretrained(save_directory, *args, **kwargs)
        finally:
            self.__class__ = engine_class


def _tracing() -> bool:
    """Whether torch.compile / torch.export is tracing the forward. Checks that branch on tensor *values* are
    skipped then: a traced Python branch on a value is data-dependent (export fails; compile breaks the graph)."""
    return torch.compiler.is_compiling()


def _check_token_ids(input_ids: torch.Tensor, vocab_size: int) -> None:
    """Out-of-range ids would index past the embedding table; checked where it is free (CPU tensors, eager)."""
    if input_ids.device.type != "cpu" or _tracing() or input_ids.numel() == 0:
        return
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ValueError(f"input_ids holds the token id {bad}, outside [0, vocab_size) = [0, {vocab_size}).")


def _validated_mask(
    attention_mask: torch.Tensor | None, batch: int, length: int, past: int | torch.Tensor, caching: bool
) -> torch.Tensor | None:
    """The 2-D padding mask as bool [B, past + T] (True = real token), or None when nothing is padded.

    Any 0/1 pattern is allowed: left padding, right padding and holes (a pad between real tokens). A pad
    leaves every linear state unchanged and is masked as a key in the window and softmax layers; positions
    count real tokens only. Under torch.compile / torch.export the mask is kept as given (no value checks), and
    `past` (then a tensor, see `_past_length`) is not compared with its length."""
    if attention_mask is None:
        return None
    total = past + length if isinstance(past, int) else attention_mask.shape[-1]
    if attention_mask.dim() != 2 or tuple(attention_mask.shape) != (batch, total) or total < length:
        raise ValueError(
            f"attention_mask must be a 2-D padding mask of shape [batch, past + seq_len] = {[batch, total]} "
            "(1 = real token, 0 = pad; with a cache it also covers the cached positions, as generate() passes "
            f"it); got shape {list(attention_mask.shape)}."
        )
    mask = attention_mask.bool()
    if _tracing():
        return mask
    if bool(mask.all()):
        return None
    if not caching and not bool(mask.any(dim=1).all()):
        # (With a cache an all-pad row is fine: a chunked prefill may not have reached its tokens yet.)
        raise ValueError("attention_mask has a row with no real token (all zeros).")
    return mask


def _packed_boundaries(position_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """cu_seqlens [N + 1] when the caller's position_ids [1, T] (no mask) do not step by one somewhere: documents
    packed into one row, each starting wherever the position does not continue the previous one (a restart at 0,
    as transformers' DataCollatorWithFlattening marks them, or any other jump, as transformers' masking reads
    them), else None. With a mask, a 0 at a pad or at a row's first real token is ordinary padding (generate()
    gives pads position 0), and a restart at 0 inside the row is refused.

    Reading the values is data-dependent: torch.export skips the detection (an exported graph treats
    position_ids as plain positions); torch.compile breaks the graph here."""
    if torch.compiler.is_exporting():
        return None
    t = position_ids.shape[1]
    if mask is None:
        if position_ids.shape[0] != 1 or t < 2:
            return None
        starts = (position_ids[0, 1:] - position_ids[0, :-1] != 1).nonzero().flatten() + 1
        if starts.numel() == 0:
            return None
        zero, end = (torch.tensor([i], device=starts.device) for i in (0, t))
        return torch.cat([zero, starts, end])
    seen_before = mask.long().cumsum(-1)[:, -t:] - 1  # real tokens before each position, [B, T]
    if bool((mask[:, -t:] & (position_ids == 0) & (seen_before > 0)).any()):
        raise ValueError(
            "position_ids restart at 0 at a real token inside the row (packed documents) and the attention_mask "
            "has pads; packed rows carry no padding: drop the mask (or give positions that count on across "
            "the pads)."
        )
    return None


def _one_cache(cache, past_key_values):
    """The cache a caller passed as `cache` (transformers >= 5.24) or `past_key_values` (older releases and
    most user code), or None; passing two different objects is an error."""
    if cache is not None and past_key_values is not None and cache is not past_key_values:
        raise ValueError("Pass the cache as `cache` or as `past_key_values`, not both.")
    return cache if cache is not None else past_key_values


def _past_length(cache) -> int | torch.Tensor:
    """Positions a cache has seen: an int, or while torch.compile traces a 0-d tensor when the cache counts in one
    (reading it as an int would be a host sync and a graph break, and an int would recompile at every step)."""
    counter = getattr(cache.layers[0], "seen", None)
    if _tracing() and counter is not None:
        return counter
    return cache.get_seq_length()


def _is_linear_attention_cache(cache) -> bool:
    # Duck-typed: a checkpoint loaded as remote code has its own copy of the cache class.
    return getattr(cache, "is_linear_attention_cache", False)


class LinearAttentionModel(LinearAttentionPreTrainedModel):
    def __init__(self, config: LinearAttentionConfig) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            LinearAttentionDecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = LinearAttentionRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LinearAttentionRotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.post_init()

    def _checked_cache(self, cache, past_key_values, use_cache: bool | None, batch: int):
        """The cache to read and advance (None without one), after checking it belongs to this model."""
        cache = _one_cache(cache, past_key_values)
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if cache is None:
            return LinearAttentionCache(self.config) if use_cache else None
        if not _is_linear_attention_cache(cache):
            raise TypeError(
                f"cache must be a LinearAttentionCache (built with LinearAttentionCache(model.config) or returned "
                f"by this model); got {type(cache).__name__}."
            )
        theirs, ours = getattr(cache, "config_fingerprint", {}), config_fingerprint(self.config)
        differ = [f"{name}={theirs.get(name)!r} (model: {value!r})" for name, value in ours.items()
                  if theirs.get(name) != value]
        if differ:
            raise ValueError(
                f"cache was built for another model configuration: {', '.join(differ)}. Build it with "
                "LinearAttentionCache(model.config) for the model that reads it."
            )
        if cache.batch_size not in (-1, batch):
            raise ValueError(
                f"cache holds states for batch size {cache.batch_size} but the input has batch size {batch}."
            )
        return cache

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: LinearAttentionCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: LinearAttentionCache | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast | tuple:
        """input_ids [B, T] (or inputs_embeds [B, T, hidden]) -> last_hidden_state [B, T, hidden].

        `attention_mask` is the usual 2-D padding mask over cached + new positions; any pattern works (left
        or right padding, holes), with or without a cache. Without `position_ids`, positions count real tokens
        only, so a padded row sees the same RoPE angles as the same prompt unpadded. `cache` (alias
        `past_key_values`) is a LinearAttentionCache; with `use_cache` (default: config.use_cache when
        not training) a new one is made and returned.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        check_sparse_cache_size(self.config)  # it may have been set on the loaded config
        if kwargs.get("output_attentions"):
            raise ValueError("output_attentions=True: linear attention has no attention weights to return.")
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        if return_dict is None:
            return_dict = self.config.return_dict
        if inputs_embeds is None:
            if input_ids.dim() != 2:
                raise ValueError(f"input_ids must be [batch, seq_len]; got shape {list(input_ids.shape)}.")
            _check_token_ids(input_ids, self.config.vocab_size)
            inputs_embeds = self.embed_tokens(input_ids)
        b, t, _ = inputs_embeds.shape
        if t == 0:
            raise ValueError("The input has zero tokens (seq_len == 0); pass at least one token.")
        cache_requested = bool(use_cache) or cache is not None or past_key_values is not None
        cache = self._checked_cache(cache, past_key_values, use_cache, b)
        if cache is not None and self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            raise ValueError(
                "A cache cannot be filled under gradient checkpointing (the recomputation would advance it "
                "twice); pass use_cache=False when training."
            )
        past = 0 if cache is None else _past_length(cache)
        mask = _validated_mask(attention_mask, b, t, past, caching=cache_requested)
        mask = None if mask is None else mask.to(inputs_embeds.device)
        cu_seqlens = None
        if position_ids is None:  # count real tokens only: a pad repeats its predecessor's position
            if mask is None:
                position_ids = (torch.arange(t, device=inputs_embeds.device) + past).expand(b, t)
            else:
                position_ids = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
        elif not (t == 1 and _tracing()):  # (one token starts no second document; reading values would break a graph)
            cu_seqlens = _packed_boundaries(position_ids, mask)
        if cu_seqlens is not None and cache is not None:
            if cache_requested:
                raise ValueError("Packed documents (position_ids restarting at 0) cannot fill a cache; "
                                 "pass use_cache=False.")
            cache = None  # only the config's default asked for one
        position_embeddings = self.rotary_emb.rotation(inputs_embeds, position_ids)

        hidden_states = inputs_embeds
        all_hidden_states = [] if output_hidden_states else None
        for i, layer in enumerate(self.layers):
            if all_hidden_states is not None:
                all_hidden_states.append(hidden_states)
            cache_layer = None if cache is None else cache.layers[i]
            hidden_states = layer(hidden_states, position_embeddings, mask, cache_layer, cu_seqlens)
        hidden_states = self.norm(hidden_states)
        if all_hidden_states is not None:
            all_hidden_states.append(hidden_states)
        output = BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            hidden_states=tuple(all_hidden_states) if all_hidden_states is not None else None,
            **{OUTPUT_CACHE_FIELD: cache},
        )
        return output if return_dict else output.to_tuple()


class LinearAttentionForCausalLM(LinearAttentionPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LinearAttentionConfig) -> None:
        super().__init__(config)
        self.model = LinearAttentionModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def set_window_weight(self, weight: float) -> None:
        """Set γ = `weight` in every head of every additive window-hybrid layer (window_gate = logit γ) and record it
        as `config.window_weight`. γ moves slowly in training (one logit per head), so where it stands is mostly
        where it was set: e.g. attention transfer at γ 0.5, which makes the linear part learn to carry more, then
        γ raised before a recovery stage that does not train it (the demo's `recovery_window_weight`)."""
        check_window_weight(weight, "set_window_weight")
        check_has_window_weight(self.config, "set_window_weight", weight)
        with torch.no_grad():
            for layer in self.modules():
                if isinstance(layer, WindowHybridAttention):
                    layer.window_gate.fill_(window_gate_logit(weight))
        self.config.window_weight = weight

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        # Assisted decoding (an assistant model, prompt lookup) verifies a draft and then rolls the cache back to
        # the accepted prefix. A recurrent state cannot be rolled back, so refuse before any token is computed
        # (transformers >= 5.25 would only find out after the prefill).
        if generation_mode == GenerationMode.ASSISTED_GENERATION:
            raise ValueError(
                f"assisted generation is not supported with stateful models such as {type(self).__name__}: its "
                "recurrent state cannot be rolled back to a draft's accepted prefix. Generate without "
                "`assistant_model` / `prompt_lookup_num_tokens` (greedy, sampling and beam search all work)."
            )
        super()._validate_generation_mode(generation_mode, generation_config, generation_mode_kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: LinearAttentionCache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: LinearAttentionCache | None = None,
        **kwargs,
    ) -> CausalLMOutputWithPast | tuple:
        """Next-token logits [B, T', vocab] (T' = T, or the last `logits_to_keep` positions).

        With `labels` [B, T] (-100 = ignored) the shifted cross-entropy loss is returned too. The cache
        comes back in the output field transformers uses for it (`cache`, or `past_key_values` before 5.24).
        """
        if return_dict is None:
            return_dict = self.config.return_dict
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            past_key_values=past_key_values,
            output_attentions=kwargs.pop("output_attentions", None),
        )
        hidden_states = outputs.last_hidden_state
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden_states[:, keep, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        output = CausalLMOutputWithPast(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            **{OUTPUT_CACHE_FIELD: getattr(outputs, OUTPUT_CACHE_FIELD)},
        )
        return output if return_dict else output.to_tuple()

    def create_masks_for_generate(self, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
        """The mask generate() passes when the cache is compileable: the 2-D padding mask as it is (generate would
        otherwise build 4-D softmax masks, which this model does not take; a decode step reads only the mask's
        last column and, without position_ids, its count of real tokens)."""
        return attention_mask

    def _prepare_cache_for_generation(self, generation_config, model_kwargs: dict, *args, **kwargs) -> None:
        """Give generate() a LinearAttentionCache before the first forward (chunked prefill needs one), or
        move a user's cache passed as `past_key_values` to the name generate() slices reused tokens by."""
        chunk = getattr(generation_config, "prefill_chunk_size", None)
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
            raise ValueError(f"prefill_chunk_size must be None (one-shot prefill) or an int ≥ 1; got {chunk!r}.")
        cache = _one_cache(model_kwargs.pop("cache", None), model_kwargs.pop("past_key_values", None))
        if cache is None and generation_config.use_cache is not False:
            cache = LinearAttentionCache(self.config)
        if cache is not None:
            model_kwargs[GENERATE_CACHE_KEY] = cache


__all__ = [
    "AdditiveLinearAttention",
    "DeltaRuleAttention",
    "DeltaWindowAttention",
    "LinearAttention",
    "SoftmaxHeadsMixin",
    "SoftmaxAttention",
    "WindowHybridAttention",
    "LinearAttentionPreTrainedModel",
    "LinearAttentionModel",
    "LinearAttentionForCausalLM",
]
