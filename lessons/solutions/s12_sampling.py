"""Lesson 12's solution: top-p (nucleus) filtering of a batch of logits."""

import torch


def top_p_filter(logits, top_p):
    """logits (rows, vocab) float; top_p one float per row. Keep, in each row, the smallest set of most likely
    tokens whose probability reaches top_p: a token stays if the mass of the tokens more likely than it is below
    top_p (so the most likely token always stays). The others get -inf. Returns a new (rows, vocab) tensor."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)           # (rows, vocab), most likely first
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs                            # mass of the more likely tokens
    p = torch.tensor(top_p, dtype=probs.dtype, device=logits.device)[:, None]
    sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)    # back to vocabulary order
