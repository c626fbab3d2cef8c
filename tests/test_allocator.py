"""The `etmlx` command runs with mimalloc in place of glibc's malloc on Linux (runtime/allocator.py): it re-executes
itself once with the cmeel-mimalloc library preloaded, ETMLX_ALLOCATOR=system keeps glibc's, and the processes it
starts get the caller's LD_PRELOAD back. (etmlx_bench reports its own linked-in mimalloc: test_etmlx_bench.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from backends.mlx.runtime import allocator

pytestmark = [pytest.mark.subprocess,
              pytest.mark.skipif(sys.platform != "linux", reason="mimalloc is preloaded on Linux only")]

ROOT = Path(__file__).resolve().parents[1]
MIMALLOC = "mimalloc " + version("cmeel-mimalloc")


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.CHOICE_ENV)}
    return subprocess.run(args, capture_output=True, text=True, timeout=120, cwd=ROOT, env={**full, **env})


def test_the_library_is_the_installed_wheels():
    lib = allocator.mimalloc_library()
    assert lib is not None and lib.is_file() and lib.name.startswith("libmimalloc.so.")


def test_the_command_runs_with_mimalloc_and_can_keep_the_system_malloc():
    done = _run([sys.executable, "-m", "backends.mlx.cli.main", "--version"])
    assert done.returncode == 0, done.stderr
    assert f"(malloc: {MIMALLOC})" in done.stdout
    kept = _run([sys.executable, "-m", "backends.mlx.cli.main", "--version"], ETMLX_ALLOCATOR="system")
    assert kept.returncode == 0 and "(malloc: system)" in kept.stdout


def test_a_process_that_imports_etmlx_keeps_its_malloc():
    # The check itself, on a process nobody re-executed: it must say "system" (the control for the above).
    done = _run([sys.executable, "-c", "from backends.mlx.runtime import allocator; print(allocator.active())"])
    assert done.returncode == 0 and done.stdout.strip() == "system"


def test_children_get_the_callers_ld_preload_back():
    # A harmless library already preloaded by the caller: the re-executed process runs with mimalloc and it,
    # and hands the caller's LD_PRELOAD (not mimalloc) to what it starts.
    libm = next(p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/lib/aarch64-linux-gnu/libm.so.6",
                            "/usr/lib64/libm.so.6") if Path(p).is_file())
    code = ("from backends.mlx.runtime import allocator; allocator.reexec_with_mimalloc(); import os; "
            "print(allocator.active()); print(os.environ.get('LD_PRELOAD')); "
            "print(sorted(k for k in os.environ if k.startswith('_ETMLX')))")
    done = _run([sys.executable, "-c", code], LD_PRELOAD=libm)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [MIMALLOC, libm, "[]"]
    alone = _run([sys.executable, "-c", code])
    assert alone.stdout.splitlines() == [MIMALLOC, "None", "[]"]


def test_env_with_mimalloc_adds_it_once_and_respects_the_opt_out():
    lib = str(allocator.mimalloc_library())
    env = allocator.env_with_mimalloc({"LD_PRELOAD": "/x/libfoo.so", "PATH": "/bin"})
    assert env["LD_PRELOAD"] == f"{lib} /x/libfoo.so" and env["MIMALLOC_ALLOW_THP"] == "0" and env["PATH"] == "/bin"
    assert allocator.env_with_mimalloc(env) == env  # already there: unchanged
    kept = {"LD_PRELOAD": "", allocator.CHOICE_ENV: "system"}
    assert allocator.env_with_mimalloc(kept) == kept


def test_the_servers_program_worker_runs_with_mimalloc(tmp_path_factory, monkeypatch):
    # The process that runs the server's decode steps (serve/program_worker.py): its mappings hold the library.
    from serve_helpers import tiny_pte

    from backends.mlx.serve.program_worker import ProgramWorker

    monkeypatch.delenv("LD_PRELOAD", raising=False)
    lib = allocator.mimalloc_library()
    for choice, expected in (("mimalloc", True), ("system", False)):
        monkeypatch.setenv(allocator.CHOICE_ENV, choice)
        worker = ProgramWorker(tiny_pte(tmp_path_factory))
        try:
            maps = Path(f"/proc/{worker._process.pid}/maps").read_text()
        finally:
            worker.close()
        assert (str(lib) in maps) == expected, choice
