"""The macOS arm64 cross build's binaries, inspected as Mach-O files (run by `make check-macos`, after it has
built them; not part of `make test`: the name does not match test_*.py). Nothing here runs them.

Each binary is placed, on paper, where a macOS wheel installs it (site-packages/backends/mlx/runtime/_lib,
CMakeLists.txt's ETMLX_INSTALL_DIR) and every dylib it loads by @rpath must be found through its own rpaths in
the macOS wheels' site-packages, as dyld would look for it.

    ETMLX_MACOS_BUILD=build-macos PYTHONPATH=build-macos/tools python -m pytest tests/macos/check_macos_build.py
"""

from __future__ import annotations

import os
import posixpath
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "cmake" / "macos"))
import macho  # noqa: E402

BUILD = Path(os.environ.get("ETMLX_MACOS_BUILD", REPO / "build-macos")).resolve()
SITE = BUILD / "site-packages"
OUT = BUILD / "cmake"
INSTALL_DIR = "backends/mlx/runtime/_lib"  # inside site-packages, as the wheel lays it out
# Every native target: file name -> Mach-O kind.
TARGETS = {
    "libetmlx_backend.dylib": "dylib",
    "libetmlx_runner.dylib": "dylib",
    "etmlx_decode": "executable",
    "etmlx_bench": "executable",
    # a bundle on a Mac; a dylib here (cmake/macos/cross-fixups.cmake: Zig's linker)
    "libetmlx_text_tokenizer.so": "dylib",
}
# What loads a wheel's dylib: the install rpath of CMakeLists.txt (etmlx_relative_rpath).
WHEEL_RPATHS = ["@loader_path", "@loader_path/../../../../executorch/lib", "@loader_path/../../../../mlx/lib"]
SYSTEM = ("/usr/lib/", "/System/Library/")
TOKENIZER_EXTENSION = "pytorch_tokenizers/pytorch_tokenizers_cpp.cpython-311-darwin.so"


def resolve(load: str, rpaths: list[str], loader_dir: str, ours: set[str]) -> str | None:
    """Where dyld would find `load` for a binary in `loader_dir` (a folder relative to site-packages): the
    file's path relative to site-packages, or None. `ours` are the build's own files, installed in INSTALL_DIR."""
    if not load.startswith("@rpath/"):
        return load if load.startswith(SYSTEM) else None
    name = load[len("@rpath/"):]
    for rpath in rpaths:
        if not rpath.startswith("@loader_path"):
            continue
        candidate = posixpath.normpath(posixpath.join(loader_dir, rpath[len("@loader_path"):].lstrip("/"), name))
        if candidate.startswith("../"):
            continue
        if (SITE / candidate).is_file() or (posixpath.dirname(candidate) == INSTALL_DIR and name in ours):
            return candidate
    return None


@pytest.fixture(scope="module")
def binaries() -> dict[str, macho.MachOFile]:
    missing = [name for name in TARGETS if not (OUT / name).is_file()]
    assert not missing, f"not built in {OUT}: {missing} (run `make check-macos`)"
    return {name: macho.read(OUT / name) for name in TARGETS}


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_each_target_is_an_arm64_macho_of_its_kind(binaries, name):
    assert (binaries[name].cpu, binaries[name].kind) == ("ARM64", TARGETS[name])


def test_the_backend_is_loaded_by_rpath(binaries):
    assert binaries["libetmlx_backend.dylib"].install_name == "@rpath/libetmlx_backend.dylib"


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_rpaths_are_loader_path_relative(binaries, name):
    rpaths = binaries[name].rpaths
    assert all(r == "@loader_path" or r.startswith("@loader_path/") for r in rpaths), rpaths
    if name == "libetmlx_runner.dylib":  # plain C++ without MLX or ExecuTorch: the system's libraries only
        assert all(d.startswith(SYSTEM) for d in binaries[name].dylibs), binaries[name].dylibs
    elif name != "libetmlx_text_tokenizer.so":
        assert rpaths == WHEEL_RPATHS
    else:
        assert rpaths


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_every_loaded_dylib_resolves_in_the_wheel_layout(binaries, name):
    file = binaries[name]
    unresolved = [d for d in file.dylibs if resolve(d, file.rpaths, INSTALL_DIR, set(TARGETS)) is None]
    assert not unresolved, f"{name}: dyld would not find {unresolved} from site-packages/{INSTALL_DIR}"
    assert not [d for d in file.dylibs if "/Frameworks/" in d], f"{name} loads frameworks itself"


def test_the_backend_and_programs_load_mlx_and_executorch_by_rpath(binaries):
    assert {"@rpath/libmlx.dylib", "@rpath/libexecutorch.dylib"} <= set(binaries["libetmlx_backend.dylib"].dylibs)
    for program in ("etmlx_decode", "etmlx_bench"):
        assert {"@rpath/libetmlx_backend.dylib", "@rpath/libexecutorch.dylib"} <= set(binaries[program].dylibs)
    for name, file in binaries.items():
        assert "/usr/lib/libc++.1.dylib" in file.dylibs, f"{name} does not use the system libc++"


def test_a_wrong_install_folder_is_caught(binaries):
    """Control: the same binary one folder higher than the wheel puts it finds none of the wheels' dylibs."""
    file = binaries["libetmlx_backend.dylib"]
    assert resolve("@rpath/libmlx.dylib", file.rpaths, INSTALL_DIR, set(TARGETS)) == "mlx/lib/libmlx.dylib"
    assert resolve("@rpath/libmlx.dylib", file.rpaths, posixpath.dirname(INSTALL_DIR), set(TARGETS)) is None
    assert resolve("/opt/elsewhere/libmlx.dylib", file.rpaths, INSTALL_DIR, set(TARGETS)) is None


@pytest.mark.parametrize("name", ["libetmlx_backend.dylib", "libetmlx_runner.dylib", "etmlx_decode", "etmlx_bench"])
def test_every_symbol_binds_to_a_named_library_that_exports_it(binaries, name):
    """Two-level namespace throughout (no -undefined dynamic_lookup), and each symbol taken from a wheel's
    dylib is one that dylib exports."""
    file = binaries[name]
    flat = sorted(symbol for symbol, library in file.undefined.items() if library is None)
    assert not flat, f"{name} looks up {len(flat)} symbols by name at load: {flat[:5]}"
    ours = {f"@rpath/{n}": OUT / n for n in TARGETS}
    for library in {lib for lib in file.undefined.values() if lib.startswith("@rpath/")}:
        path = ours.get(library) or SITE / resolve(library, file.rpaths, INSTALL_DIR, set(TARGETS))
        exported = macho.read(path).exported
        absent = sorted(s for s, lib in file.undefined.items() if lib == library and s not in exported)
        assert not absent, f"{name}: {library} does not export {absent[:5]}"


def test_the_tokenizer_plugin_looks_up_only_the_tokenizer_library(binaries):
    """The plugin's one exception (CMakeLists.txt: the extension module is a bundle, which cannot be linked):
    what it looks up at load time is all exported by pytorch_tokenizers' extension module."""
    file = binaries["libetmlx_text_tokenizer.so"]
    flat = {symbol for symbol, library in file.undefined.items() if library is None}
    assert flat, "the plugin binds no tokenizer symbols: is it linked at all?"
    exported = macho.read(SITE / TOKENIZER_EXTENSION).exported
    assert not sorted(flat - exported), f"not in {TOKENIZER_EXTENSION}: {sorted(flat - exported)[:5]}"
    assert "_etmlx_text_tokenizer_load" in file.exported  # the entry point etmlx_decode looks up (dlsym)
