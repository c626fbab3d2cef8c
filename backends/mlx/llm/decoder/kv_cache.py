"""StaticCacheLM: a transformers causal LM with a static KV cache the exported program owns.

The model's own forward is the source of truth: every family's quirks (embedding scales, multipliers,
soft-capping, QK-norm, partial rotary, parallel blocks, no-RoPE layers, MoE routing, ...) run as transformers
wrote them. etmlx owns only the KV cache and the attention mask (attention.py), through transformers' cache and
attention interfaces:

    lm = StaticCacheLM(hf_model, max_seq_len=128, batch=2)
    logits = lm(tokens [B, L], start_pos [B])                 # -> [B, L, V]
    logits = lm(tokens [B, L], start_pos [B], lengths [B])    # -> [B, V] at index lengths-1 per row
    logits = lm(tokens [B, L], start_pos [B], lengths [B], gather=index [B, G])  # -> [B, G, V] at those indices
    logits = lm(tokens, start_pos, lengths, image_embeds=E [B, L, D])  # a vision-language model (below)

A vision-language model (LLaVA: the checkpoint's whole ...ForConditionalGeneration) takes image embeddings: the
positions whose token is the config's image_token_id get E's vector there in place of the token's embedding, as
the family's forward merges its vision features (then its own forward runs on those input embeddings). Gemma 3's
image tokens also see their whole image (image_blocks.py).

Row b's tokens sit at cache positions start_pos[b] .. start_pos[b]+L-1; each query attends to the cached
positions <= its own (and within its layer's sliding window). Rows are independent sequences at their own
positions, which is what lets a server decode rows that started at different times in one call. A row with
fewer real tokens than L (lengths[b] < L) pads: its padding writes cache slots beyond its last real token, which
its own later queries can never see before they are overwritten, because every write starts at the row's next
position. The caches are mutable buffers, so an exported program keeps them on the device between calls.

The model object is left as it was: the etmlx attention, the experts implementation and the last-position
gather apply only inside this module's forward, so the same model stays a plain eager reference.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from backends.mlx.llm import experts
from backends.mlx.llm.decoder import attention
from backends.mlx.llm.decoder.attention import ForwardState, ProgramCache
from backends.mlx.llm.decoder.image_blocks import bidirectional_images, image_limits, image_positions
from backends.mlx.llm.decoder.kv_quant import check_head_dim, kv_quant
from backends.mlx.llm.decoder.model_support import check_layer_windows, check_model, float_dtype, position_limit


def _configs(config):
    """The model's config and the sub-configs that carry their own attention setting."""
    yield config
    for name in ("text_config", "decoder"):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            yield sub


@contextmanager
def _etmlx_settings(config):
    saved = [(c, c._attn_implementation, getattr(c, "_experts_implementation", None)) for c in _configs(config)]
    try:
        for c, _, experts_was in saved:
            c._attn_implementation = attention.IMPLEMENTATION
            if experts_was is not None:
                c._experts_implementation = experts.IMPLEMENTATION
        yield
    finally:
        for c, attn, experts_was in saved:
            c._attn_implementation = attn
            if experts_was is not None:
                c._experts_implementation = experts_was


def _last_positions(_module, _args, output):
    """Forward hook on the base model: inside an etmlx forward with `lengths`, only each row's sampled position
    goes on to the head ([B, 1, H]); with `gather` ([B, G] token indices), those positions ([B, G, H])."""
    state = attention._ACTIVE[-1].state if attention._ACTIVE else None
    if state is None or (state.lengths is None and state.gather is None):
        return output
    x = output[0]
    batch = x.shape[0]
    index = state.gather if state.gather is not None else (state.lengths - 1).view(batch, 1)
    output["last_hidden_state"] = x.gather(1, index.unsqueeze(2).expand(batch, index.shape[1], x.shape[-1]))
    return output


