"""torch dtypes <-> schema DType."""

from __future__ import annotations

import torch

from backends.mlx.serialization.generated.fb.DType import DType

TORCH_TO_DTYPE = {
    torch.float32: DType.Float32,
    torch.float16: DType.Float16,
    torch.bfloat16: DType.BFloat16,
    torch.int32: DType.Int32,
    torch.int64: DType.Int64,
    torch.bool: DType.Bool,
    torch.uint8: DType.UInt8,
    torch.int8: DType.Int8,
    torch.int16: DType.Int16,
    torch.uint32: DType.UInt32,
}
DTYPE_TO_TORCH = {v: k for k, v in TORCH_TO_DTYPE.items()}

FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})
INT_DTYPES = frozenset({torch.int32, torch.int64, torch.uint8, torch.int8, torch.int16, torch.uint32})
SUPPORTED_DTYPES = frozenset(TORCH_TO_DTYPE)


def to_schema(dtype: torch.dtype) -> int:
    try:
        return TORCH_TO_DTYPE[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported by the etmlx delegate") from None
