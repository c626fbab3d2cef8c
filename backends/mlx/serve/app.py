"""The server process: load the .pte once, start the engine, serve HTTP (OpenAI API, /health, LMTP
over WebSocket) and optionally LMTP lines over plain TCP; stop cleanly on SIGINT/SIGTERM.

    etmlx serve FILE.pte [--host 127.0.0.1] [--port 8000] [--max-batch N] [--lmtp-port P] [limits]

Limits (ServeLimits): the per-step deadline and restart attempts of the program worker (and a tensor-parallel
program's wait for every rank, serve/rank_group.py), an optional
per-request deadline, the admission queue, the prompt size, a request grammar's limits
(llm/decoder/grammar_limits.py: sizes, depths, choices, compile time and memory) and image input's
(serve/image_parts.py: images per request, bytes and pixels per image, local files).

`ServerThread` runs the same server on a background thread (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from backends.mlx.llm.decoder.grammar_limits import GrammarLimits
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.decoder.tokenizer_files import load_tokenizer
from backends.mlx.llm.distributed.hosts import RankHost, RankPlacement
from backends.mlx.llm.vision.images import ImageLimits
from backends.mlx.serve.body_parse import BodyParser
from backends.mlx.serve.engine import Engine
from backends.mlx.serve.grammar_compiler import GrammarCompiler
from backends.mlx.serve.image_parts import DEFAULT_MAX_IMAGES, ImageInputs
from backends.mlx.serve.service import Service
from backends.mlx.serve.supervisor import SupervisedProgram

log = logging.getLogger("etmlx.serve")


@dataclass
class ServeLimits:
    step_timeout: float | None = 120.0  # seconds one program call may take before the worker is replaced
    rank_timeout: float | None = 120.0  # an N-rank program: seconds a call waits for every rank's answer
    restart_attempts: int = 3  # tries to start a new worker before the server exits non-zero
    request_timeout: float | None = None  # seconds a request may take (None: no limit)
    max_queue: int | None = None  # requests waiting for a row; None: 8 x the rows
    lmtp_inflight: int | None = None  # unfinished streams per LMTP connection; None: 2 x the rows
    max_prompt_bytes: int = 4 * 1024 * 1024  # a request's prompt text (UTF-8); beyond it 413
    max_body_values: int | None = None  # JSON values of one body (serve/body_parse.py); None: max(65536, 4 x max_seq_len)
    grammar: GrammarLimits = field(default_factory=GrammarLimits)  # structured output's limits (400 beyond)
    max_images: int | None = None  # images per request; None: the program's (DecoderMeta.max_images) or 8
    image: ImageLimits = field(default_factory=ImageLimits)  # bytes and pixels of one image (400 beyond)
    allow_local_images: Path | None = None  # image files under this directory may be named; None: none
    prefill_step_size: int | None = None  # prompt tokens per prefill call; None: 512 (decode_rows.py), 0: one call

    def check(self) -> None:
        self.grammar.check()
        self.image.check()
        if self.allow_local_images is not None and not Path(self.allow_local_images).is_dir():
            raise ValueError(f"--allow-local-images: {self.allow_local_images} is not a directory")
        for name in ("step_timeout", "rank_timeout", "request_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {value}")
        for name, low in (("restart_attempts", 0), ("max_queue", 1), ("lmtp_inflight", 1), ("max_prompt_bytes", 1),
                          ("max_body_values", 1), ("max_images", 1), ("prefill_step_size", 0)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {value}")


def load_service(pte: Path, max_batch: int | None = None, model_name: str | None = None,
                 limits: ServeLimits | None = None, placement: RankPlacement | None = None) -> Service:
    """placement: where an N-rank program's ranks start (a hostfile's machines and addresses); default: here, on
    free loopback ports (serve/rank_group.py)."""
    limits = limits or ServeLimits()
    limits.check()
    pte = Path(pte)
    if not pte.is_file():
        raise FileNotFoundError(f"{pte} does not exist")
    meta = DecoderMeta.load(pte)
    hosts = check_ranks(pte, meta, placement or RankPlacement())
    if max_batch is not None and not 1 <= max_batch <= meta.batch:
        raise ValueError(f"--max-batch must be in [1, {meta.batch}]: {pte} was exported with batch {meta.batch} "
                         "(re-export with --batch N for more rows)")
    tokenizer = load_tokenizer(pte, meta)
    program = SupervisedProgram.for_pte(pte, step_timeout=limits.step_timeout, attempts=limits.restart_attempts,
                                        ranks=meta.ranks, hosts=hosts, ssh=(placement or RankPlacement()).ssh,
                                        rank_timeout=limits.rank_timeout)
    engine = Engine(program, meta, max_batch=max_batch, request_timeout=limits.request_timeout,
                    max_queue=limits.max_queue, pte=pte, prefill_step_size=limits.prefill_step_size).start()
    return Service(meta=meta, tokenizer=tokenizer, engine=engine, model_name=model_name or pte.stem,
                   max_prompt_bytes=limits.max_prompt_bytes,
                   lmtp_inflight=limits.lmtp_inflight or 2 * engine.usable,
                   grammar=GrammarCompiler(pte, meta, limits.grammar),
                   bodies=BodyParser(limits.max_body_values or max(65_536, 4 * meta.max_seq_len)),
                   images=image_inputs(meta, limits))


def check_ranks(pte: Path, meta: DecoderMeta, placement: RankPlacement) -> list[RankHost] | None:
    """What serving a program of meta.ranks ranks needs, checked before any worker starts (one line each); the
    hostfile's ranks (None: on free loopback ports, chosen at each start)."""
    if meta.ranks == 1:
        if placement.hostfile is not None:
            raise ValueError(f"--hostfile: {pte} is a one-rank program")
        return None
    if meta.rank != 0:
        raise ValueError(f"{pte} is rank {meta.rank}'s file of a {meta.ranks}-rank program: serve rank 0's file "
                         "(the one without .rankN)")
    if "MLX_RANK" in os.environ:
        # Each rank's worker is fed by this process (the front): a server per rank would have no inputs to run.
        raise ValueError(f"{pte} is a {meta.ranks}-rank program and etmlx serve starts its ranks itself: run it "
                         "outside mlx.launch (MLX_RANK is set), with --hostfile for the ranks' machines")
    return placement.hosts(meta.ranks)


