"""Elementwise arithmetic and math: add, sub, mul, div, pow, neg, exp, log, ... clamp."""

from __future__ import annotations

from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.dtypes import FLOAT_DTYPES
from backends.mlx.exporter.ops.common import aten, arg_dtype, out_dtype
from backends.mlx.serialization.generated.fb.BinaryOp import BinaryOp
from backends.mlx.serialization.generated.fb.UnaryOp import UnaryOp

# Ops whose result is computed in the output dtype (ints promote to float first).
_UNARY = {
    aten.neg.default: UnaryOp.Neg,
    aten.exp.default: UnaryOp.Exp,
    aten.log.default: UnaryOp.Log,
    aten.sqrt.default: UnaryOp.Sqrt,
    aten.rsqrt.default: UnaryOp.Rsqrt,
    aten.abs.default: UnaryOp.Abs,
    aten.tanh.default: UnaryOp.Tanh,
    aten.sigmoid.default: UnaryOp.Sigmoid,
    aten.sin.default: UnaryOp.Sin,
    aten.cos.default: UnaryOp.Cos,
    aten.floor.default: UnaryOp.Floor,
    aten.ceil.default: UnaryOp.Ceil,
    aten.erf.default: UnaryOp.Erf,
    aten.log1p.default: UnaryOp.Log1p,
    aten.expm1.default: UnaryOp.Expm1,
    aten.reciprocal.default: UnaryOp.Reciprocal,
    aten.sign.default: UnaryOp.Sign,
    aten.bitwise_not.default: UnaryOp.BitwiseNot,
    aten.tan.default: UnaryOp.Tan,
    aten.asin.default: UnaryOp.Arcsin,
    aten.acos.default: UnaryOp.Arccos,
    aten.atan.default: UnaryOp.Arctan,
    aten.sinh.default: UnaryOp.Sinh,
    aten.cosh.default: UnaryOp.Cosh,
    aten.asinh.default: UnaryOp.Arcsinh,
    aten.acosh.default: UnaryOp.Arccosh,
    aten.atanh.default: UnaryOp.Arctanh,
    aten.log2.default: UnaryOp.Log2,
    aten.log10.default: UnaryOp.Log10,
}


def unary(b, node, op):
    dtype = out_dtype(node)
    return b.op("UnaryNode", op=op, x=b.operand(node.args[0], dtype))


def _unary_handler(op):
    return lambda b, node: unary(b, node, op)


for _target, _op in _UNARY.items():
    REGISTRY.register(_target)(_unary_handler(_op))


def binary(b, node, op, lhs, rhs, compute=None):
    """Cast both operands to the compute dtype, apply op, cast to the node's dtype."""
    dtype = out_dtype(node)
    compute = compute or dtype
    out = b.op("BinaryNode", op=op, a=b.operand(lhs, compute), b=b.operand(rhs, compute))
    return b.cast(out, compute, dtype)


def _scaled(b, node, arg, alpha, dtype):
    """alpha * arg, as add/sub's `alpha` keyword asks."""
    t = b.operand(arg, dtype)
    if alpha == 1:
        return t
    return b.op("BinaryNode", op=BinaryOp.Multiply, a=t, b=b.full(alpha, dtype))


def _add_sub(op):
    def handler(b, node):
        dtype = out_dtype(node)
        lhs, rhs = node.args[:2]
        alpha = node.kwargs.get("alpha", 1)
        return b.op("BinaryNode", op=op, a=b.operand(lhs, dtype), b=_scaled(b, node, rhs, alpha, dtype))

    return handler


REGISTRY.register(aten.add.Tensor, aten.add.Scalar)(_add_sub(BinaryOp.Add))
REGISTRY.register(aten.sub.Tensor, aten.sub.Scalar)(_add_sub(BinaryOp.Subtract))
REGISTRY.register(aten.rsub.Scalar)(
    lambda b, node: binary(b, node, BinaryOp.Subtract, node.args[1], node.args[0])
)

_BINARY = {
    (aten.mul.Tensor, aten.mul.Scalar): BinaryOp.Multiply,
    (aten.minimum.default,): BinaryOp.Minimum,
    (aten.maximum.default,): BinaryOp.Maximum,
    (aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar): BinaryOp.Power,
    (aten.remainder.Tensor, aten.remainder.Scalar): BinaryOp.Remainder,
    (aten.floor_divide.default,): BinaryOp.FloorDivide,
    (aten.bitwise_and.Tensor, aten.bitwise_and.Scalar): BinaryOp.BitwiseAnd,
    (aten.bitwise_or.Tensor, aten.bitwise_or.Scalar): BinaryOp.BitwiseOr,
    (aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar): BinaryOp.BitwiseXor,
    # Shifts: the shift count must lie in [0, bits of the dtype) (C++ and MLX leave wider shifts undefined).
    (aten.bitwise_left_shift.Tensor, aten.bitwise_left_shift.Tensor_Scalar, aten.bitwise_left_shift.Scalar_Tensor,
     aten.__lshift__.Scalar, aten.__lshift__.Tensor): BinaryOp.LeftShift,
    (aten.bitwise_right_shift.Tensor, aten.bitwise_right_shift.Tensor_Scalar,
     aten.bitwise_right_shift.Scalar_Tensor, aten.__rshift__.Scalar, aten.__rshift__.Tensor): BinaryOp.RightShift,
    (aten.atan2.default,): BinaryOp.Arctan2,
    (aten.logaddexp.default,): BinaryOp.LogAddExp,
}


