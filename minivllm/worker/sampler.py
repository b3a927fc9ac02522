"""Sampler: one token per row of logits, each row with its own SamplingParams.

Owns: temperature, top-k, top-p and the random draw. It reads `request.sampling_params` and, for
seeded requests, advances `request.generator`; it changes nothing else.

Sampling uses the "exponential race": argmax(probs / E) with E ~ Exp(1) per token is an exact draw
from `probs`. A seeded request draws its E from its own generator, so its tokens do not depend on
what else is in the batch; unseeded rows share the engine's generator.
"""

from __future__ import annotations

import torch

from minivllm.core.request import Request


class Sampler:
    def __init__(self, seed: int = 0):
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)   # for requests without their own seed

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if self.generator.device != device:       # first draw on a GPU: a generator there, same seed
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    @staticmethod
    def _request_generator(request: Request, device: torch.device) -> torch.Generator:
        if request.generator.device != device:    # requests start with a CPU generator (request.py)
            request.generator = torch.Generator(device=device).manual_seed(request.sampling_params.seed)
        return request.generator

    def get_rng_state(self, requests: list[Request]) -> list[tuple[object, torch.Generator, torch.Tensor]]:
        """The random state this step may consume: the shared generator and every seeded request's. A failed step
        puts it back (`set_rng_state`), so its retry draws what the step would have drawn."""
        holders = [self] + [r for r in requests if r.generator is not None]
        return [(h, h.generator, h.generator.get_state()) for h in holders]

    @staticmethod
    def set_rng_state(state: list[tuple[object, torch.Generator, torch.Tensor]]) -> None:
        for holder, generator, rng in state:
            generator.set_state(rng)
            holder.generator = generator

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        # logits (num_rows, vocab_size) fp32, one row per request that samples this step
        params = [r.sampling_params for r in requests]
        greedy = torch.tensor([p.greedy for p in params])
        if bool(greedy.all()):
            return logits.argmax(dim=-1).tolist()

        device = logits.device
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=device)
        logits = logits / temperature[:, None]
        top_k = [p.top_k for p in params]
        top_p = [p.top_p for p in params]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = apply_top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(dim=-1)                                      # (num_rows, vocab)

        # Exp(1) noise, drawn where the logits are (a GPU draws a whole vocabulary per row far faster than
        # a CPU, and nothing crosses the bus): per-request generators for seeded rows, the shared one otherwise.
        noise = torch.empty(probs.shape, dtype=torch.float32, device=device)
        shared = [i for i, r in enumerate(requests) if r.generator is None]
        if shared:
            noise[shared] = torch.empty(len(shared), probs.shape[1], device=device).exponential_(
                generator=self._shared_generator(device))
        for i, r in enumerate(requests):
            if r.generator is not None:
                noise[i].exponential_(generator=self._request_generator(r, device))
        sampled = (probs / noise).argmax(dim=-1)
        greedy_ids = logits.argmax(dim=-1)
        return torch.where(greedy.to(device), greedy_ids, sampled).tolist()


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Set logits outside each row's top-k / top-p set to -inf. top_k -1 and top_p 1.0 keep all."""
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)              # (rows, vocab)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    p = torch.tensor(top_p, device=logits.device, dtype=probs.dtype)
    mass_before = probs.cumsum(dim=-1) - probs            # mass of the more likely tokens
    drop |= mass_before >= p[:, None]                     # keep the smallest set reaching top_p (>= 1 token)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)
