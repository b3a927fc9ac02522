"""Incremental detokenization gives exactly the text of decoding everything at once."""

from __future__ import annotations

import random

import pytest

from minivllm.engine.detokenizer import DetokState, detokenize_incrementally, find_stop_string


@pytest.mark.parametrize("text", [
    "Plain ASCII text, with punctuation!",
    "Ünïcödé çharacters: 日本語のテキスト, emoji 🎉🚀 and accents: café",
    "  leading spaces\n\ttabs and\nnew lines  ",
])
def test_incremental_equals_full_decode(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    state, pieces = DetokState(), []
    for i in range(1, len(ids) + 1):
        piece, state = detokenize_incrementally(tokenizer, ids[:i], state)
        pieces.append(piece)
    assert "".join(pieces) == tokenizer.decode(ids)


def test_random_token_streams_emit_a_prefix_of_the_full_text(tokenizer):
    """Random byte-level tokens may end mid-character: only such an incomplete tail may be held back."""
    rng = random.Random(0)
    for _ in range(5):
        ids = [rng.randrange(100, 49000) for _ in range(40)]
        state, text = DetokState(), ""
        for i in range(1, len(ids) + 1):
            piece, state = detokenize_incrementally(tokenizer, ids[:i], state)
            text += piece
        full = tokenizer.decode(ids)
        assert full.startswith(text)
        assert text == full or full.endswith("\ufffd")


def test_find_stop_string_only_looks_at_new_text():
    assert find_stop_string("abc STOP def", 4, ["STOP"]) is None          # completed earlier
    assert find_stop_string("abc STO", 3, ["STOP"]) is None
    assert find_stop_string("abc STOP", 1, ["STOP"]) == ("STOP", 4)       # the last char completed it
    assert find_stop_string("x END y STOP", 8, ["STOP", "END"]) == ("END", 2)
