"""etmlx's attention for transformers models: the model's own forward runs unchanged, etmlx owns the KV cache
and the attention mask.

transformers routes every modern model's attention through two interfaces, and etmlx plugs into both:
- the cache: the model calls `past_key_values.update(k, v, layer_idx)` and attends over what it returns.
  `ProgramCache` writes the new keys/values into the program's cache buffers (mutable buffers of the exported
  program) at each row's own positions and returns the whole cache of that layer;
- the attention function (`AttentionInterface`, registered as "etmlx"): `etmlx_attention` masks by position
  (causal, per row, and the layer's sliding window when it has one), applies soft-capping when the layer asks
  for it, and calls scaled_dot_product_attention, which the delegate lowers to MLX's fused kernel.

Rows are independent sequences at their own positions (`positions [B, L]`), so a server can decode rows that
started at different times in one call. A model whose attention skips the interface (Falcon) attends with its
own code over the returned cache, under the additive mask StaticCacheLM passes as `attention_mask`.

Anything the attention is asked to do that is not implemented here (attention sinks, bidirectional attention,
...) is refused by name: the model would otherwise run, and decode wrong tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache

import backends.mlx.custom_kernel_ops  # noqa: F401  (registers mlx::quantized_sdpa)
from backends.mlx.custom_kernel_ops.quantized_attention import dequantize_cache
from backends.mlx.llm.decoder import kv_quant

IMPLEMENTATION = "etmlx"

# Keywords models pass to the attention function that do not change its result in inference.
_NEUTRAL = {"dropout", "position_ids", "cache_position", "use_cache", "output_attentions", "past_key_values",
            "position_embeddings", "attention_mask", "layer_idx", "sliding_window", "softcap", "scaling",
            "is_causal", "return_dict", "output_hidden_states", "logits_to_keep", "output_router_logits"}


@dataclass
class LayerShape:
    """What the probe run saw of one layer's attention."""
    kv_heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    window: Optional[int] = None  # sliding window (keys within `window` positions of the query), None: full
    attended: bool = False  # the layer called etmlx_attention (False: the model has attention code of its own)
    softcap: Optional[float] = None  # tanh soft-capping of the scores (Gemma 2)
    # attention got the keys and values the cache returned, unchanged (False: the model computes its keys from the
    # cached tensors, as multi-head latent attention does; a quantized cache then cannot stand in for them)
    attends_cache: bool = True


@dataclass
class ForwardState:
    """One forward's positions, shared by every layer; the masks are built once per window size."""
    positions: torch.Tensor  # [B, L] int64, the cache position of each token
    probe: Optional[dict] = None  # layer index -> LayerShape, filled by a probe run instead of caching
    lengths: Optional[torch.Tensor] = None  # [B] real tokens per row (None: all L are real)
    # [B, G] token indices whose logits the head gets (speculative verification: the last accepted token and
    # the drafts after it); None: each row's last real token (lengths - 1), or every token without lengths
    gather: Optional[torch.Tensor] = None
    # [B, L] the last key position each query sees (image_blocks.py: an image token sees its whole image); None:
    # its own position (causal)
    image_limits: Optional[torch.Tensor] = None
    masks: dict = field(default_factory=dict)
    key_positions: dict = field(default_factory=dict)  # ring layer -> [B, W + L] position of each key
    # layer -> its quantized keys and values to attend over (k, k_scales, k_biases, v, v_scales, v_biases)
    quantized: dict = field(default_factory=dict)
    returned: dict = field(default_factory=dict)  # probe: layer -> the (key, value) the cache returned

    def last_positions(self) -> torch.Tensor:
        """[B, 1]: each row's last real token's position."""
        if self.lengths is None:
            return self.positions[:, -1:]
        return self.positions[:, :1] + self.lengths.view(-1, 1) - 1


_ACTIVE: list = []  # the StaticCacheLM forward in progress (a stack: forwards do not nest, but stay safe)


def active() -> "ProgramCache":
    if not _ACTIVE:
        raise RuntimeError("etmlx attention runs only inside StaticCacheLM.forward")
    return _ACTIVE[-1]


