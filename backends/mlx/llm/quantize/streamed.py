"""`--quantize` of a float checkpoint read one tensor at a time: the float model never exists whole.

transformers' from_pretrained builds the whole model in the activation dtype (float32 by default: twice a
bfloat16 checkpoint's bytes) before quantize_model replaces its layers, so the export's peak held every float
weight plus the quantized ones (3.16x the checkpoint's bytes at 1.5B). Here the model is built with its
parameters on the meta device; the tensors that stay in float (norms, biases, layers the group size does not
divide) are read into it, then quantize_model quantizes each chosen layer from its weight read from the
safetensors file just then, so at most one float weight (and quantize_tensor's one block of rows) exists beside
the quantized ones. Each tensor is read through its own short-lived safetensors handle, so no mapping of the
file keeps its pages counted in the process.

The numbers are quantize_model's on a from_pretrained model: a weight stored in the checkpoint's dtype and
widened exactly to the activations' is quantized from the stored values (which quantize_tensor would recover
from the widened ones), any other is converted to the activations' dtype first, as from_pretrained converts it.

Only checkpoints whose tensor names are the model's own are read here (llama, qwen2/3, mistral, phi3, gemma3
text, ...): a checkpoint transformers renames or fuses on load (MoE experts stacked from per-expert tensors, a
vision-language model's prefixes) returns None, and the caller loads it through from_pretrained as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch
from torch import nn

from backends.mlx.llm.quantize.affine import _is_experts, plan, quantize_model
from backends.mlx.llm.quantize.mlx_checkpoint import parameters_on_meta

WIDENING = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}  # exact conversions


def tensor_files(model_dir: Path) -> dict[str, Path]:
    """Every tensor name of the checkpoint's safetensors files -> its file (headers only)."""
    from safetensors import safe_open

    files = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            files.update((key, f) for key in handle.keys())
    return files


def load_quantized(model_dir: Path, config, dtype: torch.dtype, bits: int, group_size: int, embeddings: bool,
                   stored: Optional[torch.dtype]) -> Optional[nn.Module]:
    """The causal LM at `model_dir` with quantize_model's layers quantized, read tensor by tensor; None when the
    checkpoint's names are not the model's (the caller then loads it whole)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, GenerationConfig

    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager").eval()
    model.tie_weights()  # a tied head is the embedding's Parameter (from_pretrained ties them after loading)
    if any(_is_experts(module) for module in model.modules()):
        return None
    files = tensor_files(model_dir)
    chosen = plan(model, group_size, embeddings)
    state = model.state_dict(keep_vars=True)
    shared: dict[int, list[str]] = {}  # one tensor's names (a tied head and its embedding)
    for key, value in state.items():
        shared.setdefault(id(value), []).append(key)
    if set(files) - set(state) or any(not set(keys) & set(files) for keys in shared.values()):
        return None  # names transformers maps on load: from_pretrained's own path

    # Each name -> the name its tensor is stored under (a tied head's may be absent from the file).
    stored_as = {key: next(k for k in keys if k in files) for keys in shared.values() for key in keys}

    def read(key: str) -> torch.Tensor:
        with safe_open(str(files[stored_as[key]]), framework="pt") as handle:
            return handle.get_tensor(stored_as[key])

    def as_loaded(t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point() or t.dtype == dtype:
            return t
        return t if (t.dtype, dtype) in WIDENING and t.dtype == stored else t.to(dtype)

    quantized = {f"{name}.weight" for name in chosen.linears}
    if chosen.embedding is not None:
        quantized.add(f"{chosen.embedding}.weight")
    for keys in shared.values():
        if quantized & set(keys):
            continue  # read by quantize_model below (a tied head shares the quantized embedding)
        value = state[keys[0]]
        tensor = read(keys[0])
        tensor = tensor.to(dtype) if tensor.is_floating_point() else tensor
        if isinstance(value, nn.Parameter):
            tensor = nn.Parameter(tensor, requires_grad=value.requires_grad)
        for key in keys:
            owner, _, leaf = key.rpartition(".")
            module = model.get_submodule(owner)
            (module._parameters if leaf in module._parameters else module._buffers)[leaf] = tensor
    quantize_model(model, bits, group_size, embeddings=embeddings, stored=stored,
                   weights=lambda name: as_loaded(read(f"{name}.weight")))
    left = [name for name, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
    if left:
        raise ValueError(f"{model_dir}: no weights for {left[:4]}")
    if (Path(model_dir) / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(model_dir))  # its eos ids, as from_pretrained
    return model
