"""Instructions the cpu kernel set runs as one node (runtime/linear_groups.h): quantized linears over one
input (a layer's q/k/v and gate/up projections in a decode step; quantized_matmul_group_cpu), a gated MLP's
SiLU(gate) * up with them, and a residual add with the RMSNorm after it. Each fused result must have the
bits of the instructions run one by one (ETMLX_FUSE_LINEARS=0), as must an output projection made with the residual add
and norm after it; only linears that read the same input are
fused; prefill (many rows) and non-float32 activations keep the per-linear path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import backends.mlx  # noqa: F401  (before mlx.core: routes MLX's CPU GEMMs)
from backends.mlx.exporter.export import export_to_pte
from backends.mlx.llm.quantize.affine import quantize_tensor
from backends.mlx.llm.quantize.modules import QuantizedLinear
from backends.mlx.runtime import fused_node_counts, kernels_info
from backends.mlx.runtime.runner import load_method
from helpers import graph_node_kinds

ROOT = Path(__file__).resolve().parents[1]
K = 256
GROUP, BITS = 64, 4


def _linear(n: int, dtype, bias: bool) -> QuantizedLinear:
    # Rows of very different scales, so a result taken from the wrong matrix or row shows.
    weight = torch.randn(n, K) * torch.logspace(-1, 1, n).unsqueeze(1)
    w, scales, biases = quantize_tensor(weight.to(dtype), GROUP, BITS)
    return QuantizedLinear(w, scales, biases, GROUP, BITS, torch.randn(n).to(dtype) if bias else None)


class _Block(torch.nn.Module):
    """q over x alone (`other`, over y, comes between it and k), then k and v over x: one group; gate and
    up over z: one group; `other` has x's shape, group size and bits but its own input."""

    def __init__(self, dtype):
        super().__init__()
        self.q, self.k, self.v = (_linear(n, dtype, bias=True) for n in (192, 72, 40))
        self.other = _linear(72, dtype, bias=True)
        self.gate, self.up = (_linear(n, dtype, bias=False) for n in (136, 136))

    def forward(self, x, y, z):
        # k and v split into heads of 8 as attention does (reshape, transpose): made in the group's node.
        heads = lambda t: t.reshape(t.shape[0], t.shape[1], -1, 8).transpose(1, 2)
        q = self.q(x)
        o = self.other(y)
        k = heads(self.k(x))
        v = heads(self.v(x))
        g, u = self.gate(z), self.up(z)
        return q, o, k, v, g, u


def _export(dtype):
    torch.manual_seed(7)
    model = _Block(dtype)
    rows = torch.export.Dim("rows", min=1, max=64)
    example = tuple(torch.randn(1, 3, K).to(dtype) for _ in range(3))
    return export_to_pte(model, example, dynamic_shapes=tuple({1: rows} for _ in example))


def _run(pte: bytes, xs, monkeypatch, fuse: bool) -> tuple[list[np.ndarray], dict]:
    """The outputs' raw bits and the fused nodes built by kind; ETMLX_FUSE_LINEARS is read when the method loads."""
    if fuse:
        monkeypatch.delenv("ETMLX_FUSE_LINEARS", raising=False)
    else:
        monkeypatch.setenv("ETMLX_FUSE_LINEARS", "0")
    method = load_method(pte)
    before = fused_node_counts()
    outs = method.execute(list(xs))
    built = {k: v - before[k] for k, v in fused_node_counts().items()}
    return [o.contiguous().view(torch.int32 if o.dtype == torch.float32 else torch.int16).numpy() for o in outs], built


@pytest.mark.parametrize("rows", [1, 3])
def test_grouped_linears_give_the_bits_of_each_alone(rows, monkeypatch):
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    result = _export(torch.float32)
    assert result.ops_outside == 0
    xs = [torch.randn(1, rows, K) for _ in range(3)]
    fused, built = _run(result.pte, xs, monkeypatch, fuse=True)
    alone, built_alone = _run(result.pte, xs, monkeypatch, fuse=False)
    assert fused[2].shape == (1, 9, rows, 8)
    # Two groups per call (k+v, gate+up); q stays alone: `other`, over y, comes between q and k.
    assert built["linear_groups"] == 2 and built["silu_epilogues"] == 0 and built_alone["linear_groups"] == 0
    for i, (a, b) in enumerate(zip(fused, alone)):
        assert a.shape == b.shape and np.array_equal(a, b), f"output {i} differs fused"


