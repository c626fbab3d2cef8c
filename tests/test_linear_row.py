"""A float32 linear over a loaded weight is one graph node on the CPU (kernels/cpu_gemm.cpp).

The exporter writes nn.Linear as a transpose of the weight and a matmul; on the CPU the interpreter used to
ask MLX for five nodes per one-row linear (the weight's transpose, its transpose back, a reshape of the row into
a column, the product, the reshape back) and four for several rows (the transpose, a flatten, the product, the
unflatten), each a task on the CPU stream, a real share of a small model's step. Now the weight is used as
loaded and one node makes the very BLAS call MLX's Matmul makes: W @ x^T for one row, x @ W^T for several.

Checked: the graph of a one-row linear (with and without bias) holds one LinearRowCpu node, of a several-row
one (a prefill's, a batch's) one LinearRowsCpu node, and no Matmul, Transpose or Reshape; each result has the
bits of MLX's own matmul of the same operands (the same sgemv / sgemm through libetmlx_blas); a weight the
graph computes (not loaded, the control) keeps MLX's Matmul.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from backends.mlx.runtime.runner import load_method
from helpers import export_fn, graph_node_kinds

ROOT = Path(__file__).resolve().parents[1]
linux_only = pytest.mark.skipif(sys.platform != "linux", reason="the one-node linear uses the Linux BLAS route")

_CALL = """
import sys, torch
from backends.mlx.runtime.runner import load_method
pte, x = sys.argv[1], torch.load(sys.argv[2])
load_method(open(pte, "rb").read()).execute([x])
"""


def _kinds(pte: bytes, x: torch.Tensor, tmp_path: Path, name: str):
    program, saved, dot = tmp_path / f"{name}.pte", tmp_path / f"{name}.pt", tmp_path / f"{name}.dot"
    program.write_bytes(pte)
    torch.save(x, saved)
    done = subprocess.run([sys.executable, "-c", _CALL, str(program), str(saved)], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env={"ETMLX_DOT": str(dot), "ETMLX_KERNELS": "cpu",
                                                     "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    return graph_node_kinds(dot)


def _linear(bias: bool) -> torch.nn.Linear:
    torch.manual_seed(1)
    return torch.nn.Linear(96, 40, bias=bias).eval()


@linux_only
@pytest.mark.parametrize("bias", [False, True])
def test_a_one_row_linear_is_one_node_with_mlx_matmuls_bits(tmp_path, bias):
    import mlx.core as mx

    linear = _linear(bias)
    x = torch.randn(1, 1, 96)
    pte = export_fn(lambda t: linear(t), [x]).pte
    kinds = _kinds(pte, x, tmp_path, f"row-{bias}")
    assert kinds["LinearRowCpu"] == 1, kinds
    for kind in ("Matmul", "Transpose", "Reshape", "AddMM"):
        assert kinds[kind] == 0, (kind, kinds)

    (out,) = load_method(pte).execute([x])
    w = mx.array(linear.weight.detach().numpy())
    column = mx.matmul(w, mx.array(x.numpy()).reshape(96, 1), stream=mx.cpu)  # MLX's own product, W @ x^T
    expected = np.array(column).reshape(1, 1, 40)
    if bias:
        expected = np.array(mx.add(mx.array(linear.bias.detach().numpy()), mx.array(expected), stream=mx.cpu))
    assert np.array_equal(out.numpy(), expected), np.abs(out.numpy() - expected).max()
    torch.testing.assert_close(out, linear(x), rtol=1e-5, atol=1e-5)


@linux_only
@pytest.mark.parametrize("shape", [(1, 5, 96), (3, 96), (2, 3, 96)])
def test_several_rows_are_one_node_with_mlx_matmuls_bits(tmp_path, shape):
    import mlx.core as mx

    linear = _linear(False)
    rows = torch.randn(*shape)
    pte = export_fn(lambda t: linear(t), [rows]).pte
    kinds = _kinds(pte, rows, tmp_path, "rows")
    assert kinds["LinearRowsCpu"] == 1, kinds
    for kind in ("Matmul", "Transpose", "Reshape", "LinearRowCpu"):
        assert kinds[kind] == 0, (kind, kinds)
    (out,) = load_method(pte).execute([rows])
    w = mx.array(linear.weight.detach().numpy())
    expected = np.array(mx.matmul(mx.array(rows.numpy()), mx.transpose(w), stream=mx.cpu))  # MLX's x @ W^T
    assert np.array_equal(out.numpy(), expected), np.abs(out.numpy() - expected).max()
    torch.testing.assert_close(out, linear(rows), rtol=1e-5, atol=1e-5)


@linux_only
def test_a_computed_weight_keeps_mlx_matmul(tmp_path):
    """A weight the graph computes (twice the loaded one) is not a loaded array: MLX's Matmul, same values."""
    linear = _linear(False)
    for name, x in (("row", torch.randn(1, 1, 96)), ("rows", torch.randn(1, 4, 96))):
        fn = lambda t: torch.nn.functional.linear(t, linear.weight * 2.0)  # noqa: E731
        pte = export_fn(fn, [x]).pte
        kinds = _kinds(pte, x, tmp_path, f"computed-{name}")
        assert kinds["LinearRowCpu"] == kinds["LinearRowsCpu"] == 0 and kinds["Matmul"] == 1, kinds
        (out,) = load_method(pte).execute([x])
        torch.testing.assert_close(out, fn(x), rtol=1e-5, atol=1e-5)
