"""Every op family against eager PyTorch, through the real .pte and the ExecuTorch runtime.

Each case exports one function for one dtype; the function is applied to inputs of
several shapes in the same program, so a case covers shapes without re-exporting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import pytest
import torch

from helpers import ALL, FLOATS, INTS, assert_matches, export_fn
from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.runtime.runner import run

aten = torch.ops.aten
SHAPES = [(7,), (3, 5), (2, 3, 4)]
MATRIX_SHAPES = [(3, 5), (2, 3, 4)]


def rand(shape, dtype, low=-3.0, high=3.0):
    if dtype.is_floating_point:
        return (torch.rand(shape) * (high - low) + low).to(dtype)
    return torch.randint(int(low), int(high) + 1, shape, dtype=dtype)


def positive(shape, dtype):
    if dtype.is_floating_point:
        return (torch.rand(shape) * 3 + 0.25).to(dtype)
    return torch.randint(1, 6, shape, dtype=dtype)


def distinct(shape, dtype):
    """Values without ties (sorting ties are unspecified in torch), exact in every dtype."""
    n = int(torch.tensor(shape).prod())
    return (torch.randperm(n) - n // 2).reshape(shape).to(dtype)


@dataclass
class Case:
    name: str
    fn: Callable
    make: Callable  # (shape, dtype) -> tuple of inputs
    dtypes: Sequence[torch.dtype] = ALL
    shapes: Sequence[tuple] = tuple(SHAPES)
    # Compare half-precision results with eager run in float32 and rounded once: for ops whose eager
    # CPU half kernel rounds intermediates (measured further from the float64 result than ours).
    float32_reference: bool = False


def one(gen=rand):
    return lambda s, d: (gen(s, d),)


def two(gen=rand, gen2=None):
    return lambda s, d: (gen(s, d), (gen2 or gen)(s, d))


def _filled_empty(a):
    """An empty tensor written slice by slice, as DeepSeek-V3's attention builds its query (empty + slice_scatter)."""
    out = a.new_empty(a.shape)
    out[..., :1] = a[..., :1]
    out[..., 1:] = a[..., 1:] * 2
    return out


def last_dim_index(shape, k=2):
    return torch.randint(0, shape[-1], (*shape[:-1], k))


def within(low, high):
    """Values in (low, high) for floats; for ints, the integers in [ceil(low), floor(high)]."""
    return lambda s, d: rand(s, d, low, high) if d.is_floating_point else torch.randint(
        int(math.ceil(low)), int(math.floor(high)) + 1, s, dtype=d)


def halves(shape, dtype):
    """Multiples of 0.5 (ties for round's half-to-even), exact in every float dtype."""
    return (torch.randint(-12, 13, shape) / 2).to(dtype)


def shift_counts(shape, dtype):
    return torch.randint(0, 8, shape, dtype=dtype)


IMAGE_SHAPES = [(2, 3, 9, 8), (1, 3, 6, 7)]  # [N, C, H, W]
SIGNAL_SHAPES = [(2, 3, 11), (1, 3, 8)]  # [N, C, L]
VOLUME_SHAPES = [(1, 2, 5, 6, 7)]  # [N, C, D, H, W]


def conv_case(name, conv, weight_shape, shapes, **kw):
    """A convolution (input, weight, bias as inputs) with keyword arguments kw. Eager's half-precision
    transposed convolution rounds its partial sums, so those compare with eager in float32."""
    transposed = "transpose" in conv.__name__
    out_channels = weight_shape[1] * kw.get("groups", 1) if transposed else weight_shape[0]
    return Case(name, lambda x, w, bias: conv(x, w, bias, **kw),
                lambda s, d: (rand(s, d), rand(weight_shape, d, -1, 1), rand((out_channels,), d)), FLOATS, shapes,
                float32_reference=transposed)


