"""The cpu kernel set's erf and tanh (kernels/tanh_erf_cpu.cpp, 16 lanes at a time on AVX-512): erf gives mx.erf's
own bits (MLX's formula, each step rounded as MLX rounds it); tanh (Cephes tanhf, a vector exp) is within 2 ulp of
float64 tanh over 1M values spread over [-12, 12] and the specials; GELU's two forms, which lower to them, match
eager PyTorch. The device set (MLX's ops) is the control: its tanh differs from the host loop's on some values, so
these tests see the host loop."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import backends.mlx  # noqa: F401  (before mlx.core)
import mlx.core as mx
from backends.mlx.runtime.runner import load_method
from tests.helpers import export_fn

_SPECIALS = [0.0, -0.0, 1e-45, -1e-45, 1e-38, -1e-38, 1e-30, -1e-30, np.inf, -np.inf, np.nan, 0.625, -0.625,
             np.nextafter(np.float32(0.625), np.float32(0)), 9.0, -9.0, 44.5, -44.5, 88.0, 100.0, -1e30, 3.4e38]
# NaNs with payloads and either sign: erf's result keeps the payload, as MLX's does.
_NANS = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFA00000, 0x7FC12345], np.uint32).view(np.float32)


def _erf_values() -> np.ndarray:
    rng = np.random.default_rng(7)
    large = rng.uniform(3, 20, 4000).astype(np.float32) * rng.choice([-1, 1], 4000).astype(np.float32)
    # |x| where -x * x crosses MLX exp's -88 cut (|x| ~ 9.38) and where its exponent's rounding switches.
    edge = np.sqrt((np.arange(0, 128) + 0.5) / np.float32(1.442695)).astype(np.float32)
    edge = np.concatenate([edge, np.nextafter(edge, np.float32(np.inf)), np.nextafter(edge, np.float32(0)), -edge])
    wide = (rng.standard_normal(30000) * np.float32(10.0) ** rng.integers(-9, 2, 30000)).astype(np.float32)
    return np.concatenate([np.array(_SPECIALS, np.float32), _NANS, large, edge.astype(np.float32), wide])


def _run(fn, x: torch.Tensor) -> torch.Tensor:
    return load_method(export_fn(fn, [x]).pte).execute([x])[0]


def _bits(a) -> np.ndarray:
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("count", [1, 15, 17, None])
def test_erf_host_loop_equals_mlx_bit_for_bit(count, monkeypatch):
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    values = _erf_values() if count is None else _erf_values()[-count:]
    got = _run(torch.erf, torch.from_numpy(values.copy()))
    np.testing.assert_array_equal(_bits(got.numpy()), _bits(mx.erf(mx.array(values))))
    # Read through a transposed view (the loop copies it in row-major order first).
    grid = np.resize(values, (97, 31)).T.copy() if count is None else values.reshape(1, -1)
    got_t = _run(lambda y: torch.erf(y.transpose(0, 1)), torch.from_numpy(grid))
    np.testing.assert_array_equal(_bits(got_t.numpy()), _bits(mx.erf(mx.array(grid.T.copy()))))
    # MLX's formula (Abramowitz-Stegun 7.1.26, in float32; 1 - e t r cancels near 0) is within 6e-7 of erf
    # (mx.erf's largest error over 4M values in [-5, 5]: 5.3e-7).
    finite = torch.from_numpy(values[np.isfinite(values)])
    exact = torch.special.erf(finite.double())
    assert (_run(torch.erf, finite).double() - exact).abs().max() <= 6e-7


def _ulps_off_tanh(got: np.ndarray, values: np.ndarray) -> np.ndarray:
    exact = np.tanh(values.astype(np.float64))
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - exact) / ulp


def test_tanh_host_loop_within_2_ulp(monkeypatch):
    rng = np.random.default_rng(11)
    finite = [v for v in _SPECIALS if np.isfinite(v)]
    values = np.concatenate([np.array(finite, np.float32), rng.uniform(-12, 12, 1 << 20).astype(np.float32),
                             (rng.standard_normal(50000) * np.float32(10.0) ** rng.integers(-9, 2, 50000))
                             .astype(np.float32)])
    x = torch.from_numpy(values)
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    got = _run(torch.tanh, x).numpy()
    assert _ulps_off_tanh(got, values).max() <= 2.0
    specials = np.concatenate([np.array([0.0, -0.0, np.inf, -np.inf, 9.5, -9.5, 1e-40, -1e-40], np.float32), _NANS])
    got_s = _run(torch.tanh, torch.from_numpy(specials)).numpy()
    assert list(_bits(got_s[:8])) == list(_bits(np.array([0.0, -0.0, 1, -1, 1, -1, 1e-40, -1e-40], np.float32)))
    assert np.isnan(got_s[8:]).all()
    # The control: MLX's tanh (glibc tanhf), which the device set runs, rounds some values the other way.
    mlx_bits = _bits(mx.tanh(mx.array(values)))
    assert (_bits(got) != mlx_bits).sum() > 1000
    monkeypatch.setenv("ETMLX_KERNELS", "device")
    np.testing.assert_array_equal(_bits(_run(torch.tanh, x).numpy()), mlx_bits)


@pytest.mark.parametrize("shape", [(64, 1024), (3, 5)])
@pytest.mark.parametrize("approximate", ["tanh", "none"])
def test_gelu_matches_eager(shape, approximate, monkeypatch):
    torch.manual_seed(2)
    x = torch.randn(*shape) * 4
    x.view(-1)[:3] = torch.tensor([0.0, -0.0, -20.0])
    fn = lambda x: F.gelu(x, approximate=approximate)
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    got = _run(fn, x)
    # erf's absolute error (6e-7) times x / 2 for the exact form; tanh's 2 ulp for the other.
    torch.testing.assert_close(got, fn(x), atol=3e-6 if approximate == "none" else 1e-6, rtol=1e-5)
    if approximate == "none":  # erf's bits are MLX's: the device set's GELU is the same, bit for bit
        monkeypatch.setenv("ETMLX_KERNELS", "device")
        assert torch.equal(_run(fn, x), got)
