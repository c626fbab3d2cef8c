"""The MoE experts forward etmlx registers with transformers' ExpertsInterface (as "etmlx").

transformers' experts modules hold every expert's weights as one 3-D parameter ([E, out, in], or [E, in, out]
when `is_transposed`) and route each token to its top-k experts. Its own forwards either loop over the experts
that were hit (data-dependent shapes) or call an opaque grouped-matmul op; neither exports. This one gathers
each (token, k) pair's expert matrix and multiplies in one batched matmul: only static shapes and ops the
delegate lowers (index, matmul, the activation, a weighted sum over k), so routing and expert matmuls all run
in the program.
"""

from __future__ import annotations

import torch
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

IMPLEMENTATION = "etmlx"


def _project(x: torch.Tensor, weights: torch.Tensor, bias, transposed: bool) -> torch.Tensor:
    """x [T, K, in] through each pair's own matrix -> [T, K, out]. A broadcast product and a sum rather than a
    batched matmul: decomposing matmul flattens T * K, a symbolic product the delegate cannot compute."""
    if transposed:  # weights [T, K, in, out]
        out = (x.unsqueeze(-1) * weights).sum(dim=-2)
    else:  # weights [T, K, out, in]
        out = (weights * x.unsqueeze(-2)).sum(dim=-1)
    return out if bias is None else out + bias


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
    tokens, k = top_k_index.shape
    x = hidden_states.unsqueeze(1).expand(tokens, k, hidden_states.shape[-1])
    if getattr(self, "has_gate", True):
        first, bias = self.gate_up_proj, self.gate_up_proj_bias if has_bias else None
    else:
        first, bias = self.up_proj, self.up_proj_bias if has_bias else None
    h = _project(x, first[top_k_index], None if bias is None else bias[top_k_index], transposed)
    h = self._apply_gate(h) if getattr(self, "has_gate", True) else self.act_fn(h)
    bias = self.down_proj_bias[top_k_index] if has_bias else None
    out = _project(h, self.down_proj[top_k_index], bias, transposed)  # [T, K, hidden]
    out = (out * top_k_weights.unsqueeze(-1).to(out.dtype)).sum(dim=1)
    return out.to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, etmlx_experts_forward)