CASES = [
    # arithmetic
    Case("add", lambda a, b: a + b, two()),
    Case("add_scalar", lambda a: a + 2, one()),
    Case("sub_alpha", lambda a, b: torch.sub(a, b, alpha=2), two()),
    Case("rsub", lambda a: 1 - a, one()),
    Case("mul", lambda a, b: a * b, two()),
    Case("mul_scalar_float", lambda a: a * 0.5, one()),
    Case("div", lambda a, b: a / b, two(rand, positive)),
    Case("div_floor", lambda a, b: torch.div(a, b, rounding_mode="floor"), two(rand, positive)),
    Case("div_trunc", lambda a, b: torch.div(a, b, rounding_mode="trunc"), two(rand, positive), FLOATS),
    Case("remainder", lambda a, b: torch.remainder(a, b), two(rand, positive)),
    Case("neg", lambda a: -a, one()),
    Case("abs", torch.abs, one()),
    Case("exp", torch.exp, one()),
    Case("log", torch.log, one(positive)),
    Case("sqrt", torch.sqrt, one(positive)),
    Case("rsqrt", torch.rsqrt, one(positive), FLOATS),
    Case("pow_scalar", lambda a: a**2, one()),
    Case("pow_tensor", lambda a, b: torch.pow(a, b), two(positive, lambda s, d: rand(s, d, -2, 2)), FLOATS),
    Case("minimum", torch.minimum, two()),
    Case("maximum", torch.maximum, two()),
    Case("clamp", lambda a: torch.clamp(a, -1, 2), one()),
    Case("clamp_min_only", lambda a: torch.clamp(a, min=0.5), one(), FLOATS),
    Case("tanh_sigmoid", lambda a: torch.tanh(a) + torch.sigmoid(a), one(), FLOATS),
    Case("gelu", lambda a: torch.nn.functional.gelu(a), one(), FLOATS),
    Case("gelu_tanh", lambda a: torch.nn.functional.gelu(a, approximate="tanh"), one(), FLOATS),
    # comparisons and where
    Case("eq", lambda a, b: a == b, two(lambda s, d: rand(s, d, -1, 1))),
    Case("lt_ge", lambda a, b: torch.stack([a < b, a >= b]), two()),
    Case("gt_scalar", lambda a: a > 0, one()),
    Case("where", lambda a, b: torch.where(a > b, a, b), two()),
    Case("where_scalar", lambda a: torch.where(a > 0, a, 0), one()),
    Case("logical", lambda a, b: torch.logical_and(a > 0, b > 0) | ~(a > b), two()),
    # casts
    Case("to_float32", lambda a: a.to(torch.float32), one()),
    Case("to_float16", lambda a: a.to(torch.float16), one()),
    Case("to_int32", lambda a: a.to(torch.int32), one()),
    Case("to_int64", lambda a: a.to(torch.int64), one()),
    Case("to_bool", lambda a: a.to(torch.bool), one(lambda s, d: rand(s, d, -1, 1))),
    # creation (the input only carries the dtype and shape)
    Case("full_like", lambda a: a + torch.full(a.shape, 3, dtype=a.dtype), one()),
    Case("zeros_ones", lambda a: a + torch.zeros(a.shape, dtype=a.dtype) + torch.ones(a.shape, dtype=a.dtype),
         one()),
    Case("empty_filled", lambda a: _filled_empty(a), one()),
    Case("arange", lambda a: a + torch.arange(a.shape[-1], dtype=a.dtype), one()),
    Case("arange_step", lambda a: a * torch.arange(1, 2 * a.shape[-1] + 1, 2).to(a.dtype), one()),
    # reductions
    Case("sum", lambda a: (a.sum(-1), a.sum()), one()),
    Case("sum_keepdim", lambda a: a.sum(0, keepdim=True), one()),
    Case("mean", lambda a: (a.mean(-1), a.mean()), one(), FLOATS),
    Case("amax_amin", lambda a: (a.amax(-1), a.amin(0)), one()),
    Case("argmax_argmin", lambda a: (a.argmax(-1), a.argmin(0), a.argmax()), one(distinct)),
    Case("argmax_ties_first", lambda a: a.argmax(-1), one(lambda s, d: rand(s, d, 0, 2)), INTS),
    Case("logsumexp", lambda a: torch.logsumexp(a, -1), one(), FLOATS),
    Case("softmax", lambda a: torch.softmax(a, -1), one(), FLOATS),
    Case("log_softmax", lambda a: torch.log_softmax(a, 0), one(), FLOATS),
    Case("cumsum", lambda a: torch.cumsum(a, -1), one()),
    # sorting
    Case("sort", lambda a: torch.sort(a, -1), one(distinct)),
    Case("sort_descending", lambda a: torch.sort(a, 0, descending=True), one(distinct)),
    Case("argsort", lambda a: torch.argsort(a, -1, descending=True), one(distinct)),
    Case("topk", lambda a: torch.topk(a, 2, -1), one(distinct)),
    Case("topk_smallest", lambda a: torch.topk(a, 3, 0, largest=False), one(distinct), ALL, [(5,), (4, 3)]),
    # gather and scatter
    Case("gather", lambda a, i: torch.gather(a, -1, i), lambda s, d: (rand(s, d), last_dim_index(s))),
    Case("take_along_dim", lambda a, i: torch.take_along_dim(a, i, -1),
         lambda s, d: (rand(s, d), last_dim_index(s))),
    Case("index_select", lambda a, i: torch.index_select(a, 0, i),
         lambda s, d: (rand(s, d), torch.randint(0, s[0], (4,)))),
    Case("scatter", lambda a, i, v: torch.scatter(a, -1, i, v),
         lambda s, d: (rand(s, d), torch.argsort(torch.rand(s), -1)[..., :2].contiguous(), rand((*s[:-1], 2), d))),
    Case("scatter_add", lambda a, i, v: torch.scatter_add(a, -1, i, v),
         lambda s, d: (rand(s, d), last_dim_index(s, 3), rand((*s[:-1], 3), d))),
    # One index, broadcast from a smaller tensor, used by several gathers/scatters over axes of two sizes (as a KV cache's
    # positions are, once per layer): the runtime normalizes it once per axis size and re-broadcasts it.
    Case("broadcast_index_shared", lambda a, i: (
        torch.gather(a, -1, i.reshape(*([1] * (a.dim() - 1)), 2).expand(*a.shape[:-1], 2)),
        torch.scatter(a, -1, i.reshape(*([1] * (a.dim() - 1)), 2).expand(*a.shape[:-1], 2), 5),
        torch.gather(torch.cat([a, a], -1), -1, i.reshape(*([1] * (a.dim() - 1)), 2).expand(*a.shape[:-1], 2))),
         lambda s, d: (rand(s, d), torch.tensor([s[-1] - 1, 0]))),
    Case("embedding", lambda w, i: torch.nn.functional.embedding(i, w),
         lambda s, d: (rand((10, 4), d), torch.randint(0, 10, s)), FLOATS),
    Case("index_one_tensor", lambda a, i: (a[i], a[:, i] if a.dim() > 1 else a[i]),
         lambda s, d: (rand(s, d), torch.tensor([0, -1, 1]))),
    Case("index_two_tensors", lambda a, i, j: a[i, j],
         lambda s, d: (rand(s, d), torch.tensor([[0], [1]]), torch.tensor([0, -1, 2, 1])), ALL, [(3, 5), (2, 3, 4)]),
    Case("index_copy", lambda a, i, v: a.index_copy(-1, i, v),
         lambda s, d: (rand(s, d), torch.tensor([2, 0]), rand((*s[:-1], 2), d))),
    # shapes
    Case("split", lambda a: torch.split(a, [2, a.shape[-1] - 2], -1) + torch.split(a, 2, 0), one()),
    Case("layer_norm", lambda a, w, bias: torch.nn.functional.layer_norm(a, a.shape[-1:], w, bias, 1e-5),
         lambda s, d: (rand(s, d), rand(s[-1:], d), rand(s[-1:], d)), FLOATS),
    Case("reshape", lambda a: a.reshape(-1, 1), one()),
    Case("permute_transpose", lambda a: (a.permute(*reversed(range(a.dim()))), a.transpose(0, -1)), one()),
    Case("unsqueeze_squeeze", lambda a: (a.unsqueeze(1), a.unsqueeze(0).squeeze(0), a.unsqueeze(-1).squeeze()),
         one()),
    Case("expand", lambda a: a.unsqueeze(0).expand(3, *a.shape), one()),
    # The same cast of one array, repeated (made once per call: Interpreter::shared_view), and a cast of another.
    Case("cast_repeated", lambda a: (a.to(torch.float16) * 2, a.to(torch.float16) + 1, (a * 3).to(torch.float16),
                                     a.to(torch.int32) - 1), one(), FLOATS),
    Case("slice", lambda a: (a[..., 1:], a[::2], a[-2:], a[..., 1:-1:2]), one()),
    Case("select", lambda a: (a[0], a[-1]), one()),
    Case("cat", lambda a, b: (torch.cat([a, b], 0), torch.cat([a, b, a], -1)), two()),
    # linear algebra (MLX multiplies floating types)
    Case("matmul", lambda a, b: a @ b.transpose(-1, -2), two(), FLOATS, MATRIX_SHAPES),
    Case("linear", lambda x, w, bias: torch.nn.functional.linear(x, w, bias),
         lambda s, d: (rand(s, d), rand((6, s[-1]), d), rand((6,), d)), FLOATS, MATRIX_SHAPES),
    Case("addmm", lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0),
         lambda s, d: (rand((s[0], 6), d), rand(s, d), rand((s[1], 6), d)), FLOATS, [(3, 5), (1, 4)]),
    # more unary math
    Case("sin_cos", lambda a: (torch.sin(a), torch.cos(a)), one()),
    Case("floor_ceil_sign", lambda a: (torch.floor(a), torch.ceil(a), torch.sign(a)), one(halves), FLOATS),
    Case("erf_log1p_reciprocal", lambda a: (torch.erf(a), torch.log1p(a), torch.reciprocal(a)), one(positive), FLOATS),
    Case("isnan_isinf", lambda a: (torch.isnan(a), torch.isinf(a)),
         one(lambda s, d: torch.where(torch.rand(s) < 0.3, torch.tensor(float("nan")), rand(s, torch.float32))
             .where(torch.rand(s) > 0.2, torch.tensor(float("inf"))).to(d)), FLOATS),
    Case("relu", torch.relu, one()),
    # overloads that only appear when called by name (or produced by decompositions)
    Case("scalar_overloads", lambda a: (aten.add.Scalar(a, 2), aten.sub.Scalar(a, 1), aten.mul.Scalar(a, 3),
                                        aten.div.Scalar(a, 4), aten.pow.Scalar(2, a)), one(within(-2, 2)), FLOATS),
    Case("div_scalar_mode", lambda a: aten.div.Scalar_mode(a, 2, rounding_mode="floor"), one()),
    Case("compare_scalars", lambda a, b: (a != b, a <= b, a < 1, a >= 1, a <= 0, a != 1), two()),
    Case("logical_not_or", lambda a, b: (torch.logical_not(a > 0), torch.logical_or(a > 0, b > 0)), two()),
    Case("where_scalars", lambda a: (aten.where.ScalarSelf(a > 0, 1.5, a), aten.where.ScalarOther(a > 0, a, -2.0),
                                     aten.where.Scalar(a > 0, 1.0, 0.0)), one(), FLOATS),
    Case("clamp_tensor", lambda a, b: torch.clamp(a, b - 1, b + 1), two()),
    Case("bitwise_tensor", lambda a, b: (a & b, a | b, a ^ b, ~a), two(lambda s, d: rand(s, d, -20, 20)), INTS),
    Case("shift_overloads", lambda a, n: (a << n, a >> n, aten.bitwise_left_shift.Tensor_Scalar(a, 2),
                                          aten.bitwise_right_shift.Tensor_Scalar(a, 1),
                                          aten.bitwise_left_shift.Scalar_Tensor(3, n),
                                          aten.bitwise_right_shift.Scalar_Tensor(-64, n)),
         two(lambda s, d: rand(s, d, -20, 20), shift_counts), INTS),
    Case("any_all_prod", lambda a: ((a > 0).any(), (a > 0).any(-1), aten.any.dims(a > 0, [0]), aten.all.default(a > 0),
                                    aten.all.dim(a > 0, 0), aten.all.dims(a > 0, [0]), a.prod(), a.prod(-1)),
         one(within(-1.5, 1.5))),
    Case("full_like_family", lambda a: (torch.full_like(a, 2), aten.zeros_like.default(a), aten.ones_like.default(a)),
         one()),
    Case("scatter_value", lambda a, i: torch.scatter(a, -1, i, 5),
         lambda s, d: (rand(s, d), torch.argsort(torch.rand(s), -1)[..., :2].contiguous())),
    Case("sort_stable", lambda a: torch.sort(a, dim=-1, stable=True), one(lambda s, d: rand(s, d, 0, 3))),
    Case("sdpa", lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),
         lambda s, d: (rand((1, 2, 4, 8), d), rand((1, 2, 4, 8), d), rand((1, 2, 4, 8), d)), FLOATS, [(1,)]),
    # trigonometric, hyperbolic and logarithmic functions (integers compute in float32, as torch)
    Case("tan", torch.tan, one(within(-1.2, 1.2))),
    Case("asin_acos", lambda a: (torch.asin(a), torch.acos(a)), one(within(-0.95, 0.95))),
    Case("atan", torch.atan, one()),
    Case("sinh_cosh", lambda a: (torch.sinh(a), torch.cosh(a)), one()),
    Case("asinh", torch.asinh, one()),
    Case("acosh", torch.acosh, one(within(1.05, 4))),
    Case("atanh", torch.atanh, one(within(-0.95, 0.95)), FLOATS),
    Case("log2_log10", lambda a: (torch.log2(a), torch.log10(a)), one(positive)),
    Case("round", torch.round, one(halves), FLOATS),
    Case("round_int", torch.round, one(), INTS),
    Case("round_decimals", lambda a: (torch.round(a, decimals=1), torch.round(a * 100, decimals=-1)), one(),
         (torch.float32,)),
    Case("trunc", torch.trunc, one()),
    Case("atan2", torch.atan2, two(), FLOATS),
    Case("logaddexp", torch.logaddexp, two(), FLOATS),
    # bitwise (the shift count within the dtype's width)
    Case("bitwise_scalar", lambda a: (a & 6, a | 5, a ^ 3), one(lambda s, d: rand(s, d, -20, 20)), INTS),
    Case("shift_scalar", lambda a: (a << 3, a >> 1), one(lambda s, d: rand(s, d, -20, 20)), INTS),
    Case("shift_tensor", lambda a, n: (torch.bitwise_left_shift(a, n), torch.bitwise_right_shift(a, n)),
         two(lambda s, d: rand(s, d, -20, 20), shift_counts), INTS),
    Case("logical_xor", lambda a, b: torch.logical_xor(a > 0, b), two()),
    # activations
    Case("hardtanh_relu6", lambda a: (torch.nn.functional.hardtanh(a, -0.5, 2.0), torch.nn.functional.relu6(a * 3)),
         one()),
    Case("leaky_relu", lambda a: torch.nn.functional.leaky_relu(a, 0.07), one(), FLOATS),
    Case("elu_selu_celu", lambda a: (torch.nn.functional.elu(a, 0.7), torch.nn.functional.selu(a),
                                     torch.nn.functional.celu(a, 1.3)), one(), FLOATS),
    # reductions
    Case("max_min_all", lambda a: (a.max(), a.min()), one()),
    Case("max_min_dim", lambda a: (*a.max(-1), *a.min(0, keepdim=True)), one(distinct)),
    Case("var_std", lambda a: (a.var(-1), a.std(0, keepdim=True), torch.var(a, unbiased=False),
                               torch.var(a, -1, True, True), torch.std(a, -1, correction=0)), one(), FLOATS),
    # rearrangements
    Case("tril_triu", lambda a: (torch.tril(a), torch.triu(a, 1), torch.tril(a, -1)), one(), ALL, MATRIX_SHAPES),
    Case("constant_pad", lambda a: (torch.nn.functional.pad(a, (1, 2), value=3), torch.nn.functional.pad(a, (2, -1)),
                                    torch.nn.functional.pad(a, (0, 0, 1, 0)) if a.dim() > 1 else a), one()),
    Case("stack", lambda a, b: (torch.stack([a, b]), torch.stack([a, b, a], -1)), two()),
    Case("narrow", lambda a: (a.narrow(-1, 1, 2), a.narrow(0, 0, 1)), one()),
    Case("repeat", lambda a: (a.repeat(2, *[1] * a.dim()), a.repeat(*[1] * (a.dim() - 1), 3)), one()),
    Case("repeat_interleave", lambda a: (a.repeat_interleave(2, dim=-1), a.repeat_interleave(3)), one()),
    Case("roll", lambda a: (torch.roll(a, 2, -1), torch.roll(a, -1, 0), torch.roll(a, 3)), one()),
    Case("slice_scatter", lambda a, b: (torch.slice_scatter(a, b[..., 1:3] * 2, -1, 2, 4),
                                        torch.slice_scatter(a, b[..., ::2], -1, 0, None, 2)), two()),
    Case("copy", lambda a, b: _copy_into(a, b), two(), ALL, MATRIX_SHAPES),
    # normalization
    Case("native_layer_norm", lambda a, w, bias: torch.native_layer_norm(a, a.shape[-1:], w, bias, 1e-5),
         lambda s, d: (rand(s, d), rand(s[-1:], d), rand(s[-1:], d)), FLOATS),
    Case("rms_norm", lambda a, w: (torch.nn.functional.rms_norm(a, a.shape[-1:], w, 1e-6),
                                   torch.nn.functional.rms_norm(a, a.shape[-1:]),
                                   torch.nn.functional.rms_norm(a, a.shape[-2:], eps=1e-5) if a.dim() > 1 else a),
         lambda s, d: (rand(s, d), rand(s[-1:], d)), FLOATS),
    # A strided (transposed) input: the CPU kernel set's RMSNorm host loop reads it in place.
    Case("rms_norm_strided", lambda a, w: torch.nn.functional.rms_norm(a.transpose(0, -1), (a.shape[0],), w, 1e-6),
         lambda s, d: (rand(s, d), rand(s[:1], d)), FLOATS),
    Case("batch_norm", lambda x, m, v, w, bias: torch.nn.functional.batch_norm(x, m, v, w, bias, False, 0.1, 1e-3),
         lambda s, d: (rand(s, d), rand(s[1:2], d), positive(s[1:2], d), rand(s[1:2], d), rand(s[1:2], d)), FLOATS,
         [(2, 3, 5), (2, 3, 4, 4), (1, 3, 2, 3, 2)]),
    # convolution (conv1d/2d/3d and the transposes all export as aten.convolution)
    conv_case("conv1d", torch.nn.functional.conv1d, (4, 3, 3), SIGNAL_SHAPES, padding=1, stride=2),
    conv_case("conv1d_groups_dilation", torch.nn.functional.conv1d, (6, 1, 3), SIGNAL_SHAPES, groups=3, dilation=2),
    conv_case("conv2d", torch.nn.functional.conv2d, (4, 3, 3, 2), IMAGE_SHAPES, padding=(1, 0), stride=(1, 2)),
    conv_case("conv2d_groups", torch.nn.functional.conv2d, (6, 1, 3, 3), IMAGE_SHAPES, groups=3, dilation=(2, 1)),
    conv_case("conv3d", torch.nn.functional.conv3d, (4, 2, 2, 3, 2), VOLUME_SHAPES, padding=1),
    conv_case("conv_transpose1d", torch.nn.functional.conv_transpose1d, (3, 2, 4), SIGNAL_SHAPES, stride=2,
              padding=1, output_padding=1),
    conv_case("conv_transpose2d", torch.nn.functional.conv_transpose2d, (3, 2, 3, 3), IMAGE_SHAPES, stride=(2, 1),
              padding=(1, 0), dilation=(1, 2)),
    conv_case("conv_transpose2d_groups", torch.nn.functional.conv_transpose2d, (3, 2, 2, 2), IMAGE_SHAPES, groups=3,
              padding=2),
    conv_case("conv_transpose3d", torch.nn.functional.conv_transpose3d, (2, 3, 2, 2, 3), VOLUME_SHAPES, stride=2),
    # pooling (1-d pooling exports as the 2-d op)
    Case("max_pool1d", lambda a: torch.nn.functional.max_pool1d(a, 3, 2, padding=1), one(), FLOATS, SIGNAL_SHAPES),
    Case("max_pool2d", lambda a: (torch.nn.functional.max_pool2d(a, 2), torch.nn.functional.max_pool2d(a, 3, 2, 1),
                                  torch.nn.functional.max_pool2d(a, (2, 3), (1, 2), dilation=(2, 1), ceil_mode=True)),
         one(), FLOATS, IMAGE_SHAPES),
    Case("max_pool3d", lambda a: torch.nn.functional.max_pool3d(a, 2, ceil_mode=True), one(), FLOATS, VOLUME_SHAPES),
    Case("avg_pool1d", lambda a: torch.nn.functional.avg_pool1d(a, 3, 2, padding=1), one(), FLOATS, SIGNAL_SHAPES),
    Case("avg_pool2d", lambda a: (torch.nn.functional.avg_pool2d(a, 2), torch.nn.functional.avg_pool2d(a, 3, 2, 1),
                                  torch.nn.functional.avg_pool2d(a, 3, 2, 1, count_include_pad=False, ceil_mode=True),
                                  torch.nn.functional.avg_pool2d(a, 2, 1, 1, divisor_override=3)),
         one(), FLOATS, IMAGE_SHAPES),
    Case("avg_pool3d", lambda a: torch.nn.functional.avg_pool3d(a, 2, ceil_mode=True, count_include_pad=False), one(),
         (torch.float32,), VOLUME_SHAPES),  # eager has no half-precision avg_pool3d on the CPU
    Case("adaptive_avg_pool2d", lambda a: (torch.nn.functional.adaptive_avg_pool2d(a, (3, 2)),
                                           torch.nn.functional.adaptive_avg_pool2d(a, 1)), one(), FLOATS,
         [(2, 3, 9, 8), (1, 2, 6, 4)]),
]


