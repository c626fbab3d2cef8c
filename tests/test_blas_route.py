"""MLX's CPU GEMMs reach OpenBLAS through libetmlx_blas (Linux), with the same results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.mlx.runtime import blas_route
from helpers import export_fn
from backends.mlx.runtime.runner import load_method, run

REPO = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the route is built on Linux only (macOS: Accelerate)")


@linux_only
def test_route_is_active_and_names_openblas():
    st = blas_route.status()
    assert st.built and st.active, st
    assert "OpenBLAS" in st.library
    assert "OpenBLAS" in st.describe()


@linux_only
@pytest.mark.parametrize("dtype", ["float32", "float64", "complex64"])
@pytest.mark.parametrize("shape_a, shape_b, transpose", [
    ((1, 768), (768, 300), None),        # a decode step
    ((129, 64), (64, 31), None),         # odd sizes, not multiples of any block
    ((3, 17, 40), (3, 40, 9), None),     # batched
    ((50, 20), (50, 20), "b"),           # a @ b.T: MLX passes a transpose flag, not a copy
    ((20, 50), (20, 50), "a"),
    # one output column: float32 takes OpenBLAS's sgemv, with every operand layout
    ((1, 50), (30, 50), "b"),            # one output row stays with sgemm
    ((50, 1), (50, 30), "a"),
    ((30, 50), (50, 1), None),           # W @ x
    ((30, 50), (1, 50), "b"),
    ((50, 30), (50, 1), "a"),
    ((1, 1), (1, 30), None),             # k = 1
])
def test_gemm_goes_to_openblas_and_matches_numpy(dtype, shape_a, shape_b, transpose):
    import mlx.core as mx

    rng = np.random.default_rng(0)
    a_np = rng.standard_normal(shape_a)
    b_np = rng.standard_normal(shape_b)
    if dtype == "complex64":
        a_np = a_np + 1j * rng.standard_normal(shape_a)
        b_np = b_np + 1j * rng.standard_normal(shape_b)
    # (mx.array would store float64 input as float32; the dtype has to be asked for.)
    a = mx.array(a_np.astype(dtype), dtype=getattr(mx, dtype))
    b = mx.array(b_np.astype(dtype), dtype=getattr(mx, dtype))
    assert a.dtype == getattr(mx, dtype)
    if transpose == "a":
        a, a_np = a.T, a_np.T
    if transpose == "b":
        b, b_np = b.T, b_np.T
    before = blas_route.routed_calls()
    out = mx.matmul(a, b, stream=mx.cpu)
    mx.eval(out)
    assert blas_route.routed_calls() > before, "the matmul did not reach libetmlx_blas"
    # float32: K <= 768 products of unit normals, rounding ~sqrt(K) * 6e-8 relative to the output's scale.
    tol = 1e-12 if dtype == "float64" else 2e-5
    expected = a_np @ b_np
    np.testing.assert_allclose(np.array(out), expected, rtol=tol, atol=tol * np.abs(expected).max())


@linux_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_linear_runs_in_float32_on_the_cpu(dtype):
    """bf16/f16 products are upcast on the CPU, so they reach OpenBLAS, and round once to the dtype."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(256, 96).to(dtype)
    x = torch.randn(5, 256, dtype=dtype)
    result = export_fn(lambda t: linear(t), [x])
    assert result.ops_outside == 0
    before = blas_route.routed_calls()
    (out,) = run(result.pte, [x])
    assert blas_route.routed_calls() > before, "a half-precision linear did not take the float32 BLAS path"
    expected = torch.nn.functional.linear(x.float(), linear.weight.float(), linear.bias.float()).to(dtype)
    # One rounding of a float32 result: at most one ulp of the dtype away from the rounded reference.
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10
    torch.testing.assert_close(out.float(), expected.float(), rtol=ulp, atol=ulp)


