"""What `LLM.generate` and the engine return, with vLLM's names and shapes.

With `SamplingParams(output_kind=RequestOutputKind.DELTA)` (streaming), `outputs[0].text` and `.token_ids` hold only
what is new since the request's previous output, as in vLLM; otherwise everything so far."""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.core.request import RequestMetrics


@dataclass(frozen=True)
class Logprob:
    """One token's log-probability (vLLM's name): its rank among the vocabulary (1 = most likely) and its text."""
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None      # "stop", "length", "abort", or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # With SamplingParams(logprobs=k): per output token, {token id: Logprob} for the sampled token and the top k
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None   # the sum of the sampled tokens' logprobs

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache
    # With SamplingParams(prompt_logprobs=k): None for the first prompt token, then per prompt token {token id:
    # Logprob} for the actual token and the top k. Complete in the first output that has output tokens (with
    # DELTA only there; with n > 1 once, on the request's output).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def __repr__(self) -> str:
        o = self.outputs[0]
        return (f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
                f"num_prompt_tokens={len(self.prompt_token_ids)}, text={o.text!r}, "
                f"num_output_tokens={len(o.token_ids)}, finish_reason={o.finish_reason!r}, "
                f"finished={self.finished})")
