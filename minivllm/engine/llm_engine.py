"""LLMEngine: add requests, then `step()` until none are left (vLLM's LLMEngine / EngineCore).

Owns: the request table, the loop schedule -> run model -> sample -> detokenize -> check stops,
and turning requests into RequestOutputs. The scheduler decides what runs, the block manager where
KV goes, the model runner computes; the engine wires them and never reaches into their internals.

Continuous batching falls out of the loop: finished requests leave at the end of any step and
waiting ones join at the start of the next.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from minivllm.core.kv_cache_manager import BlockManager
from minivllm.config import EngineConfig
from minivllm.engine.detokenizer import DetokState, detokenize_incrementally, find_stop_string
from minivllm.worker.distributed import check_tp_size
from minivllm.worker.executor import make_executor
from minivllm.model.llama import ModelConfig
from minivllm.model.loader import check_checkpoint_files, load_tokenizer, resolve_device, resolve_model_path
from minivllm.outputs import CompletionOutput, RequestOutput
from minivllm.core.request import Request, RequestStatus
from minivllm.core.sampling_params import SamplingParams
from minivllm.core.scheduler import Scheduler
from minivllm.core.trace import StepTrace, build_step_trace

PromptType = str | dict | list


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_free_blocks: int
    kv_usage: float                  # fraction of blocks held by requests
    prefix_cache_hit_rate: float     # cached prompt tokens / prompt tokens looked up
    prefix_cache_hits: int           # tokens
    prefix_cache_queries: int        # tokens
    num_preemptions: int
    num_swapped: int                 # requests whose KV is in the CPU pool right now
    num_steps: int
    num_prompt_tokens_computed: int  # prefill tokens that ran through the model (recomputes included)
    num_generated_tokens: int


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_dir(self.model_path)
        check_checkpoint_files(self.model_path)
        self.device = resolve_device(config.device)
        self.tokenizer = load_tokenizer(self.model_path)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len is {self.max_model_len}, above the model's "
                             f"max_position_embeddings of {self.model_config.max_position_embeddings}.")
        check_tp_size(self.model_config, config.tensor_parallel_size)
        # Rank 0's ModelRunner lives here; the executor starts the other ranks, if any (executor.py).
        self.executor = make_executor(config, self.model_path, self.model_config, self.device)
        self.model_runner = self.executor.driver
        self.block_manager = BlockManager(self.executor.num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching, self.executor.num_cpu_blocks)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.preemption_mode)
        eos = set(self.model_config.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.num_steps = 0
        self.num_prompt_tokens_computed = 0
        self.num_generated_tokens = 0
        self.trace_listeners: list[Callable[[StepTrace], None]] = []

    # ------------------------------------------------------------------ requests in
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """A prompt is a string, {"prompt_token_ids": [...]} (optionally with "prompt"), or a list of ids."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"prompt dict has unknown key(s) {sorted(unknown)}; "
                                 "use 'prompt_token_ids' (and optionally 'prompt').")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self.tokenize(prompt["prompt"])
            raise ValueError("prompt dict needs 'prompt' or 'prompt_token_ids'.")
        if isinstance(prompt, (list, tuple)):
            return None, list(prompt)
        raise ValueError(f"prompt is a {type(prompt).__name__}; pass a string or "
                         "{'prompt_token_ids': [...]}.")

    def validate_request(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError, naming the value and the limit, for a request that can never run."""
        n = len(token_ids)
        if n == 0:
            raise ValueError("prompt is empty (0 tokens); give at least one token.")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains {bad[:3]}; token ids must be ints in [0, {vocab}).")
        if n >= self.max_model_len:
            raise ValueError(f"prompt has {n} tokens; max_model_len is {self.max_model_len}, which leaves no "
                             f"room for output. Shorten the prompt or raise max_model_len.")
        # The longest the sequence can get: the KV of all but the last token must fit in the whole pool.
        longest = min(n + params.max_tokens, self.max_model_len) - 1
        need = self.block_manager.blocks_needed(longest)
        if need > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs {need} KV blocks of "
                f"{self.config.block_size} tokens, but the whole pool has {self.block_manager.num_blocks} "
                f"blocks ({self.block_manager.num_blocks * self.config.block_size} tokens). Lower max_tokens, "
                "shorten the prompt, or raise num_kv_blocks.")

    def add_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0) -> Request:
        params = sampling_params or SamplingParams()
        text, token_ids = self.tokenize(prompt)
        self.validate_request(token_ids, params)
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use.")
        req = Request(request_id, text, token_ids, params, eos_token_ids=self.eos_token_ids, priority=priority)
        req.detok_state = DetokState()
        self.requests[request_id] = req
        self.scheduler.add_request(req)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request at any point and free everything it held. Unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish_request(req, RequestStatus.FINISHED_ABORTED)
        req.metrics.finished_time = time.time()
        return self._make_output(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """One engine iteration. Returns an output for every request that got a token or finished."""
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return []
        now = time.time()
        for req in sched.scheduled:
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
        sampling_reqs, tokens = self.executor.execute_model(sched)
        self.scheduler.update_from_output(sched)
        self.num_steps += 1
        self.num_prompt_tokens_computed += sched.num_prefill_tokens
        outputs = [self._process_token(req, tok) for req, tok in zip(sampling_reqs, tokens)]
        events = self.block_manager.pop_events()
        if self.trace_listeners:
            finished = [r for r in sampling_reqs if r.is_finished]
            trace = build_step_trace(self.num_steps, time.perf_counter() - start, sched, events,
                                     self.scheduler.running + self.scheduler.waiting, finished,
                                     self.block_manager, self.scheduler.num_preemptions)
            for listener in self.trace_listeners:
                listener(trace)
        return outputs

    def add_trace_listener(self, listener: Callable[[StepTrace], None]) -> None:
        """Call `listener(StepTrace)` after every step (see trace.py). Costs nothing while there are none."""
        self.trace_listeners.append(listener)

    def remove_trace_listener(self, listener: Callable[[StepTrace], None]) -> None:
        self.trace_listeners.remove(listener)

    @contextlib.contextmanager
    def record_traces(self) -> Iterator[list[StepTrace]]:
        """`with engine.record_traces() as traces:` every step inside the block appends its StepTrace."""
        traces: list[StepTrace] = []
        self.add_trace_listener(traces.append)
        try:
            yield traces
        finally:
            self.remove_trace_listener(traces.append)

    def _process_token(self, req: Request, token: int) -> RequestOutput:
        now = time.time()
        req.append_output_token(token)
        self.num_generated_tokens += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        sp = req.sampling_params
        new_text = detokenize_incrementally(self.tokenizer, req.output_token_ids, req.detok_state,
                                            sp.skip_special_tokens)
        req.output_text += new_text

        status = None
        if not sp.ignore_eos and token in req.eos_token_ids:
            status = RequestStatus.FINISHED_STOPPED
        elif token in sp.stop_token_ids:
            status, req.stop_reason = RequestStatus.FINISHED_STOPPED, token
        elif sp.stop and new_text and (hit := find_stop_string(req.output_text, len(new_text), sp.stop)):
            req.stop_reason, cut = hit
            req.output_text = req.output_text[:cut]
            status = RequestStatus.FINISHED_STOPPED
        elif req.num_output_tokens >= sp.max_tokens or req.num_tokens >= self.max_model_len:
            status = RequestStatus.FINISHED_LENGTH
        if status is not None:
            self.scheduler.finish_request(req, status)
            req.metrics.finished_time = now
            del self.requests[req.request_id]
        return self._make_output(req)

    def _make_output(self, req: Request) -> RequestOutput:
        """Snapshot a request. While it runs, text that could still become a stop string is held back."""
        finished = req.is_finished
        visible = len(req.output_text)
        if not finished and req.sampling_params.stop:
            visible -= max(len(s) for s in req.sampling_params.stop) - 1
        visible = max(visible, req.num_emitted_chars)
        delta_text = req.output_text[req.num_emitted_chars:visible]
        delta_ids = req.output_token_ids[req.num_emitted_tokens:]
        req.num_emitted_chars, req.num_emitted_tokens = visible, req.num_output_tokens
        completion = CompletionOutput(0, req.output_text[:visible], list(req.output_token_ids),
                                      req.status.finish_reason if finished else None, req.stop_reason)
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion], finished,
                             dataclasses.replace(req.metrics), req.num_cached_tokens, delta_text, delta_ids)

    # ------------------------------------------------------------------ introspection
    def get_stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_kv_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks, kv_usage=bm.usage,
            prefix_cache_hit_rate=bm.prefix_cache_hit_rate, prefix_cache_hits=bm.prefix_cache_hits,
            prefix_cache_queries=bm.prefix_cache_queries, num_preemptions=self.scheduler.num_preemptions,
            num_swapped=len(bm.cpu_block_tables),
            num_steps=self.num_steps, num_prompt_tokens_computed=self.num_prompt_tokens_computed,
            num_generated_tokens=self.num_generated_tokens)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (if any) and leave the process group. Also happens on garbage
        collection and at exit; safe to call twice. The engine cannot run steps afterwards."""
        self.executor.shutdown()

    def check_integrity(self) -> None:
        self.block_manager.check_integrity(self.scheduler.running + self.scheduler.waiting)

