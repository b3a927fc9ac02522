"""RejectionSampler: exact verification of speculative drafts (vLLM v1's `v1/sample/rejection_sampler.py`).

Owns: turning the target model's logits at a request's draft positions into the tokens the step keeps. A request
with k drafts d1..dk has k + 1 rows of logits: row j (0-based) is the target's prediction after the last token
and d1..dj, so it checks d(j+1); the last row predicts the token after dk.

    greedy:    accept d(j+1) while it equals argmax(row j); the first mismatch is replaced by that argmax;
               all k accepted: one more token, argmax(row k) (the "bonus" token).
    sampling:  p_j = the target's distribution at row j (temperature, min-p, top-k, top-p: the sampler's own),
               q_j = the draft's (n-gram drafts are certain: q_j is all on d(j+1)).
               accept d(j+1) with probability min(1, p_j(d) / q_j(d)); at the first rejection, draw from the
               residual max(p_j - q_j, 0), renormalised, and stop; all accepted: the bonus token from p_k.

The sampling rule makes every kept token follow exactly the target's distribution (Leviathan et al. 2023, Chen et
al. 2023): P(token = x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) * max(p(x) - q(x), 0) / Z = p(x).
So speculation changes the cost of decoding, never its output distribution (and greedy output not at all).
Requests whose logits processing depends on the tokens before it (penalties, bad_words, min_tokens) get no drafts
(spec_decode.propose_drafts), so the rows here need only the position-independent part of the sampler.
"""

from __future__ import annotations

import torch

from minivllm.core.request import Request
from minivllm.worker.sampler import Sampler, draw_from, sampling_probs


class RejectionSampler:
    def __init__(self, sampler: Sampler):
        self.sampler = sampler            # its generators: a seeded request draws from its own

    def __call__(self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]],
                 draft_probs: list[torch.Tensor | None] | None = None) -> list[list[int]]:
        """logits (sum(1 + len(d) for d in drafts), vocab) fp32, each request's rows in order; drafts[i] the draft
        tokens of requests[i]; draft_probs[i] (len(drafts[i]), vocab) the draft model's distributions, or None for
        certain (n-gram) drafts. Returns each request's kept tokens: its accepted drafts and one more."""
        params = [r.sampling_params for r, d in zip(requests, drafts) for _ in range(len(d) + 1)]
        target_argmax = logits.argmax(dim=-1).tolist()                       # (rows,)
        probs = None
        if not all(p.greedy for p in params):
            probs = sampling_probs(logits, params)                            # (rows, vocab)
        out, row = [], 0
        for i, (req, d) in enumerate(zip(requests, drafts)):
            k = len(d)
            if req.sampling_params.greedy:
                kept = self._greedy(d, target_argmax[row:row + k + 1])
            else:
                q = draft_probs[i] if draft_probs is not None else None
                kept = self._sample(req, d, probs[row:row + k + 1], q)
            out.append(kept)
            row += k + 1
        return out

    @staticmethod
    def _greedy(drafts: list[int], argmax: list[int]) -> list[int]:
        kept = []
        for j, token in enumerate(drafts):
            if token != argmax[j]:
                break
            kept.append(token)
        return kept + [argmax[len(kept)]]

    def _sample(self, req: Request, drafts: list[int], p: torch.Tensor, q: torch.Tensor | None) -> list[int]:
        """p (k + 1, vocab) the target's distributions, q (k, vocab) the draft's or None (certain drafts)."""
        k, device = len(drafts), p.device
        generator = self.sampler.generator_for(req, device)
        d = torch.tensor(drafts, device=device)
        p_d = p[torch.arange(k, device=device), d]                                 # p_j(d_j), (k,)
        q_d = torch.ones_like(p_d) if q is None else q[torch.arange(k, device=device), d]
        u = torch.rand(k, generator=generator, device=device)
        accept = (u * q_d < p_d).tolist()                                        # u < p/q without dividing by 0
        kept = []
        for j in range(k):
            if not accept[j]:
                if q is None:
                    residual = p[j].clone()
                    residual[drafts[j]] = 0.0                                      # max(p - onehot, 0) off d_j
                else:
                    residual = (p[j] - q[j]).clamp_min(0.0)
                return kept + [self._draw(residual, generator)]
            kept.append(drafts[j])
        return kept + [self._draw(p[k], generator)]                              # every draft accepted: a bonus

    @staticmethod
    def _draw(weights: torch.Tensor, generator: torch.Generator) -> int:
        """One draw from `weights` (vocab,), unnormalised, as the sampler draws (its inverse CDF)."""
        u = torch.rand(1, dtype=torch.float64, device=weights.device, generator=generator)
        return int(draw_from(weights[None], u)[0])
