"""One rank's part of a causal LM, sharded as mlx-lm shards it (mlx_lm.models.*.shard(), mlx.nn's
shard_linear): in every decoder layer the attention heads are split across the ranks (q/k/v projections
"all-to-sharded": rank r keeps its heads' output rows; o projection "sharded-to-all": rank r keeps those heads'
input columns and the partial products are summed over the ranks by mlx::all_sum), and the MLP likewise (gate
and up column-sharded, down row-sharded + all_sum). A bias of a row-sharded layer is added once, after the sum.

The embedding, the norms and the head stay whole on every rank (replicated): the head's logits then need no
gather, and every rank samples the same token from the same logits with the same seed, so the ranks stay in
step without exchanging tokens. Quantized layers (llm/quantize, also an mlx-lm checkpoint's) are sharded as
packed: rows for column sharding, whole groups of columns for row sharding, so each rank's weights are the
one-rank program's bytes, cut.

A mixture-of-experts layer (Qwen3-MoE) keeps its router and experts whole on every rank (experts replicated, not
expert-parallel): only its attention is split, and every rank computes the same expert outputs from the same
all-summed hidden state. Its weights then shrink by the attention's share only.

Families: those whose decoder layers are transformers' Llama layout (self_attn.{q,k,v,o}_proj, and
mlp.{gate,up,down}_proj or an experts block), checked by name in FAMILIES; others are refused by name."""

from __future__ import annotations

import copy

import torch
from torch import nn

import backends.mlx.custom_kernel_ops  # noqa: F401  (registers mlx::all_sum)
from backends.mlx.llm.lora.switchable import SwitchableLora
from backends.mlx.llm.quantize.modules import QuantizedLinear

# model_type -> tested with token equality against the one-rank program (tests/test_distributed.py).
FAMILIES = ("llama", "qwen3", "gemma3_text", "qwen3_moe")
ATTENTION_COLUMN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
ATTENTION_ROW = ("self_attn.o_proj",)
MLP_COLUMN = ("mlp.gate_proj", "mlp.up_proj")
MLP_ROW = ("mlp.down_proj",)


def _base(linear: nn.Module) -> nn.Module:
    """The linear under a switchable LoRA adapter (llm/lora/switchable.py), or the module itself."""
    return linear.base if isinstance(linear, SwitchableLora) else linear


def _dense_mlp(layer: nn.Module) -> bool:
    """Whether the layer's MLP is a gated dense one (else an experts block, replicated)."""
    mlp = getattr(layer, "mlp", None)
    return all(isinstance(_base(getattr(mlp, name, None)), (nn.Linear, QuantizedLinear))
               for name in ("gate_proj", "up_proj", "down_proj"))


def sharded_paths(layer: nn.Module) -> tuple[tuple, tuple]:
    """(column-sharded, row-sharded) submodule paths of a decoder layer."""
    if _dense_mlp(layer):
        return ATTENTION_COLUMN + MLP_COLUMN, ATTENTION_ROW + MLP_ROW
    return ATTENTION_COLUMN, ATTENTION_ROW


