"""Op handlers, one module per op family. Importing this package registers them all."""

from backends.mlx.exporter.ops import (  # noqa: F401
    attention,
    cast,
    collectives,
    comparison,
    convolution,
    creation,
    elementwise,
    experts,
    indexing,
    linalg,
    normalization,
    pooling,
    quantized,
    rearrange,
    reduction,
    sampling,
    shape,
    softmax,
    sorting,
)
