"""torch.ops.mlx.sample(logits, temperature, seed=None) -> token ids [B] (int64).

Gumbel-max sampling from softmax(logits / temperature); temperature <= 0 (or
NaN) means greedy argmax for that row. `seed` present: the noise comes from
MLX's keyed generator (reproducible); absent: from MLX's global key sequence.
The CPU implementation is the host reference that reproduces the device.
"""

from __future__ import annotations

from typing import Optional

import torch

from backends.mlx.custom_kernel_ops.filter_threshold import divide_by_temperature
from backends.mlx.custom_kernel_ops.reference.sample import row_noise, sample_reference

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_SEED_DTYPES = (torch.int64, torch.int32)


def _already_registered() -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("mlx::sample", "CPU") or bool(
            torch._C._dispatch_find_schema_or_throw("mlx::sample", "")
        )
    except RuntimeError:
        return False


if _already_registered():
    raise RuntimeError(
        "mlx::sample is already registered in this process (probably by executorch.backends.mlx, "
        "the upstream MLX backend); etmlx registers its own mlx::sample with a different signature, "
        "so the two cannot be imported in one process"
    )


def check_sample_args(logits, temperature, seed) -> None:
    """Raise ValueError/TypeError naming the argument; used at export time and eagerly."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a tensor, got {type(logits).__name__}")
    if logits.dim() != 2:
        raise ValueError(f"logits must be [batch, vocab], got shape {tuple(logits.shape)}")
    if logits.dtype not in _FLOATS:
        raise TypeError(f"logits must be float32, float16 or bfloat16, got {logits.dtype}")
    batch = logits.shape[0]
    if not isinstance(temperature, torch.Tensor):
        raise TypeError(f"temperature must be a tensor, got {type(temperature).__name__}")
    if temperature.dtype not in _FLOATS:
        raise TypeError(f"temperature must be a float tensor, got {temperature.dtype}")
    if not (temperature.dim() == 0 or (temperature.dim() == 1 and temperature.shape[0] == batch)):
        raise ValueError(f"temperature must be a scalar or [batch={batch}], got shape {tuple(temperature.shape)}")
    if seed is None:
        return
    if not isinstance(seed, torch.Tensor):
        raise TypeError(f"seed must be an integer tensor or None, got {type(seed).__name__}")
    if seed.dtype not in _SEED_DTYPES:
        raise TypeError(f"seed must be an int64 or int32 tensor, got {seed.dtype}")
    if not (seed.dim() == 0 or (seed.dim() == 1 and seed.shape[0] == batch)):
        raise ValueError(f"seed must be a scalar or [batch={batch}], got shape {tuple(seed.shape)}")


@torch.library.custom_op("mlx::sample", mutates_args=())
def sample(logits: torch.Tensor, temperature: torch.Tensor, seed: Optional[torch.Tensor] = None) -> torch.Tensor:
    check_sample_args(logits, temperature, seed)
    if seed is None:
        # Unseeded: any fresh key will do; take it from torch's global generator.
        seed = torch.randint(0, 2**62, (), dtype=torch.int64)
    return sample_reference(logits, temperature, seed)


@sample.register_fake
def _sample_fake(logits, temperature, seed=None):
    check_sample_args(logits, temperature, seed)
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


__all__ = ["sample", "check_sample_args", "row_noise"]


@torch.library.custom_op("mlx::sample_fused", mutates_args=())
def sample_fused(x: torch.Tensor, temperature: torch.Tensor, seed: Optional[torch.Tensor] = None,
                 threshold: Optional[torch.Tensor] = None) -> torch.Tensor:
    """mlx::sample over the tokens with x / t >= threshold (all when None). Both ops lower to the
    one GumbelMaxNode (runtime/kernels/gumbel_max.h); this one also passes the threshold."""
    if threshold is not None:
        z = divide_by_temperature(x, temperature)
        x = torch.where(z >= threshold, x.to(torch.float32), torch.full_like(z, float("-inf")))
    return sample(x, temperature, seed)


@sample_fused.register_fake
def _sample_fused_fake(x, temperature, seed=None, threshold=None):
    return _sample_fake(x, temperature, seed)
