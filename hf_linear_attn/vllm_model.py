"""The vLLM model of `LinearAttentionForCausalLM` checkpoints: an out-of-tree model plugin.

vLLM imports this module through the package's `vllm.general_plugins` entry point (`register`); transformers never
does (a checkpoint's remote code is `modeling_linear_attention.py` and what it imports), so loading a model with
transformers needs no vLLM.

The layers are the transformers model's own modules, run on vLLM's flat batch ([N, hidden]: the N scheduled tokens of
every request, decodes first, then prefills and prefill chunks). No math is repeated here:

- softmax layers (`config.softmax_layers`) project and rotate as the transformers layer does and attend with vLLM's
  paged attention (`Attention`), its KV cache growing with the context;
- every other layer runs the transformers layer's projections, short convolution, RoPE and kind's attention
  (`rotated_qkv`, `attend`: the ops of `hf_linear_attn.ops`, the one-token steps for a decode) on a cache layer
  (`cache_linear_attention`) holding the requests' fixed state slots in vLLM's cache (`MambaBase`): linear state and
  normaliser, window ring and sinks, delta-rule write strengths, convolution inputs, the sparse memory's slots and
  log decays (`state_tensors` lists them). A request's memory in these layers does not grow with its length. Decode
  steps run batched (`StateSlots.groups`): the slots of B requests gathered into [B, ...] tensors, one step of the
  layer, the results written back. The cache layer counts one position; a window step reads it (the ring slot of
  the new token; with the sparse memory, the ring tokens the row covers and the block ends), so each request is
  seen shifted to it (`slot_batch`: its ring rotated, its memory's positions shifted), and with the sparse memory
  only requests at the same place in the memory's block share a batch. Prefills and prefill chunks run one request
  at a time;
- a recurrent layer with softmax heads (`config.softmax_heads`) also has a paged `Attention` of its own (under
  `<layer>.softmax_heads`: those KV heads and their query groups), whose KV cache grows in pages beside the softmax
  layers'; its output replaces those query heads' outputs of the kind, before o_proj, as `SoftmaxHeadsMixin` does.

On vLLM's CPU platform every `nn.Linear` multiplies with the engine's packed oneDNN product (`use_engine_gemm`), as
vLLM's own linear layers do.

vLLM reuses a slot without clearing it: a request (or a prefill chunk) at context 0 gets an empty cache layer, as
`generate()` starts, and its final tensors are copied into the slot; later chunks and decode steps read the slot and
write it back. Prefix caching of the recurrent states and speculative decoding are not supported: `register`
switches the first off for this architecture and refuses the second, with the other unsupported options, at load
(`EngineOptions`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from functools import partial
from typing import NamedTuple

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.model_executor.models.config import VerifyAndUpdateConfig
from vllm.model_executor.models.interfaces import HasInnerState, IsHybrid
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

from .cache_linear_attention import LinearStateLayer, state_layer
from .configuration_linear_attention import LinearAttentionConfig, recurrent_kind
from .modeling_linear_attention import (
    ATTENTION_CLASSES,
    SOFTMAX_HEADS_CLASSES,
    LinearAttentionMLP,
    LinearAttentionRMSNorm,
    LinearAttentionRotaryEmbedding,
    Rotation,
    SoftmaxAttention,
    attention_class,
    scaled_queries,
)
from .ops_sparse_memory import MEMORY_BLOCK_SIZE

ARCHITECTURE = "LinearAttentionForCausalLM"
PAGE_ALIGNMENT = 8  # bytes: the widest state element (fp32 here; a long would need 8)
# The window ring's per-position tensors (`state_tensors`): [S + w, ...], S sink slots, then w ring slots.
RING_TENSORS = ("window_keys", "window_values", "window_mask", "window_beta", "window_log_decay")
PADDING = "padding"  # the name of the bytes that align a state page (`state_tensors`), which no cache layer reads
logger = init_logger(f"vllm.plugins.{__name__}")  # under vLLM's logger, whose handlers print INFO


def register() -> None:
    """The `vllm.general_plugins` entry point: the model class for `ARCHITECTURE` and its engine options."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, f"{__name__}:LinearAttentionForCausalLM")
    MODELS_CONFIG_MAP[ARCHITECTURE] = EngineOptions


