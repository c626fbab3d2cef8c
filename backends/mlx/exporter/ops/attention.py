"""scaled_dot_product_attention, kept whole and lowered to MLX's fused attention kernel; mlx::quantized_sdpa
(attention over a quantized KV cache) to QuantizedSdpaNode."""

from __future__ import annotations

import math

import torch

import backends.mlx.custom_kernel_ops  # noqa: F401  (registers mlx::quantized_sdpa)

from backends.mlx.exporter.builder.program_builder import BuildError
from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.fusion.graph_match import Constants
from backends.mlx.exporter.fusion.key_window import prove_key_window
from backends.mlx.exporter.ops.common import aten, float_only


def _sdpa_args(node):
    names = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal"]
    args = dict(zip(names, node.args))
    for name in names[3:] + ["scale", "enable_gqa"]:
        if name in node.kwargs:
            args[name] = node.kwargs[name]
    return args


def _sdpa_supported(node):
    reason = float_only(node)
    if reason:
        return reason
    a = _sdpa_args(node)
    if a.get("dropout_p", 0.0):
        return "attention dropout is not supported"
    q, k = a["query"].meta["val"], a["key"].meta["val"]
    if q.dim() != 4 or k.dim() != 4:
        return "attention needs 4-d q, k, v"
    # Sequence lengths may be symbolic (a dynamic-length prefill/decode program): the node reads them
    # from the operands at run time. Head counts decide the grouped-query layout, so they must be known.
    if not isinstance(q.shape[1], int) or not isinstance(k.shape[1], int):
        return "attention with a symbolic number of heads"
    if q.shape[1] % k.shape[1]:
        return "query heads must be a multiple of key/value heads"
    if a.get("is_causal", False) and a.get("attn_mask") is not None:
        return "is_causal together with attn_mask"
    if a.get("is_causal", False) and not (isinstance(q.shape[2], int) and q.shape[2] == k.shape[2]):
        return "causal attention with L != S (or a symbolic L)"
    return None


@REGISTRY.register(aten.scaled_dot_product_attention.default, supports=_sdpa_supported)
def _sdpa(b, node):
    a = _sdpa_args(node)
    q = a["query"]
    scale = a.get("scale")
    if scale is None:
        scale = 1.0 / math.sqrt(q.meta["val"].shape[-1])
    fields = dict(q=b.tid(q), k=b.tid(a["key"]), v=b.tid(a["value"]), scale=float(scale),
                  causal=bool(a.get("is_causal", False)))
    if a.get("attn_mask") is not None:
        fields["mask"] = b.tid(a["attn_mask"])
        fields.update(_key_window_fields(b, a["attn_mask"], q, a["key"]))
    return b.op("SdpaNode", **fields)


def _key_window_fields(b, mask, q, k) -> dict:
    """SdpaNode's window fields when the mask provably hides the keys past the filled part of a cache."""
    if not b.fuse:  # export_to_pte(fuse=False): the graph exactly as exported
        return {}
    window = prove_key_window(mask, q, k, Constants(b.ep))
    if window is None:
        return {}
    fields = dict(window=True, window_shift=window.shift, window_per_query=window.per_query)
    if window.base is not None:
        try:
            fields["window_base"] = b.tid(window.base)
        except BuildError:  # the start positions have no tensor slot of their own (absorbed by a fusion)
            return {}
    return fields


@REGISTRY.register(torch.ops.mlx.quantized_sdpa.default)
def _quantized_sdpa(b, node):
    """mlx::quantized_sdpa (custom_kernel_ops/quantized_attention.py) -> QuantizedSdpaNode, with SdpaNode's key
    window when the mask proves one (the packed cache has the keys on the same axis)."""
    q, k, k_scales, k_biases, v, v_scales, v_biases, mask, scale, group_size, bits = node.args
    fields = dict(q=b.tid(q), k=b.tid(k), k_scales=b.tid(k_scales), k_biases=b.tid(k_biases), v=b.tid(v),
                  v_scales=b.tid(v_scales), v_biases=b.tid(v_biases), scale=float(scale),
                  group_size=int(group_size), bits=int(bits))
    if mask is not None:
        fields["mask"] = b.tid(mask)
        fields.update(_key_window_fields(b, mask, q, k))
    return b.op("QuantizedSdpaNode", **fields)
