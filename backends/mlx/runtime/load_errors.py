"""A program or weights file that does not load, as one line naming the file and the reason.

ExecuTorch's Python bindings raise "Failed to load method forward, error: 0x:23" and leave the reason
(which tensor failed its checksum, that a .ptd is truncated) in the native log, which they write to
Python's sys.stderr (other native code writes to fd 2). `native_load` runs a load with both captured: on
success the log is passed on unchanged; on failure it raises
LoadError with the line that says why. LoadError is a ValueError, the CLI's class of bad input (exit 2,
one line, no traceback).
"""

from __future__ import annotations

import io
import os
import re
import sys
import tempfile
import threading
from contextlib import contextmanager

# fd 2 is process-wide: one capture at a time.
_lock = threading.Lock()
# ExecuTorch's log prefix: "[file.cpp:123] " or "E 00:00:00.000123 executorch:file.cpp:123] ".
_PREFIX = re.compile(r"^(?:[A-Z] [0-9:.]+ executorch:)?\[?[\w./-]+\.(?:cpp|h):\d+\] ")


class LoadError(ValueError, RuntimeError):
    """A .pte or .ptd that cannot be loaded: damaged, truncated, foreign, or not the pair of one export.

    A RuntimeError too, as the bindings' error it replaces was, so callers that caught that still do. `log` is
    the whole native log of the failed load (the message keeps one line of it)."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


def reason(log: str) -> str | None:
    """The line of a native log that says why a load failed: etmlx's own line if there is one (it names the
    constant), else ExecuTorch's first error line; without its file:line prefix."""
    lines = [_PREFIX.sub("", line).strip() for line in log.splitlines()]
    lines = [line for line in lines if line]
    for line in lines:
        if line.startswith("etmlx: "):
            return line[len("etmlx: "):]
    return lines[0] if lines else None


@contextmanager
def native_load(what: str):
    """Runs the body with fd 2 captured; a RuntimeError from the bindings becomes LoadError("cannot load <what>: <reason>")."""
    failure = None
    with _lock:
        sys.stderr.flush()
        saved = os.dup(2)
        log = tempfile.TemporaryFile()
        os.dup2(log.fileno(), 2)
        python_stderr, sys.stderr = sys.stderr, io.StringIO()
        try:
            yield
        except RuntimeError as exc:
            failure = exc
        finally:
            python_text, sys.stderr = sys.stderr.getvalue(), python_stderr
            os.dup2(saved, 2)
            os.close(saved)
            log.seek(0)
            text = python_text + log.read().decode(errors="replace")
            log.close()
            if failure is None and text:  # loaded (or failed in Python): the log goes where it would have
                sys.stderr.write(text)
    if failure is not None:
        raise LoadError(f"cannot load {what}: {reason(text) or failure}", log=text) from None
