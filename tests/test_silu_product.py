"""A gated MLP's SiLU(g) * u as one compiled node in the device kernel set (runtime/kernels/silu_product.h).

The exporter writes Sigmoid(g), Multiply(that, g), Multiply(that, u): on a GPU three graph nodes a layer, each
costing the host time to encode. The device set (ETMLX_KERNELS=device: what Metal and CUDA builds run; here MLX's
CPU compile stands in) returns the product as one mx::compile'd node. Checked: the graph has one compiled node and
no Sigmoid, the values equal MLX's three unfused operations bit for bit (float32 and bfloat16, decode- and
prefill-shaped rows through the same shapeless function, either operand order), and the control, a gate whose
product is with another array than the sigmoid's input, keeps the three nodes. The decoders' tokens on the device
set are checked against the CPU set's in test_device_kernels_lazy.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch

from backends.mlx.exporter.export import export_to_pte
from helpers import FnModule, graph_node_kinds

ROOT = Path(__file__).resolve().parents[1]

_CALL = """
import sys, torch
from backends.mlx.runtime.runner import load_method
pte, inputs, out = sys.argv[1:]
got = load_method(open(pte, "rb").read()).execute(torch.load(inputs))
torch.save([g.clone() for g in got], out)
"""


def _run_device(pte_bytes: bytes, inputs, tmp_path: Path, tag: str):
    pte, saved, out, dot = (tmp_path / f"{tag}{suffix}" for suffix in (".pte", ".in.pt", ".out.pt", ".dot"))
    pte.write_bytes(pte_bytes)
    torch.save(list(inputs), saved)
    done = subprocess.run([sys.executable, "-c", _CALL, str(pte), str(saved), str(out)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT,
                          env={"ETMLX_KERNELS": "device", "ETMLX_DOT": str(dot), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    return torch.load(out)[0], graph_node_kinds(dot)


def _mlx_unfused(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """MLX's own Sigmoid and two Multiplies, in the dtype of the inputs, as the device set ran them before."""
    to = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16}[g.dtype]
    mg, mu = (mx.array(t.float().numpy()).astype(to) for t in (g, u))
    r = mx.multiply(mx.multiply(mx.sigmoid(mg), mg), mu).astype(mx.float32)
    return torch.from_numpy(np.array(r)).to(g.dtype)


ORDERS = {
    "sigmoid_first": lambda g, u: (torch.sigmoid(g) * g) * u,
    "gate_first": lambda g, u: (g * torch.sigmoid(g)) * u,
    "up_first": lambda g, u: u * (torch.sigmoid(g) * g),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("order", list(ORDERS))
def test_silu_product_is_one_node_with_the_unfused_values(tmp_path, dtype, order):
    gen = torch.Generator().manual_seed(3)
    rows = {"decode": 1, "prefill": 7}
    for name, length in rows.items():
        g = (torch.randn(1, length, 96, generator=gen) * 4).to(dtype)
        u = torch.randn(1, length, 96, generator=gen).to(dtype)
        pte = export_to_pte(FnModule(ORDERS[order]), (g, u)).pte
        got, kinds = _run_device(pte, (g, u), tmp_path, f"{order}-{name}")
        compiled = [k for k in kinds if k.startswith("Compiled")]
        assert len(compiled) == 1 and kinds[compiled[0]] == 1, kinds
        assert kinds["Sigmoid"] == 0 and kinds["Multiply"] == 0, kinds
        assert got.dtype == dtype
        assert torch.equal(got.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                           _mlx_unfused(g, u).view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


def test_a_product_with_another_array_keeps_three_nodes(tmp_path):
    g, h, u = (torch.randn(1, 1, 64, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
    pte = export_to_pte(FnModule(lambda g, h, u: (torch.sigmoid(g) * h) * u), (g, h, u)).pte
    got, kinds = _run_device(pte, (g, h, u), tmp_path, "control")
    assert not [k for k in kinds if k.startswith("Compiled")], kinds
    assert kinds["Sigmoid"] == 1 and kinds["Multiply"] == 2, kinds
    torch.testing.assert_close(got, torch.sigmoid(g) * h * u)
