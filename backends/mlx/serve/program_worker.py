"""Runs a .pte's method in a child process, so that executing it never holds this process's GIL.

ExecuTorch's Python binding keeps the GIL for the whole of `Method.execute` (measured: a 100 ms
step stalls every other Python thread for 100 ms), so an engine *thread* alone would still freeze
the event loop during each step and /health would wait for the engine. The child
(`python -m backends.mlx.serve.program_worker FILE.pte`) owns the program; the engine thread
writes each call's inputs to its stdin and blocks reading its reply, which releases the GIL.
Frames are a 4-byte length, a kind byte and a pickle of numpy arrays (a few small tensors).

The parent reads with a deadline (`step_timeout`): a worker that died (EOF) or stopped answering
(a stopped or wedged process) raises WorkerDied and is killed; serve/supervisor.py restarts it.
"""

from __future__ import annotations

import os
import pickle
import select
import signal
import struct
import time
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from backends.mlx.llm.distributed.remote import RemoteRank
from backends.mlx.runtime.allocator import env_with_mimalloc

_HEADER = struct.Struct("<I")


def _write(stream, kind: bytes, payload: bytes) -> None:
    stream.write(_HEADER.pack(len(payload) + 1) + kind + payload)
    stream.flush()


def _read(stream) -> tuple[bytes, bytes]:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the other side closed the pipe")
    size = _HEADER.unpack(header)[0]
    body = stream.read(size)
    if len(body) < size:
        raise EOFError("the other side closed the pipe mid-frame")
    return body[:1], body[1:]


class WorkerDied(RuntimeError):
    """The worker exited or missed its deadline; it has been killed and holds no state any more."""


def _read_within(fd: int, size: int, deadline: float | None) -> bytes:
    """`size` bytes from a raw pipe, or TimeoutError at `deadline` (time.monotonic), EOFError at EOF."""
    chunks, left = [], size
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise EOFError
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _encode(tensors) -> bytes:
    return pickle.dumps([t.numpy() if isinstance(t, torch.Tensor) else np.asarray(t) for t in tensors])


def _decode(blob: bytes) -> list[torch.Tensor]:
    return [torch.from_numpy(np.array(a)) for a in pickle.loads(blob)]


def _child_main(pte: str) -> int:
    # The protocol owns the original stdout; anything the runtime prints goes to stderr instead.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    try:
        from backends.mlx.llm.decoder.meta import DecoderMeta
        from backends.mlx.runtime.load_errors import LoadError
        from backends.mlx.runtime.runner import load_method

        method = load_method(Path(pte))
        # drafts=True: the engine drives draft-verifying programs too (decode_rows.py)
        DecoderMeta.load(Path(pte)).check_program(pte, method.input_specs(), drafts=True)
    except LoadError as exc:  # already one line naming the file and the reason
        _write(out, b"e", str(exc).encode())
        return 1
    except Exception as exc:
        _write(out, b"e", f"{type(exc).__name__}: {exc}".encode())
        return 1
    _write(out, b"r", b"c" if method.can_copy_rows else b"")  # "c": the state can be copied between rows
    while True:
        try:
            kind, payload = _read(inp)
        except EOFError:
            return 0
        if kind == b"q":
            return 0
        try:
            if kind == b"c":  # copy_rows(src, dst, n)
                method.copy_rows(*pickle.loads(payload))
                _write(out, b"o", _encode([]))
                continue
            _write(out, b"o", _encode(method.execute(_decode(payload))))
        except Exception as exc:
            _write(out, b"e", f"{type(exc).__name__}: {exc}".encode())


