"""NgramProposer: draft tokens by prompt lookup (vLLM's `ngram` method), on the CPU, from the request's own tokens.

Owns: nothing but its settings. For each request it looks for the last n tokens (n from prompt_lookup_max down to
prompt_lookup_min) earlier in the request's prompt and output, and proposes the k tokens that followed the latest
such occurrence. Text that repeats or edits its prompt (code changes, summaries quoting the source, "say it again")
is full of such matches; free text has few, and then nothing is proposed and the step is a plain decode.

    tokens:  ... the cat sat on the mat . the cat sat on [?]
                 \\_____ match of "the cat sat on" _____/   propose: "the mat ." (k = 3)
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def observe(self, model_input) -> None:
        """Nothing to do: n-gram lookup needs no state beyond the requests' own tokens."""

    def propose_batch(self, requests: list, room: list[int]) -> list[list[int]]:
        """Drafts for each request (at most room[i] tokens): a lookup in its own prompt and output."""
        return [self.propose(req.all_token_ids, r) for req, r in zip(requests, room)]

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to min(k, max_tokens) draft tokens to follow `token_ids`; [] when no n-gram matches."""
        k = self.k if max_tokens is None else min(self.k, max_tokens)
        if k <= 0 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            suffix = tokens[-n:]
            # Every window of n tokens that starts before the suffix itself: (len - n, n).
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n                 # the tokens after the latest earlier occurrence
                return tokens[start:start + k].tolist()
        return []