def _copy_into(a, b):
    """A functionalized in-place copy_ (aten.copy): one row of a clone overwritten by a row of b."""
    y = a.clone()
    y[0].copy_(b[1])
    return y


def _params():
    for case in CASES:
        for dtype in case.dtypes:
            # The fast tier runs each op in its first dtype (the one the coverage check below exports too); the
            # other dtypes, ~3/4 of these programs, run in the full tier (`make test`).
            marks = () if dtype == case.dtypes[0] else (pytest.mark.slow,)
            yield pytest.param(case, dtype, id=f"{case.name}-{str(dtype).replace('torch.', '')}", marks=marks)


def _flat_module(case, arity):
    def fn(*flat):
        outs = []
        for i in range(0, len(flat), arity):
            out = case.fn(*flat[i:i + arity])
            outs.extend(out if isinstance(out, (tuple, list)) else [out])
        return tuple(outs)

    return fn


# Case name -> the registry targets whose handlers ran while its programs were built.
LOWERED: dict[str, set] = {}


def _export_case(case, dtype):
    groups = [case.make(shape, dtype) for shape in case.shapes]
    flat = [t for g in groups for t in g]
    fn = _flat_module(case, len(groups[0]))
    with REGISTRY.recording(LOWERED.setdefault(case.name, set())):
        result = export_fn(fn, flat)
    return fn, flat, result


