"""Which transformers models StaticCacheLM can run, and the config values it refuses.

transformers' forward runs unchanged, so every field a family's modeling code reads is honoured. What etmlx
replaces is the attention mask (attention.py builds it from positions and each layer's sliding window instead
of transformers' mask functions); a config that asks for any other mask (chunked attention, bidirectional
attention, linear-attention layers) would run and decode wrong tokens, so it is refused here by field name.
`check_layer_windows` cross-checks, after the probe run, that every layer the config calls sliding passed its
window to the attention.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import nn

# The families tested against transformers' greedy tokens (tests/test_model_families.py), by model_type.
TESTED = ("llama", "mistral", "qwen2", "qwen3", "gpt2", "olmo", "gemma", "gemma2", "gemma3_text", "granite",
          "smollm3", "starcoder2", "phi", "phi3", "olmo2", "stablelm", "cohere", "gpt_neox", "falcon", "qwen2_moe",
          "qwen3_moe", "mixtral", "deepseek_v3")

# Vision-language families exported whole, vision method included (vision_export.py), tested against transformers'
# greedy tokens with an image (tests/test_vision_language.py). Any other checkpoint with a vision tower is refused:
# exporting its text part alone would silently drop what users send it.
VISION_TESTED = ("llava", "llava_next", "llava_onevision", "gemma3", "qwen2_vl", "qwen2_5_vl", "idefics3",
                 "smolvlm", "mistral3")

_LAYER_TYPES = {"full_attention", "sliding_attention"}


def is_vision_language(config) -> bool:
    return getattr(config, "vision_config", None) is not None


def text_config(config):
    """The decoder's config: a vision-language model's text_config, else the config itself."""
    return config.text_config if is_vision_language(config) else config


def check_vision_family(config) -> None:
    """A checkpoint with a vision tower is one etmlx exports whole, or refused by its model_type."""
    kind = getattr(config, "model_type", "?")
    if is_vision_language(config) and kind not in VISION_TESTED:
        raise ValueError(f"model_type {kind!r} is a vision-language model etmlx does not export yet (supported: "
                         f"{', '.join(VISION_TESTED)}); its text part alone would ignore images")


def _truthy(config, name) -> bool:
    return bool(getattr(config, name, None))


def check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a transformers causal LM (nn.Module), got {type(model).__name__}")
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "base_model_prefix"):
        raise ValueError(f"{type(model).__name__} has no `config`: not a transformers causal LM")
    kind = getattr(config, "model_type", "?")
    check_vision_family(config)
    accepted = inspect.signature(model.forward).parameters
    if "past_key_values" not in accepted or "position_ids" not in accepted:
        raise ValueError(f"{type(model).__name__} (model_type {kind!r}) takes no KV cache and positions "
                         "(past_key_values, position_ids): not an attention decoder etmlx can run")
    if _truthy(config, "is_encoder_decoder"):
        raise ValueError(f"model_type {kind!r} is an encoder-decoder model: etmlx decodes decoder-only causal LMs")
    if _truthy(config, "use_bidirectional_attention"):
        raise ValueError(f"model_type {kind!r}: use_bidirectional_attention=True is not supported (causal only)")
    if getattr(config, "attention_chunk_size", None):
        raise ValueError(f"model_type {kind!r}: attention_chunk_size (chunked attention) is not supported")
    layer_types = getattr(config, "layer_types", None) or []
    others = sorted(set(layer_types) - _LAYER_TYPES)
    if others:
        raise ValueError(f"model_type {kind!r}: layer_types {others} are not supported (only full and sliding "
                         "attention)")


def check_layer_windows(config, windows: dict) -> None:
    """`windows`: layer index -> the sliding window its attention received (None: full attention)."""
    layer_types = getattr(config, "layer_types", None)
    if not layer_types:
        return
    for i, window in sorted(windows.items()):
        if i < len(layer_types) and (layer_types[i] == "sliding_attention") != (window is not None):
            raise ValueError(f"layer {i} is {layer_types[i]} in the config but its attention received "
                             f"sliding_window={window}: refusing a mask that would differ from transformers'")


def position_limit(config) -> Optional[int]:
    config = getattr(config, "text_config", None) or config  # a vision-language model's decoder
    return getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)


def float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's floating tensors (a quantized OLMo has no float parameter left, only buffers)."""
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.float32
