"""The `etmlx` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
          f"{meta.tool_call_format or '(not stored: detected from the chat template when served)'}, KV cache "
          f"{f'{meta.kv_bits}-bit (group {meta.kv_group_size})' if meta.kv_bits else meta.dtype}")
    if meta.adapters:
        print(f"switchable adapters: {', '.join(meta.adapters)} (--adapter-name NAME, or model BASE:NAME when served)")
    return 0


def _bench_unavailable(args) -> int:
    raise FileNotFoundError("etmlx bench runs from a checkout of the etmlx repository: the benchmarks are its "
                            "top-level benchmarks/ folder, which the wheel does not ship (git clone, then make setup)")


def _add_bench(sub) -> None:
    """`etmlx bench`: its subcommands come from the checkout's benchmarks/ folder (benchmarks/cli.py)."""
    bench = sub.add_parser("bench", help="benchmarks with same-run baselines (in a checkout)")
    checkout = Path(__file__).resolve().parents[3]
    if not (checkout / "benchmarks" / "cli.py").is_file():  # an installed wheel
        bench.add_argument("args", nargs=argparse.REMAINDER)
        bench.set_defaults(func=_bench_unavailable)
        return
    if str(checkout) not in sys.path:
        sys.path.insert(0, str(checkout))
    from benchmarks import cli as bench_cli

    bench_cli.add_parsers(bench)


def _add_verbose(parser: argparse.ArgumentParser) -> None:
    """--verbose on every subcommand, at every depth (`etmlx bench decode --verbose`)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for command in action.choices.values():
                command.add_argument("--verbose", action="store_true",
                                     help="also show third-party warnings and progress bars (hidden by default)")
                _add_verbose(command)


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
    _add_bench(sub)
    _add_verbose(parser)
    return parser


def main(argv=None) -> int:
    if argv is None:  # the `etmlx` command itself (not a caller's main([...])): before any work
        from backends.mlx.runtime.allocator import reexec_with_mimalloc

        reexec_with_mimalloc()
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what a tensor-parallel run's ranks are started with
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
