"""The float32 bench checkpoint as a GGUF file for llama.cpp (`etmlx bench decode --shape`'s baseline).

Written with the `gguf` package (llama.cpp's own Python writer; `make bench-deps` installs it): the same float
weights the other engines quantize, quantized by gguf's reference quantizers to Q4_0 / Q8_0 (llama.cpp's own
schemes: symmetric blocks of 32, so not MLX's integers) or stored as F16. Every matrix, the token embedding
included, gets the file's type; norms and biases stay F32, as llama.cpp's converter keeps them. A tied model
stores no output.weight: llama.cpp then multiplies by token_embd, as it does for the real Qwen2.5 files.
The tokenizer is the bench checkpoint's word list as a GPT-2 vocabulary with one merge (llama.cpp refuses a
BPE vocabulary without merges); the benchmark feeds token ids, so it is never used to split text.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

TYPES = ("Q4_0", "Q8_0", "F16")
# Converted once, cached next to the checkpoint; bump when the layout written below changes.
_LAYOUT = 1


def cached_gguf(float_dir: Path, qtype: str) -> Path:
    """`float_dir` (a benchmarks/checkpoints.py float32 directory) as `<float_dir>/llama-cpp-<qtype>.gguf`."""
    if qtype not in TYPES:
        raise ValueError(f"GGUF type must be one of {TYPES}, got {qtype!r}")
    path = Path(float_dir) / f"llama-cpp-{qtype}.gguf"
    marker = Path(str(path) + ".json")
    source = {"spec": (Path(float_dir) / "bench_spec.json").read_text(), "layout": _LAYOUT}
    if path.is_file() and marker.is_file() and json.loads(marker.read_text()) == source:
        return path
    write_gguf(Path(float_dir), path, qtype)
    marker.write_text(json.dumps(source))  # last: an interrupted write is redone
    return path


def _permute_for_llama(weight: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's Llama q/k rows rotate (first half, second half) pairs; llama.cpp's "llama" rope rotates
    adjacent pairs, so its converter reorders each head's rows (convert_hf_to_gguf's LlamaModel.permute)."""
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tensor_names(layers: int) -> dict[str, str]:
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    per_layer = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    for i in range(layers):
        for hf, gg in per_layer.items():
            for kind in ("weight", "bias"):
                names[f"model.layers.{i}.{hf}.{kind}"] = f"blk.{i}.{gg}.{kind}"
    return names


def write_gguf(float_dir: Path, path: Path, qtype: str) -> None:
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((float_dir / "config.json").read_text())
    arch = config["model_type"]
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"{float_dir}: GGUF export knows llama and qwen2, not {arch!r}")
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    hidden, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    file_type = {"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                 "F16": gguf.LlamaFileType.MOSTLY_F16}[qtype]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(float_dir.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(hidden)
    writer.add_block_count(layers)
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_rope_freq_base(float(config["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_file_type(file_type)
    writer.add_vocab_size(vocab)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_types([gguf.TokenType.NORMAL] * vocab)
    writer.add_token_merges(["t 0"])

    tensors = {}
    for file in sorted(float_dir.glob("*.safetensors")):
        tensors.update(load_file(str(file)))
    names = _tensor_names(layers)
    quant = getattr(gguf.GGMLQuantizationType, qtype)
    for key in sorted(tensors):
        if key not in names:
            raise ValueError(f"{float_dir}: no GGUF name for tensor {key}")
        data = tensors[key].astype(np.float32)
        if arch == "llama" and key.endswith("self_attn.q_proj.weight"):
            data = _permute_for_llama(data, heads)
        elif arch == "llama" and key.endswith("self_attn.k_proj.weight"):
            data = _permute_for_llama(data, kv_heads)
        if data.ndim == 2 and qtype != "F16":
            writer.add_tensor(names[key], gguf.quants.quantize(data, quant), raw_dtype=quant)
        elif data.ndim == 2:
            writer.add_tensor(names[key], data.astype(np.float16))
        else:
            writer.add_tensor(names[key], data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
