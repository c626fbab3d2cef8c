"""`etmlx bench vision --shape tiny`: the report's structure, and the program's first token for each image is
transformers' (sharp tiny weights). Timings are reported, never asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.bench, pytest.mark.subprocess, pytest.mark.slow]


def test_tiny_vision_bench_report(tmp_path):
    out = tmp_path / "vision.json"
    ran = subprocess.run([sys.executable, "-m", "backends.mlx.cli.main", "bench", "vision", "--shape", "tiny",
                          "--repeats", "2", "--cache-dir", str(tmp_path / "cache"), "--json", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["shape"] == "tiny" and report["image_tokens"] == 64 and report["repeats"] == 2
    first = report["first_tokens"]
    assert len(first["etmlx"]) == 2 and first["etmlx"] == first["transformers"]
    for engine in ("etmlx", "transformers", "etmlx_same_image_again"):
        assert report["image_first_token_s"][engine] > 0
    assert report["decode_tokens_per_s"]["vlm"] > 0 and report["decode_tokens_per_s"]["text_only"] > 0
    assert report["peak_rss_bytes"] > report["weights_bytes"] > 0
    from backends.mlx.runtime.allocator import mimalloc_library

    # the RSS child runs with the etmlx command's malloc
    assert report["allocator"].startswith("mimalloc" if mimalloc_library() is not None else "system")
