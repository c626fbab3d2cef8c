"""Matrix products: mm, bmm, matmul, addmm, linear. MLX multiplies floating types only."""

from __future__ import annotations

from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.ops.common import aten, float_only, ndim, out_dtype
from backends.mlx.serialization.generated.fb.BinaryOp import BinaryOp


@REGISTRY.register(aten.mm.default, aten.bmm.default, aten.matmul.default, supports=float_only)
def _matmul(b, node):
    dtype = out_dtype(node)
    return b.op("MatmulNode", a=b.operand(node.args[0], dtype), b=b.operand(node.args[1], dtype))


@REGISTRY.register(aten.addmm.default, supports=float_only)
def _addmm(b, node):
    dtype = out_dtype(node)
    bias, m1, m2 = node.args[:3]
    beta = node.kwargs.get("beta", 1)
    alpha = node.kwargs.get("alpha", 1)
    return b.op("AddmmNode", bias=b.operand(bias, dtype), a=b.operand(m1, dtype), b=b.operand(m2, dtype),
                alpha=float(alpha), beta=float(beta))


@REGISTRY.register(aten.linear.default, supports=float_only)
def _linear(b, node):
    dtype = out_dtype(node)
    x, weight = node.args[:2]
    bias = node.args[2] if len(node.args) > 2 else None
    wt = b.op("TransposeNode", x=b.operand(weight, dtype), perm=list(range(ndim(weight)))[::-1])
    xt = b.operand(x, dtype)
    if bias is not None and ndim(x) == 2:
        return b.op("AddmmNode", bias=b.operand(bias, dtype), a=xt, b=wt, alpha=1.0, beta=1.0)
    out = b.op("MatmulNode", a=xt, b=wt)
    if bias is not None:
        out = b.op("BinaryNode", op=BinaryOp.Add, a=out, b=b.operand(bias, dtype))
    return out
