r"""Incremental detokenization and stop strings.

Owns: turning a request's output token ids into text as they arrive. Decoding one token at a time is
wrong for byte-level BPE (a character can span tokens) and for tokenizers that merge spaces, so we
decode a short window twice, with and without the new tokens, and emit only the difference, holding
text back while it ends in an incomplete character (U+FFFD).

    output ids: [ ......... | prefix_offset ... read_offset | new ... ]
                               \_ context already emitted _/ \_ to emit _/
"""

from __future__ import annotations

from dataclasses import dataclass


class RustDecoder:
    """`tokenizer.decode` without transformers' Python around it: the Rust tokenizer's own decode.

    A step detokenizes every running request twice, so at batch 256 transformers' wrapper (its input checks
    and keyword handling: about 2.5 us of a 3.4 us call here, the Rust decode 0.8 us) costs milliseconds per
    step, which on a GPU is time the GPU waits. `fast_decoder` hands this out only where the text is the same (see there).
    """

    def __init__(self, tokenizer):
        self._decode = tokenizer.backend_tokenizer.decode

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._decode(token_ids, skip_special_tokens=skip_special_tokens)


def fast_decoder(tokenizer):
    """A RustDecoder for a transformers fast tokenizer whose decode is exactly the Rust one's, else `tokenizer`.

    Exactly: the class keeps the fast base class's decode (no model-specific override) and does not clean up
    spaces after decoding (clean_up_tokenization_spaces, a Python pass over the text)."""
    cls = type(tokenizer)
    base = next((c for c in cls.__mro__ if "backend_tokenizer" in c.__dict__), None)   # the fast base class
    if (base is None or getattr(tokenizer, "clean_up_tokenization_spaces", True)
            or getattr(cls, "decode", None) is not getattr(base, "decode", None)
            or getattr(cls, "_decode", None) is not getattr(base, "_decode", None)):
        return tokenizer
    return RustDecoder(tokenizer)


@dataclass(frozen=True)
class DetokState:
    prefix_offset: int = 0
    read_offset: int = 0


def detokenize_incrementally(tokenizer, token_ids: list[int], state: DetokState,
                             skip_special_tokens: bool = True) -> tuple[str, DetokState]:
    """New text for the tokens appended since `state` (may be "" while a character is incomplete), and the
    state after them. Pure: `state` is not changed, so a step that fails later leaves nothing to undo."""
    prefix = tokenizer.decode(token_ids[state.prefix_offset:state.read_offset],
                              skip_special_tokens=skip_special_tokens)
    full = tokenizer.decode(token_ids[state.prefix_offset:], skip_special_tokens=skip_special_tokens)
    if len(full) > len(prefix) and not full.endswith("\ufffd"):
        return full[len(prefix):], DetokState(state.read_offset, len(token_ids))
    return "", state


def find_stop_string(text: str, new_text_len: int, stop: list[str]) -> tuple[str, int] | None:
    """The first stop string that the latest text completed, and where it starts; None if none did.

    Only the tail that could contain a stop string touching the new text is searched.
    """
    best: tuple[str, int] | None = None
    for s in stop:
        start = max(0, len(text) - new_text_len - len(s) + 1)
        i = text.find(s, start)
        if i != -1 and (best is None or i < best[1]):
            best = (s, i)
    return best