def test_a_linear_over_another_input_is_not_fused_with_its_neighbours(monkeypatch):
    """y == x in value but not in slot: `other` must still read y (here made different from x)."""
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    result = _export(torch.float32)
    x = torch.randn(1, 1, K)
    fused, _ = _run(result.pte, [x, -x, x], monkeypatch, fuse=True)
    alone, _ = _run(result.pte, [x, -x, x], monkeypatch, fuse=False)
    assert np.array_equal(fused[1], alone[1])
    same_input, _ = _run(result.pte, [x, x, x], monkeypatch, fuse=True)
    assert not np.array_equal(fused[1], same_input[1]), "`other` ignored its own input"


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 64), (torch.bfloat16, 1)])
def test_prefill_and_half_activations_keep_the_per_linear_path(dtype, rows, monkeypatch):
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    result = _export(dtype)
    xs = [torch.randn(1, rows, K).to(dtype) for _ in range(3)]
    fused, built = _run(result.pte, xs, monkeypatch, fuse=True)
    alone, _ = _run(result.pte, xs, monkeypatch, fuse=False)
    assert built["linear_groups"] == 0
    for a, b in zip(fused, alone):
        assert np.array_equal(a, b)


class _GatedMlp(torch.nn.Module):
    """A decoder layer's MLP half: residual add, RMSNorm, SiLU(gate) * up, down, residual add."""

    def __init__(self):
        super().__init__()
        self.gate, self.up = (_linear(320, torch.float32, bias=False) for _ in range(2))
        weight = torch.randn(K, 320) * 0.1
        w, scales, biases = quantize_tensor(weight, GROUP, BITS)
        self.down = QuantizedLinear(w, scales, biases, GROUP, BITS)
        self.norm = torch.nn.Parameter(torch.rand(K) + 0.5)

    def forward(self, x, r):
        h = x + r
        n = torch.nn.functional.rms_norm(h, (K,), self.norm, eps=1e-6)
        y = self.down(torch.nn.functional.silu(self.gate(n)) * self.up(n))
        out = h + y
        return out, torch.nn.functional.rms_norm(out, (K,), self.norm, eps=1e-6)


@pytest.mark.parametrize("rows", [1, 2])
def test_gated_mlp_and_residual_norms_fused_give_the_same_bits(rows, monkeypatch):
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    torch.manual_seed(8)
    model = _GatedMlp()
    dim = torch.export.Dim("rows", min=1, max=64)
    example = (torch.randn(1, 3, K), torch.randn(1, 3, K))
    result = export_to_pte(model, example, dynamic_shapes=({1: dim}, {1: dim}))
    assert result.ops_outside == 0
    xs = [torch.randn(1, rows, K) * 4, torch.randn(1, rows, K)]
    fused, built = _run(result.pte, xs, monkeypatch, fuse=True)
    alone, built_alone = _run(result.pte, xs, monkeypatch, fuse=False)
    # x + r and its norm; gate/up with SiLU(gate) * up (where the CPU runs sigmoid's own x86 loop, AVX-512 or
    # AVX2: the epilogue must compute what the Sigmoid node would); down with h + y and its norm.
    silu = 1 if kernels_info()["isa"] in ("avx512", "avx2") else 0
    assert built == {"linear_groups": 1, "silu_epilogues": silu, "add_rms_norms": 1, "matmul_add_rms_norms": 1,
                     "rope_pairs": 0}, built
    assert not any(built_alone.values())
    for i, (a, b) in enumerate(zip(fused, alone)):
        assert a.shape == b.shape and np.array_equal(a, b), f"output {i} differs fused"
    # And the unfused values are the model's (a wrong fusion could agree with itself, not with this), within
    # 1e-3 of each output's range: with integer activations (the default on VNNI CPUs) the down projection's
    # error scales with the largest value of each input group, and these gate/up rows span 100x.
    want = model(*xs)
    for got, ref in zip(alone, want):
        atol = 1e-3 * float(ref.abs().max())
        torch.testing.assert_close(torch.from_numpy(got).view(torch.float32), ref, atol=atol, rtol=1e-3)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _QkRope(torch.nn.Module):
    """A layer's q and k rotated by the same tables (two RopeNodes in a row: one node on the cpu set), and
    with `chained` k rotated from q's result, or with `other_tables` by its own tables (no pair). A bfloat16
    model's tables (`half_tables`: cast to bfloat16, then promoted back by each product, a cast before each
    RopeNode) still make one node; tables rounded through float16 for k (`half_tables_apart`) do not."""

    def __init__(self, variant: str):
        super().__init__()
        self.variant = variant
        self.register_buffer("inv_freq", 1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)

    def forward(self, q, k, pos):
        freqs = pos[None, :, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)
        rq = q * cos + _rotate_half(q) * sin
        if self.variant == "chained":
            return rq, rq[:, :2] * cos + _rotate_half(rq[:, :2]) * sin
        if self.variant.startswith("half_tables"):
            cos, sin = cos.bfloat16(), sin.bfloat16()
            rq = q * cos + _rotate_half(q) * sin
            if self.variant == "half_tables_apart":
                cos, sin = cos.half(), sin.half()
            return rq, k * cos + _rotate_half(k) * sin
        if self.variant == "other_tables":
            cos2, sin2 = (emb * 0.5).cos().unsqueeze(1), (emb * 0.5).sin().unsqueeze(1)
            return rq, k * cos2 + _rotate_half(k) * sin2
        return rq, k * cos + _rotate_half(k) * sin


