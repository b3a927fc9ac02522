r"""Request: one prompt's life inside the engine core (vLLM v1's `Request`).

Owns: the token ids (prompt + generated), how many of them have KV in the cache (`num_computed_tokens`),
the lifecycle status, and timing. Writers: the scheduler alone writes `status` and `num_computed_tokens` and appends
output tokens (in `update_from_output`); the KV cache manager alone writes `block_table`. Core state only: the text,
the detokenizer's offsets and what has been streamed live with the output processor (engine/output_processor.py).

    all_token_ids:  [ p0 p1 ... p(P-1) | o0 o1 ... ]      P = num_prompt_tokens
                      \_____ num_computed_tokens ____/\__ still to run through the model __/
    block_table[i] holds the KV of tokens [i*block_size, (i+1)*block_size).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from minivllm.core.journal import Journaled, journaled, journaled_fields
from minivllm.core.sampling_params import SamplingParams
from minivllm.core.structured_output import Grammar


class RequestStatus(enum.Enum):
    WAITING = "waiting"            # in the waiting queue, no KV yet
    RUNNING = "running"            # holds blocks, scheduled every step
    PREEMPTED = "preempted"        # KV dropped (recompute mode); back in the waiting queue
    SWAPPED = "swapped"            # KV copied to the CPU pool (swap mode); waiting to come back
    FINISHED_STOPPED = "finished_stopped"    # EOS, a stop token or a stop string
    FINISHED_LENGTH = "finished_length"      # max_tokens or max_model_len reached
    FINISHED_ABORTED = "finished_aborted"    # abort(request_id)
    FINISHED_ERROR = "finished_error"        # an error of its own (RequestFailedError); the others went on

    @property
    def finished(self) -> bool:
        return self.value.startswith("finished")

    @property
    def finish_reason(self) -> str | None:
        return {"finished_stopped": "stop", "finished_length": "length",
                "finished_aborted": "abort", "finished_error": "error"}.get(self.value)


class RequestFailedError(RuntimeError):
    """An error confined to one request (its grammar refused the token it sampled): the step is rolled back, that
    request ends with finish_reason "error" (vLLM's FINISHED_ERROR), and the rest of the batch goes on."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message)
        self.request_id = request_id


@dataclass
class RequestMetrics:
    """Wall-clock times (time.time()) in vLLM's names. Kept by the output processor (front-end state)."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(eq=False)
class Request(Journaled):
    # journaled(): assignments are undone if the step fails (journal.py); `journal` is set when the scheduler adds it.
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    priority: int = 0                     # lower runs first (vLLM's convention)
    arrival_time: float = field(default_factory=time.time)

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = journaled(RequestStatus.WAITING)
    num_computed_tokens: int = journaled(0)    # tokens whose KV is in the cache
    num_cached_tokens: int = journaled(0)      # of the prompt, how many came from the prefix cache (first schedule)
    block_table: list[int] = journaled(default_factory=list)   # physical block ids; only the KV cache manager writes it
    num_preemptions: int = journaled(0)
    stop_reason: int | str | None = journaled(None)   # the stop string or stop token that ended it
    generator: torch.Generator | None = None   # per-request RNG when sampling_params.seed is set
    bad_words_token_ids: list[list[int]] = field(default_factory=list)   # sampling_params.bad_words, tokenized
    grammar: Grammar | None = None        # structured output's matcher; the scheduler advances it (structured_output.py)
    spec_token_ids: list[int] = journaled(default_factory=list)   # speculative decoding: drafts for the next step
    mm_features: tuple = ()               # images: MultiModalFeature per image, by offset (multimodal/inputs.py)
    cache_salt: str | None = None         # a tenant's salt: its prefix-cache hits are its own (enters block 0's key)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)   # prompt + outputs, appended as we go
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def block_key(self, i: int, block_size: int) -> tuple:
        """Block i as the prefix cache names it: its token ids and, when it holds image tokens, (hash, offset in the
        image) of each such image, so that prompts with different images never share a block. With a cache_salt,
        block 0's key carries it, and through the hash chain so does every later block's (vLLM's rule)."""
        key = tuple(self.all_token_ids[i * block_size:(i + 1) * block_size])
        if i == 0 and self.cache_salt is not None:
            key += (("cache_salt", self.cache_salt),)
        if not self.mm_features:
            return key
        start, end = i * block_size, (i + 1) * block_size
        return key + tuple((f.mm_hash, start - f.offset) for f in self.mm_features if f.overlaps(start, end))

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def pop_output_token(self) -> None:
        """Undo of `append_output_token` (a rolled-back step)."""
        self.output_token_ids.pop()
        self.all_token_ids.pop()

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table})")


Request.JOURNALED = journaled_fields(Request)