class EngineOptions(VerifyAndUpdateConfig):
    """What the engine must do for this model, checked before vLLM allocates anything (a clear error at load)."""

    @classmethod
    def verify_and_update_config(cls, vllm_config: VllmConfig) -> None:
        if vllm_config.speculative_config is not None:
            raise ValueError("LinearAttentionForCausalLM: speculative decoding is not supported (a recurrent state "
                             "cannot be rolled back to the accepted tokens); start the engine without it")
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError("LinearAttentionForCausalLM runs unsharded: tensor_parallel_size and "
                             "pipeline_parallel_size must be 1, got "
                             f"{parallel.tensor_parallel_size} and {parallel.pipeline_parallel_size}")
        if vllm_config.cache_config.enable_prefix_caching:
            # A request's recurrent state is kept for its last token only: a cached prefix could not restore it.
            logger.info("LinearAttentionForCausalLM: prefix caching switched off (recurrent states are not cached)")
            vllm_config.cache_config.enable_prefix_caching = False


def state_tensors(config: LinearAttentionConfig, dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The tensors of one request's state in a recurrent layer, as the kind's cache layer names them: (attribute,
    shape without the batch dimension, dtype), widest dtype first (vLLM packs them into one byte page, and each view
    must start at a multiple of its element size). `dtype` is the model's, kept for keys, values and conv inputs.

    - "state": the recurrent state, fp32 [H, K, V] (delta kinds), [H, K, V + 1] (the window hybrid, and linear
      attention with normalize=True: the normaliser column);
    - delta_window: "window_beta", fp32 [S + w, H];
    - window kinds: "window_keys", "window_values" [S + w, H_kv, D] and "window_mask" bool [S + w] (S sinks,
      w ring slots: window_size, plus MEMORY_BLOCK_SIZE with the sparse memory);
    - the sparse memory (sparse_cache_size = m > 0; F = 1, or K with a vector decay): "window_log_decay" fp32
      [S + w, H, F] (with a decay), and the m slots per KV head: "memory_keys", "memory_values" [H_kv, m, D],
      "memory_scores" fp32 [H_kv, m], "memory_positions" long [H_kv, m], "memory_log_decay" fp32 [H, m, F] (with
      a decay), "memory_mask" bool [H_kv, m];
    - conv_size = W > 0: "conv_inputs" [W − 1, (H + 2 H_kv) · D];
    - PADDING, bytes that round the page up to a multiple of PAGE_ALIGNMENT (vLLM views every slot's page at a
      stride of the page size, which must be a multiple of the widest element size).
    """
    kind = recurrent_kind(config)
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    keys = config.feature_output_dim
    normaliser = kind == "window" or (kind == "linear" and config.normalize)
    specs = [("state", (heads, keys, head_dim + int(normaliser)), torch.float32)]
    memory = config.sparse_cache_size  # > 0 with the window kind only (the config checks it)
    slots = config.num_sink_tokens + config.window_size + (MEMORY_BLOCK_SIZE if memory else 0)
    if kind == "delta_window":
        specs.append(("window_beta", (slots, heads), torch.float32))
    if kind in ("window", "delta_window"):
        specs += [(name, (slots, kv_heads, head_dim), dtype) for name in ("window_keys", "window_values")]
    if memory:
        decay_width = keys if config.decay == "vector" else 1
        if config.decay != "none":
            specs += [("window_log_decay", (slots, heads, decay_width), torch.float32),
                      ("memory_log_decay", (heads, memory, decay_width), torch.float32)]
        specs += [(name, (kv_heads, memory, head_dim), dtype) for name in ("memory_keys", "memory_values")]
        specs += [("memory_scores", (kv_heads, memory), torch.float32),
                  ("memory_positions", (kv_heads, memory), torch.long), ("memory_mask", (kv_heads, memory), torch.bool)]
    if config.conv_size > 0:
        specs.append(("conv_inputs", (config.conv_size - 1, (heads + 2 * kv_heads) * head_dim), dtype))
    if kind in ("window", "delta_window"):
        specs.append(("window_mask", (slots,), torch.bool))
    specs.sort(key=lambda spec: -spec[2].itemsize)  # (stable: the order above within a width)
    padding = -sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in specs) % PAGE_ALIGNMENT
    return specs + ([(PADDING, (padding,), torch.uint8)] if padding else [])


class SlotBatch(NamedTuple):
    """Where the cache layer of B requests (`StateSlots.slot_batch`) reads and writes vLLM's state tensors
    [slots, *shape]. `indices`, by tensor name: for one request, the index of its slot (a view: the layer updates it
    in place); else the B slots, a tensor [B] (gathered with index_select, written back with index_copy_), or for the
    ring's per-position tensors (RING_TENSORS, [slots, S + w, ...]) of requests at different positions, the index
    of the slots [B, 1] and of each one's ring slots in the layer's order [B, S + w]. `position`: the position the
    layer counts; `shifts` [B]: what each request's positions are shifted by to reach it (None: all 0)."""

    indices: dict[str, torch.Tensor | tuple]
    position: int
    shifts: torch.Tensor | None


class StateSlots(MambaBase):
    """What turns a transformers recurrent attention layer into a vLLM layer with per-request state slots (mixed in
    front of the layer's class, `vllm_attention_class`): the slot layout vLLM allocates (`get_state_shape`,
    `get_state_dtype`), the paged attention of its softmax heads if it has some (`softmax_heads`), and a forward over
    vLLM's flat batch that runs the layer's kind once per group of requests (`groups`)."""

    def setup_slots(self, config: LinearAttentionConfig, vllm_config: VllmConfig, prefix: str) -> None:
        """Register the layer with vLLM under `prefix` (its name in the model) and fix its state layout; a layer with
        softmax heads (`SoftmaxHeadsMixin`: `softmax_query_heads`, `softmax_kv_heads`) also gets their paged
        attention, an `Attention` under `prefix`.softmax_heads whose KV cache grows in pages as a softmax layer's."""
        self.layer_name = prefix
        self.specs = state_tensors(config, vllm_config.model_config.dtype)
        self.kv_cache = ()  # vLLM binds the slots (`bind_kv_cache`) after its profiling run
        context = vllm_config.compilation_config.static_forward_context
        if prefix in context:
            raise ValueError(f"duplicate layer name {prefix!r}")
        context[prefix] = self
        self.softmax_heads = None
        if config.softmax_heads_of(self.layer_idx):
            self.softmax_heads = Attention(
                len(self.softmax_query_heads), self.head_dim, self.head_dim**-0.5,
                num_kv_heads=len(self.softmax_kv_heads), cache_config=vllm_config.cache_config,
                prefix=f"{prefix}.softmax_heads")

    @property
    def mamba_type(self) -> MambaAttentionBackendEnum:
        return MambaAttentionBackendEnum.LINEAR  # its metadata: query_start_loc, seq_lens, state_indices_tensor

    def get_state_shape(self) -> tuple[tuple[int, ...], ...]:
        return tuple(shape for _, shape, _ in self.specs)

    def get_state_dtype(self) -> tuple[torch.dtype, ...]:
        return tuple(dtype for _, _, dtype in self.specs)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Rotation) -> torch.Tensor:
        """hidden_states [N, hidden] (every scheduled token), position_embeddings the `Rotation` of their positions
        (cos / sin tables [1, N, 1, D], the softmax heads' query scale [1, N, 1, 1]) -> [N, hidden]. The
        transformers layer's ops in its order: per group of requests (`groups`) the projections, short convolution
        and RoPE (`rotated_qkv`) and the kind's attention (`attend`) on the group's cache layer; then, with softmax
        heads, the paged attention of their q (scaled) / k / v over every token replaces those query heads' outputs
        (as `SoftmaxHeadsMixin.forward`); then o_proj. Tokens past the last request's (vLLM's padding) get 0; so does
        every token in vLLM's profiling run, which binds no slots."""
        output = torch.zeros_like(hidden_states)
        metadata = get_forward_context().attn_metadata
        metadata = None if metadata is None else metadata.get(self.layer_name)
        if metadata is None:
            return output
        n, head_dim = hidden_states.shape[0], self.head_dim
        o = hidden_states.new_zeros(n, self.num_heads, head_dim)  # [N, H, V]: the attention before o_proj
        if self.softmax_heads is not None:  # q [N, H, D], k, v [N, H_kv, D] of every token, for the softmax heads
            qkv = [hidden_states.new_zeros(n, heads, head_dim)
                   for heads in (self.num_heads, self.num_kv_heads, self.num_kv_heads)]
        cos, sin = position_embeddings.cos[0], position_embeddings.signed_sin[0]  # [N, 1, D]
        for tokens, slots, contexts in self.groups(metadata):  # tokens [B, T]; slots, contexts: B ints each
            x = hidden_states[tokens]  # [B, T, hidden]
            batch = self.slot_batch(slots, contexts)
            cache_layer = self.cache_layer(batch)
            q, k, v = self.rotated_qkv(x, Rotation(cos[tokens], sin[tokens], None), None, cache_layer, None)
            o[tokens] = self.attend(x, q, k, v, None, cache_layer, None)
            self.store(cache_layer, batch)
            if self.softmax_heads is not None:
                for buffer, part in zip(qkv, (q, k, v), strict=True):
                    buffer[tokens] = part
        if self.softmax_heads is not None:
            q, k, v = qkv
            kv_heads = self.softmax_kv_heads
            q_heads = scaled_queries(q[None, :, self.softmax_query_heads], position_embeddings)[0]  # [N, h, D]
            heads = self.softmax_heads(q_heads.reshape(n, -1),
                                       k[:, kv_heads].reshape(n, -1), v[:, kv_heads].reshape(n, -1))
            o[:, self.softmax_query_heads] = heads.view(n, -1, head_dim).to(o.dtype)
        real = int(metadata.query_start_loc[-1])
        output[:real] = self.project_out(o[None, :real])[0]
        return output

    def groups(self, metadata) -> Iterator[tuple[torch.Tensor, list[int], list[int]]]:
        """The requests of the batch in groups that one call of the layer runs: (their tokens' indices [B, T], their
        B state slots, the context before their tokens, per request). Request i owns tokens query_start_loc[i] ..
        [i + 1] and state slot state_indices_tensor[i]; its context is seq_lens[i] minus their number. One-token
        steps (vLLM's decodes, first in its batch) run as one batch after a filled state (`slot_batch` aligns the
        requests' positions), with the sparse memory one batch per place in the memory's block (which the step reads:
        the ring tokens it covers, the block end), and one batch at context 0 (a fresh cache layer); every prefill
        (chunk) runs alone."""
        starts = metadata.query_start_loc.tolist()
        seq_lens, slots = metadata.seq_lens.tolist(), metadata.state_indices_tensor.tolist()
        device = metadata.query_start_loc.device
        batches: dict[str | int, list[int]] = {}
        for i in range(metadata.num_decodes):
            context = seq_lens[i] - 1
            if context == 0:
                key = "start"
            elif self.config.sparse_cache_size > 0:
                key = context % MEMORY_BLOCK_SIZE
            else:
                key = "step"
            batches.setdefault(key, []).append(i)
        for requests in batches.values():
            yield (torch.tensor([starts[i] for i in requests], device=device)[:, None], [slots[i] for i in requests],
                   [seq_lens[i] - 1 for i in requests])
        for i in range(metadata.num_decodes, metadata.num_decodes + metadata.num_prefills):
            start, end = starts[i], starts[i + 1]
            yield torch.arange(start, end, device=device)[None], [slots[i]], [seq_lens[i] - (end - start)]

    def slot_tensors(self) -> dict[str, torch.Tensor]:
        """vLLM's state tensors of this layer, by attribute name, each [slots, *shape]."""
        return {name: tensor for (name, _, _), tensor in zip(self.specs, self.kv_cache, strict=True)
                if name != PADDING}

    def slot_batch(self, slots: list[int], contexts: list[int]) -> SlotBatch:
        """Where a cache layer of B requests (state `slots`, `contexts`: B ints each) reads and writes vLLM's state
        tensors (`SlotBatch`). The layer counts one position, the largest context p: request b, at p_b, is seen
        shifted by p − p_b (a multiple of MEMORY_BLOCK_SIZE with the sparse memory, `groups`): its ring (which
        holds position q in slot S + q mod w; sinks stay) rotated so that its positions sit where the layer looks
        for them, its memory slots' absolute positions shifted (their order, all they are read for, unchanged)."""
        tensors = self.slot_tensors()
        if len(slots) == 1:
            return SlotBatch(dict.fromkeys(tensors, (slice(slots[0], slots[0] + 1),)), contexts[0], None)
        device, position = self.kv_cache[0].device, max(contexts)
        rows = torch.tensor(slots, device=device)  # [B]
        indices = dict.fromkeys(tensors, rows)
        if len(set(contexts)) == 1:
            return SlotBatch(indices, position, None)
        shifts = position - torch.tensor(contexts, device=device)  # [B]
        if "window_mask" in tensors:
            sinks = self.num_sink_tokens
            width = tensors["window_mask"].shape[1] - sinks  # w
            ring = sinks + (torch.arange(width, device=device) - shifts[:, None]) % width  # [B, w]
            sink_slots = torch.arange(sinks, device=device).expand(len(slots), -1)  # [B, S]
            index = rows[:, None], torch.cat([sink_slots, ring], dim=1)
            indices.update((name, index) for name in RING_TENSORS if name in tensors)
        return SlotBatch(indices, position, shifts)

    def cache_layer(self, batch: SlotBatch) -> LinearStateLayer:
        """The kind's cache layer for the requests of `batch` (`slot_batch`): empty at position 0 (the slots may hold
        finished requests' states), else holding their slots [B, *shape] (views for one request, else copies that
        `store` writes back)."""
        layer = state_layer(self.config, self.layer_idx)
        if batch.position > 0:
            for name, tensor in self.slot_tensors().items():
                index = batch.indices[name]
                setattr(layer, name, tensor.index_select(0, index) if torch.is_tensor(index) else tensor[index])
            if batch.shifts is not None and "memory_positions" in batch.indices:
                layer.memory_positions += batch.shifts[:, None, None]
            layer.seen = torch.tensor(batch.position, dtype=torch.long, device=self.kv_cache[0].device)
        return layer

    def store(self, cache_layer: LinearStateLayer, batch: SlotBatch) -> None:
        """Write the cache layer's tensors [B, *shape] after the forward into its requests' state (`batch`), where the
        layer has not updated them in place."""
        for name, tensor in self.slot_tensors().items():
            value, index = getattr(cache_layer, name), batch.indices[name]
            if value is None:
                raise RuntimeError(f"{type(self).__name__} left its cache's {name!r} unset: the vLLM state layout "
                                   "(state_tensors) does not match the layer's cache")
            if name == "memory_positions" and batch.shifts is not None:
                value = value - batch.shifts[:, None, None]
            if torch.is_tensor(index):
                tensor.index_copy_(0, index, value)
            elif not isinstance(index[0], slice) or value.data_ptr() != tensor[index].data_ptr():
                tensor[index] = value  # the rotated rings, or a request's slot that its first forward allocated


