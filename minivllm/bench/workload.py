"""The offline workload, and how a run of it is measured.

Owns: the seeded synthetic requests both engines run (`Workload`: nano-vllm's workload, N requests of
random token ids, prompt lengths U[a, b], output lengths U[c, d]), what one engine did with them
(`ThroughputResult`, `LatencyResult`), and `percentile`, which every benchmark mode reports with.
Throughput counts only the tokens requests asked for: HF's static batches run every row to the longest
request of the batch, and those extra tokens are waste.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from minivllm.core.sampling_params import SamplingParams

# Random prompt ids are drawn from [TOKEN_ID_LOW, min(TOKEN_ID_HIGH, vocab_size)): SmolLM2's special
# tokens sit at the bottom of its vocabulary, and the top is left alone for checkpoints with added tokens.
TOKEN_ID_LOW = 100
TOKEN_ID_HIGH = 49_000


def greedy_params(max_tokens: int) -> SamplingParams:
    """What every benchmark request asks for: greedy (both engines do the same work) and ignore_eos (it
    produces exactly max_tokens tokens)."""
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)


@dataclass(frozen=True)
class Workload:
    """The requests both engines run: prompt_token_ids[i] asks for exactly output_lens[i] tokens."""
    prompt_token_ids: list[list[int]]
    output_lens: list[int]
    seed: int

    @classmethod
    def random(cls, num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
               vocab_size: int, seed: int = 0) -> "Workload":
        rng = random.Random(seed)
        low, high = TOKEN_ID_LOW, min(TOKEN_ID_HIGH, vocab_size)
        if high <= low:                                   # a toy vocabulary: use all of it
            low = 0
        prompts, outs = [], []
        for _ in range(num_requests):
            n = rng.randint(*input_len)                    # randint is inclusive at both ends: U[a, b]
            prompts.append([rng.randrange(low, high) for _ in range(n)])
            outs.append(rng.randint(*output_len))
        return cls(prompts, outs, seed)

    @property
    def num_requests(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class ThroughputResult:
    """One engine's run over a workload. `output_tokens_per_request[i]` counts useful tokens only."""
    engine: str
    wall_s: float
    output_tokens_per_request: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_tokens_per_request)

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.wall_s


@dataclass
class LatencyResult:
    """Per-request latencies from RequestOutput.metrics, in seconds.

    TTFT counts from arrival, so it includes the time a request waited in the queue (all requests of
    an offline run arrive at once). TPOT is the mean gap between a request's later tokens.
    """
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks, as numpy's default."""
    if not values:
        return float("nan")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
