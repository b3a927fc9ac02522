"""SpecDecodingStats: speculative decoding's counters, as vLLM v1 keeps them (`v1/spec_decode/metrics.py`).

Owns: how many verification steps had drafts, how many draft tokens were verified and accepted, and the accepted
ones by position. The scheduler observes each request's verification (Scheduler.update_from_output); /metrics and
the dashboard read the counts (engine_stats.py). The counters are journaled: a step that is rolled back moves none.
"""

from __future__ import annotations

from minivllm.core.journal import Journaled, StepJournal


class SpecDecodingStats(Journaled):
    JOURNALED = frozenset({"num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"})

    def __init__(self, journal: StepJournal | None = None) -> None:
        self.journal = journal
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.num_accepted_tokens_per_pos: list[int] = []

    def observe_draft(self, drafts: list[int], tokens: list[int]) -> int:
        """One request verified `drafts` and got `tokens` (the accepted drafts and one more): how many were accepted,
        counted as vLLM counts them: the leading tokens equal to the drafts (also past a stop)."""
        accepted = 0
        while accepted < min(len(drafts), len(tokens) - 1) and tokens[accepted] == drafts[accepted]:
            accepted += 1
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += accepted
        old = self.num_accepted_tokens_per_pos      # a new list: the journal keeps the old one
        padded = old + [0] * (len(drafts) - len(old))
        self.num_accepted_tokens_per_pos = [n + (i < accepted) for i, n in enumerate(padded)]
        return accepted
