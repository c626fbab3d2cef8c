"""The cpu kernel set's own exponentials (kernels/attention_cpu.cpp): attention with >= 16 query rows
(two MLX matmuls around a host-loop softmax that applies scale, mask and causality), with fewer (a decode
step) one host loop for the whole attention, and sigmoids of
>= 16K values, against eager PyTorch; boolean, additive and causal masks, grouped-query heads, queries
that start inside the cache. On AVX2 CPUs without AVX-512 the decode loop runs 8 lanes at a time and prefill
runs MLX's ops; elsewhere MLX's ops throughout (same checks)."""

from __future__ import annotations

import pytest
import torch

from helpers import export_fn
from backends.mlx.exporter.export import export_to_pte
from backends.mlx.runtime.runner import load_method

F = torch.nn.functional


@pytest.fixture(autouse=True)
def _cpu_kernels(monkeypatch):
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")


class _Cached(torch.nn.Module):
    """Queries at positions start..start+L-1 against a fixed-size cache, masked to positions <= their own."""

    def forward(self, q, k, v, start):
        slots = torch.arange(k.shape[2])
        positions = start + torch.arange(q.shape[2])
        mask = slots.view(1, 1, 1, -1) <= positions.view(1, 1, -1, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


# Prefill spans (the prefill's loop, one decode step among them) from the start and mid-cache, and decode steps
# (< 16 query rows: one host loop for the whole attention, sdpa_decode_cpu, the scores, softmax and weighted sum
# in float32): the same tolerance against eager PyTorch. `example` is the query length the program is exported at.
@pytest.mark.parametrize("seed,dim,example,spans,heads,kv_heads", [
    *[(0, 16, 80, ((0, 20), (17, 40), (40, 40), (3, 1)), h, kv) for h, kv in ((4, 4), (6, 2))],
    *[(4, 64, 3, ((0, 1), (5, 1), (40, 3), (79, 1), (60, 15)), h, kv) for h, kv in ((4, 4), (14, 2))],
])
def test_boolean_mask_matches_eager(seed, dim, example, spans, heads, kv_heads):
    torch.manual_seed(seed)
    cache = 80
    k, v = torch.randn(1, kv_heads, cache, dim), torch.randn(1, kv_heads, cache, dim)
    length = torch.export.Dim("length", min=1, max=cache)
    args = (torch.randn(1, heads, example, dim), k, v, torch.tensor(0))
    method = load_method(export_to_pte(_Cached(), args, dynamic_shapes=({2: length}, None, None, None)).pte)
    for start, n in spans:
        q = torch.randn(1, heads, n, dim) * 3  # sharper scores than randn: the softmax's exp is exercised
        got = method.execute([q, k, v, torch.tensor(start)])[0]
        torch.testing.assert_close(got, _Cached()(q, k, v, torch.tensor(start)), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 3)])
def test_causal_prefill_matches_eager(heads, kv_heads):
    torch.manual_seed(1)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=heads != kv_heads)
    n, dim = 37, 32
    args = (torch.randn(2, heads, n, dim) * 3, torch.randn(2, kv_heads, n, dim), torch.randn(2, kv_heads, n, dim))
    got = load_method(export_fn(fn, args).pte).execute(list(args))[0]
    torch.testing.assert_close(got, fn(*args), atol=2e-5, rtol=2e-5)


# 24 query rows: the prefill's loop; 2 rows with a head size that is not a multiple of 16: the decode loop
# (sdpa_decode_cpu, below) over partial vectors.
@pytest.mark.parametrize("n,dim", [(24, 16), (2, 24)])
@pytest.mark.parametrize("per_head", [False, True])
def test_additive_mask_matches_eager(per_head, n, dim):
    torch.manual_seed(2 if n > 16 else 5)
    heads, keys = 4, 50
    mask = torch.randn(1, heads if per_head else 1, n, keys)
    mask[..., ::3] = float("-inf")  # masked keys, never a whole row
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3)
    args = (torch.randn(1, heads, n, dim), torch.randn(1, heads, keys, dim), torch.randn(1, heads, keys, dim), mask)
    got = load_method(export_fn(fn, args).pte).execute(list(args))[0]
    torch.testing.assert_close(got, fn(*args), atol=2e-5, rtol=2e-5)


def test_large_sigmoid_matches_eager():
    torch.manual_seed(3)
    x = torch.randn(64, 1024) * 8
    x[0, :6] = torch.tensor([0.0, -100.0, 100.0, 88.0, -88.0, float("-inf")])
    method = load_method(export_fn(torch.sigmoid, [x]).pte)
    got = method.execute([x])[0]
    torch.testing.assert_close(got, torch.sigmoid(x), atol=1e-7, rtol=1e-6)
    small = torch.randn(4, 8)  # under the host loop's threshold: MLX's op, the same values
    torch.testing.assert_close(load_method(export_fn(torch.sigmoid, [small]).pte).execute([small])[0],
                               torch.sigmoid(small), atol=1e-7, rtol=1e-6)


