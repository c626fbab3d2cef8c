"""AllowedMaskNode in both kernel variants: exactly the allowed tokens stay finite.

The program exposes every token's processed logprob (logprobs = V), so the finite ones are exactly
the tokens the mask left. Masks cover the edges of the CPU kernel: all-ones rows (passed through
without a copy, also when the bits past V are clear), all-zero words, the sign bit, the partial last
word with junk bits past V, and a batch mixing constrained and unconstrained rows.
"""

from __future__ import annotations

import pytest
import torch

from backends.mlx.custom_kernel_ops.allowed_mask import NO_ALLOWED_TOKEN, unpack_mask
from backends.mlx.exporter.inspect_pte import delegate_blobs
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head, sampler_inputs
from backends.mlx.llm.sampler.head import SamplingHead
from backends.mlx.runtime.runner import load_method
from backends.mlx.serialization.generated.node_table import NODE_TAGS
from backends.mlx.serialization.serializer import deserialize

VOCAB, BATCH = 70, 7  # 3 words, the last covering 6 tokens
CONFIG = SamplerConfig(allowed_mask=True, logprobs=VOCAB, logprobs_mode="processed")


def _masks() -> torch.Tensor:
    w = torch.full((BATCH, 3), -1, dtype=torch.int32)
    w[1] = torch.tensor([-1, -1, 0b111111], dtype=torch.int32)  # all allowed, bits past V clear
    w[2] = torch.tensor([0, -(2 ** 31), 0b100000 | (1 << 20)], dtype=torch.int32)  # tokens 63 and 69, junk past V
    w[3] = torch.tensor([0x0F0F0F0F, 0, -1], dtype=torch.int32)
    w[4] = torch.tensor([1, 0, 0], dtype=torch.int32)  # token 0 only
    w[6] = torch.tensor([0, 0, -64], dtype=torch.int32)  # only bits past V: nothing allowed
    return w  # row 0 and 5: all ones


@pytest.fixture(scope="module")
def pte():
    return export_sampling_head(LogitsInput(), (torch.zeros(BATCH, VOCAB),), config=CONFIG, per_row=True).pte


def test_the_mask_is_one_node_and_the_empty_row_check_another(pte):
    types = [i.nodeType for i in deserialize(delegate_blobs(pte)[0]).instructions]
    assert types.count(NODE_TAGS["AllowedMaskNode"]) == 1 and types.count(NODE_TAGS["DrawnOrNoneNode"]) == 1


@pytest.mark.parametrize("kernels", ["cpu", "device"])
def test_exactly_the_allowed_tokens_stay_finite(pte, monkeypatch, kernels):
    monkeypatch.setenv("ETMLX_KERNELS", kernels)
    method = load_method(pte)
    head = SamplingHead(LogitsInput(), CONFIG)
    words = _masks()
    allowed = unpack_mask(words, VOCAB)
    gen = torch.Generator().manual_seed(3)
    for trial in range(4):
        logits = torch.randn(BATCH, VOCAB, generator=gen) * 3
        temps = torch.full((BATCH,), 0.7) if trial % 2 else torch.zeros(BATCH)
        seeds = torch.randint(0, 2 ** 40, (BATCH,), generator=gen)
        out = method.execute(sampler_inputs(CONFIG, [logits], temps, seeds, allowed_mask=words))
        eager = head(logits, temperature=temps, seed=seeds, allowed_mask=words)
        assert torch.equal(out[0], eager[0])
        assert out[0][6] == NO_ALLOWED_TOKEN  # DrawnOrNoneNode: the empty row is an error for that row only
        assert all(allowed[r, out[0][r]] for r in range(BATCH - 1))
        finite = torch.zeros(BATCH, VOCAB, dtype=torch.bool)
        finite.scatter_(1, out[2], torch.isfinite(out[3]))
        assert torch.equal(finite, allowed), trial
        # Unconstrained rows pass through untouched: their logprobs are the plain log-softmax.
        plain = torch.log_softmax(logits[[0, 1, 5]] / (0.7 if trial % 2 else 1.0), -1)
        torch.testing.assert_close(out[3][[0, 1, 5]], plain.gather(1, out[2][[0, 1, 5]]), atol=1e-4, rtol=1e-4)


def test_a_control_mask_would_be_caught(pte):
    """The finiteness check above sees a one-bit difference: flipping bit 5 of row 4 changes it."""
    method = load_method(pte)
    words = _masks()
    words[4, 0] |= 1 << 5
    out = method.execute(sampler_inputs(CONFIG, [torch.zeros(BATCH, VOCAB)], torch.ones(BATCH),
                                        torch.zeros(BATCH, dtype=torch.int64), allowed_mask=words))
    finite = torch.zeros(BATCH, VOCAB, dtype=torch.bool)
    finite.scatter_(1, out[2], torch.isfinite(out[3]))
    assert not torch.equal(finite, unpack_mask(_masks(), VOCAB))
