"""Lesson 13's solution: the n-gram (prompt lookup) proposer."""


def ngram_propose(token_ids, k, min_n, max_n):
    """Up to k draft tokens to follow `token_ids`: for n from max_n down to min_n, find the latest earlier
    occurrence of the last n tokens (one that starts before them) and propose the tokens that followed it."""
    for n in range(min(max_n, len(token_ids) - 1), min_n - 1, -1):
        suffix = token_ids[-n:]
        for start in range(len(token_ids) - n - 1, -1, -1):       # latest first; the suffix itself excluded
            if token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []
