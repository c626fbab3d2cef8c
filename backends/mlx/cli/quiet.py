"""Keep known third-party noise off the terminal (shown again with `--verbose`).

Each filter names one message where its library produces it, so anything else those libraries (or
we) report still gets through:
- torchao logs "Failed to load .../torchao/_C*.so" for its optional CUDA kernels on every import;
- torch's pytree logs a deprecation for each Enum torchao registers as a pytree constant;
- torch.export's unpickling of tree specs raises a FutureWarning about LeafSpec;
- transformers and huggingface_hub draw progress bars while loading a checkpoint.
"""

from __future__ import annotations

import logging
import os
import warnings

_DROPPED = {
    "torchao": ("Failed to load ",),
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
}


class _DropKnown(logging.Filter):
    def __init__(self, prefixes):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg if isinstance(record.msg, str) else ""
        return not msg.startswith(self.prefixes)


_installed = False


def install(verbose: bool = False) -> None:
    global _installed
    if verbose or _installed:
        return
    _installed = True
    for name, prefixes in _DROPPED.items():
        logging.getLogger(name).addFilter(_DropKnown(prefixes))
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    # Read by huggingface_hub when it is first imported (transformers follows it): no tqdm bars.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
