"""Quantize a float causal LM in place with MLX's affine scheme (--quantize int4|int8).

The integers, scales and biases are mlx.core.quantize's own, so a checkpoint quantized here and
by `mlx_lm.convert -q` with the same bits and group size holds the same numbers. Every nn.Linear
in the decoder blocks and the head is replaced; with `embeddings` the token embedding too (and a
head tied to it shares its quantized tensors). MoE experts' 3-D weight stacks become QuantizedExperts,
each expert quantized as its [out, in] matrix would be.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np
import torch
from torch import nn

from backends.mlx.custom_kernel_ops.quantized import check_params
from backends.mlx.llm import experts
from backends.mlx.llm.quantize.modules import QuantizedEmbedding, QuantizedExperts, QuantizedLinear, embedding_scales


def quantize_tensor(weight: torch.Tensor, group_size: int, bits: int, stored: Optional[torch.dtype] = None) -> tuple:
    """(w uint32, scales, biases) of a [N, K] (or [E, N, K]) float weight, as mlx.core.quantize gives them.

    `stored`: the checkpoint's own dtype. A bf16 checkpoint loaded as float32 is quantized from its bf16
    values, so the scales and biases are bf16 and every byte equals what `mlx_lm.convert -q` writes from
    the same checkpoint (half the bytes of float32 scales); a weight that does not round-trip through
    `stored` exactly is quantized in its own dtype."""
    check_params(group_size, bits, weight.shape[-1])
    dtype = weight.dtype
    if stored is not None and stored != dtype and torch.equal(weight.to(stored).to(dtype), weight):
        dtype = stored
    # Rows are quantized independently, so a block of rows at a time gives the same numbers with at most one
    # block's float32, MLX and packed copies beside the weight (a 150k-row embedding's float32 copy is ~1 GB).
    rows = weight.detach().reshape(-1, weight.shape[-1])
    step = max(1, QUANTIZE_BLOCK // rows.shape[1])
    parts = [_quantize_rows(rows[i:i + step], group_size, bits, dtype) for i in range(0, rows.shape[0], step)]
    lead = weight.shape[:-1]
    return tuple(torch.cat(p).reshape(*lead, -1) if len(p) > 1 else p[0].reshape(*lead, -1) for p in zip(*parts))


QUANTIZE_BLOCK = 1 << 22  # weights quantized per mx.quantize call (16 MB of float32)


def _quantize_rows(rows: torch.Tensor, group_size: int, bits: int, dtype: torch.dtype) -> tuple:
    import mlx.core as mx  # the compute library itself; imported only when quantizing

    # MLX has no conversion from torch; float32 numpy carries every float dtype exactly.
    source = mx.array(rows.float().cpu().numpy())
    if dtype != torch.float32:
        source = source.astype({torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}[dtype])
    w, scales, biases = mx.quantize(source, group_size=group_size, bits=bits)
    as_torch = lambda a: torch.from_numpy(np.array(a.astype(mx.float32))).to(dtype)
    return torch.from_numpy(np.array(w)), as_torch(scales), as_torch(biases)


def _quantized_linear(linear: nn.Linear, weight: torch.Tensor, group_size: int, bits: int,
                      stored=None) -> QuantizedLinear:
    w, scales, biases = quantize_tensor(weight, group_size, bits, stored)
    bias = None if linear.bias is None else linear.bias.detach().clone()
    return QuantizedLinear(w, scales, biases, group_size, bits, bias=bias)


class Plan(NamedTuple):
    """Which modules quantize_model replaces: the token embedding's name (None: it stays in float), the Linear
    layers' names, and the head's name when it is tied to the embedding (it then shares the quantized table)."""
    embedding: Optional[str]
    linears: list
    tied_head: Optional[str]


def plan(model: nn.Module, group_size: int, embeddings: bool = True) -> Plan:
    """quantize_model's choice of modules; only names, types and shapes are read (parameters may be on meta)."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    head_name = _name_of(model, head) if head is not None else None
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    # As mlx-lm does, a layer whose input width the group size does not divide stays in float.
    linears = [name for name, module in model.named_modules()
               if isinstance(module, nn.Linear) and name != head_name and module.in_features % group_size == 0]
    if embeddings and head is not None and not tied and head.in_features % group_size == 0:
        linears.append(head_name)
    quantized_embedding = embeddings and _quantizable_embedding(embedding, group_size)
    return Plan(_name_of(model, embedding) if quantized_embedding else None, linears,
                head_name if quantized_embedding and tied else None)


