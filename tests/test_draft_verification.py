"""Draft verification (sampler/draft_verification.py) by itself, over given logits: the device program
reproduces the host reference, the output distribution is the plain sampler's (chi-square, with controls
that must fail), and the penalty state counts accepted tokens only."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from backends.mlx.exporter.export import export_to_pte
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.draft_verification import position_tokens, verify_drafts
from backends.mlx.llm.sampler.export import knob_examples
from backends.mlx.llm.sampler.processing import process_and_sample
from backends.mlx.runtime.runner import load_method

ALPHA = 1e-3


class Verifier(torch.nn.Module):
    """verify_drafts over logits given as an input, with the penalty state a program keeps."""

    def __init__(self, config: SamplerConfig, batch: int, vocab: int):
        super().__init__()
        self.config = config
        self.names = config.knob_names()
        if config.penalty_window:
            self.register_buffer("state", torch.full((batch, config.penalty_window), -1, dtype=torch.int64))
        elif config.penalties:
            self.register_buffer("state", torch.zeros(batch, vocab, dtype=torch.int32))
        else:
            self.state = None

    def forward(self, logits, drafts, draft_len, temperature, seed, *knobs):
        return verify_drafts(self.config, logits, drafts, draft_len, temperature, seed,
                             dict(zip(self.names, knobs)), self.state)


CONFIGS = {
    "plain": SamplerConfig(),
    "filters": SamplerConfig(top_k=True, top_p=True, min_p=True),
    "penalties+bias": SamplerConfig(top_k=True, top_p=True, logit_bias=3, penalties=True, penalty_seed=2),
    "window": SamplerConfig(top_p=True, penalties=True, penalty_window=4),
}
B, K, V = 4, 3, 64


def _knobs(config, gen, call):
    """Per-row knob values that are on for some rows and off for others."""
    values = knob_examples(config, B, per_row=True, vocab=V)
    rows = torch.arange(B)
    if config.top_k:
        values["top_k"] = torch.tensor([0, 5, 20, 64])
    if config.top_p:
        values["top_p"] = torch.tensor([1.0, 0.9, 0.6, 0.95])
    if config.min_p:
        values["min_p"] = torch.tensor([0.0, 0.05, 0.0, 0.1])
    if config.logit_bias:
        values["bias_ids"] = torch.randint(0, V, (B, config.logit_bias), generator=gen)
        values["bias_values"] = torch.randn(B, config.logit_bias, generator=gen) * 3
    if config.penalties:
        values["presence_penalty"] = torch.tensor([0.0, 0.5, 1.0, 0.3])
        values["frequency_penalty"] = torch.tensor([0.2, 0.0, 0.5, 0.4])
        values["repetition_penalty"] = torch.tensor([1.0, 1.3, 1.1, 2.0])
        values["penalty_reset"] = (rows == call % B).to(torch.int64) if call else torch.ones(B, dtype=torch.int64)
        if config.penalty_seed:
            add = torch.full((B, config.penalty_seed), -1, dtype=torch.int64)
            add[0, 0] = int(torch.randint(0, V, (), generator=gen))
            values["penalty_add"] = add
    return [values[n] for n in config.knob_names()]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_device_program_reproduces_the_host_reference(name):
    """Many seeds, knobs and drafts (half of them the token the sampler will draw, so runs of accepted drafts
    happen), over successive calls so the penalty state evolves: the device's state stays inside its program,
    so later calls agreeing is what checks it."""
    config = CONFIGS[name]
    eager = Verifier(config, B, V)
    gen = torch.Generator().manual_seed(11)
    example = (torch.zeros(B, K + 1, V), torch.zeros(B, K + 1, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
               torch.ones(B), torch.zeros(B, dtype=torch.int64), *_knobs(config, gen, 0))
    method = load_method(export_to_pte(Verifier(config, B, V), example).pte)
    agree = total = accepted_total = 0
    for call in range(40):
        logits = torch.randn(B, K + 1, V, generator=gen) * 3
        temperature = torch.tensor([0.0, 0.8, 1.3, 0.5]).roll(call)
        seed = torch.randint(0, 2 ** 40, (B,), generator=gen)
        knobs = _knobs(config, gen, call)
        guess = logits.argmax(-1)[:, :K]  # greedy's draws; sampled rows hit them often enough
        random = torch.randint(0, V, (B, K), generator=gen)
        drafts = torch.where(torch.rand(B, K, generator=gen) < 0.6, guess, random)
        drafts = torch.cat([drafts, torch.zeros(B, 1, dtype=torch.int64)], 1)  # position K's: padding
        draft_len = torch.randint(0, K + 1, (B,), generator=gen)
        inputs = [logits, drafts, draft_len, temperature, seed, *knobs]
        with torch.no_grad():
            accepted, token = eager(*inputs)
        out = method.execute(inputs)
        same = (out[0] == accepted) & (out[1] == token)
        agree += int(same.sum())
        total += B
        accepted_total += int(accepted.sum())
        assert bool((accepted <= draft_len).all())
    print(f"\n{name}: device == host reference on {agree}/{total} rows; {accepted_total} drafts accepted")
    assert accepted_total > total // 4  # the comparison covered accepted runs, not just rejections
    assert agree == total


def _processed_distribution(logits, temperature, top_k, top_p):
    """The plain sampler's distribution at one position, computed directly: softmax(x / T) over the tokens
    that top-k and then top-p keep."""
    z = logits / temperature
    order = torch.argsort(z, descending=True)
    keep = torch.zeros_like(z, dtype=torch.bool)
    keep[order[:top_k]] = True
    p = torch.softmax(torch.where(keep, z, torch.tensor(float("-inf"))), -1)
    sorted_p = p[order]
    before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of better tokens
    nucleus = torch.zeros_like(keep)
    nucleus[order[before < top_p]] = True
    p = torch.where(keep & nucleus, p, torch.zeros_like(p))
    return (p / p.sum()).double().numpy()


def _chi_square_p(counts: np.ndarray, expected_p: np.ndarray) -> float:
    support = expected_p > 0
    if counts[~support].sum() > 0:
        return 0.0  # a token the distribution excludes was drawn
    expected = expected_p[support] / expected_p[support].sum() * counts.sum()
    return float(chisquare(counts[support], expected).pvalue)


SAMPLES = 6000
T, TOP_K, TOP_P = 0.8, 8, 0.9


@pytest.fixture(scope="module")
def draws():
    """One verification call per sample: two positions' logits, one draft (a likely but not the top token),
    each sample with its own seed; plus the controls' extra draws."""
    gen = torch.Generator().manual_seed(5)
    vocab = 12
    logits = torch.randn(2, vocab, generator=gen) * 1.5
    config = SamplerConfig(top_k=True, top_p=True)
    p0 = _processed_distribution(logits[0], T, TOP_K, TOP_P)
    draft = int(np.argsort(p0)[-2])  # the second most likely token
    n = SAMPLES
    batch_logits = logits.unsqueeze(0).expand(n, 2, vocab).contiguous()
    drafts = torch.tensor([[draft, 0]]).expand(n, 2).contiguous()  # position 1's column: padding
    seeds = torch.arange(n, dtype=torch.int64) * 1000 + 17
    knobs = {"top_k": torch.full((n,), TOP_K), "top_p": torch.full((n,), TOP_P)}
    temperature = torch.full((n,), T)
    accepted, token = verify_drafts(config, batch_logits, drafts, torch.ones(n, dtype=torch.int64), temperature,
                                    seeds, knobs)
    plain = process_and_sample(config, logits[0].expand(n, vocab), temperature, seeds, knobs)
    # A control's second, independent draw from the full distribution at position 0.
    fresh = process_and_sample(config, logits[0].expand(n, vocab), temperature, seeds + 500, knobs)
    return dict(vocab=vocab, logits=logits, draft=draft, p0=p0, p1=_processed_distribution(logits[1], T, TOP_K, TOP_P),
                accepted=accepted, token=token, plain=plain, fresh=fresh)


