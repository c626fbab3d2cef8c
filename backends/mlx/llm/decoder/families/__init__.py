"""Per-architecture adapters from a transformers causal LM to StaticCacheLM (see adapter.py).

Supported: Llama-style blocks (Llama, Mistral, Qwen2, Qwen3) and GPT-2. Anything else is refused with
the missing module named. To add a family: write an adapter module implementing `FamilyAdapter`, add it
to `ADAPTERS` with the test that recognizes its models, and add it to the family tests.
"""

from __future__ import annotations

from torch import nn

from backends.mlx.llm.decoder.families.adapter import SUPPORTED, FamilyAdapter
from backends.mlx.llm.decoder.families.gpt2 import GPT2Family
from backends.mlx.llm.decoder.families.llama import LlamaFamily

# (recognizes the model's module tree, adapter), tried in order
ADAPTERS = (
    (lambda m: hasattr(m, "transformer") and hasattr(m.transformer, "wpe"), GPT2Family),
    (lambda m: hasattr(m, "model") and hasattr(m.model, "layers"), LlamaFamily),
)


def family_for(model: nn.Module) -> FamilyAdapter:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a transformers causal LM (nn.Module), got {type(model).__name__}")
    if getattr(model, "config", None) is None:
        raise ValueError(f"{type(model).__name__} has no `config`: not a transformers causal LM")
    for recognizes, adapter in ADAPTERS:
        if recognizes(model):
            return adapter(model)
    raise ValueError(f"{type(model).__name__} (model_type {getattr(model.config, 'model_type', '?')!r}) has neither "
                     f"`model.layers` nor `transformer.h`: unsupported architecture (etmlx decodes {SUPPORTED})")