def image_inputs(meta: DecoderMeta, limits: ServeLimits) -> ImageInputs:
    """What image input the server takes: none for a text-only program (every image a 400 saying so)."""
    local = Path(limits.allow_local_images).resolve() if limits.allow_local_images is not None else None
    return ImageInputs(takes_images=bool(getattr(meta, "takes_images", False)),
                       max_images=limits.max_images or getattr(meta, "max_images", None) or DEFAULT_MAX_IMAGES,
                       local_dir=local, limits=limits.image)


def make_app(service: Service) -> web.Application:
    from backends.mlx.serve.lmtp_routes import LmtpRoutes
    from backends.mlx.serve.openai_routes import OpenAIRoutes

    # The body may hold the largest prompt allowed plus the rest of the request (JSON escapes
    # can make a prompt's text up to 6x longer; such bodies are refused with 413 by aiohttp), and the most
    # images a request may carry as data URLs (none for a text-only program).
    app = web.Application(client_max_size=service.max_prompt_bytes * 2 + 1024 * 1024 + service.images.body_bytes())
    OpenAIRoutes(service).add_to(app)
    lmtp = LmtpRoutes(service)
    lmtp.add_to(app)

    async def health(request: web.Request) -> web.Response:
        engine = service.engine  # plain ints the engine thread writes: no lock, no wait on the engine
        up = getattr(engine.program, "up", True)
        status = "stopped" if not engine.running else "ok" if up else "restarting"
        return web.json_response({"status": status, "active_rows": engine.active_rows, "waiting": engine.waiting,
                                  "steps": engine.steps, "tokens": engine.tokens,
                                  "worker_restarts": getattr(engine.program, "restarts", 0)},
                                 status=200 if status == "ok" else 503)

    app.router.add_get("/health", health)
    app["lmtp"] = lmtp
    return app


