"""LinearAttentionCache: the decode cache of a linear-attention model, constant in size.

Per layer it holds what the next token needs and nothing that grows with the context, in one class per layer kind
(`state_layer` picks it by `config.layer_kind`): `LinearStateLayer` (linear and delta-rule layers), `WindowStateLayer`
(the window hybrid), `SparseWindowStateLayer` (with its sparse memory), `DeltaWindowStateLayer` (the delta rule behind
a window), each holding only the tensors of its kind:

- linear layers: the recurrent state S (and z as its last column when normalised),
  fp32 `[B, H, K, V (+1)]`; with `update_rule="delta"` the delta-rule state S, fp32 `[B, H, K, V]`;
- layers with a short convolution (`conv_size` = W > 0): also its last W − 1 inputs (the q/k/v
  projections, pads zeroed) `[B, W − 1, C]` in the model dtype, C = (H + 2 H_kv) · D;
- window-hybrid layers: the same state for every token folded into the linear part, plus the raw
  keys/values of the sinks and of the last `window_size` positions, `[B, R, H_kv, D]` with
  R = S + w (S = num_sink_tokens sink slots, then a ring of w = window_size slots holding position q in
  slot S + q mod w), and a bool mask `[B, R]` of which slots hold real keys (no key features: φ(k) is a function
  of the stored key, so the layer recomputes it for the keys it folds, the one leaving the window at a decode step
  or the retained ones in front of a prefill);
- window-hybrid layers with a sparse memory (`sparse_cache_size` = m > 0, `ops_sparse_memory`): `state` is
  then the actual linear state (the keys folded at past block ends, decayed to the last position), the ring
  holds w = window_size + R positions (R = `MEMORY_BLOCK_SIZE`: the tokens that left the window during the
  current block stay raw until it ends) with their log decays (fp32 `window_log_decay` `[B, S + w, H, 1 | F]`,
  absent without decay), plus m slots per KV head: keys and values `[B, H_kv, m, D]` in the model dtype (no
  key features: the layer recomputes φ from a slot's key when it needs them), recall errors (fp32) and absolute
  positions (long) `[B, H_kv, m]`, the log decay each slot has accumulated since its token left the window (fp32
  `[B, H, m, 1 | F]`, absent without decay) and a bool mask `[B, H_kv, m]`;
- delta-rule window-hybrid layers (`update_rule="delta"`, `window_size` > 0): `state` is the delta-rule state of
  the tokens that have left the window, fp32 `[B, H, K, V]`; the ring is the window hybrid's (the layer recomputes
  k̂, the L2-normalised φ(k), of the keys that leave), plus each slot's write strength β (fp32 `window_beta`
  `[B, S + w, H]`, 0 in the sink slots): what a token needs to enter the state when it leaves the window;
- layers with softmax heads (`config.softmax_heads`): their kind's state (over every head) plus the growing keys and
  values of those KV heads `[B, n, T_seen, D]` (`SoftmaxHeadsState`, the `*WithSoftmaxHeads` classes);
- full-softmax layers (`config.softmax_layers`): an ordinary growing K/V (transformers' `DynamicLayer`, appending in
  place into a buffer with room ahead: `GrowingLayer`); with the softmax heads, the only parts whose size depends
  on the context.

Every layer counts the positions it has seen, so `get_seq_length()` is right for `generate()`'s
cache-reuse slicing even when no layer is a softmax layer (transformers' own recurrent cache layers
count no tokens, so a cache made only of them cannot tell). A recurrent state cannot be
rolled back: `crop` raises, and the model refuses assisted decoding.

Shapes are fixed after the first write and every update is in place (the position counter is a 0-d tensor),
so the cache is compileable (`is_compileable`) unless a layer is a softmax layer or has softmax heads.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicLayer

from .ops_sparse_memory import MEMORY_BLOCK_SIZE, SparseMemory

NO_CROP = (
    "A linear-attention cache holds a recurrent state that cannot be rolled back to an earlier "
    "position, so it cannot be cropped (this also rules out assisted / speculative decoding)."
)

# The cache attribute holding each field of a `SparseMemory`.
MEMORY_FIELDS = {field: f"memory_{field}" for field in SparseMemory._fields}


class LinearStateLayer(CacheLayerMixin):
    """Cache of one layer with a recurrent state and no window (additive linear attention or the delta rule): the
    state, and with a short convolution its last inputs. The window kinds extend it. See the module docstring for
    shapes.

    Every tensor is allocated by the layer's first write and updated in place afterwards (a decode step changes
    no shape and no address), so a compiled decode step, or a CUDA graph of it, reads and writes the same
    buffers at every step. Only `batch_repeat_interleave` / `batch_select_indices`, which change the batch size,
    allocate anew.
    """

    is_compileable = True
    is_croppable = False
    # The tensors a layer of this kind can hold (each None until its first write), by attribute name.
    TENSORS: tuple[str, ...] = ("state", "conv_inputs")

    def __init__(self) -> None:
        super().__init__()
        for name in self.TENSORS:
            setattr(self, name, None)
        # Positions seen (pads included), a 0-d tensor so that a compiled step reads and advances it without a
        # host sync or a recompilation; `get_seq_length()` reads it as an int.
        self.seen: torch.Tensor | None = None

    @property
    def has_state(self) -> bool:
        """Whether a forward has filled the layer (a prefill, then decode steps, continue from it)."""
        return self.state is not None

    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors this layer holds, by attribute name (only those that exist yet; not the position counter)."""
        return {name: getattr(self, name) for name in self.TENSORS if getattr(self, name) is not None}

    def _map(self, fn) -> None:
        for name, tensor in self.tensors().items():
            setattr(self, name, fn(tensor))

    def lazy_initialization(self, *args, **kwargs) -> None:
        """Nothing to pre-allocate: the first write allocates each tensor (`_write`)."""

    def update(self, *args, **kwargs):
        raise TypeError(
            "LinearStateLayer holds a recurrent state, not a key/value list; the linear-attention layer "
            "stores it through `store_state` / `advance`."
        )

    def _write(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """Store `value` as the tensor `name`: copied in place into the existing one, or, on the first write (or
        after a batch-size change), kept as the new buffer. Returns the stored tensor."""
        current = getattr(self, name)
        if current is not None and current.shape == value.shape and current.device == value.device:
            return current.copy_(value)
        if not torch.compiler.is_compiling():  # a fixed address: CUDA graphs may capture steps that write it
            torch._dynamo.mark_static_address(value)
        setattr(self, name, value)
        return value

    def store_state(self, state: torch.Tensor) -> None:
        """Keep the recurrent state a forward ended with (the op's final state)."""
        self._write("state", state)

    def store_conv_inputs(self, inputs: torch.Tensor) -> None:
        """Keep the short convolution's last W − 1 inputs `[B, W − 1, C]`."""
        self._write("conv_inputs", inputs)

    def advance(self, num_new_tokens: int, device: torch.device) -> None:
        """Count `num_new_tokens` more positions (in place)."""
        if self.seen is None:
            self.seen = torch.zeros((), dtype=torch.long, device=device)
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(self.seen)
        self.seen.add_(num_new_tokens)
        self.is_initialized = True

    def get_seq_length(self) -> int:
        return 0 if self.seen is None else int(self.seen)

    def get_max_length(self) -> int:
        return -1  # no limit: the state does not grow

    def get_max_cache_shape(self) -> int:  # name used by transformers < 5.13
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def reset(self) -> None:
        for name in self.TENSORS:
            setattr(self, name, None)
        self.seen = None
        self.is_initialized = False

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for tensor in self.tensors().values():  # in place: the buffers keep their addresses
            tensor.copy_(tensor.index_select(0, beam_idx.to(tensor.device)))

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


class LeavingToken(NamedTuple):
    """What a decode step's push returns of the token leaving the window (the slot's previous contents): keys,
    values `[B, 1, H_kv, D]`, and `real` `[B, 1]` (a real token that is not a sink: it enters the state)."""

    keys: torch.Tensor
    values: torch.Tensor
    real: torch.Tensor


class WindowStateLayer(LinearStateLayer):
    """Cache of one additive window-hybrid layer: the linear state of every token that has left the window, plus the
    raw keys and values of the sinks and of the last `ring_size` positions in fixed slots (`[B, S + ring_size, H_kv,
    D]`: S sink slots, then position q in ring slot S + q mod ring_size) and which slots hold real keys. The window
    kinds with more per-position data (the sparse memory, the delta rule) extend it."""

    TENSORS = (*LinearStateLayer.TENSORS, "window_keys", "window_values", "window_mask")
    # Per-position tensors the ring keeps beside keys and values (subclasses): each is 0 in the sink slots.
    PER_POSITION: tuple[str, ...] = ()

    def __init__(self, window_size: int, num_sink_tokens: int) -> None:
        super().__init__()
        self.window_size, self.num_sink_tokens = window_size, num_sink_tokens
        self.ring_size = window_size  # the raw positions kept (the sparse memory keeps a block more)
        # Whether every row's sink slots hold a token (eager bookkeeping: a decode step then skips the sink update).
        self.sinks_filled = False

    def reset(self) -> None:
        super().reset()
        self.sinks_filled = False

    def retained(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The retained keys, values `[B, S + w, H_kv, D]` and mask `[B, S + w]` in sequence order (w = ring_size): the
        S sink slots first, then the positions p − w .. p − 1 oldest first (p = positions seen), as the window ops
        take them in front of new tokens."""
        return tuple(self._in_sequence_order(x) for x in (self.window_keys, self.window_values, self.window_mask))

    def slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What a decode step's softmax row covers, in slot order (after `push`): the keys, values `[B, S + w, H_kv,
        D]` and which slots it attends to `[B, S + w]` (those holding real keys)."""
        return self.window_keys, self.window_values, self.window_mask

    def _in_sequence_order(self, slots: torch.Tensor) -> torch.Tensor:
        """Sink slots then ring slots `[B, S + w, ...]` in sequence order (ring slot S + q mod w holds position q)."""
        sinks = slots.shape[1] - self.ring_size
        shift = -(self.get_seq_length() % self.ring_size)
        return torch.cat([slots[:, :sinks], slots[:, sinks:].roll(shift, dims=1)], dim=1)

    def store_window(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> None:
        """Keep, of keys/values `[B, L, H_kv, D]` and mask `[B, L]` (the retained tokens in sequence order, if any,
        followed by the new ones), the sinks and the last positions: `_store_ring`. Call after `advance`."""
        self._store_ring(keys, values, mask, {})

    def _store_ring(
        self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, per_position: dict[str, torch.Tensor]
    ) -> None:
        """Keep the sinks (first `num_sink_tokens` real tokens) in the sink slots and the last `ring_size` positions
        (pads included, as masked slots: the window counts positions, so a decode step sees a hole where the full
        forward does) in the ring, whose slot S + q mod w holds position q. A sink is kept in its sink slot only (its
        ring slot is masked). Everything else has been folded into the state by the caller. `per_position` holds
        the kind's PER_POSITION tensors `[B, L, ...]` (fp32), kept in the ring slots beside the keys."""
        batch, length = mask.shape
        sinks, window = self.num_sink_tokens, self.ring_size
        rank = mask.long().cumsum(-1) - 1
        is_sink = mask & (rank < sinks)
        ring = (keys, values, mask & ~is_sink, *per_position.values())
        if length < window:  # fewer positions than the window: empty (masked) slots stand for those before
            ring = tuple(torch.cat([x.new_zeros(batch, window - length, *x.shape[2:]), x], dim=1) for x in ring)
        shift = self.get_seq_length() % window  # the last w positions end at p − 1 (p = positions seen now)
        ring = tuple(x[:, x.shape[1] - window :].roll(shift, dims=1) for x in ring)
        # Sink slot s holds the real token of rank s, where one exists yet (retained sinks are among the inputs).
        hit = is_sink[:, :, None] & (rank[:, :, None] == torch.arange(sinks, device=mask.device))  # [B, L, S]
        found, index = hit.any(1), hit.long().argmax(1)  # [B, S]
        sink_slots = []
        for x in (keys, values):
            shape = (batch, sinks, *[1] * (x.dim() - 2))
            picked = x.gather(1, index.view(shape).expand(-1, -1, *x.shape[2:]))
            sink_slots.append(torch.where(found.view(shape), picked, 0.0))
        sink_slots.append(found)
        for x in ring[3:]:  # the per-position tensors: zero in the sink slots (a sink never leaves)
            sink_slots.append(x.new_zeros(batch, sinks, *x.shape[2:]))
        names = ("window_keys", "window_values", "window_mask", *per_position)
        for name, sink_part, ring_part in zip(names, sink_slots, ring, strict=True):
            self._write(name, torch.cat([sink_part, ring_part], dim=1))
        self.sinks_filled = not torch.compiler.is_compiling() and bool(found.all())

    def push(self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor | None) -> LeavingToken:
        """One decode step of the window, in place and fixed-shape: the token at position p (keys/values
        `[B, 1, H_kv, D]`, real bool `[B, 1]`, or None when every row's token is real) replaces position p − w in ring
        slot S + p mod w, and a real token of rank < S also fills the next free sink slot (its ring slot is then
        masked; eager steps skip this once every sink slot is filled). Returns the token leaving the window. Call
        before `advance`."""
        return self._push_at(self._slot(), keys, values, real)

    def _push_at(
        self, slot: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor | None
    ) -> LeavingToken:
        """`push` into ring slot `slot` (`[1]`, `_slot`: kinds writing more per position compute it once)."""
        leaving = LeavingToken(self.window_keys.index_select(1, slot), self.window_values.index_select(1, slot),
                               self.window_mask.index_select(1, slot))
        sinks = self.num_sink_tokens
        in_ring = real
        if sinks and not self.sinks_filled:
            if real is None:
                real = torch.ones(keys.shape[0], 1, dtype=torch.bool, device=keys.device)
            filled = self.window_mask[:, :sinks].sum(-1, keepdim=True)  # [B, 1]: sinks so far, filled in order
            sink = real & (filled < sinks)
            hit = sink & (torch.arange(sinks, device=real.device) == filled)  # [B, S]
            for buffer, x in ((self.window_keys, keys), (self.window_values, values)):
                buffer[:, :sinks].copy_(torch.where(hit[:, :, None, None], x, buffer[:, :sinks]))
            self.window_mask[:, :sinks] |= hit
            in_ring = real & ~sink
            if not torch.compiler.is_compiling():
                self.sinks_filled = bool(self.window_mask[:, :sinks].all())
        self.window_keys.index_copy_(1, slot, keys)
        self.window_values.index_copy_(1, slot, values)
        if in_ring is None:
            self.window_mask.index_fill_(1, slot, True)
        else:
            self.window_mask.index_copy_(1, slot, in_ring)
        return leaving

    def _slot(self) -> torch.Tensor:
        """The ring slot of the position being decoded, `[1]` (a tensor: the same graph at every step)."""
        return (self.num_sink_tokens + self.seen % self.ring_size).view(1)


class DeltaWindowStateLayer(WindowStateLayer):
    """Cache of one delta-rule window layer: the delta-rule state of the tokens that have left the window, the window
    hybrid's slots, and each slot's write strength β (fp32 `window_beta` `[B, S + w, H]`, 0 in the sink slots): what a
    token needs to enter the state when it leaves the window."""

    TENSORS = (*WindowStateLayer.TENSORS, "window_beta")
    PER_POSITION = ("window_beta",)

    def retained_beta(self) -> torch.Tensor:
        """The retained slots' β `[B, S + w, H]` in the order of `retained`."""
        return self._in_sequence_order(self.window_beta)

    def store_window(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     beta: torch.Tensor) -> None:
        """`WindowStateLayer.store_window`, keeping each position's β `[B, L, H]` too."""
        self._store_ring(keys, values, mask, {"window_beta": beta.float()})

    def push(self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor | None,
             beta: torch.Tensor) -> tuple[LeavingToken, torch.Tensor]:
        """`WindowStateLayer.push` writing the token's β `[B, 1, H]` too; also returns the leaving token's β
        `[B, 1, H]`, the strength it enters the state with."""
        slot = self._slot()
        leaving_beta = self.window_beta.index_select(1, slot)
        self.window_beta.index_copy_(1, slot, beta.float())
        return self._push_at(slot, keys, values, real), leaving_beta


class MemoryBlock(NamedTuple):
    """What the sparse memory's block end reads of the cache (`SparseWindowStateLayer.ending_block`): the R ring
    tokens that left the window during the block, oldest first: keys `[B, R, H_kv, D]`, values `[B, H_kv, R, V]`,
    their log decay since leaving (None without decay, else `[B, H, R, 1 | F]`), absolute positions `[B, H_kv, R]`,
    whether each holds a real token `[B, H_kv, R]`; and the memory slots."""

    keys: torch.Tensor
    values: torch.Tensor
    log_decay: torch.Tensor | None
    positions: torch.Tensor
    valid: torch.Tensor
    memory: SparseMemory


class SparseWindowStateLayer(WindowStateLayer):
    """Cache of one window-hybrid layer with the sparse exact memory (`sparse_cache_size` = m > 0): `state` is the
    actual linear state; the ring holds window_size + R positions (R = MEMORY_BLOCK_SIZE: the tokens that left the
    window during the current block stay raw until it ends) with their log decays (fp32 `window_log_decay`, only with
    a decay), and the m memory slots per KV head (`SparseMemory`'s fields as `memory_*`)."""

    TENSORS = (*WindowStateLayer.TENSORS, "window_log_decay", *MEMORY_FIELDS.values())

    def __init__(self, window_size: int, num_sink_tokens: int) -> None:
        super().__init__(window_size, num_sink_tokens)
        self.ring_size = window_size + MEMORY_BLOCK_SIZE

    def retained_log_decay(self) -> torch.Tensor:
        """The retained slots' log decays `[B, S + w, H, 1 | F]` (fp32, 0 at the sink slots) in the order of
        `retained`: they decay the folds of the tokens that left during a block."""
        return self._in_sequence_order(self.window_log_decay)

    def store_window(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     log_decay: torch.Tensor | None) -> None:
        """`WindowStateLayer.store_window`, keeping each position's log decay (`[B, L, H]` or `[B, L, H, F]`) too."""
        per_position = {}
        if log_decay is not None:
            per_position["window_log_decay"] = (log_decay if log_decay.dim() == 4 else log_decay[..., None]).float()
        self._store_ring(keys, values, mask, per_position)

    def push(self, keys: torch.Tensor, values: torch.Tensor, real: torch.Tensor | None,
             log_decay: torch.Tensor | None) -> LeavingToken:
        """`WindowStateLayer.push` writing the token's log decay (`[B, 1, H]` or `[B, 1, H, F]`) too, and decaying the
        memory slots' clocks by it."""
        slot = self._slot()
        leaving = self._push_at(slot, keys, values, real)
        if log_decay is not None:
            self.window_log_decay.index_copy_(1, slot, log_decay.view(self.window_log_decay[:, :1].shape).float())
        return leaving

    def decay_memory(self, log_decay: torch.Tensor) -> None:
        """Advance the memory slots' log decay since leaving by one step's log a `[B, H, 1 | F]` (with a decay)."""
        if self.memory_log_decay is not None:
            self.memory_log_decay.add_(log_decay.float().view(*self.memory_log_decay.shape[:2], 1, -1))

    def slots(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`WindowStateLayer.slots`, attending at the position being decoded to the real sinks and the real ring
        tokens from the block start's window on only (those that left the window before the block are in the state
        or the memory, which the step reads beside the slots)."""
        position = self.seen
        sinks, ring = self.num_sink_tokens, self.ring_size
        slots = torch.arange(ring, device=position.device)
        slot_positions = position - (position - slots) % ring
        current = slot_positions >= position - position % MEMORY_BLOCK_SIZE - self.window_size
        mask = torch.cat([self.window_mask[:, :sinks], self.window_mask[:, sinks:] & current], dim=1)
        return self.window_keys, self.window_values, mask

    def memory(self) -> SparseMemory | None:
        """The memory slots (None before the first write; positions absolute)."""
        if self.memory_mask is None:
            return None
        return SparseMemory(**{field: getattr(self, name) for field, name in MEMORY_FIELDS.items()})

    def store_memory(self, memory: SparseMemory, where: torch.Tensor | None = None) -> None:
        """Keep `memory` (in place after the first write); with `where` (a bool 0-d tensor, the decode step's
        block end) only if it holds, without a host sync."""
        for field, name in MEMORY_FIELDS.items():
            value = getattr(memory, field)
            if value is not None:
                current = getattr(self, name)
                self._write(name, value if where is None else torch.where(where, value.to(current.dtype), current))

    def ending_block(self, position: torch.Tensor) -> MemoryBlock:
        """The block end's candidates after the query at `position` (0-d): the memory and the R ring tokens that left
        the window during the block, the oldest R slots (positions position − ring + 1 ..)."""
        sinks, window, block, ring = self.num_sink_tokens, self.window_size, MEMORY_BLOCK_SIZE, self.ring_size
        order = sinks + (position + 1 + torch.arange(ring, device=position.device)) % ring  # oldest first
        candidates = order[:block]
        since = None  # log decay since leaving: Σ over the slots from u + W + 1 on (oldest first)
        if self.window_log_decay is not None:
            steps = torch.nn.functional.pad(self.window_log_decay.index_select(1, order), (0, 0, 0, 0, 0, 1))
            since = steps.flip(1).cumsum(1).flip(1)[:, window + 1 : window + 1 + block].transpose(1, 2)
        memory = self.memory()
        b, kv_heads = memory.mask.shape[:2]
        positions = (position - ring + 1 + torch.arange(block, device=position.device)).expand(b, kv_heads, -1)
        return MemoryBlock(
            keys=self.window_keys.index_select(1, candidates),
            values=self.window_values.index_select(1, candidates).transpose(1, 2),
            log_decay=since, positions=positions,
            valid=self.window_mask.index_select(1, candidates)[:, None].expand(-1, kv_heads, -1), memory=memory,
        )

    def store_block(self, state: torch.Tensor, memory: SparseMemory, where: torch.Tensor) -> None:
        """Keep the block end's state and memory where `where` (0-d bool: the step ends a block) holds."""
        self.state.copy_(torch.where(where, state, self.state))
        self.store_memory(memory, where=where)


def appended(
    past: torch.Tensor | None, new: torch.Tensor, buffer: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`past` [B, n, T_past, D] (None or empty: nothing yet) with `new` [B, n, T, D] appended along the positions:
    (the result [B, n, T_past + T, D], the buffer it is a view of). The result is the first T_past + T positions of
    a buffer with room ahead, so a decode step writes its token in place instead of copying every cached one, as
    torch.cat does (O(context) per token: at 16K tokens most of a decode step's softmax time). When `past` is not
    the prefix of `buffer` (the first call, or after a beam reorder or batch change replaced it) or the buffer is
    full, a new one with an eighth more room (at least 256 positions) is allocated and `past` copied in. Under
    autograd, which may have saved `past`, it concatenates instead."""
    if past is None or past.numel() == 0:
        past = new[:, :, :0]
    if torch.is_grad_enabled() and (past.requires_grad or new.requires_grad):
        return torch.cat([past, new], dim=2), None
    n, t = past.shape[2], new.shape[2]
    prefix = (buffer is not None and past._base is buffer and past.data_ptr() == buffer.data_ptr()
              and past.stride() == buffer.stride() and past.shape[:2] == buffer.shape[:2])
    if not prefix or buffer.shape[2] < n + t:
        buffer = new.new_empty(*new.shape[:2], n + t + max((n + t) // 8, 256), new.shape[3])
        buffer[:, :, :n] = past
    buffer[:, :, n:n + t] = new
    return buffer[:, :, :n + t], buffer


class GrowingLayer(DynamicLayer):
    """transformers' `DynamicLayer` (a softmax layer's growing keys and values `[B, H_kv, T_seen, D]`) whose `update`
    appends in place into a buffer with room ahead (`appended`) instead of concatenating: the same tensors, without
    copying the whole cache at every decode step."""

    key_buffer: torch.Tensor | None = None
    value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.key_buffer = appended(self.keys, key_states, self.key_buffer)
        self.values, self.value_buffer = appended(self.values, value_states, self.value_buffer)
        return self.keys, self.values

    def reset(self) -> None:
        self.key_buffer = self.value_buffer = None
        super().reset()


class SoftmaxHeadsState:
    """The growing keys and values of a layer's softmax heads (`config.softmax_heads`), beside its kind's state: the
    `*WithSoftmaxHeads` classes below combine it with each state class. `head_keys`, `head_values` `[B, n, T_seen, D]`
    (n: the layer's softmax KV heads, in the model dtype) grow at every call, so such a layer is not compileable;
    beam search, batch changes, `reset` and `nbytes` treat them as the kind's tensors (they are in `TENSORS`)."""

    is_compileable = False
    SOFTMAX_HEAD_TENSORS = ("head_keys", "head_values")
    head_key_buffer: torch.Tensor | None = None  # what head_keys / head_values are views of (`appended`)
    head_value_buffer: torch.Tensor | None = None

    def update_softmax_heads(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new tokens' keys and values `[B, n, T, D]` (in place, `appended`); returns every one seen,
        `[B, n, past + T, D]`."""
        self.head_keys, self.head_key_buffer = appended(self.head_keys, keys, self.head_key_buffer)
        self.head_values, self.head_value_buffer = appended(self.head_values, values, self.head_value_buffer)
        return self.head_keys, self.head_values

    def reset(self) -> None:
        self.head_key_buffer = self.head_value_buffer = None
        super().reset()


class LinearStateLayerWithSoftmaxHeads(SoftmaxHeadsState, LinearStateLayer):
    """`LinearStateLayer` and the growing keys and values of the layer's softmax heads (`SoftmaxHeadsState`)."""

    TENSORS = (*LinearStateLayer.TENSORS, *SoftmaxHeadsState.SOFTMAX_HEAD_TENSORS)


class WindowStateLayerWithSoftmaxHeads(SoftmaxHeadsState, WindowStateLayer):
    """`WindowStateLayer` and the growing keys and values of the layer's softmax heads (`SoftmaxHeadsState`)."""

    TENSORS = (*WindowStateLayer.TENSORS, *SoftmaxHeadsState.SOFTMAX_HEAD_TENSORS)


class SparseWindowStateLayerWithSoftmaxHeads(SoftmaxHeadsState, SparseWindowStateLayer):
    """`SparseWindowStateLayer` and the growing keys and values of the layer's softmax heads (`SoftmaxHeadsState`)."""

    TENSORS = (*SparseWindowStateLayer.TENSORS, *SoftmaxHeadsState.SOFTMAX_HEAD_TENSORS)


class DeltaWindowStateLayerWithSoftmaxHeads(SoftmaxHeadsState, DeltaWindowStateLayer):
    """`DeltaWindowStateLayer` and the growing keys and values of the layer's softmax heads (`SoftmaxHeadsState`)."""

    TENSORS = (*DeltaWindowStateLayer.TENSORS, *SoftmaxHeadsState.SOFTMAX_HEAD_TENSORS)


# The state class of each layer with softmax heads, by the state class of its kind.
WITH_SOFTMAX_HEADS = {
    LinearStateLayer: LinearStateLayerWithSoftmaxHeads,
    WindowStateLayer: WindowStateLayerWithSoftmaxHeads,
    SparseWindowStateLayer: SparseWindowStateLayerWithSoftmaxHeads,
    DeltaWindowStateLayer: DeltaWindowStateLayerWithSoftmaxHeads,
}


def state_layer(config, layer_idx: int) -> CacheLayerMixin:
    """The cache layer of decoder layer `layer_idx`, by its kind (`config.layer_kind`): transformers' growing
    `DynamicLayer` for softmax layers, else the constant-size state of the kind, with the growing keys and values of
    its softmax heads when it has some (`config.softmax_heads`)."""
    kind = config.layer_kind(layer_idx)
    if kind == "softmax":
        return GrowingLayer()
    if kind == "window" and config.sparse_cache_size > 0:
        cls, window = SparseWindowStateLayer, True
    elif kind in ("window", "delta_window"):
        cls, window = (WindowStateLayer if kind == "window" else DeltaWindowStateLayer), True
    else:
        cls, window = LinearStateLayer, False
    if config.softmax_heads_of(layer_idx):
        cls = WITH_SOFTMAX_HEADS[cls]
    return cls(config.window_size, config.num_sink_tokens) if window else cls()


# The config fields that decide what a cache holds and how the model reads it: the layer kinds, the state's
# layout (heads, head and feature sizes, normaliser column, convolution inputs) and its meaning (feature map,
# decay, update rule, window, sinks). A cache built for a config that differs in any of them would be read as
# garbage, so the model refuses it. (output_norm and output_gate act on the output only, softmax_log_length_scale on
# the queries only: not listed.)
FINGERPRINT_FIELDS = (
    "num_hidden_layers", "softmax_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "feature_map", "feature_dim", "decay", "normalize", "window_size", "num_sink_tokens", "update_rule",
    "conv_size", "sparse_cache_size", "softmax_heads",
)


def config_fingerprint(config) -> dict:
    """The values of FINGERPRINT_FIELDS in `config` (lists as sorted tuples, so equal configs compare equal)."""
    values = {name: getattr(config, name, None) for name in FINGERPRINT_FIELDS}
    values["softmax_layers"] = tuple(sorted(values["softmax_layers"] or ()))
    values["softmax_heads"] = tuple((layer, tuple(heads)) for layer, heads in (values["softmax_heads"] or {}).items())
    return values


class LinearAttentionCache(Cache):
    """The cache `generate()` uses for `LinearAttentionForCausalLM` (built automatically).

    Build one yourself with `LinearAttentionCache(model.config)` to reuse it across calls: pass it
    as `cache=` (or `past_key_values=`) together with the *full* token sequence and its full
    attention mask; already-seen tokens are skipped. `nbytes()` is its size in bytes.
    """

    is_linear_attention_cache = True  # duck-typing marker: checkpoints loaded as remote code have their own class

    def __init__(self, config) -> None:
        super().__init__(layers=[state_layer(config, i) for i in range(config.num_hidden_layers)])
        self.config_fingerprint = config_fingerprint(config)

    def crop(self, max_length: int) -> None:
        raise NotImplementedError(NO_CROP)

    @property
    def is_croppable(self) -> bool:
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


__all__ = [
    "DeltaWindowStateLayer", "LinearAttentionCache", "LinearStateLayer", "SoftmaxHeadsState", "SparseWindowStateLayer",
    "WindowStateLayer", "config_fingerprint",
]
