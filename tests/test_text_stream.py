"""Streamed detokenization is exact for multi-byte characters, and stop strings cut the stream exactly."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from backends.mlx.llm.decoder.text_stream import IncrementalDetokenizer, StopStrings

TEXT = "Zoë a mangé une crème brûlée 🍮 à Köln — 東京 にいます. Plain ascii words too."


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A tiny vocabulary: most non-ASCII characters stay split across several byte tokens.
    tok.train_from_iterator(["plain ascii words", "a mangé une"] * 20,
                            trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_streamed_pieces_concatenate_to_the_text_and_are_whole_characters(tokenizer):
    ids = tokenizer(TEXT)["input_ids"]
    assert len(ids) > len(TEXT.encode()) // 3  # the test needs characters split over several tokens
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == TEXT
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some tokens were held back mid-character


def test_prompt_context_keeps_the_first_generated_piece_right(tokenizer):
    prompt, completion = tokenizer("Plain ascii")["input_ids"], tokenizer(" words too")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(detok.add(t) for t in completion) + detok.flush() == " words too"


def test_stop_strings_cut_before_the_stop_even_across_pieces():
    stop = StopStrings(["END", "\n\n"])
    out = [stop.feed(p) for p in ["abc E", "N", "xE", "ND tail"]]
    assert "".join(out) == "abc ENx" and stop.stopped  # "abc ENxEND tail" cut at END
    assert out[0] == "abc "  # "E" held back: it may start "END"
    assert stop.feed("more") == "" and stop.flush() == ""


def test_text_without_stop_is_passed_through_completely():
    stop = StopStrings(["</s>"])
    out = "".join(stop.feed(p) for p in ["a <", "/b", "> <", "/"]) + stop.flush()
    assert out == "a </b> </" and not stop.stopped


def test_bad_stop_strings_are_rejected():
    with pytest.raises(ValueError, match="non-empty"):
        StopStrings(["ok", ""])
