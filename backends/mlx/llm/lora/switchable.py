"""Several LoRA adapters kept unfused in one program, chosen per row of each call.

Every layer some adapter targets becomes a SwitchableLora: the base layer as it was (float, or quantized),
plus every adapter's A and B stacked, a [N + 1, r, in] and b [N + 1, out, r], slot 0 zeros ("no adapter"),
adapters of lower rank (or that skip the layer) padded with zeros to the widest rank r. A row whose adapter
index is a computes y = base(x) + scale_a * B_a (A_a x), as PEFT's and mlx-lm's unfused LoRA layers do (the
zero padding adds exact zeros). The LoRA part keeps the model's float dtype under a quantized base.

The index reaches the layers through one AdapterChoice they share: the program's outer module
(llm/decoder/adapter_input.py) sets it from its `adapter` [B] int64 input for the length of the call. Eager calls outside
a program (the export's self-check) leave it unset: the base model.

Names: letters, digits, '.', '_' and '-', unique; ':' would be ambiguous in an OpenAI model id "BASE:NAME".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from backends.mlx.llm.lora.adapter_files import Adapter, read_adapter
from backends.mlx.llm.lora.fuse import target_layer

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_names(names) -> list[str]:
    """The adapter names in order; a bad or repeated one is a ValueError starting with "adapters"."""
    names = list(names)
    if not names:
        raise ValueError("adapters: give at least one NAME=DIR")
    seen = set()
    for name in names:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"adapters: name {name!r} must be letters, digits, '.', '_' or '-' (no ':' or spaces; "
                             "a request names it as BASE:NAME)")
        if name in seen:
            raise ValueError(f"adapters: name {name!r} is given twice")
        seen.add(name)
    return names


def parse_adapters(spec: str) -> dict[str, str]:
    """`NAME=DIR,NAME2=DIR2` (the --adapters flag) as {name: directory}."""
    pairs = {}
    names = []
    for item in spec.split(","):
        name, sep, path = item.partition("=")
        if not sep or not path:
            raise ValueError(f"adapters: {item!r} is not NAME=DIR")
        names.append(name)
        pairs[name] = path
    check_names(names)
    return pairs


def read_adapters(paths: dict) -> dict[str, Adapter]:
    """{name: Adapter} of {name: directory}; a bad name or adapter is one ValueError "adapters: NAME=DIR: ..."."""
    adapters = {}
    for name in check_names(paths):
        try:
            adapters[name] = read_adapter(paths[name])
        except ValueError as exc:
            raise ValueError(f"adapters: {name}={str(exc).removeprefix('adapter ')}") from None
    return adapters


class AdapterChoice:
    """The current call's adapter index per row, [B] int64, shared by every SwitchableLora; None: no adapter."""

    def __init__(self, names: list[str]):
        self.names = list(names)
        self.index: torch.Tensor | None = None

    def __deepcopy__(self, memo) -> "AdapterChoice":
        # A copy of the model (a pipeline stage, llm/distributed/pipeline.py) keeps reading the one choice its
        # program's AdapterInput sets: a copied choice would never be set, and every row would run the base model.
        return self


class SwitchableLora(nn.Module):
    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, scales: torch.Tensor, choice: AdapterChoice):
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(a, requires_grad=False)  # [N + 1, r, in]
        self.lora_b = nn.Parameter(b, requires_grad=False)  # [N + 1, out, r]
        self.register_buffer("lora_scales", scales)  # [N + 1]
        self._choice = choice  # not a submodule: one object shared by every layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        index = self._choice.index
        if index is None:
            return y
        a = self.lora_a.index_select(0, index)  # [B, r, in]
        b = self.lora_b.index_select(0, index)  # [B, out, r]
        scale = self.lora_scales.index_select(0, index).reshape(-1, *([1] * (x.dim() - 1)))
        # x [B, ..., in]: as PEFT's lora_B(lora_A(x)) * scaling, each row with its own adapter
        middle = [1] * (x.dim() - 3)
        h = torch.matmul(x.to(a.dtype), a.transpose(-1, -2).reshape(a.shape[0], *middle, *a.shape[:0:-1]))
        z = torch.matmul(h, b.transpose(-1, -2).reshape(b.shape[0], *middle, *b.shape[:0:-1]))
        return y + (z * scale).to(y.dtype)


@dataclass(frozen=True)
class AttachedAdapters:
    choice: AdapterChoice
    layers: int  # layers that got a SwitchableLora

    @property
    def names(self) -> list[str]:
        return self.choice.names


def attach_adapters(model: nn.Module, adapters: dict[str, Adapter]) -> AttachedAdapters:
    """Wrap every layer an adapter targets in a SwitchableLora, in place. Every adapter's shapes are checked
    against the model first (fuse.py's checks: a layer it lacks, an update of another shape): one ValueError
    "adapters: NAME=DIR: ..." before any layer changes."""
    names = check_names(adapters)
    targets: dict[str, nn.Module] = {}
    per_layer: dict[str, dict[int, object]] = {}
    for slot, name in enumerate(names, start=1):
        adapter = adapters[name]
        where = f"adapters: {name}={adapter.path}:"
        for update in adapter.updates:
            targets[update.module] = target_layer(model, update, where)
            per_layer.setdefault(update.module, {})[slot] = update
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        dtype = torch.float32
    choice = AdapterChoice(names)
    count = len(names) + 1
    for module_name, updates in sorted(per_layer.items()):
        first = next(iter(updates.values()))
        rank = max(u.rank for u in updates.values())
        out_features, in_features = first.b.shape[0], first.a.shape[1]
        a = torch.zeros(count, rank, in_features, dtype=dtype)
        b = torch.zeros(count, out_features, rank, dtype=dtype)
        scales = torch.zeros(count, dtype=dtype)
        for slot, update in updates.items():
            a[slot, :update.rank] = update.a.to(dtype)
            b[slot, :, :update.rank] = update.b.to(dtype)
            scales[slot] = update.scale
        model.set_submodule(module_name, SwitchableLora(targets[module_name], a, b, scales, choice))
    return AttachedAdapters(choice, len(per_layer))