def vllm_attention_class(base: type[nn.Module]) -> type[nn.Module]:
    """The vLLM layer of a recurrent attention class: `StateSlots` in front of the transformers class."""
    return type(f"Vllm{base.__name__}", (StateSlots, base), {})


# The vLLM layer of each recurrent attention class, with and without softmax heads (`attention_class` picks one).
VLLM_ATTENTION_CLASSES = {base: vllm_attention_class(base) for base in (
    *(cls for kind, cls in ATTENTION_CLASSES.items() if kind != "softmax"), *SOFTMAX_HEADS_CLASSES.values())}


class PagedSoftmaxAttention(SoftmaxAttention):
    """A softmax layer: the transformers layer's projections and RoPE, vLLM's paged attention (`self.attn`)."""

    def __init__(self, config: LinearAttentionConfig, layer_idx: int, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__(config, layer_idx)
        self.attn = Attention(self.num_heads, self.head_dim, self.head_dim**-0.5, num_kv_heads=self.num_kv_heads,
                              cache_config=vllm_config.cache_config, prefix=f"{prefix}.attn")

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Rotation) -> torch.Tensor:
        """hidden_states [N, hidden], position_embeddings (`Rotation`) of [1, N, ...] -> [N, hidden]."""
        n = hidden_states.shape[0]
        q, k, v = (x.reshape(n, -1) for x in self.scaled_qkv(hidden_states[None], position_embeddings))
        return self.project_out(self.attn(q, k, v).view(1, n, -1))[0]