def _first_tokens(d, accepted, token):
    return torch.where(accepted == 1, torch.full_like(token, d["draft"]), token)


def test_speculative_sampling_has_the_plain_samplers_distribution(draws):
    d = draws
    first = _first_tokens(d, d["accepted"], d["token"])
    counts = np.bincount(first.numpy(), minlength=d["vocab"])
    p_value = _chi_square_p(counts, d["p0"])
    print(f"\nfirst token: chi-square p = {p_value:.3g}; draft accepted {int(d['accepted'].sum())}/{SAMPLES} "
          f"(p(draft) = {d['p0'][d['draft']]:.3f})")
    assert p_value > ALPHA
    # After an accepted draft, the bonus token follows position 1's distribution.
    bonus = d["token"][d["accepted"] == 1]
    p_bonus = _chi_square_p(np.bincount(bonus.numpy(), minlength=d["vocab"]), d["p1"])
    assert p_bonus > ALPHA
    # Stronger than the distribution: for the same seed the first token is the plain sampler's token.
    assert torch.equal(first, d["plain"])


def test_controls_without_the_rejection_step_fail(draws):
    """The chi-square test has the power to see wrong schemes: accepting every draft, and accepting with
    probability p(x) but resampling from the whole of p on rejection (x not removed: x is then over-drawn)."""
    d = draws
    always = np.bincount(np.full(SAMPLES, d["draft"]), minlength=d["vocab"])
    assert _chi_square_p(always, d["p0"]) < ALPHA
    resampled = torch.where(d["plain"] == d["draft"], d["plain"], d["fresh"])
    assert _chi_square_p(np.bincount(resampled.numpy(), minlength=d["vocab"]), d["p0"]) < ALPHA