@pytest.mark.parametrize("case,dtype", list(_params()))
def test_op_matches_eager(case, dtype):
    fn, flat, result = _export_case(case, dtype)
    assert result.ops_outside == 0, result.summary()
    assert_matches(run(result.pte, flat), _reference(case, fn, flat))


def _dynamic_batch():
    """A symbolic batch size: the program reads it (sym_size) to build a tensor of that size."""
    x = rand((3, 4), torch.float32)
    fn = lambda a: a + torch.zeros(a.shape[0], 1)  # noqa: E731
    with REGISTRY.recording(LOWERED.setdefault("dynamic_batch", set())):
        result = export_fn(fn, [x], dynamic_shapes=(({0: torch.export.Dim("batch", min=1, max=64)},),))
    return fn, result


def test_dynamic_batch_matches_eager():
    fn, result = _dynamic_batch()
    assert result.ops_outside == 0, result.summary()
    for rows in (1, 5):
        x = rand((rows, 4), torch.float32)
        assert_matches(run(result.pte, [x]), [fn(x)])


def _never_reaches_the_partitioner(op) -> bool:
    """Registered overloads no edge program contains, by ExecuTorch's own rules: _to_copy / clone
    become dim-order ops; what the core-ATen table decomposes is decomposed unless the partitioner
    keeps it whole; a view op becomes its X_copy twin, so X_copy appears exactly when X survives
    the decomposition."""
    from torch._decomp import core_aten_decompositions
    from executorch.exir.passes.dim_order_ops_registry import DimOrderOpsMap

    from backends.mlx.exporter.partitioner import _KEEP_WHOLE

    decomposed = core_aten_decompositions()
    if op in {getattr(k, "_op", k) for k in DimOrderOpsMap}:
        return True
    if op in _KEEP_WHOLE or op is aten.sym_size.int:  # sym_size: a graph node for every symbolic size
        return False
    name = op._opname
    if name.endswith("_copy") and name != "_to_copy":
        view = getattr(getattr(aten, name[: -len("_copy")], None), op._overloadname, None)
        return view is None or view in decomposed
    return op.is_view or op in decomposed


