"""`etmlx serve`, `etmlx lmtp-client` and `etmlx bench serve` (wired in backends/mlx/cli/main.py).
Imports stay light here: the client commands need no torch."""

from __future__ import annotations

from pathlib import Path


def _serve(args) -> int:
    if not Path(args.pte).is_file():  # before the server's imports (torch, ~2 s): a typo fails at once
        raise FileNotFoundError(f"{args.pte} does not exist")
    from backends.mlx.llm.decoder.grammar_limits import GrammarLimits
    from backends.mlx.llm.distributed.hosts import RankPlacement
    from backends.mlx.serve.app import ServeLimits, serve

    grammar = GrammarLimits(**{name: getattr(args, name) for name in GRAMMAR_FLAGS})
    from backends.mlx.llm.vision.images import ImageLimits

    limits = ServeLimits(step_timeout=args.step_timeout or None, rank_timeout=args.rank_timeout or None,
                         restart_attempts=args.restart_attempts,
                         request_timeout=args.request_timeout, max_queue=args.max_queue,
                         lmtp_inflight=args.lmtp_inflight, max_prompt_bytes=args.max_prompt_bytes,
                         max_body_values=args.max_body_values, grammar=grammar, max_images=args.max_images,
                         image=ImageLimits(max_bytes=args.max_image_bytes, max_pixels=args.max_image_pixels),
                         allow_local_images=args.allow_local_images, prefill_step_size=args.prefill_step_size)
    try:
        limits.check()
    except ValueError as exc:
        raise SystemExit(f"etmlx serve: {exc}") from None
    return serve(Path(args.pte), host=args.host, port=args.port, max_batch=args.max_batch,
                 lmtp_port=args.lmtp_port, model_name=args.model_name, limits=limits,
                 placement=RankPlacement(Path(args.hostfile) if args.hostfile else None, args.ssh, args.starting_port))


def _lmtp_client(args) -> int:
    from backends.mlx.serve.lmtp_client import main

    return main(args.url, args.send, args.tokenizer)


# Structured output's limits (GrammarLimits in llm/decoder/grammar_limits.py; defaults there): flag -> help.
GRAMMAR_FLAGS = {
    "max_schema_bytes": "largest JSON schema (bytes of JSON text)",
    "max_schema_depth": "deepest nesting of a JSON schema document",
    "max_ref_depth": "longest chain of $refs a JSON schema may follow",
    "max_choices": "most items of a choice list",
    "max_grammar_bytes": "largest grammar text (regex, Lark/GBNF, choices, a converted schema)",
    "grammar_compile_timeout": "seconds a grammar's isolated compile may take",
    "grammar_memory_mb": "MiB of address space a grammar's isolated compile may add",
    "grammar_workers": "processes that compile grammars in isolation (and threads that build them here)",
}


def add_parsers(sub) -> None:
    serve = sub.add_parser("serve", help="serve a decoder .pte: OpenAI-compatible HTTP API, /health, LMTP")
    serve.add_argument("pte", help="decoder .pte from `etmlx export` (its .json and tokenizer beside it)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-batch", type=int, default=None,
                       help="rows decoded together (default: the batch the .pte was exported with)")
    serve.add_argument("--prefill-step-size", type=int, default=None, metavar="N",
                       help="prompt tokens per prefill call (default 512; 0: a prompt in one call)")
    serve.add_argument("--lmtp-port", type=int, default=None, help="also serve LMTP lines on this TCP port")
    serve.add_argument("--model-name", default=None, help="model id in the API (default: the .pte's stem)")
    serve.add_argument("--step-timeout", type=float, default=120.0,
                       help="seconds one program call may take; past it the worker is replaced and the rows of "
                            "that call fail (default 120; 0 = no limit)")
    ranks = serve.add_argument_group("N-rank programs (docs/distributed.md): the server starts the ranks")
    ranks.add_argument("--hostfile", metavar="FILE", help="where the ranks run: mlx.launch's hostfile (JSON, one "
                       "{\"ssh\": host, \"ips\": [...]} per rank; other machines are reached over ssh, rank 0 "
                       "is this one) or MLX's ring hostfile (one list of \"ip:port\" per rank, all here); "
                       "default: here, on free loopback ports")
    ranks.add_argument("--ssh", default="ssh", metavar="CMD",
                       help="the command (and options) that starts a rank on another machine (default: ssh)")
    ranks.add_argument("--starting-port", type=int, default=32323, metavar="P",
                       help="the ring's first port for mlx.launch's hostfile, counting up per rank and ip, as "
                            "mlx.launch does (default 32323)")
    ranks.add_argument("--rank-timeout", type=float, default=120.0, metavar="S",
                       help="seconds a program call waits for every rank's answer; past it (a rank stopped or "
                            "hung) the rank group is restarted and the rows of that call fail (default 120; 0 = "
                            "no limit)")
    serve.add_argument("--restart-attempts", type=int, default=3,
                       help="tries to start a new program worker after one died; then the server exits 1 (default 3)")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds a request may take from arrival to its last token (default: no limit)")
    serve.add_argument("--max-queue", type=int, default=None,
                       help="requests that may wait for a row; beyond it HTTP 429 / an LMTP error "
                            "(default 8 x the rows)")
    serve.add_argument("--lmtp-inflight", type=int, default=None,
                       help="unfinished streams per LMTP connection (default 2 x the rows)")
    serve.add_argument("--max-prompt-bytes", type=int, default=4 * 1024 * 1024,
                       help="largest prompt text (UTF-8 bytes) of one request; beyond it HTTP 413 (default 4 MiB)")
    serve.add_argument("--max-body-values", type=int, default=None,
                       help="most JSON values in one request body; beyond it HTTP 400 (default: 65536 or 4 x the "
                            "program's max_seq_len, whichever is larger)")
    images = serve.add_argument_group("image input (vision-language programs; a request over a limit is a 400)")
    images.add_argument("--allow-local-images", metavar="DIR", default=None,
                        help="let requests name image files (file:///path or a path) inside DIR; default: data: "
                             "URLs only (remote URLs are never fetched)")
    images.add_argument("--max-images", type=int, default=None,
                        help="images per request (default: the program's limit, else 8)")
    images.add_argument("--max-image-bytes", type=int, default=20 * 1024 * 1024,
                        help="encoded size of one image (default 20 MiB)")
    images.add_argument("--max-image-pixels", type=int, default=4096 * 4096,
                        help="width x height of one image, checked before decoding (default 4096 x 4096); "
                             "decoding one takes at most 12 bytes per pixel, two at a time")
    from backends.mlx.llm.decoder.grammar_limits import GrammarLimits

    group = serve.add_argument_group("structured output limits (a request over one is a 400 naming it)")
    for name, text in GRAMMAR_FLAGS.items():
        default = getattr(GrammarLimits, name)
        group.add_argument("--" + name.replace("_", "-"), type=type(default), default=default,
                           help=f"{text} (default {default})")
    serve.set_defaults(func=_serve)
    client = sub.add_parser("lmtp-client", help="talk LMTP to `etmlx serve` (interactive, or --send)")
    client.add_argument("--url", default="ws://127.0.0.1:8000/lmtp")
    client.add_argument("--send", action="append", default=[],
                        help="a line to send (repeatable); waits for the streams to finish, then exits")
    client.add_argument("--tokenizer", default=None,
                        help="the served FILE.pte (its tokenizer), a tokenizer directory or a Hugging Face repo "
                             "id: lets you type text and shows text")
    client.set_defaults(func=_lmtp_client)
