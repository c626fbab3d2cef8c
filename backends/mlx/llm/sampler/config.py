"""Which sampler features an exported program contains (chosen at export; values are inputs).

Processing order, per row:
  0. penalties        repetition (HF, llama.cpp: divide positive logits by r, multiply negative
                      ones, for tokens seen), then presence and frequency (OpenAI:
                      logit - count * frequency - (count > 0) * presence)
  1. logit bias       add the given values at the given ids (OpenAI's logit_bias; -100 bans)
  1b. allowed mask    tokens whose bit is clear in the row's packed bitmask become -inf
                      (structured output: a grammar engine on the host writes the mask)
  2. temperature      divide by T (rows with T <= 0 or NaN are greedy: argmax after step 1)
  3. top-k            keep the k best scores (ties at the k-th kept)
  4. top-p            of what top-k kept, the smallest best-first prefix whose mass reaches p
  5. min-p            keep tokens with p >= min_p * p_max
  6. sample           Gumbel-max over the kept tokens (renormalized implicitly)

Penalties first, on the model's own preferences (vLLM and llama.cpp also penalize before
temperature and the filters; repetition before presence/frequency as vLLM does); bias after
them, so an explicit -100 ban holds however the penalties moved a token. Bias before temperature, as OpenAI and vLLM apply it to the logits, so a ban survives any
temperature; temperature before the filters (OpenAI, vLLM; llama.cpp applies it last), so
top-p and min-p measure the distribution that is actually sampled; top-k before top-p, as in
all three. Top-k, top-p and min-p then combine as an intersection of kept sets.
The allowed mask comes after penalties and bias (a grammar's constraint is absolute: no bias
can bring a disallowed token back) and before temperature and every filter, so greedy, top-k,
top-p, min-p, "processed" logprobs and Gumbel-max all see only allowed tokens (top-p's mass is
renormalized over them; the Gumbel-max kernel skips -inf tokens without drawing their noise). A
row with no allowed token (with a finite score) returns token id -1: an error for that row, which the
caller reports; penalty counts are then left with the id the unconstrained draw would give.

"Off" values, per row: top_k <= 0 or >= V; top_p >= 1 (or NaN); min_p <= 0; bias 0;
presence and frequency 0; repetition 1. The knobs' names, dtypes, off values and ranges are
declared once, in knobs.py.

Penalty counts are state the program owns ([B, V] int32, on the device): every sampled token
is counted; `penalty_reset` (1 per row) zeroes a row before the step (start of a sequence);
`penalty_add` ([B, penalty_seed] ids, -1 = none) adds tokens before the step, which is how a
caller seeds the counts from the prompt (or not: prompt counting is the caller's choice).
With `penalty_window = W` only the last W tokens count (prompt tokens added through
`penalty_add` included, in order; pass them left-aligned, -1 only as trailing padding): the
state is then the [B, W] window of recent ids instead of [B, V] counts.
Logprobs: "raw" (the default) is log_softmax of the model's logits: what OpenAI and vLLM
report by default, independent of the sampling knobs, and what scoring needs. "processed"
is log_softmax of the distribution actually sampled (after bias, temperature, filters; at
T=1 for greedy rows): filtered tokens get -inf, and when fewer than N tokens are kept the
remaining alternatives are -inf with unspecified ids.

Clamped, documented: min_p to [0, 1]; top_p <= 0 keeps only the best token; bias ids
outside [0, V) are ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from backends.mlx.llm.sampler.knobs import program_inputs

LOGPROB_MODES = ("raw", "processed")


@dataclass(frozen=True)
class SamplerConfig:
    top_k: bool = False
    top_p: bool = False
    min_p: bool = False
    logit_bias: int = 0  # max (id, value) pairs per row; 0 = no bias input
    logprobs: int = 0  # also return the chosen token's logprob and the top-N alternatives
    logprobs_mode: str = "raw"  # "raw": the model's softmax; "processed": after bias, T and filters
    candidates: int = 256  # scores sorted before falling back to a whole-row sort
    penalties: bool = False  # presence / frequency / repetition with device-owned token counts
    penalty_seed: int = 0  # ids per row that `penalty_add` can add to the counts in one step
    penalty_window: int = 0  # count only the last N tokens (0: every token since the reset)
    expose_counts: bool = False  # also return the counts after the step (tests, debugging)
    allowed_mask: bool = False  # a [B, ceil(V/32)] int32 packed bitmask input (bit set = token allowed)

    def __post_init__(self):
        if not isinstance(self.logit_bias, int) or self.logit_bias < 0:
            raise ValueError(f"logit_bias must be an int >= 0 (pairs per row), got {self.logit_bias!r}")
        if not isinstance(self.logprobs, int) or self.logprobs < 0:
            raise ValueError(f"logprobs must be an int >= 0, got {self.logprobs!r}")
        if self.logprobs_mode not in LOGPROB_MODES:
            raise ValueError(f"logprobs_mode must be one of {LOGPROB_MODES}, got {self.logprobs_mode!r}")
        if not isinstance(self.penalty_seed, int) or self.penalty_seed < 0:
            raise ValueError(f"penalty_seed must be an int >= 0, got {self.penalty_seed!r}")
        if not isinstance(self.penalty_window, int) or self.penalty_window < 0:
            raise ValueError(f"penalty_window must be an int >= 0, got {self.penalty_window!r}")
        if (self.penalty_seed or self.expose_counts or self.penalty_window) and not self.penalties:
            raise ValueError("penalty_seed, penalty_window and expose_counts need penalties=True")
        if not isinstance(self.candidates, int) or self.candidates < 1:
            raise ValueError(f"candidates must be an int >= 1, got {self.candidates!r}")

    @property
    def filters(self) -> bool:
        return self.top_k or self.top_p or self.min_p

    @property
    def plain(self) -> bool:
        """Temperature and seed only: the issue-3 program."""
        return not (self.filters or self.logit_bias or self.logprobs or self.penalties or self.allowed_mask)

    def knob_names(self) -> list[str]:
        """The program's knob inputs after temperature and seed, in order (the table in knobs.py)."""
        return program_inputs(self)
