"""The cpu kernel set's own quantized matmul (kernels/quantized_matmul_cpu.cpp), through exported
QuantizedLinear programs, against mx.quantized_matmul: 1, 3 and 64 rows (the few-row pass and the
many-row product: the tiled AVX-512 GEMM, or dequantize-then-BLAS on other CPUs), 64 to 4096 input
features, 4 and 8 bits, groups 32/64/128, float32 and bfloat16 activations. Its inner loops, every
instruction-set variant the CPU runs, are checked against a double reference by
build/etmlx_quantized_rows_test, the many-row product by build/etmlx_quantized_gemm_test."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

import backends.mlx  # noqa: F401  (before mlx.core: routes MLX's CPU GEMMs)
import mlx.core as mx
from backends.mlx.llm.quantize.affine import quantize_tensor
from backends.mlx.llm.quantize.modules import QuantizedLinear
from backends.mlx.exporter.export import export_to_pte
from backends.mlx.runtime import kernels_info
from backends.mlx.runtime.runner import load_method
from quantized_bounds import quantized_product_bound

ROWS = (1, 3, 64)
MX_DTYPES = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16}
HARNESS = Path(__file__).resolve().parents[1] / "build" / "etmlx_quantized_rows_test"
GEMM_HARNESS = HARNESS.with_name("etmlx_quantized_gemm_test")


def _mx(t: torch.Tensor):
    return mx.array(t.float().numpy()).astype(MX_DTYPES[t.dtype])


def _shapes(group: int) -> list[tuple[int, int]]:
    """(in, out) features: the smallest input a group allows, a middle one, 4096; output counts
    that do not divide evenly among threads."""
    return [(max(64, group), 40), (896, 136), (4096, 24)]


class _Linears(torch.nn.Module):
    def __init__(self, bits, group, dtype):
        super().__init__()
        self.layers = torch.nn.ModuleList()
        for k, n in _shapes(group):
            # Sharp weights: rows of very different scales, so a mixed-up group or nibble shows.
            weight = torch.randn(n, k) * torch.logspace(-1, 1, n).unsqueeze(1)
            w, scales, biases = quantize_tensor(weight.to(dtype), group, bits)
            self.layers.append(QuantizedLinear(w, scales, biases, group, bits))

    def forward(self, a, b, c):
        return tuple(layer(x) for layer, x in zip(self.layers, (a, b, c)))


def _reference(x: torch.Tensor, lin: QuantizedLinear) -> np.ndarray:
    """mx.quantized_matmul over the same values in float32, rounded once to x's dtype. (For bfloat16 not
    MLX's bfloat16 CPU kernel itself: it sums in bfloat16, off by several percent at 4096 inputs.)"""
    f32 = lambda t: mx.array(t.float().numpy())
    ref = mx.quantized_matmul(f32(x), mx.array(lin.weight.numpy()), f32(lin.scales), f32(lin.biases),
                              transpose=True, group_size=lin.group_size, bits=lin.bits)
    return np.array(ref.astype(MX_DTYPES[x.dtype]).astype(mx.float32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group", [(b, g) for b in (4, 8) for g in (32, 64, 128)])
def test_cpu_quantized_matmul_matches_mlx(bits, group, dtype, monkeypatch):
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    torch.manual_seed(bits * 1000 + group)
    model = _Linears(bits, group, dtype)
    rows = torch.export.Dim("rows", min=1, max=64)
    example = [torch.randn(3, k).to(dtype) for k, _ in _shapes(group)]
    result = export_to_pte(model, tuple(example), dynamic_shapes=tuple({0: rows} for _ in example))
    assert result.ops_outside == 0
    method = load_method(result.pte)
    for m in ROWS:
        xs = [torch.randn(m, k).to(dtype) for k, _ in _shapes(group)]
        outs = method.execute(xs)
        for x, lin, out in zip(xs, model.layers, outs):
            ref = _reference(x, lin)
            assert out.dtype == dtype and tuple(out.shape) == ref.shape
            err = np.abs(out.float().numpy() - ref)
            bound = quantized_product_bound(x, lin, ref, dtype)
            worst = float((err / bound).max())
            assert worst <= 1.0, f"rows {m}, in {x.shape[-1]}: error {worst:.3g} of the bound"


def test_every_instruction_set_variant_matches_a_double_reference():
    assert HARNESS.is_file(), "build/etmlx_quantized_rows_test missing: run `make setup`"
    done = subprocess.run([str(HARNESS)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "variant scalar" in done.stdout and " 0 failed" in done.stdout, done.stdout


def test_many_row_gemm_matches_a_double_reference():
    """The prefill products (kernels/quantized_gemm.cpp: float32 tiles on AVX-512; integer activations on
    AVX-512 VNNI and on AVX2): partial tiles, every bits/group/scale type each takes, rows equal bit for bit
    alone and in a batch. An x86 CPU with AVX2 runs at least the AVX2 integer kernel."""
    assert GEMM_HARNESS.is_file(), "build/etmlx_quantized_gemm_test missing: run `make setup`"
    done = subprocess.run([str(GEMM_HARNESS)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 failed" in done.stdout, done.stdout
    if kernels_info()["isa"] in ("avx2", "avx512"):
        assert "(0 integer kernels)" not in done.stdout, done.stdout


_RUN_ELSEWHERE = r"""
import json, sys
import torch
from backends.mlx.runtime import kernels_info
from backends.mlx.runtime.runner import load_method
x = torch.load(sys.argv[2])
out = load_method(open(sys.argv[1], "rb").read()).execute([x])[0]
print(json.dumps({"info": kernels_info(), "out": out.tolist()}))
"""


def _run_with(env_extra: dict, pte: Path, x_path: Path) -> tuple[dict, str]:
    import json
    import os
    import sys

    env = {**os.environ, "ETMLX_KERNELS": "cpu", **env_extra}
    done = subprocess.run([sys.executable, "-c", _RUN_ELSEWHERE, str(pte), str(x_path)], capture_output=True,
                          text=True, timeout=300, env=env, cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


@pytest.mark.subprocess  # fresh interpreters loading torch
def test_thread_count_and_variant_can_be_forced(tmp_path, monkeypatch):
    """ETMLX_NUM_THREADS sizes the pool and ETMLX_QMM_ISA=scalar forces the portable loop: the same
    program then gives this process's result within the stated tolerance, one thread its exact bits;
    a bad thread count is one line on stderr and the default is kept."""
    from backends.mlx.runtime import kernels_info

    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    torch.manual_seed(5)
    w, scales, biases = quantize_tensor(torch.randn(300, 256) * torch.logspace(-1, 1, 300).unsqueeze(1), 32, 4)
    lin = QuantizedLinear(w, scales, biases, 32, 4)
    x = torch.randn(2, 256)
    pte = tmp_path / "q.pte"
    pte.write_bytes(export_to_pte(lin, (x,)).pte)
    torch.save(x, tmp_path / "x.pt")
    here = load_method(pte.read_bytes()).execute([x])[0].numpy()

    forced, _ = _run_with({"ETMLX_NUM_THREADS": "3", "ETMLX_QMM_ISA": "scalar"}, pte, tmp_path / "x.pt")
    # The scalar loop has only float32 activations.
    info = forced["info"]
    assert {k: info[k] for k in ("isa", "threads", "activations")} == {"isa": "scalar", "threads": 3,
                                                                       "activations": "float32"}
    ref = _reference(x, lin)
    assert (np.abs(np.array(forced["out"], dtype=np.float32) - ref) <= quantized_product_bound(x, lin, ref, torch.float32, "float32")).all()
    assert (np.abs(here - ref) <= quantized_product_bound(x, lin, ref, torch.float32)).all()

    # Each output is summed by one thread in one order: one thread gives this process's bits.
    alone, _ = _run_with({"ETMLX_NUM_THREADS": "1"}, pte, tmp_path / "x.pt")
    assert alone["info"] == {**kernels_info(), "threads": 1}
    np.testing.assert_array_equal(np.array(alone["out"], dtype=np.float32), here)

    bad, stderr = _run_with({"ETMLX_NUM_THREADS": "zero"}, pte, tmp_path / "x.pt")
    assert "ETMLX_NUM_THREADS=zero is not a thread count from 1 to 1024" in stderr
    assert bad["info"]["threads"] == kernels_info()["threads"] >= 1


def _used(mode: str, m: int) -> str:
    """The precision a product of m rows runs at in a program exported with `mode`: float32 where this CPU has
    no integer loop (few rows) or integer GEMM (many rows) for a 4-bit group-64 layout."""
    info = kernels_info()
    return mode if info["activations" if m < 16 else "gemm_activations"] != "float32" else "float32"


def test_activation_precisions_keep_their_stated_bounds(monkeypatch):
    """The program's activations (export_to_pte(qmm_activations=...), recorded in the blob): float32 keeps the
    float32 bound; int16 (the default) and int8 keep their own, wider ones (few rows and many). The three
    programs run side by side in one process, each at its own precision. Controls: int16 and int8 are not
    float32's bits, and int8 is NOT within int16's bound, so the bounds say something."""
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    torch.manual_seed(21)
    k, n = 896, 200
    w, scales, biases = quantize_tensor(torch.randn(n, k) * torch.logspace(-1, 1, n).unsqueeze(1), 64, 4)
    lin = QuantizedLinear(w, scales, biases, 64, 4)
    rows = torch.export.Dim("rows", min=1, max=64)
    methods = {mode: load_method(export_to_pte(lin, (torch.randn(3, k),), dynamic_shapes=({0: rows},),
                                               qmm_activations=mode).pte)
               for mode in ("float32", "int16", "int8")}
    ref_of = {}
    outs = {}
    for m in (1, 3, 40):
        x = torch.randn(m, k)
        ref_of[m] = (x, _reference(x, lin))
        for mode, method in methods.items():
            outs[m, mode] = method.execute([x])[0].numpy()
    for (m, mode), out in outs.items():
        x, ref = ref_of[m]
        used = _used(mode, m)
        assert (np.abs(out - ref) <= quantized_product_bound(x, lin, ref, torch.float32, used)).all(), (m, mode)
        if used != "float32":
            assert not np.array_equal(out, outs[m, "float32"]), (m, mode)
        if used == "int8":
            assert not (np.abs(out - ref) <= quantized_product_bound(x, lin, ref, torch.float32, "int16")).all(), m


def test_an_unknown_activation_precision_is_refused_at_export():
    lin = QuantizedLinear(*quantize_tensor(torch.randn(8, 64), 64, 4), 64, 4)
    with pytest.raises(ValueError, match="qmm_activations must be one of int16, int8, float32, got 'int4'"):
        export_to_pte(lin, (torch.randn(1, 64),), qmm_activations="int4")


def test_activations_in_any_layout_and_rank(monkeypatch):
    """The few-row pass reads x in place when it is row-contiguous and copies it in row-major order when
    not: a transposed view and a 3-d input give the reference's values, and each other's bits (a row's
    result depends only on that row and W)."""

    class Twice(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, xt, x3):
            return self.lin(xt.transpose(0, 1)), self.lin(x3)

    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    torch.manual_seed(11)
    w, scales, biases = quantize_tensor(torch.randn(72, 128) * torch.logspace(-1, 1, 72).unsqueeze(1), 64, 4)
    lin = QuantizedLinear(w, scales, biases, 64, 4)
    x = torch.randn(5, 128)
    model = Twice(lin)
    result = export_to_pte(model, (x.T.contiguous(), x.reshape(1, 5, 128)))
    assert result.ops_outside == 0
    transposed, three_d = load_method(result.pte).execute([x.T.contiguous(), x.reshape(1, 5, 128)])
    assert tuple(transposed.shape) == (5, 72) and tuple(three_d.shape) == (1, 5, 72)
    ref = _reference(x, lin)
    assert (np.abs(transposed.numpy() - ref) <= quantized_product_bound(x, lin, ref, torch.float32)).all()
    np.testing.assert_array_equal(three_d.numpy()[0], transposed.numpy())


@pytest.mark.subprocess  # a fresh interpreter with a one-thread pool
def test_many_row_product_with_integer_activations(tmp_path, monkeypatch):
    """A program exported with int16 or int8 activations sends a 64-row product through an integer GEMM where the
    CPU has one (kernels/quantized_gemm_vnni.h on AVX-512 VNNI, kernels/quantized_gemm_avx2.h on AVX2): not float32's bits, within the precision's stated
    bound (tests/quantized_bounds.py: the activations' rounding meets the centred weights), with activation
    groups of very different sizes; int8's result is outside int16's bound, so the bound says something; one
    pool thread gives the same bits. Where the CPU has no integer loop, float32's bits."""
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    torch.manual_seed(13)
    k, n, group = 896, 136, 64
    w, scales, biases = quantize_tensor(torch.randn(n, k) * torch.logspace(-1, 1, n).unsqueeze(1), group, 4)
    lin = QuantizedLinear(w, scales, biases, group, 4)
    x = torch.randn(64, k) * torch.logspace(-2, 1, k)
    ptes = {mode: export_to_pte(lin, (x,), qmm_activations=mode).pte for mode in ("float32", "int16", "int8")}
    ref = _reference(x, lin)
    outs = {mode: load_method(pte).execute([x])[0].numpy() for mode, pte in ptes.items()}
    for mode in ("int16", "int8"):
        out = outs[mode]
        if _used(mode, len(x)) == "float32":  # no integer GEMM here (no AVX2, or AVX-512 without VNNI)
            assert kernels_info()["isa"] != "avx2", f"{mode}: the AVX2 integer GEMM did not run"
            np.testing.assert_array_equal(out, outs["float32"])
            continue
        assert not np.array_equal(out, outs["float32"]), f"{mode}: float32's bits: the integer GEMM did not run"
        assert (np.abs(out - ref) <= quantized_product_bound(x, lin, ref, torch.float32, mode)).all(), mode
    if _used("int8", len(x)) == "int8":
        int8 = outs["int8"]
        assert not (np.abs(int8 - ref) <= quantized_product_bound(x, lin, ref, torch.float32, "int16")).all()
        # Each output is one thread's, in one order: one thread gives the same bits.
        pte = tmp_path / "int8.pte"
        pte.write_bytes(ptes["int8"])
        torch.save(x, tmp_path / "x.pt")
        alone, _ = _run_with({"ETMLX_NUM_THREADS": "1"}, pte, tmp_path / "x.pt")
        assert alone["info"]["threads"] == 1
        np.testing.assert_array_equal(np.array(alone["out"], dtype=np.float32), int8)