@pytest.mark.parametrize("variant", ["pair", "chained", "other_tables", "half_tables", "half_tables_apart"])
def test_q_and_k_rotations_as_one_node_give_the_same_bits(variant, monkeypatch):
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    torch.manual_seed(9)
    model = _QkRope(variant)
    xs = [torch.randn(1, 4, 3, 8) * 3, torch.randn(1, 2, 3, 8) * 3, torch.tensor([7, 8, 9])]
    result = export_to_pte(model, tuple(xs))
    assert result.ops_outside == 0
    fused, built = _run(result.pte, xs, monkeypatch, fuse=True)
    alone, built_alone = _run(result.pte, xs, monkeypatch, fuse=False)
    assert built["rope_pairs"] == (1 if variant in ("pair", "half_tables") else 0), built
    assert built_alone["rope_pairs"] == 0
    for i, (a, b) in enumerate(zip(fused, alone)):
        assert a.shape == b.shape and np.array_equal(a, b), f"output {i} differs fused"
    for got, ref in zip(fused, model(*xs)):  # and they are the rotations (a swapped pair would agree with itself)
        torch.testing.assert_close(torch.from_numpy(got).view(torch.float32), ref, atol=1e-5, rtol=1e-5)


_CALL = """
import sys, torch
from backends.mlx.runtime.runner import load_method
pte = sys.argv[1]
torch.manual_seed(9)
xs = [torch.randn(1, 4, 3, 8) * 3, torch.randn(1, 2, 3, 8) * 3, torch.tensor([7, 8, 9])]
load_method(open(pte, "rb").read()).execute(xs)
"""


def test_a_bfloat16_models_table_casts_are_made_once_per_call(tmp_path):
    # The exporter casts a bfloat16 model's cos and sin back to float32 before each rotation; the interpreter
    # makes the cast of a small array once per call (Interpreter::shared_view), so q and k's casts are one
    # node each and the two rotations one node.
    from backends.mlx.exporter.inspect_pte import delegate_blobs, instruction_kinds
    from backends.mlx.serialization.serializer import deserialize

    pte = tmp_path / "half_tables.pte"
    export_to_pte(_QkRope("half_tables"), (torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8),
                                           torch.tensor([7, 8, 9]))).save(pte)
    graph = deserialize(delegate_blobs(pte.read_bytes())[0])
    casts = instruction_kinds(graph)["AsTypeNode"]
    assert casts >= 6, "the program no longer casts the tables before each rotation"  # 2 down, 2 up per rotation
    dot = tmp_path / "call.dot"
    done = subprocess.run([sys.executable, "-c", _CALL, str(pte)], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env=dict(os.environ, ETMLX_DOT=str(dot), ETMLX_KERNELS="cpu"))
    assert done.returncode == 0, done.stderr[-2000:]
    kinds = graph_node_kinds(dot)
    assert kinds["AsType"] == 4 and kinds["RopePairCpu"] == 1 and kinds["RopeCpu"] == 0, kinds  # down once, up once