def _binary_handler(op):
    return lambda b, node: binary(b, node, op, node.args[0], node.args[1])


for _targets, _op in _BINARY.items():
    REGISTRY.register(*_targets)(_binary_handler(_op))


def _div_supported(node):
    mode = node.kwargs.get("rounding_mode")
    if mode == "trunc" and out_dtype(node) not in FLOAT_DTYPES:
        return "integer division with rounding_mode='trunc' is not supported"
    return None


@REGISTRY.register(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode,
                   supports=_div_supported)
def _div(b, node):
    lhs, rhs = node.args[:2]
    mode = node.kwargs.get("rounding_mode")
    if mode is None:
        return binary(b, node, BinaryOp.Divide, lhs, rhs)
    if mode == "floor":
        return binary(b, node, BinaryOp.FloorDivide, lhs, rhs)
    # trunc on floats: sign(q) * floor(|q|)
    q = binary(b, node, BinaryOp.Divide, lhs, rhs)
    mag = b.op("UnaryNode", op=UnaryOp.Floor, x=b.op("UnaryNode", op=UnaryOp.Abs, x=q))
    return b.op("BinaryNode", op=BinaryOp.Multiply, a=b.op("UnaryNode", op=UnaryOp.Sign, x=q), b=mag)


def _clamp_bounds(node):
    args = list(node.args) + [None] * (3 - len(node.args))
    return node.kwargs.get("min", args[1]), node.kwargs.get("max", args[2])


@REGISTRY.register(aten.clamp.default, aten.clamp.Tensor)
def _clamp(b, node):
    dtype = out_dtype(node)
    lo, hi = _clamp_bounds(node)
    x = b.operand(node.args[0], dtype)
    if lo is not None:
        x = b.op("BinaryNode", op=BinaryOp.Maximum, a=x, b=b.operand(lo, dtype))
    if hi is not None:
        x = b.op("BinaryNode", op=BinaryOp.Minimum, a=x, b=b.operand(hi, dtype))
    return x


@REGISTRY.register(aten.square.default)
def _square(b, node):
    return b.op("UnaryNode", op=UnaryOp.Square, x=b.operand(node.args[0], out_dtype(node)))


__all__ = ["binary", "unary", "arg_dtype"]


@REGISTRY.register(aten.relu.default)
def _relu(b, node):
    dtype = out_dtype(node)
    return b.op("BinaryNode", op=BinaryOp.Maximum, a=b.operand(node.args[0], dtype), b=b.full(0, dtype))


@REGISTRY.register(aten.silu.default, supports=lambda n: None if out_dtype(n) in FLOAT_DTYPES else "silu needs floats")
def _silu(b, node):
    x = b.tid(node.args[0])
    return b.op("BinaryNode", op=BinaryOp.Multiply, a=x, b=b.op("UnaryNode", op=UnaryOp.Sigmoid, x=x))


def _gelu_supported(node):
    if out_dtype(node) not in FLOAT_DTYPES:
        return "gelu needs floats"
    if node.kwargs.get("approximate", "none") not in ("none", "tanh"):
        return f"gelu approximate={node.kwargs.get('approximate')!r} is not supported"
    return None


@REGISTRY.register(aten.gelu.default, supports=_gelu_supported)
def _gelu(b, node):
    """0.5 x (1 + erf(x / sqrt 2)), or with approximate='tanh' 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
    computed in float32 as torch computes half-precision gelu, then cast back."""
    import math

    import torch

    dtype, f32 = out_dtype(node), torch.float32
    x = b.operand(node.args[0], f32)

    def mul(a, c):
        return b.op("BinaryNode", op=BinaryOp.Multiply, a=a, b=c)

    if node.kwargs.get("approximate", "none") == "tanh":
        cube = mul(mul(x, x), x)
        inner = b.op("BinaryNode", op=BinaryOp.Add, a=x, b=mul(cube, b.full(0.044715, f32)))
        t = b.op("UnaryNode", op=UnaryOp.Tanh, x=mul(inner, b.full(math.sqrt(2.0 / math.pi), f32)))
    else:
        t = b.op("UnaryNode", op=UnaryOp.Erf, x=mul(x, b.full(1.0 / math.sqrt(2.0), f32)))
    one_plus = b.op("BinaryNode", op=BinaryOp.Add, a=t, b=b.full(1.0, f32))
    return b.cast(mul(mul(x, b.full(0.5, f32)), one_plus), f32, dtype)