class ProgramCache(Cache):
    """The `past_key_values` transformers sees: per-layer key/value buffers owned by StaticCacheLM."""

    def __init__(self, owner, state: ForwardState):
        # No Cache.__init__: its layer objects would allocate their own tensors; every method the decoder
        # models call is implemented here.
        self.layers = []
        self.owner, self.state = owner, state

    def __enter__(self):
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc):
        _ACTIVE.pop()

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0  # positions come from position_ids, never from the cache

    @property
    def is_compileable(self) -> bool:
        return False

    def update(self, key, value, layer_idx, cache_kwargs=None):
        state = self.state
        if state.probe is not None:
            state.probe.setdefault(layer_idx, LayerShape(key.shape[1], key.shape[-1], value.shape[-1], key.dtype))
            state.returned[layer_idx] = (key, value)
            return key, value
        k_cache, v_cache = self.owner.layer_cache(layer_idx)
        if self.owner.kv_quant is not None:
            return self._update_quantized(layer_idx, key, value, k_cache, v_cache)
        if self.owner.ring_window(layer_idx) is not None:
            return self._update_ring(layer_idx, key, value, k_cache, v_cache)
        batch, heads, length, _ = key.shape
        slots = state.positions.view(batch, 1, length, 1)
        k_cache.scatter_(2, slots.expand(batch, heads, length, key.shape[-1]), key.to(k_cache.dtype))
        v_cache.scatter_(2, slots.expand(batch, heads, length, value.shape[-1]), value.to(v_cache.dtype))
        return k_cache, v_cache

    def _update_ring(self, layer_idx, key, value, k_ring, v_ring):
        """A sliding-window layer's cache is a ring of `window` slots: slot j holds the latest position
        p = j (mod window). Attention runs over the ring as it was plus the new keys (so a prefill longer than
        the window still sees every key it should), then each slot takes the latest real position written."""
        state = self.state
        window = k_ring.shape[2]
        start = state.positions[:, :1]  # [B, 1]
        slot = torch.arange(window).view(1, -1)
        held = start - 1 - torch.remainder(start - 1 - slot, window)  # [B, W]: position in slot j (< 0: empty)
        state.key_positions[layer_idx] = torch.cat([held, state.positions], dim=1)
        keys = torch.cat([k_ring, key.to(k_ring.dtype)], dim=2)
        values = torch.cat([v_ring, value.to(v_ring.dtype)], dim=2)
        last = state.last_positions()  # [B, 1]: the last real token's position (padding is never kept)
        latest = last - torch.remainder(last - slot, window)  # [B, W]: the position slot j keeps
        from_new = (latest >= start).view(latest.shape[0], 1, window, 1)
        index = (latest - start).clamp(min=0).view(latest.shape[0], 1, window, 1)
        # Every slot is rewritten (a scatter over all of them: the mutation form the exporter keeps in place),
        # from the new keys where its position is new, else as it was.
        every = slot.view(1, 1, window, 1)
        for ring, new in ((k_ring, key.to(k_ring.dtype)), (v_ring, value.to(v_ring.dtype))):
            shape = (new.shape[0], new.shape[1], window, new.shape[-1])
            kept = torch.where(from_new, new.gather(2, index.expand(shape)), ring)
            ring.scatter_(2, every.expand(shape), kept)
        return keys, values

    def _update_quantized(self, layer_idx, key, value, k_parts, v_parts):
        """The quantized cache (kv_quant.py): the new keys and values are quantized, written as _update_ring or
        the full cache's scatter writes floats, and attention (etmlx_attention) reads the layer's packed keys and
        values from `state.quantized`. transformers gets the new float keys and values back, unused by etmlx's
        attention."""
        state, setting = self.state, self.owner.kv_quant
        if self.owner.pinned_entries is not None:
            parts = self._pinned(layer_idx, key, value)
        else:
            parts = [kv_quant.quantize(t, setting, k_parts[1].dtype) for t in (key, value)]
        if self.owner.ring_window(layer_idx) is not None:
            window = k_parts[0].shape[2]
            start = state.positions[:, :1]
            slot = torch.arange(window).view(1, -1)
            held = start - 1 - torch.remainder(start - 1 - slot, window)
            state.key_positions[layer_idx] = torch.cat([held, state.positions], dim=1)
            # Attention over the ring as it was plus the new entries, then each slot keeps its latest position.
            state.quantized[layer_idx] = [torch.cat([old, new], dim=2) for kind, new_kind in zip((k_parts, v_parts),
                                                                                                   parts)
                                          for old, new in zip(kind, new_kind)]
            last = state.last_positions()
            latest = last - torch.remainder(last - slot, window)
            from_new = (latest >= start).view(latest.shape[0], 1, window, 1)
            index = (latest - start).clamp(min=0).view(latest.shape[0], 1, window, 1)
            every = slot.view(1, 1, window, 1)
            for kind, new_kind in zip((k_parts, v_parts), parts):
                for ring, new in zip(kind, new_kind):
                    shape = (new.shape[0], new.shape[1], window, new.shape[-1])
                    kept = torch.where(from_new, new.gather(2, index.expand(shape)), ring)
                    ring.scatter_(2, every.expand(shape), kept)
            return key, value
        batch, heads, length, _ = key.shape
        slots = state.positions.view(batch, 1, length, 1)
        for kind, new_kind in zip((k_parts, v_parts), parts):
            for buffer, new in zip(kind, new_kind):
                buffer.scatter_(2, slots.expand(batch, heads, length, new.shape[-1]), new)
        state.quantized[layer_idx] = [*k_parts, *v_parts]
        return key, value

    def _pinned(self, layer_idx, key, value):
        """The entries a program wrote at these positions (StaticCacheLM.pinned_entries, one row from its start) in
        place of this forward's own quantization, and how much farther they lie from this forward's float keys and
        values than its own quantization does, in quantization steps (`pin_steps`, the largest). A 4-bit cache rounds a value that sits near a step's edge
        either way on a float difference of an ulp, and at 8B one such flip in a key moved a logit by 0.4: the
        export check compares the rest of the program over the cache it holds, and bounds that cache apart."""
        positions = self.state.positions
        start, length = int(positions[0, 0]), positions.shape[1]
        setting = self.owner.kv_quant
        entries = self.owner.pinned_entries[layer_idx]
        parts = [tuple(e[:, :, start:start + length] for e in entries[:3]),
                 tuple(e[:, :, start:start + length] for e in entries[3:])]
        for x, (packed, scales, biases) in zip((key, value), parts):
            held = dequantize_cache(packed, scales, biases, setting.group_size, setting.bits).float()
            own = dequantize_cache(*kv_quant.quantize(x, setting, scales.dtype), setting.group_size,
                                   setting.bits).float()
            step = scales.float().abs().clamp(min=1e-30).repeat_interleave(setting.group_size, dim=-1)
            excess = ((held - x.float()).abs() - (own - x.float()).abs()) / step
            self.owner.pin_steps = max(self.owner.pin_steps, float(excess.amax()))
        return parts

    def mask(self, layer_idx, key_length: int, window: Optional[int]) -> torch.Tensor:
        """[B, 1, L, S] bool: query (row b, index l) may see key s. A full cache's slot s holds position s: its
        mask is `arange(S) <= P` exactly, the form the exporter's key-window proof recognises (a decode step then
        attends over the filled part only, exporter/fusion/key_window.py). A ring layer's keys carry the
        positions `_update_ring` recorded (< 0: an empty slot)."""
        ring = layer_idx in self.state.key_positions
        cache_key = ("ring" if ring else key_length, window)
        if cache_key not in self.state.masks:
            batch, length = self.state.positions.shape
            q = self.state.positions.view(batch, 1, length, 1)
            limits = self.state.image_limits
            upper = q if limits is None else limits.view(batch, 1, length, 1)
            if ring:
                k = self.state.key_positions[layer_idx].view(batch, 1, 1, -1)
                visible = (k <= upper) & (k >= 0)
            else:
                k = torch.arange(key_length).view(1, 1, 1, key_length)
                visible = k <= upper
            if window is not None:
                visible = visible & (k > q - window)
            self.state.masks[cache_key] = visible
        return self.state.masks[cache_key]


