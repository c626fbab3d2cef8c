"""The speculative-decoding flags of `etmlx generate` and `etmlx chat`, and what they ask for: a program exported
with --draft-tokens K decodes speculatively (llm/decoder/speculation.py, the Python API's path too) with the plain
program's tokens; drafts come from prompt lookup (`--draft ngram`, the default), a small draft program
(`--draft-model SMALL.pte`, llm/decoder/draft_model.py) or, for generate, a predicted output
(`--prediction TEXT|@FILE`). On a plain program the flags are a one-line error."""

from __future__ import annotations

from pathlib import Path


def add_draft_flags(parser, prediction: bool) -> None:
    parser.add_argument("--draft", choices=["ngram", "none"],
                        help="--draft-tokens programs: where drafts come from: prompt lookup over the prompt and "
                             "the output (default ngram), or none")
    if prediction:
        parser.add_argument("--prediction", metavar="TEXT|@FILE",
                            help="--draft-tokens programs: the expected output (Predicted Outputs), used as drafts; "
                                 "token ids with --prompt-ids")
    parser.add_argument("--draft-model", metavar="SMALL.pte",
                        help="--draft-tokens programs: a small plain program with the same vocabulary proposes "
                             "the drafts (greedy)")
    parser.add_argument("--draft-model-cost", type=float, metavar="C",
                        help="with --draft-model: a draft call's time over a target call's, fixed instead of "
                             "measured (reproducible draft counts)")
    parser.add_argument("--num-draft-tokens", type=int,
                        help="--draft-tokens programs: most drafts per call (default the program's K)")


def prediction_text(value: str) -> str:
    """--prediction TEXT, or @FILE for a file's contents."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text()
    except OSError as exc:
        raise ValueError(f"--prediction: cannot read {value[1:]}: {exc.strerror}") from None


def speculation_from_args(args, decoder):
    """The Speculation the flags ask for on `decoder` (None: a plain program, decoded by the plain loop)."""
    from backends.mlx.llm.decoder.speculation import speculation

    prediction = getattr(args, "prediction", None)
    if prediction is not None:
        prediction = prediction_text(prediction)  # @FILE read first, whatever the prompt is
        if getattr(args, "prompt_ids", None) is not None:
            try:  # with token-id prompts, a prediction is token ids too
                prediction = [int(t) for t in prediction.split(",") if t.strip()]
            except ValueError:
                raise ValueError("--prediction with --prompt-ids must be comma-separated token ids") from None
    return speculation(decoder, prediction, args.draft, args.num_draft_tokens, flags=True,
                       draft_model=args.draft_model, draft_model_cost=args.draft_model_cost)