def test_penalty_state_counts_accepted_tokens_only():
    """Counts after a call: the state before it, the accepted drafts and the next token, nothing rejected."""
    config = SamplerConfig(penalties=True)
    vocab, k = 10, 3
    logits = torch.full((1, k + 1, vocab), -5.0)
    logits[0, :, 2] = 5.0  # greedy draws token 2 at every position
    state = torch.zeros(1, vocab, dtype=torch.int32)
    knobs = {"presence_penalty": torch.zeros(1), "frequency_penalty": torch.zeros(1),
             "repetition_penalty": torch.ones(1), "penalty_reset": torch.ones(1, dtype=torch.int64)}
    drafts = torch.tensor([[2, 7, 2, 0]])  # 2 accepted, 7 rejected (the draw there is 2), the last never reached
    accepted, token = verify_drafts(config, logits, drafts, torch.tensor([3]), torch.zeros(1), torch.zeros(1,
                                    dtype=torch.int64), knobs, state)
    assert (int(accepted), int(token)) == (1, 2)
    expected = torch.zeros(1, vocab, dtype=torch.int32)
    expected[0, 2] = 2  # the accepted draft and the correction
    assert torch.equal(state, expected)


def test_positions_see_the_drafts_before_them_in_the_penalties():
    """A frequency penalty on a token drafted at position 1 moves position 2's draw off it."""
    config = SamplerConfig(penalties=True)
    vocab = 6
    logits = torch.full((1, 3, vocab), -5.0)
    logits[0, :, 4] = 1.0
    logits[0, :, 1] = 0.5
    knobs = {"presence_penalty": torch.zeros(1), "frequency_penalty": torch.ones(1),
             "repetition_penalty": torch.ones(1), "penalty_reset": torch.ones(1, dtype=torch.int64)}
    tokens, _ = position_tokens(config, logits, torch.tensor([[4, 1, 0]]), torch.zeros(1),
                                torch.zeros(1, dtype=torch.int64), knobs, torch.zeros(1, vocab, dtype=torch.int32))
    assert tokens.tolist() == [[4, 1, 4]]  # position 1 saw 4 once (1.0 - 1 < 0.5); position 2 saw 4 and 1