class AllSumLinear(nn.Module):
    """A row-sharded linear: this rank's partial product, summed over the ranks, then the bias."""

    def __init__(self, linear: nn.Module, bias: torch.Tensor | None):
        super().__init__()
        self.linear = linear
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.mlx.all_sum(self.linear(x))
        return y if self.bias is None else y + self.bias


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    base = getattr(model, model.base_model_prefix, None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(f"{type(model).__name__} has no decoder layers at {model.base_model_prefix}.layers")
    return layers


def check_shardable(model: nn.Module, ranks: int) -> None:
    """A one-line ValueError naming what stops `model` from splitting over `ranks` ranks."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 2:
        raise ValueError(f"tensor_parallel must be an int >= 2, got {ranks!r}")
    config = getattr(model.config, "text_config", model.config)
    family = getattr(config, "model_type", "")
    if family not in FAMILIES:
        raise ValueError(f"tensor_parallel: {family or type(model).__name__} models are not sharded yet "
                         f"(sharded: {', '.join(FAMILIES)})")
    layers = decoder_layers(model)
    counts = [("attention heads", config.num_attention_heads),
              ("key/value heads", getattr(config, "num_key_value_heads", None) or config.num_attention_heads)]
    counts += [("MLP width", width) for width in sorted({_base(layer.mlp.gate_proj).weight.shape[0]
                                                          for layer in layers if _dense_mlp(layer)})]
    for name, count in counts:
        if count % ranks:
            raise ValueError(f"tensor_parallel {ranks}: the model's {count} {name} do not split over {ranks} ranks")
    for i, layer in enumerate(layers):
        for path in sharded_paths(layer)[1]:
            linear = _base(layer.get_submodule(path))
            if isinstance(linear, QuantizedLinear):
                columns = linear.scales.shape[-1] * linear.group_size
                if (columns // ranks) % linear.group_size:
                    raise ValueError(f"tensor_parallel {ranks}: layer {i}'s {path} has {columns} input columns in "
                                     f"groups of {linear.group_size}, which do not split into whole groups")
            elif not isinstance(linear, nn.Linear):
                raise ValueError(f"tensor_parallel: layer {i}'s {path} is a {type(linear).__name__}, not a linear")


def _rows(t: torch.Tensor | None, rank: int, ranks: int) -> torch.Tensor | None:
    if t is None:
        return None
    n = t.shape[0] // ranks
    return t[rank * n:(rank + 1) * n].clone()


def _columns(t: torch.Tensor, rank: int, ranks: int) -> torch.Tensor:
    n = t.shape[-1] // ranks
    return t[..., rank * n:(rank + 1) * n].clone()


def _column_sharded(linear: nn.Module, rank: int, ranks: int) -> nn.Module:
    if isinstance(linear, SwitchableLora):  # B's output rows split with the base's; A is whole on every rank
        lora_b = linear.lora_b.detach()  # [N + 1, out, r]
        n = lora_b.shape[1] // ranks
        return SwitchableLora(_column_sharded(linear.base, rank, ranks), linear.lora_a.detach(),
                              lora_b[:, rank * n:(rank + 1) * n].clone(), linear.lora_scales, linear._choice)
    if isinstance(linear, QuantizedLinear):
        return QuantizedLinear(_rows(linear.weight, rank, ranks), _rows(linear.scales, rank, ranks),
                               _rows(linear.biases, rank, ranks), linear.group_size, linear.bits,
                               _rows(linear.bias, rank, ranks))
    out = nn.Linear(linear.in_features, linear.out_features // ranks, bias=linear.bias is not None,
                    dtype=linear.weight.dtype, device="meta")
    out.weight = nn.Parameter(_rows(linear.weight.detach(), rank, ranks), requires_grad=False)
    if linear.bias is not None:
        out.bias = nn.Parameter(_rows(linear.bias.detach(), rank, ranks), requires_grad=False)
    return out


def _row_sharded(linear: nn.Module, rank: int, ranks: int) -> nn.Module:
    part, bias = _row_part(_base(linear), rank, ranks)
    if isinstance(linear, SwitchableLora):
        # A's input columns split with the base's: each rank's B (A_r x_r) is a partial sum, summed with the base's.
        part = SwitchableLora(part, _columns(linear.lora_a.detach(), rank, ranks), linear.lora_b.detach(),
                              linear.lora_scales, linear._choice)
    return AllSumLinear(part, bias)


def _row_part(linear: nn.Module, rank: int, ranks: int) -> tuple[nn.Module, torch.Tensor | None]:
    """This rank's input columns of `linear` (no bias: added once, after the all-sum) and the bias."""
    bias = None if linear.bias is None else linear.bias.detach().clone()
    if isinstance(linear, QuantizedLinear):
        # Packed words and groups split at the same column: check_shardable made each rank's part whole groups.
        return QuantizedLinear(_columns(linear.weight, rank, ranks), _columns(linear.scales, rank, ranks),
                               _columns(linear.biases, rank, ranks), linear.group_size, linear.bits), bias
    part = nn.Linear(linear.in_features // ranks, linear.out_features, bias=False, dtype=linear.weight.dtype,
                     device="meta")
    part.weight = nn.Parameter(_columns(linear.weight.detach(), rank, ranks), requires_grad=False)
    return part, bias


def shard_model(model: nn.Module, rank: int, ranks: int) -> nn.Module:
    """Rank `rank`'s part of `model` (of `ranks`), a new module sharing the replicated parameters with `model`,
    which is left as it was."""
    check_shardable(model, ranks)
    if not 0 <= rank < ranks:
        raise ValueError(f"rank {rank} is not one of 0..{ranks - 1}")
    # Every tensor is shared, not copied: the sharded layers are replaced below, the rest is replicated.
    memo = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    part = copy.deepcopy(model, memo)
    for layer in decoder_layers(part):
        column, row = sharded_paths(layer)
        for path in column:
            owner, name = path.rsplit(".", 1)
            module = layer.get_submodule(owner)
            setattr(module, name, _column_sharded(getattr(module, name), rank, ranks))
        for path in row:
            owner, name = path.rsplit(".", 1)
            module = layer.get_submodule(owner)
            setattr(module, name, _row_sharded(getattr(module, name), rank, ranks))
    return part