def etmlx_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                    softcap=None, **kwargs):
    """transformers' attention-function signature: q [B, H, L, D], k/v [B, Hkv, S, D] -> ([B, L, H, Dv], None)."""
    unsupported = sorted(k for k, v in kwargs.items() if k not in _NEUTRAL and v is not None)
    if unsupported:
        raise ValueError(f"{type(module).__name__} asks attention for {', '.join(unsupported)}, which etmlx does "
                         "not implement")
    if kwargs.get("is_causal") is False or getattr(module, "is_causal", True) is False:
        raise ValueError(f"{type(module).__name__} is bidirectional (is_causal=False): etmlx decodes causal models")
    cache = active()
    heads = query.shape[1]
    if cache.state.probe is not None:
        layer = getattr(module, "layer_idx", None)
        if layer in cache.state.probe:
            cache.state.probe[layer].window = sliding_window
            cache.state.probe[layer].attended = True
            cache.state.probe[layer].softcap = softcap
            returned = cache.state.returned.get(layer, (None, None))
            cache.state.probe[layer].attends_cache = key is returned[0] and value is returned[1]
    layer = getattr(module, "layer_idx", None)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    quantized = cache.state.quantized.get(layer)
    if quantized is not None:  # --kv-bits: over the packed cache (custom_kernel_ops/quantized_attention.py)
        setting = cache.owner.kv_quant
        mask = cache.mask(layer, quantized[0].shape[2], sliding_window)
        out = torch.ops.mlx.quantized_sdpa(query, *quantized, mask, float(scale), setting.group_size, setting.bits)
        return out.transpose(1, 2).contiguous(), None
    mask = cache.mask(layer, key.shape[2], sliding_window)
    if softcap is None:
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale,
                                                               enable_gqa=key.shape[1] != heads)
    else:  # Gemma 2: tanh soft-capping of the scores, which SDPA has no argument for
        out = _softcapped(query, key, value, mask, scale, softcap)
    return out.transpose(1, 2).contiguous(), None


def _softcapped(query, key, value, mask, scale, softcap):
    """Attention with tanh-capped scores. Query heads are grouped under their key/value head ([B, Hkv, G, L, D])
    rather than keys repeated per query head: repeating would guard on the symbolic key length."""
    batch, heads, length, _ = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(batch, kv_heads, heads // kv_heads, length, query.shape[-1])
    scores = torch.matmul(q, key.unsqueeze(2).transpose(-1, -2)) * scale  # [B, Hkv, G, L, S]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask.unsqueeze(2), float("-inf"))
    weights = torch.softmax(scores.float(), dim=-1).to(query.dtype)
    out = torch.matmul(weights, value.unsqueeze(2))  # [B, Hkv, G, L, Dv]
    return out.reshape(batch, heads, length, value.shape[-1])


AttentionInterface.register(IMPLEMENTATION, etmlx_attention)