class StaticCacheLM(nn.Module):
    def __init__(self, model: nn.Module, max_seq_len: int, batch: int = 1, rings: bool = True, kv_bits: int = 0,
                 kv_group_size: int = 64, kv_scale_dtype: str = ""):
        """`rings=False` keeps every layer's cache full-length (a sliding window is then only a mask): a
        program that writes positions it may later reject (speculative verification) needs that, since a ring
        slot written for a rejected position has lost the older position it held.
        `kv_bits` 4 or 8: the keys and values are stored MLX-affine quantized in groups of `kv_group_size`
        (kv_quant.py), their scales and biases in `kv_scale_dtype` ("": kv_quant.DEFAULT_SCALES, bfloat16 for a
        float32 model, else the model's dtype); 0 keeps them in the model's float dtype."""
        super().__init__()
        self.rings = rings
        self.kv_quant = kv_quant(kv_bits, kv_group_size, kv_scale_dtype, reference=True)
        # A program's own cache entries, per layer (keys' packed, scales, biases, then the values'), [B, Hkv, T, .]:
        # the quantized cache writes them in place of its own (kv_reference.py, the export check); pin_steps is
        # then how much farther they lie from the forward's float keys and values than its own quantization, in
        # quantization steps (the largest).
        self.pinned_entries = None
        self.pin_steps = 0.0
        check_model(model)
        if not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 1:
            raise ValueError(f"max_seq_len must be a positive int, got {max_seq_len!r}")
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"batch must be a positive int, got {batch!r}")
        limit = position_limit(model.config)
        if limit is not None and max_seq_len > limit:
            raise ValueError(f"max_seq_len {max_seq_len} exceeds the model's {limit} positions")
        self.model = model
        self.max_seq_len = max_seq_len
        self.batch = batch
        base = getattr(model, model.base_model_prefix, None)
        if not isinstance(base, nn.Module):
            raise ValueError(f"{type(model).__name__} has no base model at `{model.base_model_prefix}`: not a "
                             "transformers causal LM")
        # Once per base model, however many StaticCacheLMs wrap it; the hook holds no reference to this module
        # (it would keep the caches alive as long as the model), and outside etmlx's forward it does nothing.
        if not getattr(base, "_etmlx_last_positions", False):
            base.register_forward_hook(_last_positions)
            base._etmlx_last_positions = True
        self.layers = self._probe()
        attended = {shape.attended for shape in self.layers.values()}
        if len(attended) > 1:
            raise ValueError(f"{type(model).__name__} attends through etmlx's attention in some layers only")
        self.uses_attention_interface = attended.pop()
        if self.uses_attention_interface:
            check_layer_windows(model.config, {i: shape.window for i, shape in self.layers.items()})
        if self.kv_quant is not None:
            self._check_quantizable()
        for i, shape in sorted(self.layers.items()):
            # A sliding-window layer narrower than the cache keeps a ring of `window` slots (attention.py).
            slots = self.ring_window(i) or max_seq_len
            for name, dim in (("k", shape.key_dim), ("v", shape.value_dim)):
                if self.kv_quant is None:
                    self.register_buffer(f"{name}_cache_{i}", torch.zeros(batch, shape.kv_heads, slots, dim,
                                                                          dtype=shape.dtype))
                    continue
                # The packed integers, then one scale and one bias per group (kv_quant.py), each [B, Hkv, S, .]:
                # the positions on axis 2, as the host's state access and the prompt cache file expect.
                q = self.kv_quant
                self.register_buffer(f"{name}_cache_{i}", torch.zeros(batch, shape.kv_heads, slots,
                                                                      q.packed_dim(dim), dtype=torch.uint8))
                for part in ("scales", "biases"):
                    self.register_buffer(f"{name}_{part}_{i}", torch.zeros(batch, shape.kv_heads, slots,
                                                                           q.groups(dim),
                                                                           dtype=q.scales_dtype(shape.dtype)))

    def _probe(self) -> dict:
        """One eager token through the model records each layer's key/value shape and sliding window."""
        state = ForwardState(positions=torch.zeros(1, 1, dtype=torch.int64), probe={})
        with torch.no_grad():
            self._run(torch.zeros(1, 1, dtype=torch.int64), state)
        if not state.probe:
            raise ValueError(f"{type(self.model).__name__} never called the KV cache: not a decoder etmlx can run")
        layers = sorted(state.probe)
        if layers != list(range(len(layers))):
            raise ValueError(f"{type(self.model).__name__} cached layers {layers}: expected 0..{len(layers) - 1}")
        return state.probe

    def ring_window(self, i: int):
        """Layer i's sliding window when its cache is a ring (narrower than max_seq_len), else None. Soft-capped
        layers (Gemma 2) keep a full cache under a window mask: their hand-written attention over a ring's
        window + L keys needs sizes the exporter cannot express (window + a symbolic length)."""
        layer = self.layers[i]
        if not self.rings or layer.window is None or layer.window >= self.max_seq_len or layer.softcap is not None:
            return None
        return layer.window

    def _check_quantizable(self) -> None:
        """One-line refusals of what the quantized cache does not run."""
        name = type(self.model).__name__
        if not self.uses_attention_interface:
            raise ValueError(f"{name} attends with its own code over the returned cache: --kv-bits needs "
                             "etmlx's attention (a model on transformers' attention interface)")
        for i, shape in sorted(self.layers.items()):
            if not shape.attends_cache:
                raise ValueError(f"{name} computes its attention's keys and values from what it caches (layer {i}; "
                                 "multi-head latent attention): --kv-bits does not support it")
            if shape.softcap is not None:
                raise ValueError(f"{name} soft-caps its attention scores (layer {i}): --kv-bits does not "
                                 "support soft-capped attention")
            check_head_dim(self.kv_quant, shape.key_dim, "key")
            check_head_dim(self.kv_quant, shape.value_dim, "value")

    def layer_cache(self, i: int):
        """Layer i's (keys, values): each a float buffer, or with --kv-bits a (packed, scales, biases) triple."""
        if self.kv_quant is None:
            return getattr(self, f"k_cache_{i}"), getattr(self, f"v_cache_{i}")
        return tuple(tuple(getattr(self, f"{name}_{part}_{i}") for part in ("cache", "scales", "biases"))
                     for name in ("k", "v"))

    def _cache_buffers(self) -> list[torch.Tensor]:
        return [b for n, b in self.named_buffers() if n.startswith(("k_", "v_")) and n.rsplit("_", 1)[-1].isdigit()]

    def cache_bytes(self) -> int:
        """The bytes of every layer's KV cache buffers (what the program holds for its cache)."""
        return sum(b.numel() * b.element_size() for b in self._cache_buffers())

    def release_caches(self) -> None:
        """Frees the KV cache buffers' memory once the program is exported (it holds their initial value): the
        traced graphs torch.export and ExecuTorch leave in module-level state reference the buffers, so dropping
        this module would not free them (150 MB at 8B with 576 positions). The module cannot run after."""
        for buffer in self._cache_buffers():
            buffer.untyped_storage().resize_(0)

    def _run(self, tokens, state: ForwardState, image_embeds=None, position_ids=None):
        cache = ProgramCache(self, state)
        kwargs = {"input_ids": tokens}
        if image_embeds is not None:
            image = image_positions(tokens, image_embeds, self.model.config.image_token_id).unsqueeze(-1)
            text = self.model.get_input_embeddings()(tokens)
            kwargs = {"inputs_embeds": torch.where(image, image_embeds.to(text.dtype), text)}
        if state.probe is not None or not self.uses_attention_interface:
            # A model with its own attention code (Falcon) adds this mask to its scores.
            keys = 1 if state.probe is not None else self.max_seq_len
            visible = cache.mask(None, keys, None)
            dtype = float_dtype(self.model)
            kwargs["attention_mask"] = torch.zeros(visible.shape, dtype=dtype).masked_fill(
                ~visible, torch.finfo(dtype).min)
        with cache, _etmlx_settings(self.model.config):
            out = self.model(position_ids=state.positions if position_ids is None else position_ids,
                             past_key_values=cache, use_cache=True, **kwargs)
        return out.logits

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, lengths: torch.Tensor | None = None,
                gather: torch.Tensor | None = None, image_embeds: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None):
        """gather [B, G] (token indices per row): the logits of those tokens, [B, G, V]. image_embeds [B, L, D]:
        a vision-language model's image embedding at each image-token position. position_ids: the rotary
        positions the model takes where they are not the cache positions (Qwen2-VL's [3, B, L], qwen2_vl.py)."""
        batch, length = tokens.shape
        positions = start_pos.unsqueeze(1) + torch.arange(length).unsqueeze(0)  # [B, L]
        state = ForwardState(positions=positions, lengths=lengths, gather=gather)
        if image_embeds is not None and bidirectional_images(self.model.config):
            image = image_positions(tokens, image_embeds, self.model.config.image_token_id)
            state.image_limits = image_limits(image, positions, lengths)
        logits = self._run(tokens, state, image_embeds, position_ids)
        if gather is not None:
            return logits
        return logits[:, 0] if lengths is not None else logits
