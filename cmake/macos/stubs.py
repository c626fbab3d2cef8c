"""Stand-ins for the two parts of the macOS SDK the cross build links against (there is no SDK here):

- usr/lib/libc++.tbd: a text stub of the system /usr/lib/libc++.1.dylib (which re-exports libc++abi). Its
  symbols are those the wheels' own binaries (built by Apple's toolchain against that library) bind to it,
  plus EXTRA_LIBCXX below: a symbol the etmlx code needs that neither list has fails the link, as it would on
  a Mac whose libc++ lacked it.
- usr/lib/libz.tbd and usr/include/zlib.h, zconf.h: the system /usr/lib/libz.1.dylib (zlib's API, the same on
  every platform: the headers are this machine's).

    python cmake/macos/stubs.py build-macos      # reads build-macos/site-packages, writes build-macos/stubs
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import macho  # noqa: E402

LIBCXX = "/usr/lib/libc++.1.dylib"
LIBZ = "/usr/lib/libz.1.dylib"
# In the system libc++.1.dylib long before macOS 14 (LLVM's libcxx/lib/abi/arm64-apple-darwin ABI list) and
# called by etmlx, but bound by none of the wheels' binaries: sized operator delete, mutex::try_lock,
# thread::detach, istream::seekg/tellg, ostream << streambuf*, and the library's std::sort of doubles.
EXTRA_LIBCXX = [
    "__ZdlPvm", "__ZdaPvm", "__ZNSt3__15mutex8try_lockEv", "__ZNSt3__16thread6detachEv",
    "__ZNSt3__113basic_istreamIcNS_11char_traitsIcEEE5seekgENS_4fposI11__mbstate_tEE",
    "__ZNSt3__113basic_istreamIcNS_11char_traitsIcEEE5tellgEv",
    "__ZNSt3__113basic_ostreamIcNS_11char_traitsIcEEElsEPNS_15basic_streambufIcS2_EE",
    "__ZNSt3__16__sortIRNS_6__lessIddEEPdEEvT0_S5_T_",
]
# zlib 1.2.12 (macOS 14's): what named_constant.cpp calls.
LIBZ_SYMBOLS = ["_crc32", "_crc32_z", "_zlibVersion"]


def tbd(install_name: str, symbols: list[str]) -> str:
    """A TAPI text stub (tbd-version 4) of one arm64 macOS dylib exporting `symbols`."""
    listed = ",\n".join(f"      '{name}'" for name in sorted(symbols))
    return (f"--- !tapi-tbd\ntbd-version: 4\ntargets: [ arm64-macos ]\ninstall-name: '{install_name}'\n"
            f"current-version: 1\ncompatibility-version: 1\nexports:\n  - targets: [ arm64-macos ]\n"
            f"    symbols: [\n{listed} ]\n...\n")


def libcxx_symbols(site: Path) -> list[str]:
    found = set(EXTRA_LIBCXX)
    binaries = [*site.rglob("*.dylib"), *site.rglob("*.so")]
    if not binaries:
        raise SystemExit(f"stubs.py: no macOS binaries in {site} (run fetch.py first)")
    for path in binaries:
        found.update(name for name, lib in macho.read(path).undefined.items() if lib == LIBCXX)
    return sorted(found)


def main(out: Path) -> int:
    stubs = out / "stubs"
    (stubs / "usr" / "lib").mkdir(parents=True, exist_ok=True)
    (stubs / "usr" / "include").mkdir(parents=True, exist_ok=True)
    (stubs / "usr" / "lib" / "libc++.tbd").write_text(tbd(LIBCXX, libcxx_symbols(out / "site-packages")))
    (stubs / "usr" / "lib" / "libz.tbd").write_text(tbd(LIBZ, LIBZ_SYMBOLS))
    for header in ("zlib.h", "zconf.h"):
        source = Path("/usr/include") / header
        if not source.is_file():
            raise SystemExit(f"stubs.py: {source} not found (the Linux build's zlib headers: apt-get install zlib1g-dev)")
        shutil.copyfile(source, stubs / "usr" / "include" / header)
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
