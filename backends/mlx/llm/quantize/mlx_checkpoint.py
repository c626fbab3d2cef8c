"""An mlx-lm quantized checkpoint (`mlx_lm.convert -q`) as a transformers model with quantized layers.

mlx-lm writes safetensors in Hugging Face's key names where each quantized layer has `.weight` (uint32,
packed), `.scales` and `.biases`, and config.json a "quantization" entry ({"group_size", "bits",
"mode"}, plus per-layer overrides). The packed tensors go into QuantizedLinear / QuantizedEmbedding
as they are: no dequantize/requantize round trip. Bits and group size are read per layer from the
tensors' shapes (which also covers mlx-lm's per-layer overrides and the layers it leaves in float).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from backends.mlx.llm.quantize.modules import QuantizedEmbedding, QuantizedLinear

# Model types whose mlx-lm weight names equal transformers' (a name that does not is refused below by the
# strict key check) and whose quantized directories are tested (tests/test_quantized_decoder.py,
# tests/test_model_families.py).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "phi3")


def quantization_config(model_dir: Path) -> dict | None:
    """config.json's "quantization" entry, or None for a float checkpoint."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text()).get("quantization")


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{model_dir} has config.json's quantization entry but no .safetensors files")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f)))
    return tensors


def _packed(prefix: str, module: nn.Module, tensors: dict, dtype: torch.dtype) -> tuple:
    w, scales = tensors.pop(prefix + ".weight"), tensors.pop(prefix + ".scales")
    biases = tensors.pop(prefix + ".biases", None)
    if biases is None:
        raise ValueError(f"{prefix} has scales but no biases: only MLX's affine quantization is supported")
    in_features = module.in_features if isinstance(module, nn.Linear) else module.embedding_dim
    if w.dtype != torch.uint32 or w.dim() != 2 or (w.shape[1] * 32) % in_features:
        raise ValueError(f"{prefix}.weight {w.dtype} {tuple(w.shape)} is not a packed [out, in * bits / 32] "
                         f"uint32 weight of {in_features} input features")
    bits = w.shape[1] * 32 // in_features
    group_size = in_features // max(scales.shape[-1], 1)
    return w, scales.to(dtype), biases.to(dtype), group_size, bits


def load_mlx_quantized(model_dir: Path, dtype: torch.dtype) -> nn.Module:
    """The checkpoint as a transformers causal LM whose quantized layers hold mlx-lm's tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    quant = quantization_config(model_dir) or {}
    mode = quant.get("mode", "affine")
    if mode != "affine":
        raise ValueError(f"{model_dir}: quantization mode {mode!r} is not supported (only MLX's affine mode)")
    config = AutoConfig.from_pretrained(str(model_dir))
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{model_dir}: a quantized {config.model_type!r} checkpoint is not supported "
                         f"(quantized checkpoints of {', '.join(SUPPORTED_MODEL_TYPES)} are)")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager").eval()
    tensors = _read_weights(model_dir)
    for prefix in sorted(k[: -len(".scales")] for k in tensors if k.endswith(".scales")):
        module = model.get_submodule(prefix)
        if isinstance(module, nn.Linear):
            bias = tensors.pop(prefix + ".bias", None)
            packed = _packed(prefix, module, tensors, dtype)
            replacement = QuantizedLinear(*packed, bias=None if bias is None else bias.to(dtype))
        elif isinstance(module, nn.Embedding):
            scale = getattr(module, "embed_scale", None)  # Gemma scales the rows it looks up
            replacement = QuantizedEmbedding(*_packed(prefix, module, tensors, dtype),
                                             scale=None if scale is None else float(scale))
        else:
            raise ValueError(f"{prefix}: quantized weights for a {type(module).__name__}, not a Linear or Embedding")
        parent, _, leaf = prefix.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, replacement)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    quantized_embedding = model.get_input_embeddings()
    if tied and isinstance(quantized_embedding, QuantizedEmbedding):
        # mlx-lm stores no lm_head for a tied model: the head multiplies by the quantized table.
        model.lm_head = QuantizedLinear(*quantized_embedding.packed())
    missing, unexpected = model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v
                                                 for k, v in tensors.items()}, strict=False)
    # Quantized modules took their tensors above; rotary tables are computed; a tied head is the embedding.
    missing = [k for k in missing if not (k.endswith("inv_freq") or _quantized_owner(model, k)
                                          or (tied and k == "lm_head.weight"))]
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights do not match the {config.model_type} config "
                         f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    return model


def _quantized_owner(model: nn.Module, key: str) -> bool:
    owner, _, _ = key.rpartition(".")
    return isinstance(model.get_submodule(owner), (QuantizedLinear, QuantizedEmbedding))
