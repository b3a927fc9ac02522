"""Logprobs of the sampled tokens (vLLM's `SamplingParams.logprobs`): what the model thought of each token.

Owns: turning one step's logits into, per row that asks, the sampled token's log-probability and rank and the
`k` most likely tokens. Values are the model's own log-softmax, before any penalty, temperature or top-k/top-p
(vLLM's default, "raw logprobs"), so they say what the model predicted, not what the sampler did with it.

    logits (rows, vocab) -> log_softmax -> sampled token: logprob, rank (1 = most likely)
                                        -> top k: ids, logprobs (ranks 1..k)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SampleLogprobs:
    """One row: the sampled token first, then the top k (which may include it again)."""
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]


def compute_logprobs(logits: torch.Tensor, sampled: list[int],
                     num_logprobs: list[int | None]) -> list[SampleLogprobs | None]:
    """For each row whose request asked (num_logprobs[i] is not None), its SampleLogprobs; None elsewhere."""
    rows = [i for i, k in enumerate(num_logprobs) if k is not None]
    result: list[SampleLogprobs | None] = [None] * len(sampled)
    if not rows:
        return result
    device = logits.device
    lp = logits[rows].float().log_softmax(dim=-1)                                  # (len(rows), vocab)
    tokens = torch.tensor([sampled[i] for i in rows], device=device)
    chosen = lp.gather(1, tokens[:, None])                                         # (len(rows), 1)
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    k = max(num_logprobs[i] for i in rows)
    top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], lp[:, :0].long())   # (len(rows), k)
    chosen, top_lp, top_ids = chosen[:, 0].tolist(), top_lp.tolist(), top_ids.tolist()
    for j, i in enumerate(rows):
        n = num_logprobs[i]
        result[i] = SampleLogprobs([sampled[i]] + top_ids[j][:n], [chosen[j]] + top_lp[j][:n],
                                   [ranks[j]] + list(range(1, n + 1)))
    return result
