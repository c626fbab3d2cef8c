"""`etmlx bench NAME ...`: one subcommand parser per benchmark.

The `etmlx` command (backends/mlx/cli/main.py) calls `add_parsers` when this folder is importable, which
is the case in a checkout (`make setup`); a wheel ships without it. Each benchmark measures its baselines
in the same run (README.md here).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

DEFAULT_DECODE_DTYPES = "float32,bfloat16"
CACHE_DIR = "out/bench"


def _common(parser: argparse.ArgumentParser, *, repeats: str | None = None, cache: bool = False) -> None:
    parser.add_argument("--json", help="also write the records to this path")
    if repeats:
        parser.add_argument("--repeats", type=int, help=f"timed calls per measurement, median (default {repeats})")
    if cache:
        parser.add_argument("--cache-dir", default=CACHE_DIR, help="where checkpoints and programs are cached")


def _sampler(args) -> int:
    from benchmarks import sampler

    vocabs = tuple(int(v) for v in args.vocabs.split(",")) if args.vocabs else sampler.VOCABS
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else sampler.BATCHES
    return sampler.main(args.json, repeats=args.repeats or 30, vocabs=vocabs, batches=batches, suite=args.suite)


def _agreement(args) -> int:
    from benchmarks import agreement

    return agreement.main(rows=args.rows)


def _decode(args) -> int:
    if args.tensor_parallel or args.pipeline_parallel:
        from benchmarks import decode_parallel

        split = "tensor" if args.tensor_parallel else "pipeline"
        if args.tensor_parallel and args.pipeline_parallel:
            raise ValueError("etmlx bench decode: --tensor-parallel and --pipeline-parallel: choose one")
        if args.shape or args.quantized_dtype or args.dtypes != DEFAULT_DECODE_DTYPES:
            raise ValueError(f"etmlx bench decode: --{split}-parallel measures its own float32 model: drop --shape, "
                             "--dtypes and --quantized-dtype")
        return decode_parallel.main(args.json, ranks=args.tensor_parallel or args.pipeline_parallel, quick=args.quick,
                                    cache_dir=args.cache_dir, split=split)
    dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
    if args.context or args.kv_bits or args.layers or args.vocab or args.score_limit or args.kv_group_size != 64:
        from benchmarks import long_context

        if not (args.shape and args.context):
            raise ValueError("etmlx bench decode: --context, --kv-bits, --kv-group-size, --layers, --vocab and "
                             "--score-limit go with --shape and --context")
        return long_context.main(args.shape, long_context.parse_contexts(args.context), args.kv_bits, args.layers,
                                 args.vocab, args.activations, args.cache_dir, args.json, args.score_limit,
                                 args.kv_group_size)
    if args.shape:
        from benchmarks import decode_shapes

        if args.quick:
            raise ValueError("etmlx bench decode: --quick and --shape exclude each other")
        dtypes = dtypes if args.dtypes != DEFAULT_DECODE_DTYPES else ("int4",)
        return decode_shapes.main(args.shape, args.json, dtypes=dtypes, repeats=args.repeats,
                                  cache_dir=args.cache_dir, quantized_float_dtype=args.quantized_dtype or "float32",
                                  bf16_export=args.bf16_export)
    if args.bf16_export:
        raise ValueError("etmlx bench decode: --bf16-export applies to --shape")
    if args.quantized_dtype:
        raise ValueError("etmlx bench decode: --quantized-dtype applies to --shape")
    from benchmarks import decode

    return decode.main(args.json, quick=args.quick, dtypes=dtypes, repeats=args.repeats, cache_dir=args.cache_dir)


def _serve(args) -> int:
    from benchmarks.serve import main

    streams = tuple(int(s) for s in args.streams.split(","))
    return main(pte=args.pte, url=args.url, streams=streams, max_tokens=args.max_tokens, json_path=args.json)


def _structured(args) -> int:
    from benchmarks import structured

    result = structured.run(repeats=args.repeats or 200)
    if args.builtin:
        from benchmarks import structured_builtin

        result["builtin"] = structured_builtin.run(Path(args.cache_dir))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _pipeline(args) -> int:
    from benchmarks import pipeline

    return pipeline.main(args.json, quick=args.quick, repeats=args.repeats)


def _speculative(args) -> int:
    if args.shape:
        from benchmarks import speculative_shape

        return speculative_shape.main(args.shape, args.json, args.cache_dir, repeats=args.repeats)
    from benchmarks import speculative

    return speculative.main(args.json, args.cache_dir, repeats=args.repeats)


def _gemm(args) -> int:
    from benchmarks import cpu_gemm

    return cpu_gemm.main(args.json)


def _vision(args) -> int:
    from benchmarks import vision

    return vision.main(args.json, shape=args.shape, repeats=args.repeats or 3, cache_dir=args.cache_dir)


def _prompt_cache(args) -> int:
    from benchmarks import prompt_cache

    return prompt_cache.main(args.cache_dir, args.json, repeats=args.repeats or 3)


def _qmm(args) -> int:
    from benchmarks import quantized_matmul

    return quantized_matmul.main(args.json, repeats=args.repeats)


def _tools(args) -> int:
    from benchmarks import tools

    return tools.main(args.cache_dir, args.json, repeats=args.repeats or 30, hidden=args.hidden, layers=args.layers,
                      batch=args.batch, max_seq_len=args.max_seq_len)


def _adapters(args) -> int:
    from benchmarks import adapters

    return adapters.main(args.json, dtype=args.dtype, rank=args.rank, repeats=args.repeats or 3, quick=args.quick,
                         cache_dir=args.cache_dir)


def _gpu_kit(args) -> int:
    from benchmarks import gpu_kit

    gpu_kit.build(Path(args.out), Path(args.cache_dir), shapes=[args.shape] if args.shape else (),
                  binaries=args.with_binaries)
    return 0


SHAPE_HELP = ("qwen2.5-0.5b, qwen2.5-1.5b or llama-3.2-1b: a published model's shape at real size (random "
              "weights, mlx_lm.convert -q)")


def add_parsers(bench: argparse.ArgumentParser) -> None:
    """One subcommand per benchmark under `etmlx bench`."""
    sub = bench.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")

    p = sub.add_parser("sampler", help="on-device sampling vs mlx-lm, the upstream formulation and the host")
    _common(p, repeats="30")
    p.add_argument("--suite", choices=["all", "basic", "features"], default="all",
                   help="basic (temperature by vocab and batch), features (top-k/top-p), or all")
    p.add_argument("--vocabs", help="comma-separated vocabulary sizes (default 32000,128256,262144)")
    p.add_argument("--batches", help="comma-separated batch sizes (default 1,8)")
    p.set_defaults(func=_sampler)

    p = sub.add_parser("agreement", help="how often the host reference reproduces the device's draws")
    p.add_argument("--rows", type=int, default=2000, help="rows per dtype")
    p.set_defaults(func=_agreement)

    p = sub.add_parser("decode", help="decode speed, file size and peak RSS vs mlx-lm (and llama.cpp with --shape)")
    _common(p, repeats="3 generations", cache=True)
    p.add_argument("--quick", action="store_true", help="a tiny model and short runs (CI smoke)")
    p.add_argument("--shape", help=SHAPE_HELP + ", against mlx-lm and llama.cpp (make bench-deps), with the "
                   "memory-bandwidth floor; --dtypes int4 (default), int8 or both; or llama-3.1-8b, written packed "
                   "with bfloat16 scales (no float checkpoint, no llama.cpp)")
    p.add_argument("--dtypes", default=DEFAULT_DECODE_DTYPES,
                   help="comma-separated weight dtypes: float32, bfloat16, int4, int8")
    p.add_argument("--quantized-dtype", choices=("float32", "bfloat16"),
                   help="--shape: the mlx-lm directory's scales, biases and norms (float32 default; bfloat16 as "
                   "published 4-bit models carry them)")
    p.add_argument("--context", help="--shape: long prompts instead, comma-separated lengths (1k,8k,32k): "
                   "prefill and decode tok/s and memory against the KV cache per length (benchmarks/long_context.py)")
    p.add_argument("--kv-bits", type=int, choices=[8, 4], default=0, help="--context: a quantized KV cache")
    p.add_argument("--layers", type=int, help="--context: only this many of the shape's layers (the report "
                   "extrapolates the cache per layer to the full depth)")
    p.add_argument("--vocab", type=int, help="--context: a smaller vocabulary than the shape's (weights only)")
    p.add_argument("--kv-group-size", type=int, choices=[32, 64, 128], default=64,
                   help="--kv-bits: values per scale and bias (default 64)")
    p.add_argument("--score-limit", type=float, metavar="MB", help="--context: the runtime's bound on one "
                   "attention's scores (default 64 MiB): a prefill chunk's attention runs in query blocks within it")
    p.add_argument("--activations", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="--context: the program's float dtype, its float KV cache's and the scales' (default float32)")
    p.add_argument("--tensor-parallel", type=int, metavar="N", help="an N-rank tensor-parallel program against the "
                   "one-rank program: weight bytes per rank, decode speed, bytes exchanged and time in collectives")
    p.add_argument("--pipeline-parallel", type=int, metavar="N", help="an N-rank pipeline-parallel program (a block "
                   "of layers per rank) against the one-rank program: weight bytes per rank, decode speed, bytes sent")
    p.add_argument("--bf16-export", action="store_true",
                   help="--shape: also export the shape's bfloat16 checkpoint with --quantize int4 and report its "
                   "peak RSS over the checkpoint's bytes")
    p.set_defaults(func=_decode)

    p = sub.add_parser("serve", help="tokens/s and time to first token for concurrent streams")
    _common(p)
    p.add_argument("--pte", help="the decoder .pte to serve (default: a tiny random Llama, batch 16)")
    p.add_argument("--url", help="benchmark a running server instead of starting one")
    p.add_argument("--streams", default="1,4,16", help="concurrent stream counts (default 1,4,16)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per stream")
    p.set_defaults(func=_serve)

    p = sub.add_parser("structured", help="the cost of the on-device mask and of llguidance")
    _common(p, repeats="200", cache=True)
    p.add_argument("--builtin", action="store_true", help="also the built-in model: unconstrained vs JSON schema "
                   "vs sample-check-resample")
    p.set_defaults(func=_structured)

    p = sub.add_parser("pipeline", help="pipelined vs unpipelined programs, 128 vs 4096 cache slots")
    _common(p, repeats="5")
    p.add_argument("--quick", action="store_true", help="a tiny model and short runs (CI smoke)")
    p.set_defaults(func=_pipeline)

    p = sub.add_parser("speculative", help="speculative decoding vs plain decoding")
    _common(p, repeats="3", cache=True)
    p.add_argument("--shape", help=SHAPE_HELP + ": its 4-bit program with --draft-tokens 8 against the plain one")
    p.set_defaults(func=_speculative)

    p = sub.add_parser("adapters", help="decode speed with two switchable LoRA adapters vs the fused program")
    _common(p, repeats="3", cache=True)
    p.add_argument("--dtype", default="int4", help="int4 (default), int8 or float32")
    p.add_argument("--rank", type=int, default=8, help="the adapters' rank (default 8)")
    p.add_argument("--quick", action="store_true", help="a tiny model (CI smoke)")
    p.set_defaults(func=_adapters)

    p = sub.add_parser("gemm", help="CPU matrix products: the stock wheel vs the OpenBLAS route")
    _common(p)
    p.set_defaults(func=_gemm)

    p = sub.add_parser("qmm", help="the CPU quantized matmul vs mx::quantized_matmul")
    _common(p, repeats="default")
    p.set_defaults(func=_qmm)

    p = sub.add_parser("vision", help="image + first token vs transformers, VLM vs text-only decode, peak RSS")
    _common(p, repeats="3", cache=True)
    p.add_argument("--shape", default="0.5b", help="0.5b (default: ~0.5B LLaVA-shaped, 448x448) or tiny")
    p.set_defaults(func=_vision)

    p = sub.add_parser("prompt-cache", help="what the prompt cache saves on the built-in model")
    _common(p, repeats="3", cache=True)
    p.set_defaults(func=_prompt_cache)

    p = sub.add_parser("tools", help="tool calls that parse and validate, and TTFT with 20 tools vs none")
    _common(p, repeats="30", cache=True)
    p.add_argument("--hidden", type=int, default=32, help="the random model's width (default 32: a tiny model)")
    p.add_argument("--layers", type=int, default=1, help="its layers (default 1; --hidden 896 --layers 24 steps at "
                   "about a third of a 0.5B model's cost)")
    p.add_argument("--batch", type=int, default=4, help="rows of the program (default 4)")
    p.add_argument("--max-seq-len", type=int, default=8192, help="positions (default 8192; the 20 tools take 3,416)")
    p.set_defaults(func=_tools)

    p = sub.add_parser("gpu-kit", help="programs, inputs and a manifest for a GPU host (gpu_device.py runs them)")
    p.add_argument("--cache-dir", default=CACHE_DIR, help="where checkpoints and programs are cached")
    p.add_argument("--out", default="out/gpu-kit", help="the directory to write")
    p.add_argument("--shape", help=SHAPE_HELP + ": add that shape's 4-bit decoder")
    p.add_argument("--with-binaries", action="store_true",
                   help="also copy etmlx_bench, etmlx_decode, their libraries (not MLX's) and gpu_device.py")
    p.set_defaults(func=_gpu_kit)
