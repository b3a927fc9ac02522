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
