"""Lesson 09's solution: the deltas a stream sends, with text held back while it could still become a stop string."""


def stream_deltas(pieces, stop):
    """The text each step's output carries (RequestOutputKind.DELTA), given `pieces`, the new text of each step's
    token (from the detokenizer), and the stop strings `stop`. The last `max(len(s) for s in stop) - 1` characters
    wait until the next piece shows whether a stop string starts there; a stop string ends the stream just before
    it; the last piece sends everything still held back."""
    hold = max((len(s) for s in stop), default=1) - 1
    deltas, pending = [], ""
    for i, piece in enumerate(pieces):
        window = pending + piece
        hits = [window.find(s) for s in stop if s in window]
        if hits:                                            # the earliest stop string in the text ends it
            deltas.append(window[:min(hits)])
            return deltas
        cut = len(window) if i == len(pieces) - 1 else max(len(window) - hold, 0)
        deltas.append(window[:cut])
        pending = window[cut:]
    return deltas