@linux_only
@pytest.mark.parametrize("rows, expect_gemv", [(1, True), (4, False)])
def test_one_row_linears_take_sgemv_and_batched_ones_do_not(rows, expect_gemv):
    """The interpreter writes a one-row float32 linear as a one-column product, which goes to sgemv;
    products with several rows (a batch, attention's heads) keep sgemm's summation order."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    x = torch.randn(1, rows, 64)
    result = export_fn(lambda t: linear(t), [x])
    method = load_method(result.pte)
    before = blas_route.gemv_calls()
    (out,) = method.execute([x])
    assert (blas_route.gemv_calls() > before) == expect_gemv
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)


@linux_only
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
                    reason="OpenBLAS runs one thread here anyway")
def test_small_products_run_on_one_openblas_thread():
    """Products under 2^26 multiply-adds (attention's per-head ones) run on one OpenBLAS thread, so its
    spinning workers do not take cores from the etmlx pool; larger ones keep OpenBLAS's threads. Both
    still equal numpy's product."""
    import mlx.core as mx

    rng = np.random.default_rng(0)
    for n, small in ((64, True), (512, False)):  # 2.6e5 and 1.3e8 multiply-adds
        a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
        before = blas_route.one_thread_calls()
        out = np.array(mx.matmul(mx.array(a), mx.array(b), stream=mx.cpu))
        assert (blas_route.one_thread_calls() > before) == small
        np.testing.assert_allclose(out, a @ b, rtol=1e-4, atol=1e-3 * np.sqrt(n))


@linux_only
@pytest.mark.subprocess
def test_matmul_before_etmlx_import_is_reported():
    """MLX binds its GEMMs at the first matmul; if that came first, etmlx says so instead of running slowly."""
    code = (
        "import warnings, mlx.core as mx\n"
        "mx.eval(mx.ones((2, 2)) @ mx.ones((2, 2)))\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import backends.mlx.runtime\n"
        "    backends.mlx.runtime.load()  # registering the backend is when etmlx checks the route\n"
        "from backends.mlx.runtime import blas_route\n"
        "print('ACTIVE', blas_route.status().active)\n"
        "print('WARNED', any('Import backends.mlx before' in str(w.message) for w in caught))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ACTIVE False" in proc.stdout
    assert "WARNED True" in proc.stdout


@linux_only
def test_cpp_programs_load_the_route_ahead_of_mlxs_blas():
    """The C++ decode loop gets the route by linking the backend: libetmlx_blas precedes MLX's BLAS in load order."""
    runner = REPO / "build" / "etmlx_decode"
    assert runner.is_file(), "build/etmlx_decode missing: run `make setup`"
    listing = subprocess.run(["ldd", str(runner)], capture_output=True, text=True, check=True).stdout
    names = [line.split()[0] for line in listing.splitlines() if line.strip()]
    ours = next(i for i, n in enumerate(names) if n.startswith("libetmlx_blas"))
    reference = next(i for i, n in enumerate(names) if n.startswith("libblas"))
    assert ours < reference, names


@pytest.mark.bench
@pytest.mark.subprocess
def test_gemm_bench_times_the_stock_wheel_and_the_route_in_separate_processes():
    from benchmarks import cpu_gemm

    for variant in ("stock", "etmlx"):
        ms = cpu_gemm._time(variant, "float32", 4, 32, 16)
        assert 0 < ms < 10_000, (variant, ms)


@linux_only
@pytest.mark.subprocess
def test_etmlx_blas_reference_sends_gemms_to_mlxs_bundled_blas():
    code = (
        "import backends.mlx.runtime\n"
        "from backends.mlx.runtime import blas_route\n"
        "st = blas_route.status()\n"
        "print('DESCRIBE', st.describe())\n"
        "print('OPENBLAS_CLAIMED', 'OpenBLAS' in st.describe())\n"
    )
    env = {**__import__("os").environ, "ETMLX_BLAS": "reference"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "ETMLX_BLAS=reference" in proc.stdout
    assert "OPENBLAS_CLAIMED False" in proc.stdout