@REGISTRY.register(aten.round.default, aten.round.decimals)
def _round(b, node):
    """Half to even, as torch.round; with `decimals` d, round(x * 10^d) / 10^d as torch computes it
    (d < 0: round(x / 10^-d) * 10^-d). Integers are already round."""
    dtype = out_dtype(node)
    x = b.operand(node.args[0], dtype)
    if dtype not in FLOAT_DTYPES:
        return b.op("CopyNode", x=x)
    decimals = node.kwargs.get("decimals", node.args[1] if len(node.args) > 1 else 0)
    if decimals == 0:
        return b.op("UnaryNode", op=UnaryOp.Round, x=x)
    scale = b.full(10.0 ** abs(decimals), dtype)
    into, back = (BinaryOp.Multiply, BinaryOp.Divide) if decimals > 0 else (BinaryOp.Divide, BinaryOp.Multiply)
    r = b.op("UnaryNode", op=UnaryOp.Round, x=b.op("BinaryNode", op=into, a=x, b=scale))
    return b.op("BinaryNode", op=back, a=r, b=scale)


@REGISTRY.register(aten.trunc.default)
def _trunc(b, node):
    """sign(x) * floor(|x|); integers are already whole."""
    dtype = out_dtype(node)
    x = b.operand(node.args[0], dtype)
    if dtype not in FLOAT_DTYPES:
        return b.op("CopyNode", x=x)
    mag = b.op("UnaryNode", op=UnaryOp.Floor, x=b.op("UnaryNode", op=UnaryOp.Abs, x=x))
    return b.op("BinaryNode", op=BinaryOp.Multiply, a=b.op("UnaryNode", op=UnaryOp.Sign, x=x), b=mag)


def _arg_or(node, index, name, default):
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


@REGISTRY.register(aten.hardtanh.default)
def _hardtanh(b, node):
    """clamp(x, min_val, max_val) (relu6 is hardtanh(x, 0, 6))."""
    dtype = out_dtype(node)
    lo, hi = _arg_or(node, 1, "min_val", -1.0), _arg_or(node, 2, "max_val", 1.0)
    x = b.op("BinaryNode", op=BinaryOp.Maximum, a=b.operand(node.args[0], dtype), b=b.full(lo, dtype))
    return b.op("BinaryNode", op=BinaryOp.Minimum, a=x, b=b.full(hi, dtype))


def _floats(name):
    return lambda n: None if out_dtype(n) in FLOAT_DTYPES else f"{name} needs floats"


@REGISTRY.register(aten.leaky_relu.default, supports=_floats("leaky_relu"))
def _leaky_relu(b, node):
    """x where x > 0, else x * negative_slope, computed in float32 for the half types as torch does."""
    import torch

    dtype, f32 = out_dtype(node), torch.float32
    slope = _arg_or(node, 1, "negative_slope", 0.01)
    x = b.operand(node.args[0], f32)
    positive = b.op("BinaryNode", op=BinaryOp.Greater, a=x, b=b.full(0, f32))
    scaled = b.op("BinaryNode", op=BinaryOp.Multiply, a=x, b=b.full(slope, f32))
    return b.cast(b.op("WhereNode", cond=positive, x=x, y=scaled), f32, dtype)


@REGISTRY.register(aten.elu.default, supports=_floats("elu"))
def _elu(b, node):
    """scale * x where x > 0, else scale * alpha * expm1(input_scale * x); computed in float32 for the
    half types, as torch does, then rounded once (selu and celu export as elu)."""
    import torch

    dtype, f32 = out_dtype(node), torch.float32
    alpha, scale, input_scale = (_arg_or(node, 1, "alpha", 1.0), _arg_or(node, 2, "scale", 1.0),
                                 _arg_or(node, 3, "input_scale", 1.0))
    x = b.operand(node.args[0], f32)

    def mul(a, c):
        return a if c == 1 else b.op("BinaryNode", op=BinaryOp.Multiply, a=a, b=b.full(c, f32))

    negative = mul(b.op("UnaryNode", op=UnaryOp.Expm1, x=mul(x, input_scale)), alpha * scale)
    positive = b.op("BinaryNode", op=BinaryOp.Greater, a=x, b=b.full(0, f32))
    return b.cast(b.op("WhereNode", cond=positive, x=mul(x, scale), y=negative), f32, dtype)
