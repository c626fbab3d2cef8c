"""Penalties with device-owned counts, and the scoring program, through the real .pte."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from backends.mlx.exporter.export import export_to_pte
from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head, sampler_inputs
from backends.mlx.llm.sampler.processing import apply_penalties
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.head import SamplingHead
from backends.mlx.llm.sampler.scoring import ScoringHead
from backends.mlx.runtime.runner import load_method

ALPHA = 1e-3
CFG = SamplerConfig(penalties=True, penalty_seed=4, expose_counts=True)


def _knobs(batch, presence=0.0, frequency=0.0, repetition=1.0, reset=0, add=None):
    rows = lambda v, dt=torch.float32: torch.full((batch,), v, dtype=dt)
    add = torch.full((batch, 4), -1, dtype=torch.int64) if add is None else torch.tensor(add).expand(batch, -1)
    return dict(presence_penalty=rows(presence), frequency_penalty=rows(frequency),
                repetition_penalty=rows(repetition), penalty_reset=rows(reset, torch.int64), penalty_add=add.contiguous())


def test_penalty_arithmetic_by_hand():
    x = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    counts = torch.tensor([[2, 1, 0, 0]], dtype=torch.int32)
    out = apply_penalties(x, counts, torch.tensor(0.5), torch.tensor(0.25), torch.tensor(2.0))
    # token 0: 2 / 2 - 2 * 0.25 - 0.5 = 0; token 1: -2 * 2 - 0.25 - 0.5 = -4.75; unseen tokens unchanged
    assert out.tolist() == [[0.0, -4.75, 1.0, 0.5]]


@pytest.fixture(scope="module")
def penalized_500x5():
    result = export_sampling_head(LogitsInput(), (torch.zeros(500, 5),), config=CFG, per_row=True)
    assert result.ops_outside == 0, result.summary()
    return load_method(result.pte)


def test_device_samples_follow_the_penalized_distribution(penalized_500x5):
    logits = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
    knobs = _knobs(500, presence=0.5, frequency=0.7, repetition=1.5, reset=1, add=[0, 0, 1, -1])
    counts = torch.tensor([[2, 1, 0, 0, 0]], dtype=torch.int32)
    expected = torch.softmax(apply_penalties(logits[None], counts, torch.tensor(0.5), torch.tensor(0.7),
                                             torch.tensor(1.5)).double(), -1)[0].numpy()
    draws = []
    for call in range(8):  # reset every call, so each step sees exactly the seeded counts
        seeds = torch.arange(500) + call * 500
        draws.append(penalized_500x5.execute(sampler_inputs(CFG, [logits.expand(500, -1).contiguous()],
                                                             torch.ones(500), seeds, **knobs))[0])
    tokens = torch.cat(draws).numpy()
    observed = np.bincount(tokens, minlength=5)
    p = stats.chisquare(observed, expected * observed.sum()).pvalue
    assert p > ALPHA, (observed, expected)
    unpenalized = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    assert stats.chisquare(observed, unpenalized * observed.sum()).pvalue < ALPHA  # the penalty is visible


def test_counts_follow_a_host_recount_and_reset_and_seeding_work():
    batch, vocab = 4, 30
    result = export_sampling_head(LogitsInput(), (torch.zeros(batch, vocab),), config=CFG, per_row=True)
    method = load_method(result.pte)
    head = SamplingHead(LogitsInput(), CFG, batch=batch, vocab=vocab)
    logits = torch.randn(batch, vocab)
    recount = np.zeros((batch, vocab), dtype=np.int64)
    prompt = [3, 3, 7, -1]
    for step in range(25):
        first = step in (0, 12)  # a new sequence at step 0 and again at step 12
        knobs = _knobs(batch, presence=0.3, frequency=0.4, repetition=1.2, reset=int(first),
                       add=prompt if first else None)
        seeds = torch.arange(batch) * 1000 + step
        tokens, counts = method.execute(sampler_inputs(CFG, [logits], torch.full((batch,), 0.9), seeds, **knobs))
        eager_tokens, eager_counts = head(logits, temperature=torch.full((batch,), 0.9), seed=seeds, **knobs)
        if first:
            recount[:] = 0
            for t in prompt:
                if t >= 0:
                    recount[:, t] += 1
        recount[np.arange(batch), tokens.numpy()] += 1
        assert np.array_equal(counts.numpy(), recount), f"step {step}"
        assert torch.equal(tokens, eager_tokens) and torch.equal(counts, eager_counts)
    assert int(counts.sum()) == batch * (13 + 3)  # 13 sampled and 3 prompt tokens since the reset


def test_penalties_need_batch_and_vocab():
    with pytest.raises(ValueError, match="batch= and vocab="):
        SamplingHead(LogitsInput(), CFG)
    with pytest.raises(ValueError, match="penalties=True"):
        SamplerConfig(penalty_seed=3)


class _Tiny(torch.nn.Module):
    def __init__(self, vocab=40):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 16)
        self.out = torch.nn.Linear(16, vocab)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


@pytest.mark.parametrize("top", [0, 3])
def test_scoring_program_returns_the_logprob_of_each_target(top):
    torch.manual_seed(0)
    model = _Tiny().eval()
    head = ScoringHead(model, top=top)
    ids = torch.randint(0, 40, (2, 7))
    targets = torch.randint(0, 40, (2, 7))
    result = export_to_pte(head, (ids,), {"targets": targets}, strict=True)
    assert result.ops_outside == 0, result.summary()
    out = load_method(result.pte).execute([ids, targets])
    with torch.no_grad():
        dist = torch.log_softmax(model(ids), -1)
    expected = dist.gather(2, targets.unsqueeze(2)).squeeze(2)
    torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)
    if top:
        ref_lp, ref_ids = dist.topk(top, -1)
        torch.testing.assert_close(out[2], ref_lp, atol=1e-5, rtol=1e-5)
        assert torch.equal(out[1], ref_ids)


def test_scoring_rejects_bad_targets():
    head = ScoringHead(_Tiny())
    with pytest.raises(ValueError, match="targets must be"):
        head(torch.zeros(2, 3, dtype=torch.int64), targets=torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(TypeError, match="targets"):
        head(torch.zeros(2, 3, dtype=torch.int64), targets=torch.zeros(2, 3))


def test_window_counts_only_the_last_tokens():
    batch, vocab, width = 3, 25, 5
    config = SamplerConfig(penalties=True, penalty_seed=4, penalty_window=width, expose_counts=True)
    method = load_method(export_sampling_head(LogitsInput(), (torch.zeros(batch, vocab),), config=config,
                                              per_row=True).pte)
    head = SamplingHead(LogitsInput(), config, batch=batch, vocab=vocab)
    logits = torch.randn(batch, vocab)
    history: list[list[int]] = [[] for _ in range(batch)]
    prompt = [4, 9, 9, -1]
    for step in range(12):
        first = step == 0
        knobs = _knobs(batch, presence=0.4, frequency=0.6, repetition=1.3, reset=int(first),
                       add=prompt if first else None)
        seeds = torch.arange(batch) * 77 + step
        tokens, counts = method.execute(sampler_inputs(config, [logits], torch.ones(batch), seeds, **knobs))
        eager_tokens, eager_counts = head(logits, temperature=torch.ones(batch), seed=seeds, **knobs)
        assert torch.equal(tokens, eager_tokens) and torch.equal(counts, eager_counts)
        for r in range(batch):
            if first:
                history[r] = [t for t in prompt if t >= 0]
            history[r].append(int(tokens[r]))
            expected = np.bincount(history[r][-width:], minlength=vocab)
            assert np.array_equal(counts[r].numpy(), expected), f"step {step} row {r}"
