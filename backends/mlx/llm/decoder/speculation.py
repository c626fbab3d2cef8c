"""The options of speculative decoding as callers give them, and its tokens in the plain loop's step shape.

`etmlx generate`, `etmlx chat` and the Python API (`etmlx.generate(..., prediction=..., draft=...,
num_draft_tokens=...)`) all build a Speculation here: a draft source (draft_sources.py, or a draft model:
draft_model.py) and the most drafts per call, checked against the program's K. text_generation.stream_text then decodes through it as it does
through the plain loop, so the text, stop strings and prompt cache work the same on both.

load_decoder opens a program with the loop that drives it: SpeculativeDecoder for a --draft-tokens program,
else the plain Decoder.
"""

from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from backends.mlx.llm.decoder.draft_model import DraftModel, check_vocabulary
from backends.mlx.llm.decoder.draft_sources import DraftBudget, NgramDraft, PredictionDraft
from backends.mlx.llm.decoder.loop import Decoder, Step
from backends.mlx.llm.decoder.meta import DecoderMeta
from backends.mlx.llm.decoder.speculative import SpeculativeDecoder
from backends.mlx.llm.distributed.launch import group_rank
from backends.mlx.llm.distributed.rank_files import rank_file

DRAFTS = ("ngram", "none")  # `draft=` / --draft: prompt lookup, or no drafts
PLAIN_HINT = "needs a program exported with --draft-tokens K"


def load_decoder(pte: Path, prefill_step_size: int | None = None) -> Decoder | SpeculativeDecoder:
    """The program's decoder; `prefill_step_size`: Decoder's (a draft-verifying program prefills whole)."""
    pte = Path(pte)
    if not pte.is_file():
        raise FileNotFoundError(f"{pte} does not exist")
    meta = DecoderMeta.load(pte)
    if meta.ranks > 1 and meta.rank == 0:  # a tensor-parallel program: this process's rank's file (under mlx.launch)
        pte = rank_file(pte, group_rank())
    return SpeculativeDecoder(pte, meta) if meta.draft_tokens else Decoder(pte, prefill_step_size)


@dataclass
class Speculation:
    source: object | None  # a draft source (draft_sources.py); None: no drafts
    max_drafts: int  # at most this many drafts per call (0..the program's K)

    def steps(self, decoder, prompt_ids, max_tokens: int, params=None, constraint=None,
              reuse: bool = False) -> Iterator[Step]:
        """`decoder` (a SpeculativeDecoder)'s tokens as Decoder.stream yields them."""
        source = self.source if self.max_drafts else None
        with closing(decoder.stream(prompt_ids, max_tokens, params, source, budget=DraftBudget(max(self.max_drafts, 1)),
                                    reuse=reuse, constraint=constraint)) as tokens:
            for token in tokens:
                yield Step(token)


def prediction_ids(tokenizer, prediction) -> list[int]:
    """A predicted output as token ids: text through the tokenizer (no BOS: it is output, not a prompt), or ids."""
    if isinstance(prediction, str):
        if tokenizer is None:
            raise ValueError("a text prediction needs the program's tokenizer: give token ids instead")
        return list(tokenizer.encode(prediction, add_special_tokens=False))
    if isinstance(prediction, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prediction):
        return list(prediction)
    raise TypeError("prediction must be text or a list of token ids")


def speculation(decoder, prediction=None, draft: str | None = None, num_draft_tokens: int | None = None,
                flags: bool = False, draft_model=None, draft_model_cost: float | None = None) -> Speculation | None:
    """The source and draft count asked for on `decoder`'s program (meta.draft_tokens K); defaults: prompt lookup,
    K drafts per call. A plain program (K = 0) gives None, and refuses any option with a one-line ValueError
    (`flags`: errors name the options as the CLI's flags). `draft_model`: a plain .pte with the program's
    vocabulary (or a DraftModel, whose row cache then carries over between calls) proposes the drafts;
    `draft_model_cost`: its call's time over a target call's, fixed (default: measured; DraftModel's `cost`)."""
    def name(option: str) -> str:
        return "--" + option.replace("_", "-") if flags else option

    k_max = decoder.meta.draft_tokens
    if not k_max:
        given = [name(option) for option, value in (("prediction", prediction), ("draft", draft),
                                                    ("num_draft_tokens", num_draft_tokens),
                                                    ("draft_model", draft_model),
                                                    ("draft_model_cost", draft_model_cost)) if value is not None]
        if given:
            raise ValueError(f"{' and '.join(given)} {PLAIN_HINT}; {decoder.pte} verifies no drafts")
        return None
    if draft is not None and draft not in DRAFTS:
        raise ValueError(f"{name('draft')} must be one of {', '.join(DRAFTS)}, got {draft!r}")
    sources = [name(option) for option, value in (("prediction", prediction), ("draft", draft),
                                                   ("draft_model", draft_model)) if value is not None]
    if len(sources) > 1:
        raise ValueError(f"give {' or '.join(sources)}, not {'both' if len(sources) == 2 else 'more than one'}: "
                         "each is a draft source")
    k = k_max if num_draft_tokens is None else num_draft_tokens
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= k_max:
        raise ValueError(f"{name('num_draft_tokens')} must be 0..{k_max} (the program's --draft-tokens), got {k!r}")
    if draft_model_cost is not None and (draft_model is None or isinstance(draft_model, DraftModel)):
        raise ValueError(f"{name('draft_model_cost')} needs {name('draft_model')} given as a .pte path")
    if draft_model is not None:
        if not isinstance(draft_model, DraftModel):
            draft_model = DraftModel(Path(draft_model), target=decoder, cost=draft_model_cost)
        else:
            check_vocabulary(draft_model.meta.vocab_size, draft_model.pte, decoder.meta.vocab_size, decoder.pte)
        return Speculation(draft_model, k)
    if prediction is not None:
        tokenizer = decoder.tokenizer if decoder.has_tokenizer else None
        ids = prediction_ids(tokenizer, prediction)
        if any(not 0 <= t < decoder.meta.vocab_size for t in ids):  # drafts are fed to the model's embedding
            raise ValueError(f"prediction token ids must be in [0, {decoder.meta.vocab_size})")
        return Speculation(PredictionDraft(ids), k)
    return Speculation(NgramDraft() if draft in (None, "ngram") else None, k)
