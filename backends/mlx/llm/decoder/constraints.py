"""Structured output on the host: llguidance matches a grammar and writes each step's allowed-token mask.

A program exported with `--sampler mask` (SamplerConfig(allowed_mask=True)) takes a packed bitmask per
row; the device applies it before temperature and every filter (llm/sampler/config.py). Here, per
sequence, a `Matcher` turns a `Constraint` (JSON schema, any JSON object, regex, choice list, Lark or
GBNF grammar) into that bitmask for the next token and advances with the token the device sampled.
llguidance allows the end-of-sequence token only where the grammar accepts, and only it once the
grammar is complete, so a constrained generation ends with EOS exactly when the output is whole.

Why nothing overlaps within a sequence: step k+1's mask depends on step k's token, which is what the
device returns, so the mask is computed between two calls (llguidance: tens of microseconds per token
on these vocabularies, see docs/structured-output.md); the server computes the rows of one call
together (`fill_masks`, llguidance's thread pool, GIL released).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from backends.mlx.llm.decoder.grammar_guard import GrammarChecker, on_big_stack
from backends.mlx.llm.decoder.grammar_limits import ConstraintError, GrammarLimits, check_grammar_size, one_line, precheck
from backends.mlx.llm.decoder.grammar_worker import parser_limits
from backends.mlx.llm.sampler.knobs import mask_words

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON as OpenAI's structured outputs print it, with no free whitespace: llguidance allows any run of
# whitespace between tokens by default, and a model (a small one especially) can spend its whole budget
# there. A schema's own "x-guidance" options override these.
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
EXPORT_HINT = "this program was exported without the allowed-token mask (export with --sampler ...,mask)"


@dataclass(frozen=True)
class Constraint:
    """What the output must match. `spec` per kind: json_schema: a dict or JSON text; json_object: None;
    regex: the pattern; choice: a list of strings; grammar: Lark (llguidance's dialect) or GBNF text."""

    kind: str
    spec: object = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ConstraintError(f"unknown constraint kind {self.kind!r} (choose from {', '.join(KINDS)})")

    def check_shape(self) -> None:
        """ConstraintError for a spec of the wrong shape (cheap: nothing is converted or compiled)."""
        kind, spec = self.kind, self.spec
        if kind == "json_schema" and not isinstance(spec, (dict, str)):
            raise ConstraintError(f"json_schema must be a JSON object, got {type(spec).__name__}")
        if kind == "choice" and not (isinstance(spec, (list, tuple)) and spec
                                     and all(isinstance(c, str) and c for c in spec)):
            raise ConstraintError("choice must be a non-empty list of non-empty strings")
        if kind in ("regex", "grammar") and not (isinstance(spec, str) and spec):
            raise ConstraintError(f"{kind} must be a non-empty string")

    def grammar(self, limits: GrammarLimits | None = None) -> str:
        """The llguidance grammar (not yet checked against a tokenizer: GrammarVocabulary.compile does);
        ConstraintError names a malformed spec or one over `limits` (default: GrammarLimits())."""
        from llguidance import LLMatcher, grammar_from

        kind, spec = self.kind, self.spec
        limits = limits or GrammarLimits()
        self.check_shape()
        precheck(kind, spec, limits)  # before any llguidance call: sizes, nesting, $ref chains, choices
        try:
            grammar = self._grammar(kind, spec, LLMatcher, grammar_from)
        except ConstraintError:
            raise
        except (ValueError, TypeError, RuntimeError) as exc:
            raise ConstraintError(f"{kind}: {_one_line(exc)}") from None
        except BaseException as exc:  # a Rust panic (pyo3's PanicException is a BaseException)
            if type(exc).__name__ != "PanicException":
                raise
            raise ConstraintError(f"{kind}: {_one_line(exc)}") from None
        check_grammar_size(grammar, limits)
        return grammar

    @staticmethod
    def _grammar(kind, spec, LLMatcher, grammar_from) -> str:
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if kind == "json_schema":
            if isinstance(spec, str):
                try:
                    spec = json.loads(spec)
                except json.JSONDecodeError as exc:
                    raise ConstraintError(f"json_schema is not valid JSON: {exc}") from None
                except RecursionError:
                    raise ConstraintError("json_schema is nested too deeply to parse") from None
            if not isinstance(spec, dict):
                raise ConstraintError(f"json_schema must be a JSON object, got {type(spec).__name__}")
            return LLMatcher.grammar_from_json_schema(spec, defaults=JSON_DEFAULTS)
        if kind == "choice":
            return grammar_from("choice", json.dumps(list(spec)))
        return LLMatcher.grammar_from_regex(spec) if kind == "regex" else grammar_from("grammar", spec)


_one_line = one_line


class GrammarVocabulary:
    """llguidance's view of one program's tokenizer (built once per program: ~0.1-1 s), and the guard that
    compiles a client's grammar in a bounded worker process before this process does (grammar_guard.py)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 limits: GrammarLimits | None = None):
        from llguidance import LLTokenizer

        if not eos_token_ids:
            raise ConstraintError("structured output needs an end-of-sequence token, and this program has none")
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        self.limits = limits or GrammarLimits()
        self.limits.check()
        self.tokenizer = LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids))
        self.checker = GrammarChecker(tokenizer_json, vocab_size, eos_token_ids, self.limits)

    def compile(self, constraint: Constraint) -> str:
        """The grammar of `constraint`, within the limits and proven to compile (and to allow something) in a
        worker process; ConstraintError names the problem in one line. Blocking: call it off an event loop."""
        grammar = constraint.grammar(self.limits)
        try:
            self.checker.check(grammar)
        except ConstraintError as exc:
            raise ConstraintError(f"invalid {constraint.kind}: {exc}") from None
        return grammar

    def matchers(self, constraint: Constraint, count: int = 1) -> list["Matcher"]:
        """`count` fresh grammar states (one per sequence) for `constraint`: compiled once, on a big stack,
        after the worker proved it safe, then copied (a copy shares the compiled grammar)."""
        grammar = self.compile(constraint)
        first = on_big_stack(Matcher, self, grammar)
        return [first] + [first.copy() for _ in range(count - 1)]

    def matcher(self, constraint: Constraint) -> "Matcher":
        return self.matchers(constraint, 1)[0]

    def close(self) -> None:
        self.checker.close()


class Matcher:
    """One sequence's grammar state: `mask()` for the next token, `advance(token)` with the one sampled.
    Build it through GrammarVocabulary.matchers (which proves the grammar safe first), not directly."""

    def __init__(self, vocab: GrammarVocabulary | None, grammar: str | None, _matcher=None, _words: int = 0):
        from llguidance import LLMatcher

        if _matcher is not None:
            self.words, self._m = _words, _matcher
            return
        self.words = vocab.words
        self._m = LLMatcher(vocab.tokenizer, grammar, log_level=0, limits=parser_limits(vocab.limits.max_choices))
        self._check("the grammar")

    def copy(self) -> "Matcher":
        return Matcher(None, None, _matcher=self._m.deep_copy(), _words=self.words)

    def _check(self, what: str) -> None:
        if self._m.is_error():
            raise ConstraintError(f"{what}: {_one_line(self._m.get_error())}")

    def mask(self, out: np.ndarray | None = None) -> np.ndarray:
        """The packed bitmask ([ceil(V/32)] int32) of the tokens the grammar allows next."""
        out = np.empty(self.words, dtype=np.int32) if out is None else out
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        self._check("computing the mask")
        return out

    def advance(self, token: int) -> None:
        if not self._m.consume_token(int(token)):
            raise ConstraintError(f"the grammar rejected token {token}: {_one_line(self._m.get_error())}")

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many leading tokens of `tokens` the grammar accepts from here (the state is unchanged)."""
        return int(self._m.validate_tokens([int(t) for t in tokens])) if tokens else 0

    def masks_along(self, tokens: list[int]) -> np.ndarray:
        """[len(tokens) + 1, words]: the mask now and after each of `tokens` (all accepted: valid_prefix),
        a draft-verifying call's per-position masks; the state is left as it was (the drafts go through a copy:
        llguidance's rollback does not restore a matcher that a drafted end-of-sequence token stopped)."""
        out = np.empty((len(tokens) + 1, self.words), dtype=np.int32)
        self.mask(out[0])
        ahead = self.copy() if tokens else self
        for i, token in enumerate(tokens):
            ahead.advance(token)
            ahead.mask(out[i + 1])
        return out

    @property
    def accepting(self) -> bool:
        """The output so far is complete (EOS would be allowed)."""
        return self._m.is_accepting()


def fill_masks(matchers: list[Matcher | None], words: int) -> np.ndarray:
    """[rows, words] int32: each constrained row's mask, all ones (unconstrained) elsewhere; the rows'
    masks are computed in parallel by llguidance's executor, without the GIL."""
    from llguidance import LLExecutor

    out = np.full((len(matchers), words), -1, dtype=np.int32)
    constrained = [i for i, m in enumerate(matchers) if m is not None]
    if len(constrained) == 1:  # one row: its own mask(out), no executor (any object with Matcher's mask works)
        matchers[constrained[0]].mask(out[constrained[0]])
    elif constrained:
        rows = [(matchers[i]._m, i) for i in constrained]
        global _EXECUTOR
        if _EXECUTOR is None:
            _EXECUTOR = LLExecutor()
        _EXECUTOR.unsafe_compute_mask_ptr(rows, out.ctypes.data, words * 4, len(matchers))
        for i, m in enumerate(matchers):
            if m is not None:
                m._check("computing the mask")
    return out


_EXECUTOR = None


def vocabulary_for(pte, meta, limits: GrammarLimits | None = None) -> GrammarVocabulary:
    """The program's GrammarVocabulary, from the tokenizer.json inside it; ConstraintError when the program
    has no mask input or no tokenizer.json."""
    from backends.mlx.llm.decoder.tokenizer_files import tokenizer_json

    if not meta.config.allowed_mask:
        raise ConstraintError(EXPORT_HINT)
    text = tokenizer_json(pte, meta)
    if text is None:
        raise ConstraintError("structured output needs the program's tokenizer (a tokenizer.json), and it has none")
    return GrammarVocabulary(text, meta.vocab_size, meta.eos_token_ids, limits)


class ProgramGrammar:
    """Grammar states for the sequences of a program (its holder has `pte` and `meta`): the decode loops,
    and the server's GrammarCompiler."""

    pte: object
    meta: object
    _vocabulary: GrammarVocabulary | None = None

    def vocabulary(self, limits: GrammarLimits | None = None) -> GrammarVocabulary:
        """The program's GrammarVocabulary, built on first use; ConstraintError for a program exported without
        the mask input, or pipelined (the next call's mask would need the token the device has not returned)."""
        from backends.mlx.llm.decoder.meta import PIPELINED_HINT

        if not self.meta.config.allowed_mask or self.pte is None:
            raise ConstraintError(EXPORT_HINT)
        if self.meta.pipelined:
            raise ConstraintError(PIPELINED_HINT)
        if self._vocabulary is None:
            self._vocabulary = vocabulary_for(self.pte, self.meta, limits)
        return self._vocabulary

    def matcher(self, constraint: Constraint) -> Matcher:
        """A fresh grammar state for one sequence; ConstraintError names a bad constraint, or a program that
        cannot constrain (vocabulary()), before anything is decoded."""
        return self.vocabulary().matcher(constraint)
