"""A program's KV cache is resident at most once: the peak RSS of a process that loads a program whose cache holds
131,072 positions and decodes a few tokens exceeds the same model's with 64 positions by at most 1.35x the cache's
bytes (the loader drops the constants the state starts from: kept, they pinned the starting zeros beside the state
the first call writes, and the same runs grew by 2x the cache). Float and 4-bit caches, through the Python loop and
the C++ etmlx_decode (which calls again as soon as a token is back: the cache write found the last call's kernels
still holding the cache and copied it, 1.5-2x the cache, until execute waited for the stream). A memory bound, read
from the child's VmHWM (the Python loop) or its maximum resident set (etmlx_decode, a child of a fresh process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.kv_cache import StaticCacheLM
from backends.mlx.runtime.native_tools import tool_path

pytestmark = pytest.mark.subprocess  # each measure in a fresh process

LONG = 131072
CHILD = """
import sys
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.sampler.params import SamplingParams
decoder = Decoder(sys.argv[1])
list(decoder.stream([1, 2, 3], 4, SamplingParams(), stop_at_eos=False))
print([int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM:")][0] * 1024)
"""
CPP_CHILD = """
import resource, subprocess, sys
subprocess.run([sys.argv[2], sys.argv[1], "--prompt-ids", "1,2,3", "--max-tokens", "8"], check=True,
               stdout=subprocess.DEVNULL)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                        max_position_embeddings=LONG, eos_token_id=None, bos_token_id=None,
                                        tie_word_embeddings=False)).eval()


def _peak_rss_bytes(pte: Path, loop: str) -> int:
    child = [CHILD, str(pte)] if loop == "python" else [CPP_CHILD, str(pte), str(tool_path("etmlx_decode"))]
    done = subprocess.run([sys.executable, "-c", *child], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("loop", ["python", "cpp"])
@pytest.mark.parametrize("kv_bits", [0, 4])
def test_the_cache_is_resident_once(tmp_path, kv_bits, loop):
    model = _model()
    short, long = tmp_path / "short.pte", tmp_path / "long.pte"
    export_decoder(model, short, 64, kv_bits=kv_bits, kv_group_size=32, verify=False)
    export_decoder(model, long, LONG, kv_bits=kv_bits, kv_group_size=32, verify=False)
    cache = StaticCacheLM(model, LONG, kv_bits=kv_bits, kv_group_size=32).cache_bytes()
    assert cache >= 16 << 20  # large enough to read in the RSS (float: 128 MiB, 4-bit with bfloat16 scales: 20)
    growth = min(_peak_rss_bytes(long, loop) for _ in range(2)) - min(_peak_rss_bytes(short, loop) for _ in range(2))
    assert growth < 1.35 * cache, (growth / cache, cache)
