"""An mlx-lm quantized checkpoint (`mlx_lm.convert -q`) as a transformers model with quantized layers.

mlx-lm writes safetensors in Hugging Face's key names where each quantized layer has `.weight` (uint32,
packed), `.scales` and `.biases`, and config.json a "quantization" entry ({"group_size", "bits",
"mode"}, plus per-layer overrides). The packed tensors go into QuantizedLinear / QuantizedEmbedding
as they are: no dequantize/requantize round trip. Each layer's bits and group size are config.json's
(its per-layer entry, which `mlx_lm.convert` writes for every layer a recipe quantizes differently, else
the top-level default), and every packed weight, scale and bias must have the shapes they give: a
directory whose tensors disagree with its config (scales shaped for another group size, weights packed
for other bits) is refused by tensor name rather than decoded as whichever of the two is wrong.
(mlx-lm 0.32 itself infers a layer's scheme from the shapes where the config names no per-layer entry.)
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from torch import nn

from backends.mlx.llm.quantize.modules import QuantizedEmbedding, QuantizedLinear, embedding_scales

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


def layer_scheme(quant: dict, prefix: str) -> tuple[int, int] | None:
    """(group size, bits) config.json's "quantization" entry gives layer `prefix`: its per-layer entry if it has
    one (False: left in float, None returned), else the top-level defaults."""
    entry = quant.get(prefix, quant)
    if entry is False:
        return None
    if not isinstance(entry, dict):  # True: the defaults
        entry = quant
    group_size, bits = entry.get("group_size", quant.get("group_size")), entry.get("bits", quant.get("bits"))
    if not isinstance(group_size, int) or not isinstance(bits, int) or group_size <= 0 or bits <= 0:
        raise ValueError(f"{prefix}: config.json's quantization gives group size {group_size!r} and bits {bits!r}; "
                         "both must be positive integers")
    return group_size, bits


def _packed(prefix: str, module: nn.Module, tensors: dict, dtype: torch.dtype, quant: dict) -> tuple:
    w, scales = tensors.pop(prefix + ".weight"), tensors.pop(prefix + ".scales")
    biases = tensors.pop(prefix + ".biases", None)
    if biases is None:
        raise ValueError(f"{prefix} has scales but no biases: only MLX's affine quantization is supported")
    scheme = layer_scheme(quant, prefix)
    if scheme is None:
        raise ValueError(f"{prefix} has packed weights and scales but config.json's quantization leaves it in float")
    group_size, bits = scheme
    if isinstance(module, nn.Linear):
        out_features, in_features = module.out_features, module.in_features
    else:
        out_features, in_features = module.num_embeddings, module.embedding_dim
    if in_features % group_size or (in_features * bits) % 32:
        raise ValueError(f"{prefix}: config.json's group size {group_size} and {bits} bits do not divide its "
                         f"{in_features} input features")
    packed = (out_features, in_features * bits // 32)
    if w.dtype != torch.uint32 or tuple(w.shape) != packed:
        found = (f", packed for {w.shape[1] * 32 // in_features} bits" if w.dim() == 2 and w.dtype == torch.uint32
                 and (w.shape[1] * 32) % in_features == 0 else "")
        raise ValueError(f"{prefix}.weight is {str(w.dtype).removeprefix('torch.')} {list(w.shape)}{found}; "
                         f"config.json's {bits} bits need uint32 {list(packed)}")
    grouped = [out_features, in_features // group_size]
    for name, t in (("scales", scales), ("biases", biases)):
        if list(t.shape) != grouped:
            found = (f", shaped for group size {in_features // t.shape[1]}" if t.dim() == 2 and t.shape[1]
                     and in_features % t.shape[1] == 0 else "")
            raise ValueError(f"{prefix}.{name} is {list(t.shape)}{found}; config.json's group size {group_size} "
                             f"needs {grouped}")
    # Scales and biases stay as stored (bf16 in most mlx-community repos): the file holds them once, at their own
    # size, and the product promotes them to the activations' dtype as mlx-lm's does.
    return w, scales, biases, group_size, bits


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
    # Parameters are made on the meta device: a float copy of the whole model (2 GB at 0.5B in float32, built
    # and randomly initialised) would be thrown away, since every parameter comes from the checkpoint below.
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager").eval()
    tensors = _read_weights(model_dir)
    for prefix in sorted(k[: -len(".scales")] for k in tensors if k.endswith(".scales")):
        module = model.get_submodule(prefix)
        if isinstance(module, nn.Linear):
            bias = tensors.pop(prefix + ".bias", None)
            packed = _packed(prefix, module, tensors, dtype, quant)
            replacement = QuantizedLinear(*packed, bias=None if bias is None else bias.to(dtype))
        elif isinstance(module, nn.Embedding):
            scale = getattr(module, "embed_scale", None)  # Gemma scales the rows it looks up
            w, scales, biases, group_size, bits = _packed(prefix, module, tensors, dtype, quant)
            replacement = QuantizedEmbedding(w, *embedding_scales(scales, biases, dtype), group_size, bits,
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
                                                 for k, v in tensors.items()}, strict=False, assign=True)
    # Quantized modules took their tensors above; rotary tables are computed; a tied head is the embedding.
    missing = [k for k in missing if not (k.endswith("inv_freq") or _quantized_owner(model, k)
                                          or (tied and k == "lm_head.weight"))]
    if missing or unexpected:
        raise ValueError(f"{model_dir}: weights do not match the {config.model_type} config "
                         f"(missing {missing[:4]}, unexpected {unexpected[:4]})")
    if tied and isinstance(getattr(model, "lm_head", None), nn.Linear):
        # assign=True gave the embedding a new Parameter; the float head must be that one again.
        model.lm_head.weight = model.get_input_embeddings().weight
    left = [name for name, p in model.named_parameters() if p.is_meta]
    if left:
        raise ValueError(f"{model_dir}: no weights for {left[:4]}")
    return model


@contextlib.contextmanager
def parameters_on_meta():
    """Every nn.Parameter registered inside goes to the meta device (no memory, no initialisation); buffers
    (rotary tables, computed from the config) stay real. What accelerate's init_empty_weights does."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            kept = module._parameters[name]
            module._parameters[name] = nn.Parameter(kept.to("meta"), requires_grad=kept.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _quantized_owner(model: nn.Module, key: str) -> bool:
    owner, _, _ = key.rpartition(".")
    return isinstance(model.get_submodule(owner), (QuantizedLinear, QuantizedEmbedding))
