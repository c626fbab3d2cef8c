"""Give back the memory a model's weights hold while they sit mapped from their checkpoint file.

An mlx-lm directory's tensors are mmaps of its safetensors (safetensors' default backend): a page the export
read stays in the process's RSS until unmapped. The export's own check then loads the written program, whose
runtime copies every weight (docs/weights.md): with the eager model's pages still resident that is twice the
weights. `release(model)` asks the kernel to reclaim the pages of file-backed tensors (MADV_PAGEOUT, Linux
5.4+): they are read again from the file (or the page cache) when next touched, so nothing changes but RSS.
Only pages inside a file mapping are advised: anonymous memory (a model built in memory) would go to swap
where there is swap, and is left alone. Where the advice is not available (other systems, older kernels)
nothing is done.

The check's eager forward then reads every weight again; `paged_out_after_use(model)` gives each module's pages
back as soon as its forward returns, so that forward holds about one layer's weights, not all of them (without
it the export's peak was 1.2-1.46x the weights, by how much the reread overlapped the runtime's freed memory).
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import sys
from contextlib import contextmanager
from typing import Iterable

import torch

MADV_PAGEOUT = 21  # <linux/mman.h>; Python's mmap module names it from 3.12 only


def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def _file_mappings() -> list[tuple[int, int]]:
    """(start, end) of this process's mappings of regular files, sorted (/proc/self/maps)."""
    spans = []
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[4] != "0" and fields[5].startswith("/"):
                    start, end = fields[0].split("-")
                    spans.append((int(start, 16), int(end, 16)))
    except OSError:
        return []
    return sorted(spans)


def _file_backed_pages(tensors: Iterable[torch.Tensor], mappings: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(first, length) of the whole pages inside each distinct CPU storage of `tensors` that lie in one of
    `mappings`."""
    page, seen, ranges = mmap.PAGESIZE, set(), []
    starts = [start for start, _ in mappings]
    for tensor in tensors:
        if tensor is None or tensor.device.type != "cpu" or tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        if not size or start in seen:
            continue
        seen.add(start)
        at = bisect.bisect_right(starts, start) - 1
        if at < 0:
            continue
        first = max(-(-start // page) * page, mappings[at][0])
        end = min((start + size) // page * page, mappings[at][1])
        if end > first:
            ranges.append((first, end - first))
    return ranges


def _advise(madvise, ranges: list[tuple[int, int]]) -> int:
    return sum(length for first, length in ranges if madvise(first, length, MADV_PAGEOUT) == 0)


def release(module: torch.nn.Module) -> int:
    """Advise the kernel to page out the file-backed memory of every CPU parameter and buffer of `module`
    (whole pages inside each storage only); returns the bytes advised. The tensors stay valid: their pages are
    read again when touched."""
    madvise = _madvise()
    if madvise is None:
        return 0
    return _advise(madvise, _file_backed_pages([*module.parameters(), *module.buffers()], _file_mappings()))


@contextmanager
def paged_out_after_use(module: torch.nn.Module):
    """Within: every submodule holding file-backed parameters or buffers of its own releases them (as above)
    when its forward returns. A weight used twice (a tied head) is read again from the page cache or the file."""
    madvise = _madvise()
    mappings = _file_mappings() if madvise is not None else []
    handles = []
    for holder in module.modules() if mappings else ():
        ranges = _file_backed_pages([*holder.parameters(recurse=False), *holder.buffers(recurse=False)], mappings)
        if ranges:
            handles.append(holder.register_forward_hook(_releasing(madvise, ranges)))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _releasing(madvise, ranges: list[tuple[int, int]]):
    def hook(_module, _args, _output) -> None:  # returns None: a forward hook's value would replace the output
        _advise(madvise, ranges)
    return hook
