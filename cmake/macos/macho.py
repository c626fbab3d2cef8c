"""What a Mach-O file says about its linking: kind, CPU, install name, rpaths, the dylibs it loads, and its
undefined symbols with the dylib each binds to (two-level namespace) or None (looked up by name at load,
`-undefined dynamic_lookup`). Reads with macholib (installed by `make check-macos` into build-macos/tools)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from macholib import mach_o
from macholib.MachO import MachO
from macholib.SymbolTable import SymbolTable

_LOADS = {mach_o.LC_LOAD_DYLIB, mach_o.LC_LOAD_WEAK_DYLIB, mach_o.LC_REEXPORT_DYLIB, mach_o.LC_LAZY_LOAD_DYLIB,
          mach_o.LC_LOAD_UPWARD_DYLIB}
KINDS = {mach_o.MH_EXECUTE: "executable", mach_o.MH_DYLIB: "dylib", mach_o.MH_BUNDLE: "bundle",
         mach_o.MH_OBJECT: "object"}
# The library ordinal in an undefined symbol's n_desc (<mach-o/nlist.h> GET_LIBRARY_ORDINAL). A symbol
# looked up by name at load (-undefined dynamic_lookup) has DYNAMIC_LOOKUP_ORDINAL from ld64 and 0
# (SELF_LIBRARY_ORDINAL, which names no library for an undefined symbol) from Zig's linker, whose bind
# information then looks it up in the flat namespace.
_LOOKUP_ORDINALS = (0, 0xFE)
_EXECUTABLE_ORDINAL = 0xFF


@dataclass
class MachOFile:
    path: Path
    kind: str
    cpu: str
    install_name: str | None
    rpaths: list[str]
    dylibs: list[str]
    # symbol -> the dylib it binds to, None for a name looked up at load time
    undefined: dict[str, str | None] = field(default_factory=dict)
    exported: set[str] = field(default_factory=set)


def _text(data: bytes) -> str:
    return data.split(b"\0", 1)[0].decode()


def read(path: Path) -> MachOFile:
    macho = MachO(str(path))
    if len(macho.headers) != 1:
        raise ValueError(f"{path}: a universal binary ({len(macho.headers)} slices), expected one arm64 slice")
    header = macho.headers[0]
    rpaths, dylibs, install_name = [], [], None
    for load, command, data in header.commands:
        if load.cmd == mach_o.LC_RPATH:
            rpaths.append(_text(data))
        elif load.cmd in _LOADS:
            dylibs.append(_text(data))
        elif load.cmd == mach_o.LC_ID_DYLIB:
            install_name = _text(data)
    cpu = mach_o.CPU_TYPE_NAMES.get(header.header.cputype, str(header.header.cputype))
    file = MachOFile(path, KINDS.get(header.header.filetype, str(header.header.filetype)), cpu, install_name,
                     rpaths, dylibs)
    symbols = SymbolTable(macho, header)
    for entry, name in symbols.undefsyms:
        ordinal = (entry.n_desc >> 8) & 0xFF
        if ordinal in _LOOKUP_ORDINALS:
            file.undefined[name.decode()] = None
        elif ordinal == _EXECUTABLE_ORDINAL:
            file.undefined[name.decode()] = "<executable>"
        elif ordinal <= len(dylibs):
            file.undefined[name.decode()] = dylibs[ordinal - 1]
        else:
            raise ValueError(f"{path}: symbol {name.decode()} names library {ordinal} of {len(dylibs)}")
    file.exported = {name.decode() for _, name in symbols.extdefsyms}
    return file