def test_every_registered_aten_op_has_a_parity_case():
    """Every aten op with a handler that an edge program can contain is lowered by some case above:
    what each case lowered is recorded from the handlers that ran (cases this session did not run
    are exported here)."""
    for case in CASES:
        if case.name not in LOWERED:
            _export_case(case, case.dtypes[0])
    if "dynamic_batch" not in LOWERED:
        _dynamic_batch()
    lowered = set().union(*LOWERED.values())
    registered = [t for t in REGISTRY.targets() if t.namespace == "aten"]
    missing = sorted(str(t) for t in registered if t not in lowered and not _never_reaches_the_partitioner(t))
    assert not missing, f"registered aten ops no parity case lowers: {missing}"
    # The exemption must not hide anything: no case ever lowered an op it calls unreachable.
    wrongly_exempt = sorted(str(t) for t in registered if t in lowered and _never_reaches_the_partitioner(t))
    assert not wrongly_exempt, f"lowered, yet counted as never reaching the partitioner: {wrongly_exempt}"


def _reference(case, fn, flat):
    if not case.float32_reference:
        return list(fn(*flat))
    up = [t.float() if t.dtype.is_floating_point else t for t in flat]
    return [r.to(t.dtype) for r, t in zip(fn(*up), fn(*flat))]
