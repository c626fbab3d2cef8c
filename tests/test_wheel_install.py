"""The wheel (pyproject.toml: scikit-build-core runs CMake) installs into a fresh virtual environment outside
the checkout and runs there: `etmlx --version`, `etmlx generate` on a .pte (the same tokens as the checkout's
code), the C++ `etmlx_decode` it ships (through the `etmlx_decode` command, by ids and by text, which needs
the tokenizer plugin) and `etmlx serve` until /health answers.

Fast and offline: the wheel build reuses the checkout's CMake build directory (`make setup`'s build/, via
scikit-build-core's build-dir), so nothing compiles twice; only etmlx is installed into the new environment.
Its dependencies come from this interpreter's site-packages: the packages whose native libraries the wheel's
relative rpath names (executorch, mlx, scipy_openblas32, pytorch_tokenizers) are linked into the new
site-packages, where an installed wheel finds them, and a .pth adds the rest."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

from serve_helpers import tiny_pte

pytestmark = [pytest.mark.slow, pytest.mark.subprocess, pytest.mark.server, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
BUILD = REPO / "build"
# The dependencies whose shared libraries the installed programs find through their rpath (CMakeLists.txt,
# install section): they must sit in the same site-packages as etmlx.
NATIVE_DEPENDENCIES = ("executorch", "mlx", "scipy_openblas32", "pytorch_tokenizers")


def _generator() -> str:
    """The generator build/ was configured with (a build directory keeps one generator)."""
    cache = BUILD / "CMakeCache.txt"
    if cache.is_file():
        for line in cache.read_text().splitlines():
            if line.startswith("CMAKE_GENERATOR:INTERNAL="):
                return line.split("=", 1)[1]
    return "Unix Makefiles"


def _env_without_checkout() -> dict:
    """The environment minus anything that would import the checkout instead of the installed package."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh virtual environment outside the checkout with the wheel built from it installed."""
    root = tmp_path_factory.mktemp("wheel")
    dist = root / "dist"
    built = subprocess.run(
        ["nice", "-n", "10", sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(dist),
         "-C", f"build-dir={BUILD}"],
        cwd=REPO, capture_output=True, text=True, env={**os.environ, "CMAKE_GENERATOR": _generator()})
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheels = list(dist.glob("etmlx-*.whl"))
    assert len(wheels) == 1, wheels

    env_dir = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    ours = Path(sysconfig.get_paths()["purelib"])
    for name in NATIVE_DEPENDENCIES:
        (site / name).symlink_to(ours / name, target_is_directory=True)
    (site / "zz_dependencies.pth").write_text(f"{ours}\n")  # appended after site-packages: the links win
    installed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                                "--no-index", "--quiet", str(wheels[0])], capture_output=True, text=True)
    assert installed.returncode == 0, installed.stderr[-3000:]
    return env_dir


def _run(venv, *args, timeout=300):
    return subprocess.run([str(venv / "bin" / args[0]), *args[1:]], cwd=venv.parent, env=_env_without_checkout(),
                          capture_output=True, text=True, timeout=timeout)


def test_the_wheel_ships_the_runtime_and_the_programs(venv):
    where = _run(venv, "python", "-c", "import backends.mlx.runtime as r, backends.mlx.runtime.native_tools as t; "
                 "print(r.library_path()); print(t.tool_path('etmlx_decode')); print(t.tool_path('etmlx_bench')); "
                 "print(r.runner_library_path())")
    assert where.returncode == 0, where.stderr[-2000:]
    paths = [Path(p) for p in where.stdout.split()]
    assert all(p.is_file() and p.is_relative_to(venv) for p in paths), paths  # the installed copies, not build/
    *paths, runner = paths  # the runner library (decode-step rules, draft sources) beside the backend's
    lib_dir = paths[0].parent
    assert runner.parent == lib_dir
    assert (lib_dir / "libetmlx_text_tokenizer.so").is_file()
    # nothing in the installed programs points back at this machine's build: the rpath is relative
    for binary in [*paths, lib_dir / "libetmlx_blas.so"]:
        dynamic = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True).stdout
        runpath = next(line for line in dynamic.splitlines() if "RUNPATH" in line)
        assert str(REPO) not in runpath and "site-packages" not in runpath, runpath


