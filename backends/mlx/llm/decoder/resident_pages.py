"""Give back the memory a model's weights hold while they sit mapped from their checkpoint file.

An mlx-lm directory's tensors are mmaps of its safetensors (safetensors' default backend): a page the export
read stays in the process's RSS until unmapped. The export's own check then loads the written program, whose
runtime copies every weight (docs/weights.md): with the eager model's pages still resident that is twice the
weights. `release(model)` asks the kernel to reclaim the pages of file-backed tensors (MADV_PAGEOUT, Linux
5.4+): they are read again from the file (or the page cache) when next touched, so nothing changes but RSS.
Anonymous memory (a model built in memory) cannot be paged out without swap: there the call does nothing, as it
does where the advice is not available (other systems, older kernels).
"""

from __future__ import annotations

import ctypes
import mmap
import sys

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


def release(module: torch.nn.Module) -> int:
    """Advise the kernel to page out the memory of every CPU parameter and buffer of `module` (whole pages
    inside each storage only); returns the bytes advised. The tensors stay valid: file-backed pages are read
    again when touched, anonymous ones are kept."""
    madvise = _madvise()
    if madvise is None:
        return 0
    page = mmap.PAGESIZE
    seen, advised = set(), 0
    for tensor in [*module.parameters(), *module.buffers()]:
        if tensor.device.type != "cpu" or tensor.is_meta:
            continue
        storage = tensor.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        if not size or start in seen:
            continue
        seen.add(start)
        first, end = -(-start // page) * page, (start + size) // page * page
        if end > first and madvise(first, end - first, MADV_PAGEOUT) == 0:
            advised += end - first
    return advised
