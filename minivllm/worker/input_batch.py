"""One step's batch as it crosses the worker layer (vLLM v1's `v1/worker/gpu_input_batch.py`).

Owns: the plain data of a step, from its inputs to its sampled outputs: `ModelInput` (the flat batch as lists,
built by ModelRunner.prepare_inputs, pickled to the other ranks; `model/attention.py`'s `model_input_tensors` puts
them on a device) and `InFlightBatch` (a batch the executor sent in, with its logits and, under async scheduling,
the tokens sampled on the device), and the helpers the modes beyond the base step need (async scheduling's
`prev_token_inputs` and `copy_to_host`, speculative decoding's `first_rows`). It runs no model, samples nothing and
imports neither the runner, the executor nor a proposer, so all of them (and spec_decode's draft model) share it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from minivllm.core.request import Request
from minivllm.core.scheduler import SchedulerOutput
from minivllm.worker.logprobs import PromptLogprobsSpan, StepScores

# Structured output's masks (core/structured_output.py): (sampling requests, drafts by request id) ->
# (rows, ceil(vocab / 32)) int32 bitmask, or None when no request has a grammar.
GrammarBitmaskFn = Callable[[list[Request], dict[str, list[int]]], "torch.Tensor | None"]


@dataclass(frozen=True)
class ModelInput:
    """One step's inputs as plain lists. Rank 0 builds it from the SchedulerOutput; under tensor
    parallelism it is pickled to every other rank, and each rank turns it into tensors on its device."""
    input_ids: list[int]                       # (num_tokens,)
    positions: list[int]                       # (num_tokens,)
    slot_mapping: list[int]                    # (num_tokens,)
    q_lens: list[int]                          # (num_seqs,) new tokens per request
    seq_lens: list[int]                        # (num_seqs,) context after this step
    block_tables: list[list[int]]              # (num_seqs, max_blocks), padded with 0
    sample_rows: list[int]                     # rows of the flat batch whose logits are sampled (1 + drafts each)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)   # (device block, cpu block)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)    # (cpu block, device block)
    prompt_logprob_spans: list[PromptLogprobsSpan] = field(default_factory=list)   # rows scoring prompt tokens
    step_id: int = 0                           # which batch this is (the executor numbers them; for timelines)
    # Async scheduling: (row of input_ids, row of the previous batch's sampled tokens). Those input ids are the
    # tokens the previous batch samples, still on the device: the host writes 0 there and the device fills them in.
    prev_token_rows: list[tuple[int, int]] = field(default_factory=list)
    kv_connector_metadata: object = None       # KV transfer: blocks loaded before / saved after the forward
    mm: object = None                          # images: encoder_runner.MultiModalBatch; None for a text model


def prev_token_inputs(mi: ModelInput, prev_sampled: torch.Tensor, device: torch.device
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Async scheduling: (rows of input_ids, their tokens) to write on the device, from the previous batch's
    sampled tokens (num_sampling,) int64 on the device. Called only when some input comes from there
    (`mi.prev_token_rows`)."""
    rows, prev = zip(*mi.prev_token_rows)

    def t(x):
        return torch.tensor(x, dtype=torch.int64).to(device, non_blocking=True)
    return t(rows), prev_sampled.index_select(0, t(prev))


def first_rows(drafts: list[list[int]]) -> list[int]:
    """Request i's rows of a step's sampling logits are first[i] .. first[i + 1] - 1: one, plus one per draft."""
    first = [0]
    for d in drafts:
        first.append(first[-1] + len(d) + 1)
    return first

@dataclass
class InFlightBatch:
    """A batch sent into the ranks whose output has not been used yet (vLLM v1's batch queue holds these).

    Its logits arrive once (`Executor.collect` receives them in the order the batches went in) and are kept, so a
    step that fails after receiving them and is rolled back can sample them again."""
    step_id: int
    sched: SchedulerOutput
    model_input: ModelInput
    sampling_requests: list[Request]            # row order
    logits: torch.Tensor | None = None          # (sampling rows, vocab) fp32, once received
    prompt_logits: torch.Tensor | None = None   # (prompt-logprob rows, vocab) fp32, once received
    received: bool = False
    sampled: torch.Tensor | None = None         # async scheduling: (sampling rows,) int64 tokens, on the device
    logprobs_ahead: StepScores | None = None    # ... and the logprobs asked for, scored there too
    host: list[torch.Tensor] | None = None      # ... both copied to the host (pinned): [sampled, *scores' tensors]
    ready: "torch.cuda.Event | None" = None     # ... recorded right after that copy (None on a CPU: nothing to wait)


def copy_to_host(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], "torch.cuda.Event | None"]:
    """Start copying a batch's sampled tokens (and scores) to the host without waiting: (pinned host tensors, the
    event recorded after the copies) on a GPU, (the tensors themselves, None) on a CPU. The copies are queued right
    behind the sampling and ahead of the next batch's forward, so waiting for the event waits for this batch alone;
    `tokens.tolist()` would wait for everything queued on the stream by then, the next batch's forward included
    (vLLM copies on a stream of its own for the same reason)."""
    if not tensors or tensors[0].device.type != "cuda":
        return tensors, None
    hosts = []
    for t in tensors:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        hosts.append(host)
    ready = torch.cuda.Event()
    ready.record()
    return hosts, ready
