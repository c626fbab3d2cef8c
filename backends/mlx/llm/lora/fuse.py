"""Fuse a LoRA adapter into a loaded causal LM, in place: each adapted layer's weight W becomes
W + scale * B @ A.

A float layer (nn.Linear, or transformers' Conv1D, whose weight is stored [in, out]) adds the update computed
in float32 and cast to the weight's dtype, as mlx-lm's LoRALinear.fuse and PEFT's merge do. A quantized layer
(an mlx-lm quantized checkpoint's QuantizedLinear) is fused as mlx-lm's own fuse does it: dequantize with
mx.dequantize (in the scales' dtype), add the update cast to that dtype, quantize again with mx.quantize at the
layer's bits and group size; so `etmlx export --adapter` of an mlx-lm quantized directory holds the integers
`mlx_lm.fuse` writes. Every adapted layer's shapes are checked before any weight changes: a layer the model
does not have, or an update whose shape is not the layer's, is one ValueError naming it.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from backends.mlx.llm.lora.adapter_files import Adapter, LoraUpdate
from backends.mlx.llm.quantize.modules import QuantizedLinear


def fuse_adapter(model: nn.Module, adapter: Adapter) -> nn.Module:
    where = f"adapter {adapter.path}:"
    targets = [(update, target_layer(model, update, where)) for update in adapter.updates]
    with torch.no_grad():
        for update, module in targets:
            if isinstance(module, QuantizedLinear):
                _fuse_quantized(module, update)
            else:
                _fuse_float(module, update)
    return model


def _conv1d(module: nn.Module) -> bool:
    from transformers.pytorch_utils import Conv1D

    return isinstance(module, Conv1D)


def target_layer(model: nn.Module, update: LoraUpdate, where: str) -> nn.Module:
    try:
        module = model.get_submodule(update.module)
    except AttributeError:
        raise ValueError(f"{where} {update.module} is not a layer of this {model.config.model_type} model "
                         "(an adapter for another base model?)") from None
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if module is head and embedding is not None and _shares_weights(head, embedding):
        raise ValueError(f"{where} {update.module} is tied to the input embedding: fusing into it would change "
                         "the embedding too")
    if isinstance(module, (QuantizedLinear, nn.Linear)):
        out_features, in_features = module.out_features, module.in_features
    elif _conv1d(module):
        in_features, out_features = module.weight.shape
    else:
        raise ValueError(f"{where} {update.module} is a {type(module).__name__}; LoRA is fused into linear layers "
                         "only")
    got = (update.b.shape[0], update.a.shape[1])
    if got != (out_features, in_features):
        raise ValueError(f"{where} {update.module}: its update is {got[0]}x{got[1]} (out x in) but the base layer is "
                         f"{out_features}x{in_features}: an adapter for another base model?")
    return module


def _shares_weights(head: nn.Module, embedding: nn.Module) -> bool:
    return getattr(head, "weight", None) is getattr(embedding, "weight", False)


def _fuse_float(module: nn.Module, update: LoraUpdate) -> None:
    delta = (update.scale * update.b.float()) @ update.a.float()  # [out, in]
    weight = module.weight
    if _conv1d(module):
        delta = delta.t()
    weight.copy_(weight + delta.to(weight.dtype))


def _fuse_quantized(module: QuantizedLinear, update: LoraUpdate) -> None:
    """mlx-lm's LoRALinear.fuse on a QuantizedLinear, with MLX's own dequantize and quantize."""
    import mlx.core as mx

    w, scales, biases, group_size, bits = module.packed()
    weight = mx.dequantize(mx.array(w.numpy()), _to_mx(scales), _to_mx(biases), group_size=group_size, bits=bits)
    delta = (update.scale * _to_mx(update.b)) @ _to_mx(update.a)
    fused = weight + delta.astype(weight.dtype)
    qw, qs, qb = mx.quantize(fused, group_size=group_size, bits=bits)
    as_torch = lambda a: torch.from_numpy(np.array(a.astype(mx.float32))).to(scales.dtype)
    module.weight = torch.from_numpy(np.array(qw))
    module.scales, module.biases = as_torch(qs), as_torch(qb)


def _to_mx(t: torch.Tensor):
    """The tensor as an MLX array of its own dtype (float32 numpy carries each float dtype exactly)."""
    import mlx.core as mx

    dtypes = {torch.float32: mx.float32, torch.float16: mx.float16, torch.bfloat16: mx.bfloat16}
    return mx.array(t.detach().float().cpu().numpy()).astype(dtypes[t.dtype])
