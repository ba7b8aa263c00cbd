"""LinearAttentionCache: the decode cache of a linear-attention model, constant in size.

Per layer it holds what the next token needs and nothing that grows with the context:

- linear layers: the recurrent state S (and z as its last column when normalised),
  fp32 `[B, H, K, V (+1)]`; with `update_rule="delta"` the delta-rule state S, fp32 `[B, H, K, V]`;
- layers with a short convolution (`conv_size` = W > 0): also its last W − 1 inputs (the q/k/v
  projections, pads zeroed) `[B, W − 1, C]` in the model dtype, C = (H + 2 H_kv) · D;
- window-hybrid layers: the same state for every token folded into the linear part, plus the raw
  keys/values of the sinks and of the last `window_size` positions, `[B, R, H_kv, D]` with
  R = num_sink_tokens + window_size, right-aligned, and a bool mask `[B, R]` of which slots are
  real tokens;
- full-softmax layers (`config.softmax_layers`): an ordinary growing K/V (transformers'
  `DynamicLayer`), the only part whose size depends on the context.

Every layer counts the positions it has seen, so `get_seq_length()` is right for `generate()`'s
cache-reuse slicing even when no layer is a softmax layer (transformers' own recurrent cache layers
count no tokens, so a cache made only of them cannot tell). A recurrent state cannot be
rolled back: `crop` raises, and the model refuses assisted decoding.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

NO_CROP = (
    "A linear-attention cache holds a recurrent state that cannot be rolled back to an earlier "
    "position, so it cannot be cropped (this also rules out assisted / speculative decoding)."
)


class LinearStateLayer(CacheLayerMixin):
    """Cache of one linear-attention (or window-hybrid) layer. See the module docstring for shapes."""

    is_compileable = False
    is_croppable = False

    def __init__(self) -> None:
        super().__init__()
        self.state: torch.Tensor | None = None
        self.window_keys: torch.Tensor | None = None
        self.window_values: torch.Tensor | None = None
        self.window_mask: torch.Tensor | None = None
        self.conv_inputs: torch.Tensor | None = None
        self.seen_tokens = 0

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this layer holds, by attribute name (only those that exist yet)."""
        names = ("state", "window_keys", "window_values", "window_mask", "conv_inputs")
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def _map(self, fn) -> None:
        for name, tensor in self.tensors().items():
            setattr(self, name, fn(tensor))

    def lazy_initialization(self, *args, **kwargs) -> None:
        """Nothing to pre-allocate: the first forward writes the state."""

    def update(self, *args, **kwargs):
        raise TypeError(
            "LinearStateLayer holds a recurrent state, not a key/value list; the linear-attention layer "
            "writes it through `update_state` / `update_window`."
        )

    def update_state(self, state: torch.Tensor, num_new_tokens: int) -> None:
        """Store the state after `num_new_tokens` more positions."""
        self.state = state
        self.seen_tokens += num_new_tokens
        self.is_initialized = True

    def update_conv(self, inputs: torch.Tensor) -> None:
        """Store the short convolution's last W − 1 inputs `[B, W − 1, C]` (the next call's left context)."""
        self.conv_inputs = inputs

    def update_window(
        self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, window_size: int, num_sink_tokens: int
    ) -> None:
        """Keep, of keys/values `[B, L, H_kv, D]` and mask `[B, L]` (the retained window followed by the new
        tokens), the sinks (first `num_sink_tokens` real tokens) and the last `window_size` positions (pads
        included, as masked slots: the window counts positions, so a decode step sees a hole where the full
        forward does), right-aligned into R = num_sink_tokens + window_size slots. Everything else has been
        folded into the state by the caller."""
        batch, length = mask.shape
        slots = window_size + num_sink_tokens
        if length < slots:  # left-pad with empty slots so that exactly R are always kept (constant size)
            pad = slots - length
            keys = torch.cat([keys.new_zeros(batch, pad, *keys.shape[2:]), keys], dim=1)
            values = torch.cat([values.new_zeros(batch, pad, *values.shape[2:]), values], dim=1)
            mask = torch.cat([mask.new_zeros(batch, pad), mask], dim=1)
            length = slots
        position = torch.arange(length, device=mask.device)
        is_sink = mask & (mask.long().cumsum(-1) <= num_sink_tokens)
        keep = is_sink | (position >= length - window_size)  # [B, L]
        # Sort dropped positions first and kept ones in sequence order after them, then take the last R.
        order = torch.argsort(keep.long() * (position + 1), dim=-1, stable=True)[:, -slots:]  # [B, R]
        index = order[:, :, None, None]
        self.window_keys = keys.gather(1, index.expand(-1, -1, *keys.shape[2:]))
        self.window_values = values.gather(1, index.expand(-1, -1, *values.shape[2:]))
        self.window_mask = (mask & keep).gather(1, order)

    def get_seq_length(self) -> int:
        return self.seen_tokens

    def get_max_length(self) -> int:
        return -1  # no limit: the state does not grow

    def get_max_cache_shape(self) -> int:  # name used by transformers < 5.13
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen_tokens + query_length, 0

    def reset(self) -> None:
        self.state = self.window_keys = self.window_values = self.window_mask = self.conv_inputs = None
        self.seen_tokens = 0
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map(lambda t: t[indices])

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(NO_CROP)

    @property
    def batch_size(self) -> int:
        return self.state.shape[0]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


