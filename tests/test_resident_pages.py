"""resident_pages: the export's check gives back the file-backed pages of the eager model's weights.

A linear whose weight is mapped from a safetensors file (safetensors' default, as an mlx-lm directory loads) is
read by a forward; inside `paged_out_after_use` its pages leave this process's RSS once that forward returns,
the output is unchanged. Controls: outside the context the pages stay resident after the same forward, and a
weight in anonymous memory is never advised (it would go to swap where there is swap).
"""

from __future__ import annotations

import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from backends.mlx.llm.decoder.resident_pages import paged_out_after_use, release

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_PAGEOUT and /proc are Linux's")
SIDE = 2048  # a 16 MiB float32 weight: far above what a forward's own allocations move RssFile by


def _rss_file() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssFile:"))


@pytest.fixture()
def mapped_linear(tmp_path):
    torch.manual_seed(0)
    save_file({"weight": torch.randn(SIDE, SIDE)}, str(tmp_path / "w.safetensors"))
    linear = torch.nn.Linear(SIDE, SIDE, bias=False)
    with torch.no_grad():
        linear.weight = torch.nn.Parameter(load_file(str(tmp_path / "w.safetensors"))["weight"], requires_grad=False)
    return linear


def _forward(linear, x):
    with torch.no_grad():
        return linear(x)


def test_a_mapped_weight_leaves_rss_after_its_forward_and_the_output_is_unchanged(mapped_linear):
    x = torch.randn(1, SIDE)
    expected = _forward(mapped_linear, x)  # reads every page: resident now
    weight = SIDE * SIDE * 4
    resident = _rss_file()
    with paged_out_after_use(mapped_linear):
        got = _forward(mapped_linear, x)
    assert torch.equal(got, expected)
    assert resident - _rss_file() > 0.9 * weight, "the weight's pages stayed resident after its forward"
    assert not mapped_linear._forward_hooks, "the context left its hooks on the module"
    # Control: the same forward outside the context reads the pages back and they stay.
    before = _rss_file()
    assert torch.equal(_forward(mapped_linear, x), expected)
    assert _rss_file() - before > 0.9 * weight


def test_anonymous_weights_are_not_advised():
    linear = torch.nn.Linear(SIDE, SIDE, bias=False)
    assert release(linear) == 0
    with paged_out_after_use(linear):
        assert not linear._forward_hooks
