"""The cpu kernel set's decode-step attention over a packed KV cache (kernels/attention_quantized_cpu.cpp: 64 keys
at a time dequantized, then the float decode loop's row functions) gives, bit for bit, the float decode loop's
result over mx::dequantize's keys and values: 4- and 8-bit caches, groups of 32/64/128, head sizes through the
blocked score loop (<= 128) and the plain one (160), grouped-query heads, verify rows, a batch of two with its own
windows, windows ending inside and across the 64-key blocks. MLX's own route (the device kernel set: quantized
matmuls) agrees within float32 noise. The same with the scales and biases in bfloat16 (a float32 program's
default) or float16, read widened. Control: one changed scale in the cache changes the bits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import backends.mlx  # noqa: F401  (before mlx.core)
import backends.mlx.custom_kernel_ops  # noqa: F401  (registers mlx::quantized_sdpa)
import mlx.core as mx
from backends.mlx.exporter.export import export_to_pte
from backends.mlx.runtime.runner import load_method

F = torch.nn.functional
SCALE = 0.125


def _host_loop_runs() -> bool:
    """The CPU has what exp16_supported() asks (kernels/exp_vectors.h); elsewhere MLX's route runs."""
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        return False
    return {"avx512f", "avx512bw", "avx512vl", "fma"} <= flags


def _mask(k_slots: int, q, start):
    slots = torch.arange(k_slots)
    positions = start.view(-1, 1) + torch.arange(q.shape[2])  # [B, L]
    return (slots.view(1, 1, 1, -1) <= positions.view(q.shape[0], 1, -1, 1))


class _Packed(torch.nn.Module):
    def __init__(self, group: int, bits: int):
        super().__init__()
        self.group, self.bits = group, bits

    def forward(self, q, k, ks, kb, v, vs, vb, start):
        return torch.ops.mlx.quantized_sdpa(q, k, ks, kb, v, vs, vb, _mask(k.shape[2], q, start), SCALE, self.group,
                                            self.bits)


class _Float(torch.nn.Module):
    def forward(self, q, k, v, start):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=_mask(k.shape[2], q, start), scale=SCALE,
                                              enable_gqa=q.shape[1] != k.shape[1])