def quantize_model(model: nn.Module, bits: int, group_size: int = 64, embeddings: bool = True,
                   stored: Optional[torch.dtype] = None,
                   weights: Optional[Callable[[str], torch.Tensor]] = None) -> nn.Module:
    """Replace the model's Linear layers (and, with `embeddings`, the token embedding and the head) by
    quantized ones, in place. `stored`: the checkpoint's dtype, which the scales and biases keep
    (quantize_tensor). `weights`: module name -> the float weight to quantize, read only when that module is
    replaced (quantize/streamed.py reads each from the checkpoint, the module's own parameter being on meta);
    None: each module's own weight."""
    chosen = plan(model, group_size, embeddings)
    weight_of = weights or (lambda name: model.get_submodule(name).weight)
    if chosen.embedding is not None:
        embedding = model.get_input_embeddings()
        w, scales, biases = quantize_tensor(weight_of(chosen.embedding), group_size, bits, stored)
        # Under the activations' dtype (the module's), not the weight's as read (embedding_scales).
        scales, biases = embedding_scales(scales, biases, embedding.weight.dtype)
        # Gemma's embedding scales its rows (embed_scale): the quantized table keeps that scale.
        scale = getattr(embedding, "embed_scale", None)
        model.set_input_embeddings(QuantizedEmbedding(w, scales, biases, group_size, bits,
                                                      scale=None if scale is None else float(scale)))
        if chosen.tied_head is not None:
            # The head multiplies by the same table: it shares the quantized tensors.
            _set(model, chosen.tied_head, QuantizedLinear(w, scales, biases, group_size, bits))
    for name in chosen.linears:
        _set(model, name, _quantized_linear(model.get_submodule(name), weight_of(name), group_size, bits, stored))
    quantized_experts = False
    for module in model.modules():
        if _is_experts(module):
            _quantize_experts(module, group_size, bits, stored)
            quantized_experts = True
    if quantized_experts:
        # transformers' own experts forwards multiply the 3-D float stacks; only etmlx's runs quantized ones, so
        # the eager model (export's reference) runs it too.
        for config in (model.config, getattr(model.config, "text_config", None)):
            if config is not None and hasattr(config, "_experts_implementation"):
                config._experts_implementation = experts.IMPLEMENTATION
    return model


# The projections an experts module (transformers' use_experts_implementation) may hold as 3-D stacks.
EXPERT_PROJECTIONS = ("gate_up_proj", "up_proj", "down_proj")


def _is_experts(module: nn.Module) -> bool:
    """A module built by transformers' use_experts_implementation (its decorator sets these flags)."""
    return all(hasattr(module, flag) for flag in ("is_transposed", "has_gate", "is_concatenated"))


def _quantize_experts(module: nn.Module, group_size: int, bits: int, stored=None) -> None:
    """Each 3-D projection stack ([E, out, in], or [E, in, out] when is_transposed) -> QuantizedExperts over
    [E, out, in]; a stack whose input width the group size does not divide stays in float (as a Linear)."""
    for name in EXPERT_PROJECTIONS:
        weight = getattr(module, name, None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 3:
            continue
        stack = weight.detach().transpose(1, 2) if module.is_transposed else weight.detach()
        if stack.shape[-1] % group_size:
            continue
        w, scales, biases = quantize_tensor(stack.contiguous(), group_size, bits, stored)
        delattr(module, name)
        setattr(module, name, QuantizedExperts(w, scales, biases, group_size, bits))


def _quantizable_embedding(embedding, group_size: int) -> bool:
    """A plain nn.Embedding, or a subclass whose only addition is a row scale (embed_scale); any other subclass
    does something in its forward that a quantized lookup would skip, so it stays in float."""
    if not isinstance(embedding, nn.Embedding) or embedding.embedding_dim % group_size:
        return False
    return type(embedding).forward is nn.Embedding.forward or hasattr(embedding, "embed_scale")


def _name_of(model: nn.Module, target: nn.Module) -> str:
    return next(name for name, module in model.named_modules() if module is target)


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)