def test_the_wheel_has_no_benchmark_code(venv):
    """Benchmarks stay in the checkout (benchmarks/); `etmlx bench` in an install says where they are."""
    site = next((venv / "lib").glob("python*/site-packages"))
    shipped = [str(p.relative_to(site)) for p in site.rglob("*.py") if "bench" in p.name or "bench" in p.parent.name]
    assert shipped == [] and not (site / "benchmarks").exists(), shipped
    ran = _run(venv, "etmlx", "bench", "decode", "--quick")
    assert ran.returncode == 2 and "benchmarks/ folder" in ran.stderr and "Traceback" not in ran.stderr, ran.stderr


def test_version_generate_and_decode_from_the_installed_package(venv, tmp_path_factory):
    version = _run(venv, "etmlx", "--version")
    assert version.returncode == 0 and version.stdout.split()[:2] == ["etmlx", "0.1.0"], version
    # the installed command re-executes itself with the cmeel-mimalloc wheel's library (runtime/allocator.py)
    assert "(malloc: mimalloc " in version.stdout or sys.platform != "linux", version.stdout

    pte = tiny_pte(tmp_path_factory)
    args = ("generate", str(pte), "--prompt-ids", "5,6,7", "--max-tokens", "12", "--json")
    installed = _run(venv, "etmlx", *args)
    assert installed.returncode == 0, installed.stderr[-2000:]
    checkout = subprocess.run([sys.executable, "-m", "backends.mlx.cli.main", *args], cwd=REPO, capture_output=True,
                              text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert checkout.returncode == 0, checkout.stderr[-2000:]
    tokens = json.loads(installed.stdout.strip().splitlines()[-1])["tokens"]
    assert tokens == json.loads(checkout.stdout.strip().splitlines()[-1])["tokens"] and len(tokens) > 0

    by_ids = _run(venv, "etmlx_decode", str(pte), "--prompt-ids", "5,6,7", "--max-tokens", "12", "--json")
    assert by_ids.returncode == 0, by_ids.stderr[-2000:]
    assert json.loads(by_ids.stdout)["tokens"] == tokens
    by_text = _run(venv, "etmlx_decode", str(pte), "--prompt", "Mira went", "--max-tokens", "4", "--json")
    assert by_text.returncode == 0, by_text.stderr[-2000:]  # the tokenizer plugin loaded from the package
    assert json.loads(by_text.stdout)["prompt_ids"]


def test_serve_from_the_installed_package_answers_health(venv, tmp_path_factory):
    pte = tiny_pte(tmp_path_factory)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(venv / "bin" / "etmlx"), "serve", str(pte), "--port", str(port)],
                              cwd=venv.parent, env=_env_without_checkout(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        health = None
        while health is None and time.monotonic() < deadline:
            assert server.poll() is None, server.stderr.read().decode()[-3000:]
            try:
                health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read())
            except OSError:
                time.sleep(0.5)
        assert health is not None and health["status"] == "ok", health
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_make_develop_installs_the_checkout_without_taking_over_pythonpath(tmp_path):
    """`make setup`'s editable install (`make develop`: pip install -e . --no-build-isolation with this build
    backend) gives the `etmlx` command and imports the checkout, and a PYTHONPATH naming another tree (a
    worktree) still wins over it."""
    env_dir = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    python = env_dir / "bin" / "python"
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "zz_dependencies.pth").write_text(f"{sysconfig.get_paths()['purelib']}\n")  # pip, the backend
    done = subprocess.run(["make", "--no-print-directory", "develop", f"VENV={env_dir}"], cwd=REPO,
                          capture_output=True, text=True, env=_env_without_checkout())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert not (REPO / "_skbuild").exists()

    version = _run(env_dir, "etmlx", "--version")
    assert version.returncode == 0 and version.stdout.split()[:2] == ["etmlx", "0.1.0"], version
    where = _run(env_dir, "python", "-c", "import backends.mlx, etmlx; print(backends.mlx.__file__, etmlx.__file__)")
    assert where.returncode == 0, where.stderr[-2000:]
    assert all(Path(p).resolve().is_relative_to(REPO.resolve()) for p in where.stdout.split()), where.stdout

    other = tmp_path / "worktree"
    (other / "etmlx").mkdir(parents=True)
    (other / "etmlx" / "__init__.py").write_text("WHERE = 'worktree'\n")
    shadowed = subprocess.run([str(python), "-c", "import etmlx; print(etmlx.WHERE)"], cwd=tmp_path,
                              env={**_env_without_checkout(), "PYTHONPATH": str(other)}, capture_output=True,
                              text=True)
    assert shadowed.stdout.strip() == "worktree", shadowed.stderr[-2000:]