def _quantize(x: np.ndarray, group: int, bits: int, scale_dtype=torch.float32):
    """[B, Hkv, S, D] float32 -> (bytes, scales, biases in `scale_dtype`, the dequantized float32) as torch
    tensors; narrower scales are rounded first and the float32 is what they stand for, widened."""
    b, h, s, d = x.shape
    wq, scales, biases = mx.quantize(mx.array(x.reshape(-1, d)), group_size=group, bits=bits)
    t = lambda a, *shape: torch.from_numpy(np.ascontiguousarray(a).reshape(*shape))
    scales, biases = (t(np.array(a), b, h, s, -1).to(scale_dtype) for a in (scales, biases))
    wide = [mx.array(a.float().reshape(b * h * s, -1).numpy()) for a in (scales, biases)]
    deq = np.array(mx.dequantize(wq, *wide, group_size=group, bits=bits)).reshape(b, h, s, d)
    packed = np.array(wq).view(np.uint8).reshape(b, h, s, d * bits // 8)
    return t(packed, b, h, s, -1), scales, biases, t(deq, b, h, s, d)


def _case(seed, batch, heads, kv_heads, rows, dim, slots, group, bits, scale_dtype=torch.float32):
    rng = np.random.default_rng(seed)
    q = torch.from_numpy(rng.standard_normal((batch, heads, rows, dim), dtype=np.float32) * 3)
    k = _quantize(rng.standard_normal((batch, kv_heads, slots, dim), dtype=np.float32), group, bits, scale_dtype)
    v = _quantize(rng.standard_normal((batch, kv_heads, slots, dim), dtype=np.float32), group, bits, scale_dtype)
    return q, k, v


def _programs(q, k, v, group, bits, start):
    packed = load_method(export_to_pte(_Packed(group, bits), (q, *k[:3], *v[:3], start)).pte)
    plain = load_method(export_to_pte(_Float(), (q, k[3], v[3], start)).pte)
    return packed, plain


CASES = [  # seed, batch, heads, kv_heads, rows, dim, slots, group, bits, starts (one per batch row)
    (0, 1, 8, 2, 1, 128, 200, 64, 4, [(0,), (63,), (64,), (130,), (199,)]),
    (1, 1, 4, 4, 3, 64, 150, 32, 8, [(5,), (127,), (147,)]),
    (2, 2, 6, 3, 2, 96, 140, 32, 4, [(10, 100), (138, 64)]),
    (3, 1, 4, 1, 1, 160, 90, 32, 8, [(80,)]),
    (4, 1, 2, 2, 4, 128, 70, 128, 4, [(66,), (1,)]),
]


# A float32 program's cache keeps bfloat16 scales and biases by default (--kv-scale-dtype, kv_quant.py); float16
# is the other choice. Each with two cases, and a prefill-sized query (32 rows: MLX's route, the cache widened).
NARROW_SCALES = [(dtype, CASES[i]) for dtype in (torch.bfloat16, torch.float16) for i in (0, 2)] + [
    (torch.bfloat16, (5, 1, 4, 2, 32, 128, 120, 64, 4, [(0,), (88,)]))]


@pytest.mark.parametrize("seed,batch,heads,kv_heads,rows,dim,slots,group,bits,starts,scale_dtype",
                         [(*case, torch.float32) for case in CASES]
                         + [(*case, dtype) for dtype, case in NARROW_SCALES])
def test_packed_decode_equals_the_float_loop_over_the_dequantized_cache(
        seed, batch, heads, kv_heads, rows, dim, slots, group, bits, starts, scale_dtype, monkeypatch):
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    q, k, v = _case(seed, batch, heads, kv_heads, rows, dim, slots, group, bits, scale_dtype)
    start = torch.tensor(starts[0])
    packed, plain = _programs(q, k, v, group, bits, start)
    for s in starts:
        start = torch.tensor(s)
        got = packed.execute([q, *k[:3], *v[:3], start])[0]
        want = plain.execute([q, k[3], v[3], start])[0]
        if _host_loop_runs() and rows * heads // kv_heads <= 16:  # the host loop: the float loop's bits
            np.testing.assert_array_equal(got.numpy().view(np.uint32), want.numpy().view(np.uint32))
        torch.testing.assert_close(got, _Float()(q, k[3], v[3], start), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.bfloat16])
def test_mlx_route_agrees_and_a_changed_scale_changes_the_bits(monkeypatch, scale_dtype):
    seed, batch, heads, kv_heads, rows, dim, slots, group, bits, starts = CASES[0]
    q, k, v = _case(seed, batch, heads, kv_heads, rows, dim, slots, group, bits, scale_dtype)
    start = torch.tensor(starts[3])
    args = [q, *k[:3], *v[:3], start]
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    got = load_method(export_to_pte(_Packed(group, bits), tuple(args)).pte).execute(args)[0]
    monkeypatch.setenv("ETMLX_KERNELS", "device")
    mlx_route = load_method(export_to_pte(_Packed(group, bits), tuple(args)).pte).execute(args)[0]
    torch.testing.assert_close(got, mlx_route, atol=2e-5, rtol=2e-5)
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    changed = list(args)
    changed[2] = args[2].clone()
    changed[2][0, 1, 100, 0] *= 1.5  # one scale of a key inside the window, of the second key/value head
    other = load_method(export_to_pte(_Packed(group, bits), tuple(args)).pte).execute(changed)[0]
    assert not torch.equal(other, got)
    assert torch.equal(other[:, :heads // kv_heads], got[:, :heads // kv_heads])  # the first head's rows unchanged
