"""Helpers shared by op handlers."""

from __future__ import annotations

import torch

from backends.mlx.exporter.dtypes import FLOAT_DTYPES

aten = torch.ops.aten


def out_dtype(node: torch.fx.Node) -> torch.dtype:
    return node.meta["val"].dtype


def arg_dtype(arg) -> torch.dtype | None:
    return arg.meta["val"].dtype if isinstance(arg, torch.fx.Node) else None


def ndim(arg) -> int:
    return arg.meta["val"].dim()


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def _probe(arg):
    if isinstance(arg, torch.fx.Node):
        v = arg.meta["val"]
        return torch.empty([1] * v.dim(), dtype=v.dtype)
    return arg


def promoted(a, b) -> torch.dtype:
    """torch's type promotion of two operands (fx-node tensors or Python scalars)."""
    return torch.result_type(_probe(a), _probe(b))


def float_only(node: torch.fx.Node):
    dtype = out_dtype(node) if isinstance(node.meta["val"], torch.Tensor) else node.meta["val"][0].dtype
    return None if dtype in FLOAT_DTYPES else f"needs a floating dtype, got {dtype}"


def static_shape(node: torch.fx.Node):
    val = node.meta["val"]
    return None if all(isinstance(s, int) for s in val.shape) else "needs a static shape"


def resolvable_dims(shape) -> bool:
    """Every size is a literal or a plain symbol (an input's dynamic dimension, read at run time)."""
    return all(isinstance(s, int) or (isinstance(s, torch.SymInt) and s.node.expr.is_Symbol) for s in shape)


def resolvable_shape(node: torch.fx.Node):
    return None if resolvable_dims(node.meta["val"].shape) else "sizes are expressions of symbolic sizes"


def half_type(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)
