"""Op handlers, one module per op family. Importing this package registers them all."""

from backends.mlx.exporter.ops import (  # noqa: F401
    attention,
    cast,
    comparison,
    creation,
    elementwise,
    indexing,
    linalg,
    normalization,
    reduction,
    sampling,
    shape,
    softmax,
    sorting,
)
