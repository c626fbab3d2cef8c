"""The cpu kernel set's sigmoid (kernels/sigmoid_cpu.cpp: MLX's CPU formula 16 lanes at a time on AVX-512)
gives MLX's own bits: every float32 around the formula's edges (|x| near 88, where 2^i switches, -0, inf, NaN,
subnormals) and a wide random sweep, in shapes that leave a partial last vector, and through a non-contiguous
view."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import backends.mlx  # noqa: F401  (before mlx.core)
import mlx.core as mx
from backends.mlx.exporter.export import export_to_pte
from backends.mlx.runtime.runner import load_method


class _Sigmoid(torch.nn.Module):
    def forward(self, x, y):
        return torch.sigmoid(x), torch.sigmoid(y.transpose(0, 1))


def _values() -> np.ndarray:
    rng = np.random.default_rng(3)
    edges = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-45, 1e-38, 88.0, -88.0, 87.9999, 88.0001, -88.0001,
             100.0, -100.0, 0.5, -0.5]
    # x * log2(e) landing on and beside half-integers, where the rounding of the exponent part switches.
    halves = (np.arange(-180, 181) + 0.5) / np.float32(1.442695)
    near = np.concatenate([np.nextafter(halves.astype(np.float32), np.float32(np.inf)),
                           np.nextafter(halves.astype(np.float32), np.float32(-np.inf)), halves.astype(np.float32)])
    wide = (rng.standard_normal(20000) * np.float32(10.0) ** rng.integers(-6, 3, 20000)).astype(np.float32)
    return np.concatenate([np.array(edges, np.float32), near, wide]).astype(np.float32)


@pytest.mark.parametrize("count", [1, 15, 17, None])
def test_cpu_sigmoid_equals_mlx_bit_for_bit(count, monkeypatch):
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    values = _values() if count is None else _values()[:count]
    x = torch.from_numpy(values.copy())
    y = torch.from_numpy(np.resize(values, (7, 9)).T.copy())  # the program reads it transposed
    result = export_to_pte(_Sigmoid(), (x, y))
    assert result.ops_outside == 0
    out_x, out_y = load_method(result.pte).execute([x, y])
    want_x = np.array(mx.sigmoid(mx.array(values)))
    want_y = np.array(mx.sigmoid(mx.array(y.numpy().T.copy())))
    np.testing.assert_array_equal(out_x.numpy().view(np.uint32), want_x.view(np.uint32))
    np.testing.assert_array_equal(out_y.numpy().view(np.uint32), want_y.view(np.uint32))