class Server:
    """The aiohttp site(s) around a Service, on the running event loop."""

    def __init__(self, service: Service, host: str, port: int, lmtp_port: int | None = None):
        self.service, self.host, self.port, self.lmtp_port = service, host, port, lmtp_port
        self.app = make_app(service)
        # handler_cancellation: a client that disconnects cancels its handler, and so its rows.
        self.runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        self.tcp_server = None

    async def start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.host, self.port, shutdown_timeout=5.0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        if self.lmtp_port is not None:
            from backends.mlx.serve.lmtp_routes import serve_lmtp_lines

            self.tcp_server = await serve_lmtp_lines(self.service, self.host, self.lmtp_port)
            self.lmtp_port = self.tcp_server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        # The engine first: every in-flight request gets its final "abort" event while the loop still
        # runs, so open streams end properly; then the sockets close.
        await asyncio.get_running_loop().run_in_executor(None, self.service.engine.stop)
        await self.app["lmtp"].close_all()
        if self.tcp_server is not None:
            self.tcp_server.close()
        await self.runner.cleanup()
        await asyncio.get_running_loop().run_in_executor(None, self.service.engine.program.close)
        if self.service.grammar is not None:
            self.service.grammar.close()
        if self.service.bodies is not None:
            self.service.bodies.close()


def serve(pte: Path, host: str = "127.0.0.1", port: int = 8000, max_batch: int | None = None,
          lmtp_port: int | None = None, model_name: str | None = None, limits: ServeLimits | None = None,
          placement: RankPlacement | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # The engine thread's Python work between program calls holds the GIL; a short switch
    # interval bounds how long the event loop can wait for it.
    sys.setswitchinterval(0.001)
    started = time.perf_counter()
    service = load_service(pte, max_batch, model_name, limits, placement)

    async def main() -> None:
        server = Server(service, host, port, lmtp_port)
        try:
            await server.start()
        except OSError as exc:  # e.g. the port is taken
            await asyncio.get_running_loop().run_in_executor(None, service.engine.stop)
            service.engine.program.close()
            raise SystemExit(f"etmlx serve: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
        meta = service.meta
        lines = f", LMTP lines on {host}:{server.lmtp_port}" if server.lmtp_port is not None else ""
        log.info("serving %s (%d rows, max_seq_len %d) on http://%s:%d%s; ready in %.1f s", service.model_name,
                 service.engine.usable, meta.max_seq_len, host, server.port, lines, time.perf_counter() - started)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        service.engine.on_fatal = lambda: loop.call_soon_threadsafe(stop.set)  # the worker is gone for good
        if not service.engine.running:
            stop.set()
        await stop.wait()
        log.info("shutting down: aborting %d active and %d waiting requests", service.engine.active_rows,
                 service.engine.waiting)
        await server.stop()

    asyncio.run(main())
    if service.engine.fatal:
        log.error("exiting: %s", service.engine.fatal)
        return 1
    return 0


class ServerThread:
    """The server on a background thread and event loop: start(), .port, stop()."""

    def __init__(self, pte: Path, host: str = "127.0.0.1", port: int = 0, max_batch: int | None = None,
                 lmtp_port: int | None = None, model_name: str | None = None, limits: ServeLimits | None = None,
                 placement: RankPlacement | None = None):
        self.service = load_service(pte, max_batch, model_name, limits, placement)
        self.server = Server(self.service, host, port, lmtp_port)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etmlx-server", daemon=True)
        self._error: BaseException | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self.server.start())
        except BaseException as exc:  # reported by start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.run_forever()

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return f"http://{self.server.host}:{self.server.port}"

    def start(self) -> "ServerThread":
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        return self

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