# The config fields that decide what a cache holds and how the model reads it: the layer kinds, the state's
# layout (heads, head and feature sizes, normaliser column, convolution inputs) and its meaning (feature map,
# decay, update rule, window, sinks). A cache built for a config that differs in any of them would be read as
# garbage, so the model refuses it. (output_norm and output_gate act on the output only: not listed.)
FINGERPRINT_FIELDS = (
    "num_hidden_layers", "softmax_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "feature_map", "feature_dim", "decay", "normalize", "window_size", "num_sink_tokens", "update_rule",
    "conv_size",
)


def config_fingerprint(config) -> dict:
    """The values of FINGERPRINT_FIELDS in `config` (lists as sorted tuples, so equal configs compare equal)."""
    values = {name: getattr(config, name, None) for name in FINGERPRINT_FIELDS}
    values["softmax_layers"] = tuple(sorted(values["softmax_layers"] or ()))
    return values


class LinearAttentionCache(Cache):
    """The cache `generate()` uses for `LinearAttentionForCausalLM` (built automatically).

    Build one yourself with `LinearAttentionCache(model.config)` to reuse it across calls: pass it
    as `cache=` (or `past_key_values=`) together with the *full* token sequence and its full
    attention mask; already-seen tokens are skipped. `nbytes()` is its size in bytes.
    """

    is_linear_attention_cache = True  # duck-typing marker: checkpoints loaded as remote code have their own class

    def __init__(self, config) -> None:
        softmax_layers = set(config.softmax_layers)
        layers = [
            DynamicLayer() if i in softmax_layers else LinearStateLayer() for i in range(config.num_hidden_layers)
        ]
        super().__init__(layers=layers)
        self.config_fingerprint = config_fingerprint(config)

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(NO_CROP)

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        """Batch size of the stored states, or -1 before the first forward."""
        for layer in self.layers:
            if isinstance(layer, LinearStateLayer) and layer.state is not None:
                return layer.batch_size
            if isinstance(layer, DynamicLayer) and layer.keys is not None and layer.keys.numel():
                return layer.keys.shape[0]
        return -1

    def nbytes(self) -> int:
        """Bytes held by every tensor of the cache."""
        total = 0
        for layer in self.layers:
            if isinstance(layer, LinearStateLayer):
                total += layer.nbytes()
            elif layer.keys is not None:
                total += layer.keys.numel() * layer.keys.element_size()
                total += layer.values.numel() * layer.values.element_size()
        return total


__all__ = ["LinearAttentionCache", "LinearStateLayer", "config_fingerprint"]
