"""top-k, top-p, min-p, logit bias, logprobs and per-row parameters through the real .pte.

Chi-square tests: fixed seeds, significance ALPHA, bins with < 5 expected draws pooled,
and no draw may fall outside the allowed set.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from backends.mlx.custom_kernel_ops.filter_threshold import threshold_reference
from backends.mlx.llm.sampler.export import LogitsInput, export_sampling_head, sampler_inputs
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.head import SamplingHead
from backends.mlx.runtime.runner import load_method

ALPHA = 1e-3
ROWS = 500  # draws per call: one batch row each, per-row seeds
ALL = SamplerConfig(top_k=True, top_p=True, min_p=True, logit_bias=2)


def _program(config, batch, vocab, per_row=True):
    result = export_sampling_head(LogitsInput(), (torch.zeros(batch, vocab),), config=config, per_row=per_row)
    assert result.ops_outside == 0, result.summary()
    return load_method(result.pte)


@pytest.fixture(scope="module")
def full_500x5():
    return _program(ALL, ROWS, 5)


@pytest.fixture(scope="module")
def full_500x64():
    return _program(ALL, ROWS, 64)


def _knobs(batch, top_k=0, top_p=1.0, min_p=0.0, bias=((0, 0.0), (0, 0.0))):
    rows = lambda v, dt: torch.full((batch,), v, dtype=dt)
    return dict(top_k=rows(top_k, torch.int64), top_p=rows(top_p, torch.float32),
                min_p=rows(min_p, torch.float32),
                bias_ids=torch.tensor([b[0] for b in bias]).expand(batch, -1).contiguous(),
                bias_values=torch.tensor([b[1] for b in bias], dtype=torch.float32).expand(batch, -1).contiguous())


def _draw(method, logits_row, calls, temperature=1.0, base_seed=0, **knob_values):
    batch = ROWS
    knobs = _knobs(batch, **knob_values)
    logits = logits_row.expand(batch, -1).contiguous()
    out = []
    for c in range(calls):
        seeds = torch.arange(batch, dtype=torch.int64) + base_seed + c * batch
        inputs = sampler_inputs(ALL, [logits], torch.full((batch,), temperature), seeds, validate=False, **knobs)
        out.append(method.execute(inputs)[0])
    return torch.cat(out)


def _filtered_probs(logits_row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, bias=()):
    x = logits_row.double().clone()
    for i, v in bias:
        x[i] += v
    z = (x.float() / torch.tensor(temperature, dtype=torch.float32)).numpy()[None]
    thr = threshold_reference(z, np.array([top_k]), np.array([top_p], np.float32), np.array([min_p], np.float32))
    kept = z[0] >= thr[0, 0]
    p = np.where(kept, np.exp(z[0].astype(np.float64) - z[0].max()), 0.0)
    return p / p.sum()


def _pvalue(tokens, probs):
    counts = np.bincount(tokens.numpy(), minlength=len(probs)).astype(np.float64)
    outside = counts[probs == 0].sum()
    assert outside == 0, f"{int(outside)} draws outside the allowed set"
    expected = probs * counts.sum()
    big = expected >= 5
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    if len(exp) < 2:
        return 1.0
    return stats.chisquare(obs, exp).pvalue


# Hand-computed: probabilities 0.4, 0.3, 0.15, 0.1, 0.05 at temperature 1.
HAND = torch.log(torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05]))
HAND_CASES = [
    (dict(top_k=2), [0, 1]),
    (dict(top_k=4), [0, 1, 2, 3]),
    (dict(top_p=0.65), [0, 1]),
    (dict(top_p=0.72), [0, 1, 2]),
    (dict(top_p=0.3), [0]),
    (dict(min_p=0.3), [0, 1, 2]),  # p >= 0.12
    (dict(min_p=0.5), [0, 1]),  # p >= 0.2
    (dict(top_k=3, top_p=0.6), [0, 1]),  # top-k renormalizes: 0.47, 0.82 -> two tokens
    (dict(top_k=3, top_p=0.45), [0]),
    (dict(top_p=0.9, min_p=0.3), [0, 1, 2]),
    (dict(top_k=0, top_p=1.0, min_p=0.0), [0, 1, 2, 3, 4]),  # all off
    (dict(top_k=-3, top_p=1.5), [0, 1, 2, 3, 4]),  # negative k and p > 1 are off
]


@pytest.mark.parametrize("knobs,kept", HAND_CASES)
def test_hand_computed_kept_sets_and_probabilities(full_500x5, knobs, kept):
    probs = _filtered_probs(HAND, **knobs)
    assert sorted(np.nonzero(probs)[0].tolist()) == kept
    base = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    np.testing.assert_allclose(probs[kept], base[kept] / base[kept].sum(), rtol=1e-6)
    tokens = _draw(full_500x5, HAND, 8, **knobs)
    assert set(tokens.tolist()) <= set(kept)
    assert _pvalue(tokens, probs) > ALPHA


def test_ties_at_the_top_k_threshold_are_all_kept(full_500x5):
    logits = torch.tensor([1.0, 1.0, 1.0, 0.0, -1.0])
    tokens = _draw(full_500x5, logits, 4, top_k=2)
    assert set(tokens.tolist()) == {0, 1, 2}


def test_logit_bias_bans_and_boosts(full_500x5):
    tokens = _draw(full_500x5, HAND, 4, bias=((0, -100.0), (4, 3.0)))
    probs = _filtered_probs(HAND, bias=((0, -100.0), (4, 3.0)))
    assert 0 not in set(tokens.tolist())
    assert _pvalue(tokens, probs) > ALPHA


def test_out_of_range_bias_ids_are_ignored(full_500x5):
    tokens = _draw(full_500x5, HAND, 4, bias=((7, 50.0), (-2, 50.0)))
    assert _pvalue(tokens, _filtered_probs(HAND)) > ALPHA


@pytest.mark.parametrize("knobs", [dict(top_k=10), dict(top_p=0.8), dict(min_p=0.1), dict(top_k=20, top_p=0.9),
                                   dict(top_p=0.95, min_p=0.05), dict(top_k=30, top_p=0.7, min_p=0.02)])
@pytest.mark.parametrize("temperature", [0.7, 1.5])
def test_device_matches_the_exact_filtered_distribution(full_500x64, knobs, temperature):
    logits = torch.randn(64, generator=torch.Generator().manual_seed(5)) * 2
    tokens = _draw(full_500x64, logits, 16, temperature=temperature, base_seed=77, **knobs)
    probs = _filtered_probs(logits, temperature=temperature, **knobs)
    p = _pvalue(tokens, probs)
    assert p > ALPHA, f"{knobs} T={temperature}: p={p:.2e}"


def test_an_off_by_one_top_p_is_caught(full_500x64):
    """Guard the guard: dropping the token that crosses p must fail the test above."""
    logits = torch.randn(64, generator=torch.Generator().manual_seed(5)) * 2
    tokens = _draw(full_500x64, logits, 16, base_seed=77, top_p=0.8)
    right = _filtered_probs(logits, top_p=0.8)
    wrong = right.copy()
    kept = np.nonzero(right)[0]
    wrong[kept[np.argmin(right[kept])]] = 0  # the smallest kept token is the one that crossed p
    wrong /= wrong.sum()
    with pytest.raises(AssertionError, match="outside the allowed set"):
        _pvalue(tokens, wrong)


def test_per_row_parameters_behave_as_when_run_alone():
    batch, vocab = 6, 64
    batched = _program(ALL, batch, vocab)
    alone = _program(ALL, 1, vocab)
    logits = torch.randn(batch, vocab) * 2
    temps = torch.tensor([0.5, 1.0, 0.0, 1.5, 0.8, 1.0])
    seeds = torch.tensor([3, 1, 4, 1, 5, 9])
    knobs = dict(top_k=torch.tensor([5, 0, 3, 40, 0, 1]), top_p=torch.tensor([1.0, 0.5, 0.9, 0.3, 1.0, 1.0]),
                 min_p=torch.tensor([0.0, 0.0, 0.1, 0.0, 0.2, 0.0]),
                 bias_ids=torch.tensor([[1, 2]] * batch), bias_values=torch.tensor([[2.0, -1.0]] * batch))
    out = batched.execute(sampler_inputs(ALL, [logits], temps, seeds, **knobs))[0]
    for r in range(batch):
        row = {k: v[r:r + 1] for k, v in knobs.items()}
        single = alone.execute(sampler_inputs(ALL, [logits[r:r + 1]], temps[r:r + 1], seeds[r:r + 1], **row))[0]
        assert int(single[0]) == int(out[r]), f"row {r}"
    assert int(out[5]) == int((logits[5] + torch.nn.functional.one_hot(torch.tensor(1), vocab) * 2).argmax())


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_match_log_softmax_of_the_right_distribution(mode):
    config = SamplerConfig(top_k=True, top_p=True, logprobs=4, logprobs_mode=mode)
    batch, vocab = 4, 50
    method = _program(config, batch, vocab)
    logits = torch.randn(batch, vocab) * 2
    temps = torch.tensor([0.7, 1.0, 1.3, 0.9])
    knobs = dict(top_k=torch.tensor([10, 0, 5, 20]), top_p=torch.tensor([0.9, 0.8, 1.0, 0.95]))
    tokens, chosen, top_ids, top_lp = method.execute(
        sampler_inputs(config, [logits], temps, torch.arange(batch), **knobs))
    if mode == "raw":
        dist = torch.log_softmax(logits, -1)
    else:
        z = logits / temps[:, None]
        thr = torch.from_numpy(threshold_reference(z.numpy(), knobs["top_k"].numpy(), knobs["top_p"].numpy(), None))
        dist = torch.log_softmax(torch.where(z >= thr, z, torch.tensor(-math.inf)), -1)
    torch.testing.assert_close(chosen, dist.gather(1, tokens[:, None]).squeeze(1), atol=1e-5, rtol=1e-5)
    assert bool((top_lp[:, :-1] >= top_lp[:, 1:]).all())
    ref_lp, ref_ids = dist.topk(4, -1)
    torch.testing.assert_close(top_lp, ref_lp, atol=1e-5, rtol=1e-5)
    finite = torch.isfinite(ref_lp)  # past the kept set, alternatives are -inf with unspecified ids
    assert torch.equal(top_ids[finite], ref_ids[finite])
    if mode == "processed":
        assert bool(torch.isfinite(chosen).all())  # the sampled token is always in the kept set


def test_host_reference_equals_device_across_the_feature_set():
    config = SamplerConfig(top_k=True, top_p=True, min_p=True, logit_bias=3, logprobs=2)
    batch, vocab = 8, 500
    method = _program(config, batch, vocab)
    head = SamplingHead(LogitsInput(), config)
    gen = torch.Generator().manual_seed(99)
    agree = total = 0
    for trial in range(40):
        logits = torch.randn(batch, vocab, generator=gen) * (0.5, 2.0, 6.0)[trial % 3]
        temps = torch.rand(batch, generator=gen) * 1.5
        temps[trial % batch] = 0.0
        knobs = dict(top_k=torch.randint(-2, 60, (batch,), generator=gen),
                     top_p=torch.rand(batch, generator=gen) * 0.6 + 0.45,
                     min_p=torch.rand(batch, generator=gen) * 0.1,
                     bias_ids=torch.randint(0, vocab, (batch, 3), generator=gen),
                     bias_values=torch.randn(batch, 3, generator=gen) * 5)
        seeds = torch.randint(0, 2**40, (batch,), generator=gen)
        device = method.execute(sampler_inputs(config, [logits], temps, seeds, validate=False, **knobs))
        eager = head(logits, temperature=temps, seed=seeds, **knobs)
        agree += int((device[0] == eager[0]).sum())
        total += batch
        torch.testing.assert_close(device[1][device[0] == eager[0]], eager[1][device[0] == eager[0]],
                                   atol=1e-5, rtol=1e-5)
    assert agree / total >= 0.99, f"{agree}/{total}"
    print(f"\nhost reference == device on {agree}/{total} rows")


def test_odd_runtime_values_never_give_an_invalid_id(full_500x64):
    nan = float("nan")
    logits = torch.randn(64) * 2
    for knobs in (dict(top_p=nan), dict(min_p=nan), dict(min_p=3.0), dict(top_p=-1.0), dict(top_k=10**9),
                  dict(top_k=-(10**9)), dict(bias=((3, nan), (5, float("inf"))))):
        tokens = _draw(full_500x64, logits, 1, **knobs)
        assert int(tokens.min()) >= 0 and int(tokens.max()) < 64, knobs
    assert set(_draw(full_500x64, logits, 1, min_p=3.0).tolist()) == {int(logits.argmax())}  # clamped to 1
    assert set(_draw(full_500x64, logits, 1, top_p=-1.0).tolist()) == {int(logits.argmax())}


@pytest.mark.parametrize("bad,error,needle", [
    (dict(top_k=torch.tensor(1.5)), TypeError, "top_k"),
    (dict(top_p=torch.ones(3)), ValueError, "top_p"),
    (dict(min_p=torch.tensor(1)), TypeError, "min_p"),
    (dict(bias_ids=torch.zeros(5, dtype=torch.int64)), ValueError, "bias_ids"),
])
def test_bad_knobs_are_clear_errors_at_export(bad, error, needle):
    batch, config = 2, SamplerConfig(top_k=True, top_p=True, min_p=True, logit_bias=2)
    kwargs = dict(temperature=torch.tensor(1.0), seed=torch.tensor(0), top_k=torch.tensor(5),
                  top_p=torch.tensor(0.9), min_p=torch.tensor(0.0), bias_ids=torch.zeros(2, dtype=torch.int64),
                  bias_values=torch.zeros(2))
    kwargs.update(bad)
    with pytest.raises(error, match=needle):
        torch.export.export(SamplingHead(LogitsInput(), config), (torch.zeros(batch, 10),), kwargs, strict=False)


@pytest.mark.parametrize("bad,needle", [
    (dict(top_p=torch.tensor(0.0)), "top_p"), (dict(top_p=torch.tensor(1.5)), "top_p"),
    (dict(top_k=torch.tensor(-1)), "top_k"), (dict(min_p=torch.tensor(1.2)), "min_p"),
    (dict(min_p=torch.tensor(float("nan"))), "NaN"), (dict(bias_ids=torch.tensor([3, 12])), "bias_ids"),
    (dict(bias_values=torch.tensor([0.0, 150.0])), "bias_values"), (dict(temperature=torch.tensor(-1.0)), "temperature"),
])
def test_out_of_range_values_are_clear_errors_on_the_host(bad, needle):
    knobs = dict(top_k=torch.tensor(5), top_p=torch.tensor(0.9), min_p=torch.tensor(0.0),
                 bias_ids=torch.tensor([1, 2]), bias_values=torch.tensor([1.0, -1.0]))
    temperature = bad.pop("temperature", torch.tensor(1.0))
    knobs.update(bad)
    with pytest.raises(ValueError, match=needle):
        sampler_inputs(ALL, [torch.zeros(1, 10)], temperature, torch.tensor(0), vocab=10, **knobs)


def test_knob_without_its_feature_is_refused():
    with pytest.raises(ValueError, match="top_k was given"):
        SamplingHead(LogitsInput())(torch.zeros(1, 4), temperature=torch.tensor(1.0), top_k=torch.tensor(2))
    with pytest.raises(ValueError, match="logprobs_mode"):
        SamplerConfig(logprobs=2, logprobs_mode="softmax")
