"""The `etmlx` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _demo(args) -> int:
    from backends.mlx import demo

    return demo.main(Path(args.out))


def _inspect(args) -> int:
    from backends.mlx.inspect_pte import describe

    print(describe(Path(args.pte)))
    return 0


def _bench(args) -> int:
    if args.what == "sampler":
        from backends.mlx.bench import sampler

        vocabs = tuple(int(v) for v in args.vocabs.split(",")) if args.vocabs else sampler.VOCABS
        batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else sampler.BATCHES
        repeats = 30 if args.repeats is None else args.repeats
        return sampler.main(args.json, repeats=repeats, vocabs=vocabs, batches=batches, suite=args.suite)
    if args.what == "agreement":
        from backends.mlx.bench import agreement

        return agreement.main(rows=args.rows)
    if args.what == "decode":
        from backends.mlx.bench import decode

        dtypes = tuple(d.strip() for d in args.dtypes.split(",") if d.strip())
        return decode.main(args.json, quick=args.quick, dtypes=dtypes, repeats=args.repeats, cache_dir=args.cache_dir)
    raise ValueError(f"unknown benchmark {args.what!r}")


def _export(args) -> int:
    from transformers import AutoModelForCausalLM

    from backends.mlx.llm.decode import export_decoder

    if not Path(args.model).is_dir():
        raise FileNotFoundError(f"--model {args.model} is not a local checkpoint directory")
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="eager")
    result = export_decoder(model, Path(args.out), args.max_seq_len)
    print(f"wrote {args.out} ({len(result.pte)} bytes): {result.summary()}")
    return 0


def _generate(args) -> int:
    import json

    from backends.mlx.llm.decode import Decoder

    try:
        prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
    decoder = Decoder(Path(args.pte))
    if args.json:
        out = decoder.generate(prompt, args.max_tokens, args.temperature, args.seed)
        print(json.dumps({"tokens": out.tokens, "finish_reason": out.finish_reason,
                          "time_to_first_token_s": out.first_token_s, "decode_tokens_per_s": out.decode_tokens_per_s}))
        return 0
    for token in decoder.stream(prompt, args.max_tokens, args.temperature, args.seed):
        print(token, end=" ", flush=True)
    print()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="etmlx", description="ExecuTorch programs on MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="export a small built-in model and run it through the runtime")
    demo.add_argument("--out", default="out/demo.pte", help="where to write the .pte (default: out/demo.pte)")
    demo.set_defaults(func=_demo)
    inspect = sub.add_parser("inspect", help="list the etmlx delegate graphs inside a .pte")
    inspect.add_argument("pte", help="path to a .pte file")
    inspect.set_defaults(func=_inspect)
    export = sub.add_parser("export", help="export a local Llama/Qwen2 checkpoint for on-device decoding")
    export.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    export.add_argument("--out", required=True, help="the .pte to write (FILE.pte.json is written beside it)")
    export.add_argument("--max-seq-len", type=int, default=256, help="KV cache length (default 256)")
    export.set_defaults(func=_export)
    generate = sub.add_parser("generate", help="decode on the device from an exported .pte")
    generate.add_argument("pte", help="a .pte written by `etmlx export`")
    generate.add_argument("--prompt-ids", required=True, help="comma-separated prompt token ids")
    generate.add_argument("--max-tokens", type=int, default=32)
    generate.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    generate.add_argument("--seed", type=int, default=0, help="base seed; step k uses seed + k")
    generate.add_argument("--json", action="store_true", help="print token ids and timings as JSON")
    generate.set_defaults(func=_generate)
    bench = sub.add_parser("bench", help="benchmarks with same-run baselines")
    bench.add_argument("what", choices=["sampler", "agreement", "decode"], help="which benchmark")
    bench.add_argument("--suite", choices=["all", "basic", "features"], default="all",
                       help="sampler: basic (temperature by vocab and batch), features (top-k/top-p), or all")
    bench.add_argument("--rows", type=int, default=2000, help="agreement: rows per dtype")
    bench.add_argument("--json", help="also write the records to this path")
    bench.add_argument("--repeats", type=int, help="timed calls per measurement, median (default: sampler 30, "
                       "decode 5 generations)")
    bench.add_argument("--quick", action="store_true", help="decode: a tiny model and short runs (CI smoke)")
    bench.add_argument("--dtypes", default="float32,bfloat16", help="decode: comma-separated weight dtypes")
    bench.add_argument("--cache-dir", default="out/bench", help="decode: where checkpoints and programs are cached")
    bench.add_argument("--vocabs", help="comma-separated vocabulary sizes (default 32000,128256,262144)")
    bench.add_argument("--batches", help="comma-separated batch sizes (default 1,8)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "out", None):
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError, TypeError) as exc:  # bad input: one clear line, no traceback
        print(f"etmlx: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
