"""Quantized weights (MLX's affine scheme): the integers are mlx.core.quantize's, the delegate's
QuantizedLinearNode / QuantizedEmbeddingNode give what MLX's own kernels give, a bad layout fails at
load, and --quantize / mlx-lm checkpoints export and decode."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import backends.mlx  # noqa: F401  (before mlx.core: routes MLX's CPU GEMMs)
import mlx.core as mx
from backends.mlx.custom_kernel_ops import quantized as q
from backends.mlx.llm.quantize.affine import quantize_model, quantize_tensor
from backends.mlx.llm.quantize.modules import QuantizedEmbedding, QuantizedLinear
from backends.mlx.runtime.runner import run
from helpers import export_fn
from quantized_bounds import quantized_product_bound

PARAMS = [(bits, group) for bits in (4, 8) for group in (32, 64, 128)]
MX_DTYPES = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16, torch.float16: mx.float16}


def _mx(t: torch.Tensor):
    if t.dtype in (torch.bfloat16, torch.float16):
        return mx.array(t.float().numpy()).astype(MX_DTYPES[t.dtype])
    return mx.array(t.numpy())


def _np(a) -> np.ndarray:
    return np.array(a.astype(mx.float32)) if a.dtype == mx.bfloat16 else np.array(a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group", PARAMS)
def test_quantize_gives_mlx_quantize_integers_scales_and_biases(bits, group, dtype):
    weight = (torch.randn(24, 256) * 0.3).to(dtype)
    w, scales, biases = quantize_tensor(weight, group, bits)
    ref = mx.quantize(_mx(weight), group_size=group, bits=bits)
    assert w.dtype == torch.uint32 and scales.dtype == dtype and biases.dtype == dtype
    assert np.array_equal(w.numpy(), np.array(ref[0]))
    assert np.array_equal(scales.float().numpy(), _np(ref[1]))
    assert np.array_equal(biases.float().numpy(), _np(ref[2]))


@pytest.mark.parametrize("bits,group", PARAMS)
def test_host_dequantize_equals_mlx_dequantize(bits, group):
    w, scales, biases = quantize_tensor(torch.randn(8, 256), group, bits)
    ref = mx.dequantize(_mx(w), _mx(scales), _mx(biases), group_size=group, bits=bits)
    np.testing.assert_allclose(q.dequantize(w, scales, biases, group, bits).numpy(), np.array(ref),
                               rtol=0, atol=1e-6)


class _Layers(torch.nn.Module):
    def __init__(self, bits, group, dtype=torch.float32, bias=True):
        super().__init__()
        w, scales, biases = quantize_tensor(torch.randn(40, 256).to(dtype), group, bits)
        self.linear = QuantizedLinear(w, scales, biases, group, bits,
                                      bias=torch.randn(40).to(dtype) if bias else None)
        self.embedding = QuantizedEmbedding(w, scales, biases, group, bits)

    def forward(self, x, ids):
        return self.linear(x), self.embedding(ids)


@pytest.mark.parametrize("kernels", ["cpu", "device"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group", PARAMS)
def test_quantized_linear_and_embedding_match_mlx_kernels(bits, group, dtype, kernels, monkeypatch):
    monkeypatch.setenv("ETMLX_KERNELS", kernels)
    model = _Layers(bits, group, dtype, bias=group != 64)
    x, ids = torch.randn(2, 3, 256).to(dtype), torch.tensor([[0, 39, 7], [39, 3, 3]])
    result = export_fn(model, [x, ids])
    assert result.ops_outside == 0
    linear, embedding = run(result.pte, [x, ids])
    lin = model.linear
    ref = mx.quantized_matmul(_mx(x), _mx(lin.weight), _mx(lin.scales), _mx(lin.biases), transpose=True,
                              group_size=group, bits=bits)
    if lin.bias is not None:
        ref = ref + _mx(lin.bias)
    assert linear.dtype == dtype and tuple(linear.shape) == (2, 3, 40)
    if kernels == "device":
        np.testing.assert_array_equal(linear.float().numpy(), _np(ref))
    else:
        # The cpu set's own kernel (tests/test_quantized_matmul_cpu.py has the full check): MLX's kernel
        # over the same values in float32, up to the order of the float32 additions.
        f32 = lambda t: mx.array(t.float().numpy())
        ref32 = mx.quantized_matmul(f32(x), _mx(lin.weight), f32(lin.scales), f32(lin.biases), transpose=True,
                                    group_size=group, bits=bits).astype(MX_DTYPES[dtype])
        if lin.bias is not None:
            ref32 = ref32 + _mx(lin.bias)
        # Within the stated bound of the kernels' activation precision (tests/quantized_bounds.py); in bfloat16
        # the bias add rounds once more (one more bfloat16 step).
        bound = quantized_product_bound(x, lin, _np(ref32), dtype)
        if dtype == torch.bfloat16 and lin.bias is not None:
            bound = bound + 2.0 ** -7 * np.abs(_np(ref32))
        assert (np.abs(linear.float().numpy() - _np(ref32)) <= bound).all()
    rows = mx.dequantize(_mx(lin.weight), _mx(lin.scales), _mx(lin.biases), group_size=group, bits=bits)
    np.testing.assert_array_equal(embedding.float().numpy(), _np(rows)[ids.numpy()])
    # The host reference (dequantize, then the float op) agrees within float rounding (the cpu set: within
    # its activation precision's bound more).
    eager_linear, eager_embedding = model(x, ids)
    # bfloat16: torch and MLX accumulate the 256-term dot products differently; within 5% of the range.
    scale = float(eager_linear.float().abs().max())
    if dtype == torch.bfloat16:
        torch.testing.assert_close(linear, eager_linear, rtol=0, atol=0.05 * scale)
    else:
        slack = 1e-4 + 1e-4 * np.abs(eager_linear.detach().numpy())
        if kernels == "cpu":
            slack = slack + quantized_product_bound(x, lin, eager_linear.detach().numpy(), dtype)
        assert (np.abs(linear.numpy() - eager_linear.detach().numpy()) <= slack).all()
    # The reference computes scale * q + bias as MLX does, in the scales' dtype one operation at a time.
    torch.testing.assert_close(embedding, eager_embedding, **(dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=0, atol=1e-6)))


class _Embedding(torch.nn.Module):
    def __init__(self, bits, group, dtype):
        super().__init__()
        # Scales of every size (a wide range of magnitudes), so that the products round in many ways.
        weight = torch.randn(300, 256) * torch.logspace(-3, 2, 300).unsqueeze(1)
        self.embedding = QuantizedEmbedding(*quantize_tensor(weight.to(dtype), group, bits), group, bits)

    def forward(self, ids):
        return self.embedding(ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bits,group", [(4, 64), (8, 32), (4, 128)])
def test_cpu_embedding_lookup_is_mlx_dequantize_bit_for_bit(bits, group, dtype, monkeypatch):
    # The cpu set's host loop (kernels/quantized_embedding_cpu.cpp) in each scales dtype: q cast to it, times
    # the scale, plus the bias, each rounded to that dtype as MLX's dequantize does (one rounding of the
    # float32 q * scale + bias differs: checked).
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")
    model = _Embedding(bits, group, dtype)
    ids = torch.randint(0, 300, (3, 40))
    (looked_up,) = run(export_fn(model, [ids]).pte, [ids])
    e = model.embedding
    rows = mx.dequantize(_mx(e.weight), _mx(e.scales), _mx(e.biases), group_size=group, bits=bits)
    assert looked_up.dtype == dtype
    np.testing.assert_array_equal(looked_up.float().numpy(), np.array(rows.astype(mx.float32))[ids.numpy()])


def test_bad_parameters_are_one_line_errors():
    with pytest.raises(ValueError, match="group size 64 does not divide the input dimension 96"):
        quantize_tensor(torch.randn(4, 96), 64, 4)
    with pytest.raises(ValueError, match="3-bit quantization is not supported"):
        quantize_tensor(torch.randn(4, 128), 64, 3)
    with pytest.raises(ValueError, match="group size 16 is not supported"):
        quantize_tensor(torch.randn(4, 128), 16, 4)
    w, scales, biases = quantize_tensor(torch.randn(4, 128), 64, 4)
    with pytest.raises(ValueError, match="do not match packed weights"):
        QuantizedLinear(w, scales[:, :1], biases[:, :1], 64, 4)


def _tiny_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


def test_quantize_model_replaces_every_linear_and_shares_a_tied_head():
    tied = quantize_model(_tiny_llama(tied=True), 4, 64)
    assert not any(isinstance(m, (torch.nn.Linear, torch.nn.Embedding)) for m in tied.modules())
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    kept = quantize_model(_tiny_llama(tied=False), 8, 32, embeddings=False)
    assert isinstance(kept.lm_head, torch.nn.Linear) and isinstance(kept.model.embed_tokens, torch.nn.Embedding)
    assert isinstance(kept.model.layers[0].mlp.down_proj, QuantizedLinear)
