"""A long prefill's attention in blocks of query rows (kernels/attention_blocks.h, runtime/attention_limit.py).

The score limit is lowered to one byte, so that a tiny model's 100-token prefill runs its attention in blocks of
16 query rows (the fewest the CPU set's prefill takes), with a float cache (SdpaNode) and a 4-bit one
(QuantizedSdpaNode, whose prefill dequantizes the keys it attends to, then one key/value head at a time). The greedy tokens and the returned
log-probabilities (top 4 per step) must equal the unblocked run's, bit for bit. Controls: the block counter grows
only under the low limit (the blocked path ran; the default limit leaves this prompt whole), and the same
comparison tells the 4-bit cache's run from the 8-bit one's (it can fail)."""

from __future__ import annotations

import pytest
import torch
import transformers as T

from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.runtime import attention_limit

PROMPT = torch.randint(1, 128, (100,), generator=torch.Generator().manual_seed(3)).tolist()
STEPS = 8


@pytest.fixture(autouse=True)
def _cpu_kernels(monkeypatch):
    monkeypatch.setenv("ETMLX_KERNELS", "cpu")


def _export(path, kv_bits: int):
    torch.manual_seed(0)
    config = T.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                           initializer_range=0.2, tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                           pad_token_id=0)
    model = T.AutoModelForCausalLM.from_config(config).eval()
    export_decoder(model, path, 128, kv_bits=kv_bits, kv_group_size=32, config=SamplerConfig(logprobs=4),
                   verify=False)
    return path


def _run(pte) -> tuple[list[int], list[float], list]:
    decoder = Decoder(pte)
    steps = list(decoder.stream(PROMPT, STEPS, stop_at_eos=False))
    return [s.token for s in steps], [s.logprob for s in steps], [s.top for s in steps]


def _blocked(pte) -> tuple[tuple, int]:
    before = attention_limit.query_blocks()
    with attention_limit.score_limit_set(1):
        out = _run(pte)
    return out, attention_limit.query_blocks() - before


@pytest.mark.parametrize("kv_bits", [0, 4])
def test_blocked_prefill_gives_the_unblocked_tokens_and_logprobs(tmp_path, kv_bits):
    pte = _export(tmp_path / f"kv{kv_bits}.pte", kv_bits)
    before = attention_limit.query_blocks()
    whole = _run(pte)
    assert attention_limit.query_blocks() == before  # the default limit keeps 100 rows x 128 keys whole
    blocked, blocks = _blocked(pte)
    # 2 layers x 100 rows in blocks of >= 16 rows: 6 blocks each (the decode steps have one row); the 4-bit cache's
    # attention also one key/value head at a time (2 heads), each head's rows in 6 blocks
    assert blocks == 2 * 6 * (2 if kv_bits else 1)
    assert blocked == whole
    assert attention_limit.score_limit() == attention_limit.DEFAULT_SCORE_LIMIT  # restored


@pytest.mark.slow
def test_the_comparison_tells_two_caches_apart(tmp_path):
    """Control: the same equality over the 4-bit and the 8-bit cache's runs fails."""
    four, _ = _blocked(_export(tmp_path / "kv4.pte", 4))
    eight, _ = _blocked(_export(tmp_path / "kv8.pte", 8))
    assert four[1] != eight[1]


def test_the_limit_is_positive():
    with pytest.raises(ValueError, match="positive number of bytes"):
        with attention_limit.score_limit_set(0):
            pass
