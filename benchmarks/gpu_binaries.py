"""`etmlx bench gpu-kit --with-binaries`: the C++ tools and the libraries they load, copied into KIT/bin, so
that a GPU host needs the kit directory and MLX's wheel for its GPU, nothing else.

What travels: etmlx_bench, etmlx_decode, the backend library and every library they resolve here that is not
the system's (ExecuTorch's, OpenBLAS) and not MLX's: the GPU host's `mlx` wheel brings its own libmlx (the
CUDA or Metal build), which the tools then load from LD_LIBRARY_PATH. The list comes from `ldd`, so a
library added to the build later travels too. The text tokenizer library (etmlx_decode --prompt TEXT) stays:
it loads this machine's Python; the kit feeds token ids.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("build/etmlx_bench", "build/etmlx_decode")
LIBRARIES = ("backends/mlx/runtime/_lib/libetmlx_backend.so", "backends/mlx/runtime/_lib/libetmlx_blas.so")
SYSTEM = ("/lib/", "/lib64/", "/usr/lib/", "/usr/lib64/")


class MissingBinary(FileNotFoundError):  # the CLI prints its one line
    pass


def resolved(path: Path) -> dict[str, Path]:
    """name -> file of each library `path` loads, as the dynamic linker resolves it here."""
    done = subprocess.run(["ldd", str(path)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        raise MissingBinary(f"ldd {path} failed: {done.stderr.strip() or done.stdout.strip()}")
    libraries = {}
    for line in done.stdout.splitlines():
        name, arrow, rest = line.strip().partition(" => ")
        if not arrow:
            continue
        target = rest.split(" (")[0].strip()
        if target == "not found":
            raise MissingBinary(f"{path} needs {name}, which is not found here: run `make setup`")
        libraries[name] = Path(target)
    return libraries


def carried(name: str, path: Path) -> bool:
    """Whether a resolved library goes into the kit: not the system's, not MLX's (nor its CPU build's own
    BLAS and LAPACK, in mlx_cpu.libs)."""
    text = str(path)
    return not text.startswith(SYSTEM) and not name.startswith("libmlx.") and "mlx_cpu.libs" not in text


def copy_binaries(out: Path, root: Path = ROOT) -> list[str]:
    """Copies the tools and their libraries into `out`; returns the file names, sorted."""
    sources = []
    for rel in TOOLS + LIBRARIES:
        path = root / rel
        if not path.is_file():
            raise MissingBinary(f"{path} is missing: build it with `make setup`")
        sources.append(path)
    files = {p.name: p for p in sources}
    for path in sources:
        for name, lib in resolved(path).items():
            if carried(name, lib):
                files.setdefault(name, lib)
    out.mkdir(parents=True, exist_ok=True)
    for name, path in files.items():
        shutil.copy2(path, out / name)
    return sorted(files)
