"""mlx::sample -> Gumbel-max built from RandomBitsNode and existing nodes.

The graph mirrors how MLX composes its own sampler (bits -> uniform -> gumbel)
so that the host reference (backends/mlx/custom_kernel_ops/reference/sample.py) can follow
the same float32 steps:
    x      = float32(logits), NaN -> -inf
    u      = min(float32(bits) / 4294967295, nextafter(1, 0))
    score  = x / T + (-log(-log(u))),  NaN -> -inf
    token  = T > 0 ? argmax(score) : argmax(x)      (per row; NaN T is greedy)
"""

from __future__ import annotations

import numpy as np
import torch

import backends.mlx.custom_kernel_ops  # noqa: F401  (registers mlx::sample)
from backends.mlx.exporter.builder.registry import REGISTRY
from backends.mlx.exporter.dtypes import to_schema
from backends.mlx.serialization.generated.fb.ArgReduceOp import ArgReduceOp
from backends.mlx.serialization.generated.fb.BinaryOp import BinaryOp
from backends.mlx.serialization.generated.fb.UnaryOp import UnaryOp

F32 = torch.float32
_JUST_BELOW_ONE = float(np.nextafter(np.float32(1), np.float32(0)))


def _static_logits(node):
    shape = node.args[0].meta["val"].shape
    if not all(isinstance(s, int) for s in shape):
        return "mlx::sample needs static logits shapes for now"
    return None


def _unary(b, op, x):
    return b.op("UnaryNode", op=op, x=x)


def _binary(b, op, x, y):
    return b.op("BinaryNode", op=op, a=x, b=y)


def _nan_to_neg_inf(b, x):
    return b.op("WhereNode", cond=_unary(b, UnaryOp.IsNan, x), x=b.full(float("-inf"), F32), y=x)


def emit_uniform(b, shape, seed_tid):
    """MLX's uniform [0, 1) from one RandomBitsNode."""
    bits = b.new_tensor()
    fields = dict(shape=list(shape), width=4, out=bits)
    if seed_tid is not None:
        fields["seed"] = seed_tid
    b.emit("RandomBitsNode", **fields)
    u = _binary(b, BinaryOp.Divide, b.op("AsTypeNode", x=bits, dtype=to_schema(F32)), b.full(4294967295.0, F32))
    return _binary(b, BinaryOp.Minimum, u, b.full(_JUST_BELOW_ONE, F32))


def emit_gumbel(b, u):
    return _unary(b, UnaryOp.Neg, _unary(b, UnaryOp.Log, _unary(b, UnaryOp.Neg, _unary(b, UnaryOp.Log, u))))


def _argmax(b, x):
    return b.op("ArgReduceNode", op=ArgReduceOp.ArgMax, x=x, axis=1, keepdims=False)


@REGISTRY.register(torch.ops.mlx.sample.default, supports=_static_logits)
def _sample(b, node):
    logits, temperature = node.args[:2]
    seed = node.args[2] if len(node.args) > 2 else node.kwargs.get("seed")
    batch, vocab = logits.meta["val"].shape
    x = _nan_to_neg_inf(b, b.operand(logits, F32))
    t = b.operand(temperature, F32)
    if temperature.meta["val"].dim() == 1:
        t = b.op("ReshapeNode", x=t, shape=[batch, 1])
    positive = _binary(b, BinaryOp.Greater, t, b.full(0.0, F32))
    safe_t = b.op("WhereNode", cond=positive, x=t, y=b.full(1.0, F32))
    u = emit_uniform(b, (batch, vocab), b.tid(seed) if seed is not None else None)
    score = _nan_to_neg_inf(b, _binary(b, BinaryOp.Add, _binary(b, BinaryOp.Divide, x, safe_t), emit_gumbel(b, u)))
    row_positive = b.op("BroadcastToNode", x=b.op("ReshapeNode", x=positive, shape=[-1, 1]), shape=[batch, 1])
    row_positive = b.op("ReshapeNode", x=row_positive, shape=[batch])
    token = b.op("WhereNode", cond=row_positive, x=_argmax(b, score), y=_argmax(b, x))
    return b.op("AsTypeNode", x=token, dtype=to_schema(torch.int64))


def _opt(b, node, i, name):
    arg = node.args[i] if len(node.args) > i else node.kwargs.get(name)
    return None if arg is None else b.tid(arg)


@REGISTRY.register(torch.ops.mlx.filter_threshold.default)
def _filter_threshold(b, node):
    candidates = node.args[5] if len(node.args) > 5 else node.kwargs.get("candidates", 256)
    fields = dict(x=b.operand(node.args[0], F32), temperature=b.operand(node.args[1], F32),
                  candidates=int(candidates))
    for i, name in ((2, "top_k"), (3, "top_p"), (4, "min_p")):
        tid = _opt(b, node, i, name)
        if tid is not None:
            fields[name] = tid
    return b.op("FilterThresholdNode", **fields)


@REGISTRY.register(torch.ops.mlx.sample_fused.default)
def _sample_fused(b, node):
    logits, temperature = node.args[:2]
    fields = dict(x=b.operand(logits, F32), temperature=b.operand(temperature, F32))
    for i, name in ((2, "seed"), (3, "threshold")):
        tid = _opt(b, node, i, name)
        if tid is not None:
            fields[name] = tid
    return b.op("GumbelMaxNode", **fields)