class ProgramWorker:
    """`execute(inputs) -> outputs`, like a loaded method, run in a child process.

    step_timeout: seconds one call may take (None: no limit); past it the worker is killed and
    execute raises WorkerDied, as it does when the worker has exited."""

    def __init__(self, pte: Path, step_timeout: float | None = None, load_timeout: float | None = 600.0,
                 env: dict | None = None, wait: bool = True, remote: RemoteRank | None = None):
        """env: variables added to the worker's environment (a rank's MLX_RANK, MLX_HOSTFILE). wait=False: return
        once started; the caller then reads the load reply (`loaded`), as a rank group does for all its ranks
        at once (each rank's load waits for the others to join the group). remote: start the worker on another
        machine over ssh (a rank of a group spread over hosts; `pte` is the path there)."""
        pte = Path(pte)
        if remote is None and not pte.is_file():
            raise FileNotFoundError(f"pte: no such file {pte}")
        self.pte = pte
        self.step_timeout = step_timeout
        self.can_copy_rows = False
        self._remote = remote
        argv = [sys.executable, "-m", "backends.mlx.serve.program_worker", str(pte)]
        # The worker runs the decode steps: with mimalloc, as the `etmlx` command does (runtime/allocator.py).
        full_env = env_with_mimalloc({**os.environ, **(env or {})})
        if remote is not None:  # the same variables set there (the same install at the same path is assumed)
            added = {key: value for key, value in full_env.items() if os.environ.get(key) != value}
            argv, full_env = remote.command(argv, added), None
        self._last_error = ""  # a remote rank's last stderr line (ssh's own errors too), for exit messages
        self._process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=full_env,
                                         stderr=subprocess.PIPE if remote is not None else None)
        self._relay = None
        if remote is not None:
            self._relay = threading.Thread(target=self._relay_stderr, name="etmlx-remote-stderr", daemon=True)
            self._relay.start()
        if not wait:
            return
        try:
            kind, payload = self._reply(load_timeout)
        except WorkerDied as exc:
            raise RuntimeError(f"the program worker failed while loading {pte}: {exc}") from None
        self.loaded(kind, payload)

    def _relay_stderr(self) -> None:
        """A remote rank's stderr to ours, line by line, keeping the last one."""
        for raw in self._process.stderr:
            sys.stderr.buffer.write(raw)
            sys.stderr.flush()
            line = raw.decode(errors="replace").strip()
            if line:
                self._last_error = line

    def loaded(self, kind: bytes, payload: bytes) -> None:
        """Take the worker's load reply: ready, or ValueError with its one-line reason (the worker closed)."""
        if kind != b"r":
            self.close()
            message = payload.decode()
            raise ValueError(message if message.startswith("cannot load ") else f"cannot load {self.pte}: {message}")
        self.can_copy_rows = payload == b"c"

    @property
    def pid(self) -> int:
        return self._process.pid

    def alive(self) -> bool:
        return self._process.poll() is None

    def fileno(self) -> int:
        """The pipe the worker's replies come on (frames: 4-byte length, kind byte, payload)."""
        return self._process.stdout.fileno()

    def send(self, kind: bytes, payload: bytes) -> None:
        """One frame to the worker; WorkerDied (the worker killed) when it has gone."""
        try:
            _write(self._process.stdin, kind, payload)
        except (BrokenPipeError, OSError, ValueError):
            raise self._died("exited") from None

    def exit_status(self, wait: float = 0.0) -> str:
        """How the worker ended ("exit status None": still running after `wait` s)."""
        try:
            code = self._process.wait(timeout=wait) if wait else self._process.poll()
        except subprocess.TimeoutExpired:
            code = None
        if code is not None and self._relay is not None:
            self._relay.join(timeout=2.0)  # its last lines, written before it exited
        status = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        return f"{status}: {self._last_error}" if code is not None and self._last_error else status

    def _died(self, what: str) -> WorkerDied:
        self.kill()
        return WorkerDied(f"the program worker {what} ({self.exit_status()})")

    def _reply(self, timeout: float | None) -> tuple[bytes, bytes]:
        deadline = None if timeout is None else time.monotonic() + timeout
        fd = self._process.stdout.fileno()
        try:
            size = _HEADER.unpack(_read_within(fd, _HEADER.size, deadline))[0]
            body = _read_within(fd, size, deadline)
        except EOFError:
            raise self._died("exited") from None
        except TimeoutError:
            raise self._died(f"did not answer within {timeout:g} s and was stopped") from None
        return body[:1], body[1:]

    def execute(self, inputs) -> list[torch.Tensor]:
        self.send(b"i", _encode(inputs))
        kind, payload = self._reply(self.step_timeout)
        if kind == b"e":
            raise RuntimeError(f"program call failed: {payload.decode()}")
        return _decode(payload)

    def copy_rows(self, src: int, dst: int, n: int) -> None:
        """Positions [0, n) of row src's KV cache into row dst, in the worker's program (LoadedMethod.copy_rows)."""
        self.send(b"c", pickle.dumps((int(src), int(dst), int(n))))
        kind, payload = self._reply(self.step_timeout)
        if kind == b"e":
            raise RuntimeError(f"copying rows failed: {payload.decode()}")

    def kill(self) -> None:
        """End the worker now, whatever its state (SIGKILL ends a stopped process too)."""
        if self._process.poll() is None:
            try:
                self._process.send_signal(signal.SIGKILL)
            except ProcessLookupError:
                pass
        self._process.wait(timeout=30)
        if self._remote is not None:  # the ssh client is gone; the rank itself may still wait in a collective
            self._remote.kill()

    def close(self) -> None:
        try:
            _write(self._process.stdin, b"q", b"")
            self._process.stdin.close()
        except (OSError, ValueError):
            pass
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.kill()
        self._process.stdout.close()


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1]))
