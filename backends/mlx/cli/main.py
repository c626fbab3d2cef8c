"""The `etmlx` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_DECODE_DTYPES = "float32,bfloat16"

from backends.mlx.cli import llm_commands as llm_cli
from backends.mlx.cli import quiet
from backends.mlx.cli import serve_commands as serve_cli


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("etmlx")  # pyproject.toml is the one home of the number
    except PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def _allocator() -> str:
    from backends.mlx.runtime.allocator import active

    return active()


def _demo(args) -> int:
    if args.classifier:
        from backends.mlx.cli import demo_classifier

        return demo_classifier.main(Path(args.out or "out/classifier.pte"))
    from backends.mlx.cli import demo

    return demo.main(Path(args.out or "out/builtin.pte"), prompt=args.prompt, max_tokens=args.max_tokens)


def _inspect(args) -> int:
    pte = Path(args.pte)
    if not pte.is_file():  # before the exporter's imports (seconds): a typo fails at once
        raise FileNotFoundError(f"{pte} is not a file (give the path of a .pte)")
    from backends.mlx.exporter.inspect_pte import describe

    try:
        text = describe(pte)
    except Exception as exc:  # noqa: BLE001 - any parse failure of a foreign file: say what it is not
        raise ValueError(f"{pte} is not a readable ExecuTorch .pte ({type(exc).__name__}: {exc})") from None
    print(text)
    from backends.mlx.llm.decoder.meta import DecoderMeta

    try:
        meta = DecoderMeta.load(pte)
    except (FileNotFoundError, ValueError):  # not a decoder program: nothing more to say
        return 0
    print(f"decoder: max_seq_len {meta.max_seq_len}, vocab {meta.vocab_size}, batch {meta.batch}, tool-call format "
          f"{meta.tool_call_format or '(not stored: detected from the chat template when served)'}")
    return 0


def _bench(args) -> int:
    if args.what == "sampler":
        from backends.mlx.bench import sampler

        vocabs = tuple(int(v) for v in args.vocabs.split(",")) if args.vocabs else sampler.VOCABS
        batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else sampler.BATCHES
        repeats = 30 if args.repeats is None else args.repeats
        return sampler.main(args.json, repeats=repeats, vocabs=vocabs, batches=batches, suite=args.suite)
    if args.what == "serve":
        return serve_cli.bench(args)
    if args.what == "agreement":
        from backends.mlx.bench import agreement

        return agreement.main(rows=args.rows)
    if args.what == "decode":
        from backends.mlx.bench import decode

        dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
        if args.shape:
            from backends.mlx.bench import decode_shapes

            if args.quick:
                raise SystemExit("etmlx bench decode: --quick and --shape exclude each other")
            dtypes = dtypes if args.dtypes != DEFAULT_DECODE_DTYPES else ("int4",)
            return decode_shapes.main(args.shape, args.json, dtypes=dtypes, repeats=args.repeats,
                                      cache_dir=args.cache_dir, quantized_float_dtype=args.quantized_dtype or "float32")
        if args.quantized_dtype:
            raise SystemExit("etmlx bench decode: --quantized-dtype applies to --shape")
        return decode.main(args.json, quick=args.quick, dtypes=dtypes, repeats=args.repeats, cache_dir=args.cache_dir)
    if args.what == "structured":
        import json

        from backends.mlx.bench import structured

        result = structured.run(repeats=args.repeats or 200)
        if args.builtin:
            from backends.mlx.bench import structured_builtin

            result["builtin"] = structured_builtin.run(Path(args.cache_dir))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    if args.what == "pipeline":
        from backends.mlx.bench import pipeline

        return pipeline.main(args.json, quick=args.quick, repeats=args.repeats)
    if args.what == "speculative":
        if args.shape:
            from backends.mlx.bench import speculative_shape

            return speculative_shape.main(args.shape, args.json, args.cache_dir, repeats=args.repeats)
        from backends.mlx.bench import speculative

        return speculative.main(args.json, args.cache_dir, repeats=args.repeats)
    if args.what == "gemm":
        from backends.mlx.bench import cpu_gemm

        return cpu_gemm.main(args.json)
    if args.what == "tools":
        from backends.mlx.bench import tools

        return tools.main(args.cache_dir, args.json, repeats=args.repeats or 30)
    if args.what == "prompt-cache":
        from backends.mlx.bench import prompt_cache

        return prompt_cache.main(args.cache_dir, args.json, repeats=args.repeats or 3)
    if args.what == "qmm":
        from backends.mlx.bench import quantized_matmul

        return quantized_matmul.main(args.json, repeats=args.repeats)
    if args.what == "gpu-kit":
        from pathlib import Path

        from backends.mlx.bench import gpu_kit

        gpu_kit.build(Path(args.out or "out/gpu-kit"), Path(args.cache_dir),
                      shapes=[args.shape] if args.shape else (), binaries=args.with_binaries)
        return 0
    raise ValueError(f"unknown benchmark {args.what!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="etmlx", description="ExecuTorch programs on MLX")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()} (malloc: {_allocator()})")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="export a small built-in model and run it through the runtime")
    demo.add_argument("--out", help="where to write the .pte (default: out/builtin.pte, out/classifier.pte)")
    demo.add_argument("--prompt", default="One morning, Mira went to", help="prompt for the built-in model")
    demo.add_argument("--max-tokens", type=int, default=60)
    demo.add_argument("--classifier", action="store_true",
                      help="the small classifier demo instead (no training; compares with eager PyTorch)")
    demo.set_defaults(func=_demo)
    inspect = sub.add_parser("inspect", help="list the etmlx delegate graphs inside a .pte")
    inspect.add_argument("pte", help="path to a .pte file")
    inspect.set_defaults(func=_inspect)
    llm_cli.add_parsers(sub)
    serve_cli.add_parsers(sub)
    bench = sub.add_parser("bench", help="benchmarks with same-run baselines")
    bench.add_argument("what", choices=["sampler", "agreement", "decode", "serve", "gemm", "qmm", "structured", "pipeline", "speculative", "prompt-cache", "tools", "gpu-kit"], help="which benchmark (gpu-kit: write the programs bench/gpu_device.py "
                       "measures on a GPU host)")
    bench.add_argument("--suite", choices=["all", "basic", "features"], default="all",
                       help="sampler: basic (temperature by vocab and batch), features (top-k/top-p), or all")
    bench.add_argument("--rows", type=int, default=2000, help="agreement: rows per dtype")
    bench.add_argument("--json", help="also write the records to this path")
    bench.add_argument("--out", help="gpu-kit: the directory to write (default out/gpu-kit)")
    bench.add_argument("--with-binaries", action="store_true",
                       help="gpu-kit: also copy etmlx_bench, etmlx_decode, their libraries (not MLX's) and "
                       "gpu_device.py into the kit, so a GPU host needs only it and MLX's wheel")
    bench.add_argument("--repeats", type=int, help="timed calls per measurement, median (default: sampler 30, "
                       "decode 3 generations, pipeline 5)")
    bench.add_argument("--builtin", action="store_true", help="structured: also the built-in model (demo checkpoint, "
                       "cached in --cache-dir): unconstrained vs JSON schema vs sample-check-resample")
    bench.add_argument("--quick", action="store_true", help="decode, pipeline: a tiny model and short runs (CI smoke)")
    bench.add_argument("--shape", help="decode: qwen2.5-0.5b, qwen2.5-1.5b or llama-3.2-1b, a published model's shape at real size "
                       "(random weights, mlx_lm.convert -q), against mlx-lm and llama.cpp (make bench-deps), with the "
                       "memory-bandwidth floor; --dtypes int4 (default), int8 or both. speculative: that shape's 4-bit "
                       "program with --draft-tokens 8 against the plain one (Predicted Outputs, no drafts, a prediction "
                       "that never matches)")
    bench.add_argument("--dtypes", default=DEFAULT_DECODE_DTYPES, help="decode: comma-separated weight dtypes: float32, bfloat16, int4, int8 (mlx_lm.convert -q of the float32 checkpoint)")
    bench.add_argument("--quantized-dtype", choices=("float32", "bfloat16"),
                       help="decode --shape: the mlx-lm directory's scales, biases and norms (mlx_lm.convert --dtype): "
                       "float32 (the float checkpoint's, default) or bfloat16 (as published 4-bit models carry them)")
    bench.add_argument("--cache-dir", default="out/bench", help="decode, prompt-cache, speculative: where checkpoints and programs are cached")
    bench.add_argument("--vocabs", help="comma-separated vocabulary sizes (default 32000,128256,262144)")
    bench.add_argument("--batches", help="comma-separated batch sizes (default 1,8)")
    serve_cli.add_bench_arguments(bench)
    bench.set_defaults(func=_bench)
    for command in sub.choices.values():
        command.add_argument("--verbose", action="store_true",
                             help="also show third-party warnings and progress bars (hidden by default)")
    return parser


def main(argv=None) -> int:
    if argv is None:  # the `etmlx` command itself (not a caller's main([...])): before any work
        from backends.mlx.runtime.allocator import reexec_with_mimalloc

        reexec_with_mimalloc()
    args = build_parser().parse_args(argv)
    quiet.install(verbose=args.verbose)
    if getattr(args, "out", None):
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError, TypeError) as exc:  # bad input: one clear line, no traceback
        print(f"etmlx: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a directory where a file goes, a server that is not there, a busy port
        print(f"etmlx: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
