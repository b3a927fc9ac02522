"""ParentRequest: one prompt sampled n times (vLLM v1's `ParentRequest`, `SamplingParams.n > 1`).

Owns: the fan-out of one request into n child requests for the core, and which of them have finished. The core
never sees a parent: it schedules n ordinary requests with the same prompt. They share the prompt's KV blocks
through the prefix cache (admitted in the same step, the later children take the full blocks the first one is
computing; see kv_cache_manager.py), so the prompt is computed about once, and each child decodes on its own.
The output processor gathers the children's outputs into one RequestOutput with n CompletionOutputs.

    parent "7", n=3  ->  core requests "0_7", "1_7", "2_7"  (vLLM's child ids), seeds seed, seed+1, seed+2
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from minivllm.core.request import RequestMetrics
from minivllm.core.sampling_params import SamplingParams
from minivllm.outputs import CompletionOutput


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    metrics: RequestMetrics
    finished: set[int] = field(default_factory=set)                  # indexes of the children that finished
    latest: dict[int, CompletionOutput] = field(default_factory=dict)  # index -> its last full completion
    num_cached_tokens: int = 0

    @property
    def n(self) -> int:
        return self.sampling_params.n

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def child_ids(self) -> list[str]:
        return [f"{i}_{self.request_id}" for i in range(self.n)]

    def child_params(self, index: int) -> SamplingParams:
        """One sample's params: n=1, and a seed of its own (seed + index) so every sample is reproducible."""
        seed = None if self.sampling_params.seed is None else self.sampling_params.seed + index
        return dataclasses.replace(self.sampling_params, n=1, seed=seed)

    @property
    def is_finished(self) -> bool:
        return len(self.finished) == self.n
