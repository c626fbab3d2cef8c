import gc
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture(autouse=True)
def _fixed_seed():
    torch.manual_seed(0)


# A worker runs ~60 test files, each building programs (millions of short-lived objects), and holds a million
# objects that live on (imports, caches kept for the process). Python's full collection walks all of them and ran
# whenever the survivors grew by a quarter: ~11% of a file's time (31 of 153 s in test_quantized_decoder). Here a
# full collection waits for 100 middle-generation ones instead of 10; cyclic garbage lives a little longer.
gc.set_threshold(700, 10, 100)


def pytest_runtest_setup(item):
    """At each test file's first test, what earlier files left alive is collected once and frozen out of the
    collector's generations (still freed by reference counting), so later full collections walk only what this
    file made."""
    if getattr(item.module, "_etmlx_frozen", False):
        return
    item.module._etmlx_frozen = True
    gc.collect()
    gc.freeze()
