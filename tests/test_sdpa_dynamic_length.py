"""Attention whose query length is symbolic (a dynamic-length prefill/decode program) stays one fused
SdpaNode instead of ExecuTorch's decomposition, which materializes the grouped-query repeat of the
whole key/value cache and several cache-sized intermediates on every call."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from backends.mlx.exporter.export import export_to_pte
from backends.mlx.exporter.inspect_pte import delegate_blobs
from backends.mlx.runtime.runner import load_method
from backends.mlx.serialization.generated.node_table import NODE_TAGS
from backends.mlx.serialization.serializer import deserialize

_NAMES = {tag: name for name, tag in NODE_TAGS.items()}


class _CachedAttention(torch.nn.Module):
    """Queries at positions start..start+L-1 against a fixed-size cache, masked to positions <= their own."""

    def forward(self, q, k_cache, v_cache, start):
        slots = torch.arange(k_cache.shape[2])
        positions = start + torch.arange(q.shape[2])
        mask = slots.view(1, 1, 1, -1) <= positions.view(1, 1, -1, 1)
        return torch.nn.functional.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask,
                                                                enable_gqa=q.shape[1] != k_cache.shape[1])


def _node_counts(pte: bytes) -> Counter:
    counts = Counter()
    for blob in delegate_blobs(pte):
        counts.update(_NAMES[i.nodeType] for i in deserialize(blob).instructions)
    return counts


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_symbolic_query_length_keeps_one_fused_attention_node_and_matches_eager(heads, kv_heads):
    torch.manual_seed(0)
    cache, dim = 24, 8
    k = torch.randn(1, kv_heads, cache, dim)
    v = torch.randn(1, kv_heads, cache, dim)
    length = torch.export.Dim("length", min=1, max=cache)
    example = (torch.randn(1, heads, cache, dim), k, v, torch.tensor(0))
    result = export_to_pte(_CachedAttention(), example, dynamic_shapes=({2: length}, None, None, None))
    assert result.ops_outside == 0, result.summary()
    counts = _node_counts(result.pte)
    assert counts["SdpaNode"] == 1 and counts["SoftmaxNode"] == 0, counts
    method = load_method(result.pte)
    for start, n in ((0, 7), (7, 1), (15, 9)):  # a prefill, one decode step, a chunk reaching the cache's end
        q = torch.randn(1, heads, n, dim)
        got = method.execute([q, k, v, torch.tensor(start)])[0]
        torch.testing.assert_close(got, _CachedAttention()(q, k, v, torch.tensor(start)), atol=1e-5, rtol=1e-5)
