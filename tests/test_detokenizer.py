"""Incremental detokenization gives exactly the text of decoding everything at once."""

from __future__ import annotations

import random

import pytest

from minivllm.engine.output_processor import (DetokState, RustDecoder, detokenize_incrementally, fast_decoder,
                                         find_stop_string)


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


def test_the_fast_decoder_gives_tokenizer_decodes_text(tokenizer):
    """The output processor's decoder (the Rust tokenizer's own decode) equals tokenizer.decode, special tokens
    and incomplete characters included, with and without skip_special_tokens."""
    fast = fast_decoder(tokenizer)
    assert isinstance(fast, RustDecoder)                  # it fired: the default model's tokenizer qualifies
    rng = random.Random(1)
    special = tokenizer.all_special_ids
    for _ in range(200):
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tokenizer))
               for _ in range(rng.randrange(0, 12))]
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    text = "Ünïcödé 日本語 🎉 and  spaces\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces, state = [], DetokState()
    for i in range(1, len(ids) + 1):
        piece, state = detokenize_incrementally(fast, ids[:i], state)
        pieces.append(piece)
    assert "".join(pieces) == text


def test_the_fast_decoder_keeps_tokenizer_decode_where_the_text_could_differ(tokenizer):
    """Space clean-up after decoding, or a class with its own decode: the tokenizer's decode stays."""
    import copy

    cleaned = copy.copy(tokenizer)
    cleaned.clean_up_tokenization_spaces = True
    assert fast_decoder(cleaned) is cleaned

    class OwnDecode(type(tokenizer)):
        def decode(self, *args, **kwargs):
            return super().decode(*args, **kwargs).upper()

    own = copy.copy(tokenizer)
    own.__class__ = OwnDecode
    assert fast_decoder(own) is own
    assert fast_decoder(None) is None                     # no tokenizer (token ids in and out)
