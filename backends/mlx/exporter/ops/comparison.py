"""Comparisons, logical ops, predicates and where."""

from __future__ import annotations

import torch

from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.ops.common import aten, out_dtype, promoted
from backends.mlx.exporter.ops.elementwise import binary
from backends.mlx.serialization.generated.fb.BinaryOp import BinaryOp
from backends.mlx.serialization.generated.fb.UnaryOp import UnaryOp

_COMPARE = {
    "eq": BinaryOp.Equal,
    "ne": BinaryOp.NotEqual,
    "lt": BinaryOp.Less,
    "le": BinaryOp.LessEqual,
    "gt": BinaryOp.Greater,
    "ge": BinaryOp.GreaterEqual,
}


def _compare_handler(op):
    def handler(b, node):
        lhs, rhs = node.args[:2]
        return binary(b, node, op, lhs, rhs, compute=promoted(lhs, rhs))

    return handler


for _name, _op in _COMPARE.items():
    _packet = getattr(aten, _name)
    REGISTRY.register(_packet.Tensor, _packet.Scalar)(_compare_handler(_op))


def _logical_handler(op):
    def handler(b, node):
        return binary(b, node, op, node.args[0], node.args[1], compute=torch.bool)

    return handler


REGISTRY.register(aten.logical_and.default)(_logical_handler(BinaryOp.LogicalAnd))
REGISTRY.register(aten.logical_or.default)(_logical_handler(BinaryOp.LogicalOr))
REGISTRY.register(aten.logical_xor.default)(_logical_handler(BinaryOp.NotEqual))  # on bools, xor is !=


@REGISTRY.register(aten.logical_not.default)
def _logical_not(b, node):
    x = b.operand(node.args[0], torch.bool)
    return b.cast(b.op("UnaryNode", op=UnaryOp.LogicalNot, x=x), torch.bool, out_dtype(node))


def _predicate_handler(op):
    def handler(b, node):
        return b.op("UnaryNode", op=op, x=b.tid(node.args[0]))

    return handler


REGISTRY.register(aten.isnan.default)(_predicate_handler(UnaryOp.IsNan))
REGISTRY.register(aten.isinf.default)(_predicate_handler(UnaryOp.IsInf))


@REGISTRY.register(aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar)
def _where(b, node):
    cond, x, y = node.args
    dtype = out_dtype(node)
    return b.op("WhereNode", cond=b.operand(cond, torch.bool), x=b.operand(x, dtype), y=b.operand(y, dtype))
