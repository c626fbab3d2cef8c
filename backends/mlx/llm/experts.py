"""The MoE experts forward etmlx registers with transformers' ExpertsInterface (as "etmlx").

transformers' experts modules hold every expert's weights as one 3-D parameter ([E, out, in], or [E, in, out]
when `is_transposed`) and route each token to its top-k experts. Its own forwards either loop over the experts
that were hit (data-dependent shapes) or call an opaque grouped-matmul op; neither exports. This one sends each
projection through mlx::gather_mm (custom_kernel_ops/experts.py), which the delegate runs as MLX's gather_mm:
every (token, k) pair multiplies by its own expert's matrix by index, so no [T, K, out, in] copy of the
weights is built (a prefill of T tokens would otherwise gather T * K expert matrices). A projection that
--quantize replaced by a quantized stack (llm/quantize/modules.py: QuantizedExperts, called as
stack(x, indices)) runs as mlx::gather_qmm instead.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

import backends.mlx.custom_kernel_ops  # noqa: F401  (registers mlx::gather_mm / gather_qmm)

IMPLEMENTATION = "etmlx"


def _project(x: torch.Tensor, weights, bias, top_k_index: torch.Tensor, transposed: bool) -> torch.Tensor:
    """x [T, in] (every k reads the token's row) or [T, K, in] through each pair's own expert -> [T, K, out]."""
    if isinstance(weights, torch.nn.Module):  # a quantized stack, [E, out, in] whatever the float layout was
        out = weights(x, top_k_index)
    else:
        out = torch.ops.mlx.gather_mm(x, weights, top_k_index, transposed)
    return out if bias is None else out + bias[top_k_index]


def etmlx_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    if getattr(self, "_is_expert_parallel", False):
        raise ValueError("expert-parallel MoE layers are not supported")
    if getattr(self, "has_post_expert_norm", False):
        raise ValueError(f"{type(self).__name__}: a norm after each expert is not supported")
    transposed = getattr(self, "is_transposed", False)
    if getattr(self, "has_gate", True) and not getattr(self, "is_concatenated", True):
        raise ValueError(f"{type(self).__name__}: interleaved gate/up expert weights are not supported")
    has_bias = getattr(self, "has_bias", False)
    if getattr(self, "has_gate", True):
        first, bias = self.gate_up_proj, self.gate_up_proj_bias if has_bias else None
    else:
        first, bias = self.up_proj, self.up_proj_bias if has_bias else None
    h = _project(hidden_states, first, bias, top_k_index, transposed)
    h = self._apply_gate(h) if getattr(self, "has_gate", True) else self.act_fn(h)
    out = _project(h, self.down_proj, self.down_proj_bias if has_bias else None, top_k_index, transposed)
    out = (out * top_k_weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)
    return out.to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, etmlx_experts_forward)
