"""A checkpoint directory (or Hub repo id) to one decoder .pte: what `etmlx export --model` and
`etmlx.export(...)` both do.

Loads the checkpoint (a float one, quantized here with `quantize=`, or an `mlx_lm.convert -q` directory as
it is), its tokenizer, and writes the program with export_decoder. Every option is checked before the
minutes of downloading, loading and lowering; a bad one is a ValueError whose message starts with the
option's name (the CLI turns that name into its flag).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.knobs import FEATURE_FLAGS, parse_features

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}
SCHEMES = {"int4": 4, "int8": 8}  # quantize=: name -> bits
DEFAULT_SAMPLER = "top-k,top-p,min-p"
SAMPLER_CHOICES = (*FEATURE_FLAGS, "none")


def sampler_config(sampler: str, logprobs: int = 0, logprobs_mode: str = "raw") -> SamplerConfig:
    """The SamplerConfig of `--sampler FEATURES --logprobs N --logprobs-mode MODE`."""
    if logprobs < 0:
        raise ValueError(f"logprobs must be >= 0, got {logprobs}")
    return SamplerConfig(**parse_features(sampler), logprobs=logprobs, logprobs_mode=logprobs_mode)


def export_checkpoint(model: str | Path, out: str | Path | None = None, *, revision: str | None = None,
                      dtype: str = "float32", quantize: str | None = None, group_size: int = 64,
                      quantize_embeddings: bool = True, max_seq_len: int = 256, batch: int = 1,
                      sampler: str = DEFAULT_SAMPLER, logprobs: int = 0, logprobs_mode: str = "raw",
                      seeded: bool = True, pipelined: bool | None = None, verify: bool = True,
                      draft_tokens: int = 0, propose_tokens: int = 0, external_weights: bool = False,
                      progress: Optional[Callable[[str], None]] = None, adapter: str | Path | None = None,
                      tool_call_format: str | None = None, qmm_activations: str = "int16", kv_bits: int = 0,
                      kv_group_size: int = 64, kv_scale_dtype: str = "", tensor_parallel: int = 1,
                      pipeline_parallel: int = 1, adapters: dict | None = None):
    """Export the causal LM at `model` (a local directory or a Hugging Face repo id) to `out` (default:
    NAME.pte in the current directory), which holds the program when this returns its ExportResult.
    `adapter`: a LoRA adapter directory (mlx-lm's or PEFT's) fused into the weights (llm/lora/).
    `adapters`: {name: directory} of LoRA adapters kept unfused, each request choosing one by name (or none) per
    row (llm/lora/switchable.py); with `adapter` too, that one is fused into the base first.
    `tool_call_format`: the tool-call syntax stored in the program (default: detected from the chat template;
    llm/decoder/tool_formats.py).
    `qmm_activations`: int16 (default), int8 or float32 activations in the CPU's quantized products, recorded in
    the program (exporter/export.py).
    `kv_bits` 8 or 4: the KV cache stored MLX-affine quantized, `kv_group_size` values per scale and bias, those in
    `kv_scale_dtype` (default: bfloat16 for a float32 model, else its dtype; llm/decoder/kv_quant.py); 0: float.
    `tensor_parallel` N > 1: a program split over N ranks, one file per rank (`out` rank 0's, OUT.rankR.pte the
    others'; llm/decoder/tensor_parallel.py, docs/distributed.md).
    `pipeline_parallel` N > 1: a program whose layers are split over N ranks, a contiguous block each, one file per
    rank as for `tensor_parallel` (llm/decoder/pipeline_parallel.py); not both."""
    from backends.mlx.llm.checkpoint_source import check_weight_files, default_pte_name, resolve_checkpoint

    say = progress or (lambda stage: None)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of float32, float16, bfloat16, got {dtype!r}")
    if quantize is not None and quantize not in SCHEMES:
        raise ValueError(f"quantize must be one of {', '.join(SCHEMES)}, got {quantize!r}")
    config = sampler_config(sampler, logprobs, logprobs_mode)
    from backends.mlx.llm.decoder.kv_quant import kv_quant

    kv_quant(kv_bits, kv_group_size, kv_scale_dtype)  # before the checkpoint loads
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"tensor_parallel must be an int >= 1, got {tensor_parallel!r}")
    if isinstance(pipeline_parallel, bool) or not isinstance(pipeline_parallel, int) or pipeline_parallel < 1:
        raise ValueError(f"pipeline_parallel must be an int >= 1, got {pipeline_parallel!r}")
    from backends.mlx.llm.distributed.split_options import check_split_options

    split = dict(propose_tokens=propose_tokens, kv_bits=kv_bits, adapters=adapters)
    if tensor_parallel > 1:
        check_split_options("tensor_parallel", **split)
    if pipeline_parallel > 1:
        check_split_options("pipeline_parallel", tensor_parallel=tensor_parallel > 1, **split)
    if draft_tokens < 0:
        raise ValueError(f"draft_tokens must be >= 0, got {draft_tokens}")
    if propose_tokens < 0:
        raise ValueError(f"propose_tokens must be >= 0, got {propose_tokens}")
    if propose_tokens:  # a draft model's program: the plain sampler (llm/decoder/proposer.py)
        if sampler != DEFAULT_SAMPLER or logprobs:
            raise ValueError("propose_tokens takes the plain sampling head (temperature and seed): drop the "
                             "sampler features and logprobs")
        config = SamplerConfig()
    out = Path(out or default_pte_name(str(model)))
    if out.is_dir():
        raise IsADirectoryError(f"out {out} is a directory; give the .pte file to write, e.g. {out / 'model.pte'}")
    lora = None
    if adapter is not None:
        from backends.mlx.llm.lora.adapter_files import read_adapter

        lora = read_adapter(adapter)  # its files and config now; its shapes against the model once loaded
    switchable = None
    if adapters is not None:
        from backends.mlx.llm.lora.switchable import read_adapters

        if draft_tokens or propose_tokens:
            raise ValueError("adapters: switchable adapters need a plain program (not draft_tokens or propose_tokens)")
        switchable = read_adapters(adapters)  # files and configs now; shapes against the model once loaded
    model_dir = resolve_checkpoint(str(model), revision)  # a local directory, or a Hub repo id
    check_weight_files(model_dir)  # a truncated or foreign weights file: one line, not transformers' traceback

    import torch
    from transformers import AutoTokenizer

    from backends.mlx.llm.decoder.export import export_decoder
    from backends.mlx.llm.decoder.vision_export import PROCESSOR_FILES

    torch_model = _load_model(model_dir, getattr(torch, DTYPES[dtype]), quantize, group_size, quantize_embeddings,
                              say, lora)
    attached = None
    if switchable is not None:
        from backends.mlx.llm.lora.switchable import attach_adapters

        attached = attach_adapters(torch_model, switchable)
        say(f"keeping {len(switchable)} adapters switchable ({', '.join(switchable)}) on {attached.layers} layers")
    tokenizer = None
    if any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    else:
        say("no tokenizer in the checkpoint: generate will need --prompt-ids")
    processor_files = {name: (model_dir / name).read_bytes() for name in PROCESSOR_FILES
                       if (model_dir / name).is_file()}
    options = dict(config=config, batch=batch, seeded=seeded, tokenizer=tokenizer, progress=say,
                   external_weights=external_weights, pipelined=pipelined, verify=verify,
                   tool_call_format=tool_call_format, qmm_activations=qmm_activations, kv_bits=kv_bits,
                   kv_group_size=kv_group_size, kv_scale_dtype=kv_scale_dtype, processor_files=processor_files,
                   adapters=attached)
    if tensor_parallel > 1:
        from backends.mlx.llm.decoder.tensor_parallel import export_tensor_parallel

        # Quantized before sharding (above): each rank's packed weights are the one-rank program's, cut.
        result = export_tensor_parallel(torch_model, out, tensor_parallel, max_seq_len=max_seq_len, **options)
    elif pipeline_parallel > 1:
        from backends.mlx.llm.decoder.pipeline_parallel import export_pipeline_parallel

        result = export_pipeline_parallel(torch_model, out, pipeline_parallel, max_seq_len=max_seq_len, **options)
    else:
        result = export_decoder(torch_model, out, max_seq_len, draft_tokens=draft_tokens,
                                propose_tokens=propose_tokens, **options)
    say("done")
    return result


def _load_model(model_dir: Path, dtype, quantize: str | None, group_size: int, embeddings: bool, say, lora=None):
    """A float checkpoint (quantized with `quantize`), or an mlx-lm quantized one as it is; the LoRA adapter
    `lora` fused into its weights (before quantizing)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    from backends.mlx.llm.checkpoint_source import stored_dtype_name
    from backends.mlx.llm.decoder.model_support import check_vision_family, is_vision_language
    from backends.mlx.llm.quantize.mlx_checkpoint import load_mlx_quantized, quantization_config

    if quantization_config(model_dir) is not None:
        if quantize is not None:
            raise ValueError(f"{model_dir} is already quantized (config.json has a quantization entry): "
                             "drop --quantize")
        say(f"loading the mlx-lm quantized checkpoint {model_dir} ({dtype} activations)")
        return _fused(load_mlx_quantized(model_dir, dtype), lora, say)
    config = AutoConfig.from_pretrained(str(model_dir))
    check_vision_family(config)  # before the minutes of loading: a vision tower etmlx does not export is refused
    vision = is_vision_language(config)
    stored = stored_dtype_name(model_dir)
    stored = getattr(torch, stored) if stored else None
    if quantize is not None and lora is None and not vision:
        from backends.mlx.llm.quantize.streamed import load_quantized

        say(f"loading {model_dir} as {dtype}, quantizing to {quantize} one layer at a time, group size {group_size}"
            + ("" if embeddings else " (embedding and head kept in float)"))
        model = load_quantized(model_dir, config, dtype, SCHEMES[quantize], group_size, embeddings, stored)
        if model is not None:
            return model
        say("its tensor names are not the model's: loading it whole")
    loader = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    say(f"loading {model_dir} as {dtype}")
    model = _fused(loader.from_pretrained(str(model_dir), dtype=dtype, attn_implementation="eager"), lora, say)
    if quantize is not None:
        from backends.mlx.llm.quantize.affine import quantize_model

        say(f"quantizing to {quantize}, group size {group_size}"
            + ("" if embeddings else " (embedding and head kept in float)"))
        # Scales and biases keep the checkpoint's dtype (bf16 for most releases), as mlx_lm.convert -q writes them
        # (but the embedding's under float32 activations: modules.embedding_scales).
        quantize_model(model, SCHEMES[quantize], group_size, embeddings=embeddings, stored=stored)
    return model


def _fused(model, lora, say):
    if lora is not None:
        from backends.mlx.llm.lora.fuse import fuse_adapter

        say(f"fusing the {lora.describe()}")
        fuse_adapter(model, lora)
    return model