class DecoderLayer(nn.Module):
    """The transformers decoder layer's blocks (same names and checkpoint keys), with the vLLM attention of its kind."""

    def __init__(self, config: LinearAttentionConfig, layer_idx: int, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        kind = config.layer_kind(layer_idx)
        attention_prefix = f"{prefix}.self_attn"
        if kind == "softmax":
            self.self_attn = PagedSoftmaxAttention(config, layer_idx, vllm_config, attention_prefix)
        else:
            self.self_attn = VLLM_ATTENTION_CLASSES[attention_class(config, layer_idx)](config, layer_idx)
            self.self_attn.setup_slots(config, vllm_config, attention_prefix)
        self.mlp = LinearAttentionMLP(config)
        self.input_layernorm = LinearAttentionRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LinearAttentionRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: Rotation) -> torch.Tensor:
        """hidden_states [N, hidden] -> [N, hidden] (pre-norm residual blocks, as the transformers layer)."""
        hidden_states = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class LinearAttentionModel(nn.Module):
    def __init__(self, config: LinearAttentionConfig, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList(DecoderLayer(config, i, vllm_config, f"{prefix}.layers.{i}")
                                    for i in range(config.num_hidden_layers))
        self.norm = LinearAttentionRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = LinearAttentionRotaryEmbedding(config)

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """hidden_states [N, hidden] (embedded tokens), positions [N] -> the final norm's output [N, hidden]."""
        position_embeddings = self.rotary_emb.rotation(hidden_states[None], positions[None])
        for layer in self.layers:
            hidden_states = layer(hidden_states, position_embeddings)
        return self.norm(hidden_states)


class LinearAttentionForCausalLM(nn.Module, IsHybrid, HasInnerState):
    """vLLM's model for `ARCHITECTURE` (see the module docstring)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        self.model = LinearAttentionModel(config, vllm_config, f"{prefix}.model" if prefix else "model")
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def get_mamba_state_shape_from_config(cls, vllm_config: VllmConfig) -> tuple[tuple[int, ...], ...]:
        return tuple(shape for _, shape, _ in cls._state_tensors(vllm_config))

    @classmethod
    def get_mamba_state_dtype_from_config(cls, vllm_config: VllmConfig) -> tuple[torch.dtype, ...]:
        return tuple(dtype for _, _, dtype in cls._state_tensors(vllm_config))

    @classmethod
    def _state_tensors(cls, vllm_config: VllmConfig) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        model_config = vllm_config.model_config
        return state_tensors(model_config.hf_config, model_config.dtype)

    @classmethod
    def get_mamba_state_copy_func(cls) -> tuple:
        """vLLM copies states between slots only for prefix caching's "align" mode and speculative decoding, which
        `EngineOptions` switches off and refuses."""
        raise NotImplementedError("LinearAttentionForCausalLM keeps one state per request: no prefix caching of "
                                  "recurrent states, no speculative decoding")

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, input_ids: torch.Tensor | None, positions: torch.Tensor, intermediate_tensors=None,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [N] (or inputs_embeds [N, hidden]), positions [N] -> hidden states [N, hidden]."""
        if inputs_embeds is None:
            inputs_embeds = self.embed_input_ids(input_ids)
        return self.model(inputs_embeds, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states [n, hidden] -> logits [n, vocab]."""
        return self.lm_head(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the checkpoint's tensors (the transformers model's names) into the parameters; returns the names
        loaded. A tied lm_head is the embedding and needs no tensor of its own."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                if name == "lm_head.weight" and self.config.tie_word_embeddings:
                    continue
                raise ValueError(f"the checkpoint holds {name!r}, which LinearAttentionForCausalLM does not have")
            params[name].data.copy_(tensor)
            loaded.add(name)
        if current_platform.is_cpu():
            use_engine_gemm(self)
        return loaded


def use_engine_gemm(model: nn.Module) -> None:
    """Every `nn.Linear` of `model` multiplies with vLLM's CPU matrix product, as vLLM's own linear layers do: the
    weight packed once for oneDNN (`dispatch_cpu_unquantized_gemm`; the layer keeps its `weight` tensor too, which a
    tied embedding shares, so the weights are held twice). torch's fp32 product of the few rows of a decode step takes
    ~2.4x as long (SmolLM2-135M, 4 requests at 8K: 68 against 28 ms of a 172 ms step)."""
    for module in model.modules():
        if isinstance(module, nn.Linear):
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)
            module.forward = partial(engine_linear, module)


def engine_linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x [..., in] -> [..., out]: `module`'s product by the CPU kernel `use_engine_gemm` chose for it."""
    return module.cpu_linear(x, module.weight, module.bias)
