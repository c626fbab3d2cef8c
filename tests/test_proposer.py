"""A draft model's program that proposes K tokens per call (`--propose-tokens K`, llm/decoder/proposer.py): one
call returns what K calls of the plain program would (greedy, and seeded: step i draws with seed + i; a control
with another seed must differ), any decode loop can drive it as a plain program (column 0), positions past the
cache's end are dropped, and what it cannot be is a one-line error."""

from __future__ import annotations

import pytest

from backends.mlx.llm.decoder.export import export_decoder
from backends.mlx.llm.decoder.loop import Decoder
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.sampler.config import SamplerConfig
from backends.mlx.llm.sampler.params import SamplingParams
from helpers import eager_greedy, tiny_llama

pytestmark = pytest.mark.slow  # whole decoder exports

VOCAB = 96
K = 5
PROMPT = [5, 17, 3, 40, 8, 5, 17, 3]


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(VOCAB, 3, head_scale=0.3, hidden=32, layers=2)


@pytest.fixture(scope="module")
def programs(tmp_path_factory, llama) -> dict:
    out = tmp_path_factory.mktemp("proposer")
    paths = {"plain": out / "plain.pte", "proposer": out / "proposer.pte"}
    export_decoder(llama, paths["plain"], 32, config=SamplerConfig(), pipelined=False)
    export_decoder(llama, paths["proposer"], 32, propose_tokens=K)
    return paths


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.5, seed=11)],
                         ids=["greedy", "seeded"])
def test_one_call_proposes_what_k_plain_calls_would(programs, llama, params):
    plain, proposer = Decoder(programs["plain"]), Decoder(programs["proposer"])
    assert proposer.meta.propose_tokens == K and not proposer.meta.pipelined
    for prompt in (PROMPT, [1, 2], PROMPT[:5] + [60, 61, 62]):
        expected = [s.token for s in plain.stream(prompt, K, params, stop_at_eos=False)]
        assert proposer.propose(prompt, params, reuse=False) == expected, prompt
    if params.temperature == 0:
        assert proposer.propose(PROMPT, params) == eager_greedy(llama, PROMPT, K)
    else:  # the control: the seed reaches every column (another seed draws another sequence)
        other = SamplingParams(temperature=params.temperature, seed=params.seed + 1)
        assert proposer.propose(PROMPT, params, reuse=False) != proposer.propose(PROMPT, other, reuse=False)


def test_the_row_cache_is_reused_and_overwritten(programs, llama):
    """Each proposal feeds only what the row does not hold; the columns it wrote past the fed tokens are
    overwritten by the next call, whatever they held."""
    proposer = Decoder(programs["proposer"])
    truth = eager_greedy(llama, PROMPT, 12)
    assert proposer.propose(PROMPT) == truth[:K]
    wrong = PROMPT + truth[:2] + [(truth[2] + 1) % VOCAB]  # leaves the proposed path
    assert proposer.propose(wrong) == eager_greedy(llama, wrong, K)
    assert proposer.last_cached == len(PROMPT)  # the row held the prompt; its proposed columns were rewritten
    assert proposer.propose(PROMPT + truth[:6]) == truth[6:6 + K]


def test_a_proposer_decodes_as_a_plain_program(programs):
    plain, proposer = Decoder(programs["plain"]), Decoder(programs["proposer"])
    reference = [s.token for s in plain.stream(PROMPT, 20, stop_at_eos=False)]
    assert [s.token for s in proposer.stream(PROMPT, 20, stop_at_eos=False)] == reference


def test_past_the_cache_end_fewer_tokens(programs, llama):
    proposer = Decoder(programs["proposer"])
    long = (PROMPT * 4)[:30]  # max_seq_len 32: two positions left
    assert proposer.propose(long) == eager_greedy(llama, long, 2)


def test_what_a_proposer_cannot_be_is_a_one_line_error(programs, llama, tmp_path):
    with pytest.raises(ValueError, match="export them as two programs"):
        export_decoder(llama, tmp_path / "x.pte", 32, propose_tokens=K, draft_tokens=K)
    with pytest.raises(ValueError, match="plain sampler"):
        export_decoder(llama, tmp_path / "x.pte", 32, propose_tokens=K, config=SamplerConfig(top_k=True))
    with pytest.raises(ValueError, match="unpipelined"):
        export_decoder(llama, tmp_path / "x.pte", 32, propose_tokens=K, pipelined=True)
    with pytest.raises(ValueError, match="must be below max_seq_len"):
        export_decoder(llama, tmp_path / "x.pte", 32, propose_tokens=32)
    with pytest.raises(ValueError, match="propose_tokens must be an int >= 0"):
        export_decoder(llama, tmp_path / "x.pte", 32, propose_tokens=-1)
    with pytest.raises(ValueError, match="--propose-tokens K"):
        Decoder(programs["plain"]).propose(PROMPT)
    assert DecoderMeta.load(programs["plain"]).propose_tokens == 0