def test_eager_attention_softmax_matches_eager():
    """Attention spelled as matmul, softmax, matmul (transformers' eager attention, as vision towers export): the
    softmax node runs the host loop's exp. Rows partly at -inf (a causal mask) stay exact; a row that is all -inf,
    or holds a NaN or +inf, gives NaN everywhere, as PyTorch."""
    torch.manual_seed(5)
    q, k, v = torch.randn(1, 3, 40, 64) * 3, torch.randn(1, 3, 40, 64), torch.randn(1, 3, 40, 64)
    mask = torch.full((40, 40), float("-inf")).triu(1)

    def eager(q, k, v, mask):
        return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) * 0.125 + mask, dim=-1), v)

    args = (q, k, v, mask)
    got = load_method(export_fn(eager, args).pte).execute(list(args))[0]
    torch.testing.assert_close(got, eager(*args), atol=2e-5, rtol=2e-5)
    x = torch.randn(5, 1025) * 20
    x[1] = float("-inf")
    x[2, 7], x[3, 9] = float("nan"), float("inf")
    x[4, ::2] = float("-inf")
    fn = lambda x: torch.softmax(x, dim=-1)
    out = load_method(export_fn(fn, [x]).pte).execute([x])[0]
    torch.testing.assert_close(out, fn(x), atol=1e-6, rtol=1e-5, equal_nan=True)
    assert out[1:4].isnan().all() and not out[[0, 4]].isnan().any()


def test_causal_decode_and_transposed_keys_match_eager():
    """Causal with a few rows (L == S), and k / v that reach the loop as transposed views (strided reads)."""
    torch.manual_seed(6)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    args = (torch.randn(2, 4, 5, 32) * 3, torch.randn(2, 4, 5, 32), torch.randn(2, 4, 5, 32))
    got = load_method(export_fn(fn, args).pte).execute(list(args))[0]
    torch.testing.assert_close(got, fn(*args), atol=2e-5, rtol=2e-5)
    strided = lambda q, k, v: F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2))
    args = (torch.randn(1, 4, 1, 32), torch.randn(1, 30, 4, 32), torch.randn(1, 30, 4, 32))
    got = load_method(export_fn(strided, args).pte).execute(list(args))[0]
    torch.testing.assert_close(got, strided(*args), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("rows", [1, 3])
def test_decode_output_view_made_with_the_attention_gives_the_same_bits(rows, monkeypatch):
    """A decode step's attention and the transpose + reshape after it (back to [B, L, H * D]) are one node
    (runtime/exec_fused.cpp sdpa_with_view): the same bits as the three run apart (ETMLX_FUSE_LINEARS=0)."""
    torch.manual_seed(7)

    class Heads(torch.nn.Module):
        def forward(self, q, k, v, start):
            out = _Cached()(q, k, v, start)
            return out.transpose(1, 2).contiguous().reshape(q.shape[0], q.shape[2], -1)

    k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    length = torch.export.Dim("length", min=1, max=40)
    example = (torch.randn(1, 6, 3, 16), k, v, torch.tensor(0))
    pte = export_to_pte(Heads(), example, dynamic_shapes=({2: length}, None, None, None)).pte
    q = torch.randn(1, 6, rows, 16) * 3
    args = [q, k, v, torch.tensor(20)]
    fused = load_method(pte).execute(args)[0]
    monkeypatch.setenv("ETMLX_FUSE_LINEARS", "0")
    alone = load_method(pte).execute(args)[0]
    assert fused.shape == (1, rows, 96) and torch.equal(fused.view(torch.int32), alone.view(torch.int32))
    torch.testing.assert_close(fused, Heads()(*args), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dim", [16, 40, 64, 128, 144])
def test_decode_rows_match_eager_and_ignore_the_masked_keys_after_them(dim):
    """The decode loop's scores go 16 keys at a time (a transposing sum) and its weighted values through two
    accumulator sets (even and odd keys) where k / v rows are contiguous and the head dimension is a multiple
    of 16 up to 128 (40 and 144: the per-key loop). Against eager PyTorch with 77 keys (a last block of 13),
    and the same bits with 16 more keys that the mask hides: a key's score and a row's sum must not depend on
    how many keys the call holds (the control: one of those keys let through changes the result)."""
    torch.manual_seed(dim)
    heads, kv_heads, cache, extra = 14, 2, 77, 16
    k, v = torch.randn(1, kv_heads, cache + extra, dim), torch.randn(1, kv_heads, cache + extra, dim)
    length = torch.export.Dim("length", min=1, max=8)

    def run(module, keys, q, start):
        kk, vv = k[:, :, :keys].contiguous(), v[:, :, :keys].contiguous()
        example = (torch.randn(1, heads, 2, dim), kk, vv, torch.tensor(0))
        method = load_method(export_to_pte(module, example, dynamic_shapes=({2: length}, None, None, None)).pte)
        return method.execute([q, kk, vv, torch.tensor(start)])[0]

    class Hidden(torch.nn.Module):
        """_Cached with the keys from `cache` on masked whatever the position: they are never seen."""

        def __init__(self, let_through: bool = False):
            super().__init__()
            self.let_through = let_through

        def forward(self, q, k, v, start):
            slots = torch.arange(k.shape[2])
            positions = start + torch.arange(q.shape[2])
            seen = (slots.view(1, 1, 1, -1) <= positions.view(1, 1, -1, 1)) & (slots < cache).view(1, 1, 1, -1)
            if self.let_through:
                seen = seen | (slots == cache + 5).view(1, 1, 1, -1)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=seen, enable_gqa=True)

    for start, n in ((76, 1), (40, 3), (0, 1)):
        q = torch.randn(1, heads, n, dim) * 3
        short = run(_Cached(), cache, q, start)
        torch.testing.assert_close(short, _Cached()(q, k[:, :, :cache], v[:, :, :cache], torch.tensor(start)),
                                   atol=2e-5, rtol=2e-5)
        longer = run(Hidden(), cache + extra, q, start)
        assert torch.equal(short.view(torch.int32), longer.view(torch.int32)), (dim, start, n)
        control = run(Hidden(let_through=True), cache + extra, q, start)
        assert not torch.equal(short, control)
