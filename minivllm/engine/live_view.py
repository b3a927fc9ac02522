"""What a live page watches, published by the engine thread after each step, so that a page never waits for it.

Owns: the latest picture of the KV pool (taken after each step only while a page has asked for one in the last
WATCH_S seconds: O(num_blocks), never paid when nobody looks), a time series of the steps longer than the trace
window (wall time, tokens, KV usage, queue lengths), and the timings of recently finished requests (queue time,
TTFT, time per output token, end-to-end, every inter-token gap), in vLLM's definitions.

Only the engine thread writes (the async engine calls `on_trace`, `publish_pool` and `observe`); every published
value is immutable and is swapped in whole, so a reader takes the latest one by reference, at any time, without
waiting for the step under way. It never calls the engine and never decides anything.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass

from minivllm.core.block_pool import PoolSnapshot
from minivllm.engine.trace import StepTrace
from minivllm.outputs import RequestOutput

WATCH_S = 5.0              # keep publishing the pool this long after a page last asked for it
STEP_HISTORY = 20_000      # steps kept for the charts (the trace window keeps 120)
FINISHED_HISTORY = 2_000   # finished requests kept for the latency percentiles
TRACKED_MAX = 10_000       # requests whose token times are followed at once (aborted ones are never observed
                           # finishing: the oldest are dropped past this)


@dataclass(frozen=True)
class StepPoint:
    """One step, as the charts need it."""
    time: float                # time.time() when the engine thread recorded the step
    step: int
    num_prefill_tokens: int
    num_decode_tokens: int
    kv_usage: float            # 0..1
    num_running: int           # after the step
    num_waiting: int


@dataclass(frozen=True)
class RequestTiming:
    """A request that finished (stop or length), in seconds, as vLLM defines each interval:
    queue = first scheduled - arrival; ttft = first token - arrival; tpot = (last token - first token) /
    (output tokens - 1), None for a single token; e2e = finished - arrival; itl = the gaps between its outputs."""
    request_id: str
    finished_time: float
    queue_s: float
    ttft_s: float
    tpot_s: float | None
    e2e_s: float
    itl_s: tuple[float, ...]
    num_output_tokens: int


class LiveView:
    """The engine thread's publication for live pages. See the module docstring."""

    def __init__(self, engine, step_history: int = STEP_HISTORY, finished_history: int = FINISHED_HISTORY):
        self._engine = engine                # an LLMEngine: its trace listener, and its pool on the engine thread
        self._lock = threading.Lock()        # held for an append or a copy, never across a step
        self._steps: collections.deque[StepPoint] = collections.deque(maxlen=step_history)
        self._finished: collections.deque[RequestTiming] = collections.deque(maxlen=finished_history)
        self._tokens: dict[str, tuple[int, list[float]]] = {}   # request id -> (output tokens, output times)
        self._watched_until = 0.0
        self.pool: PoolSnapshot | None = None                   # the latest published picture (or None)
        engine.add_trace_listener(self.on_trace)

    def close(self) -> None:
        self._engine.remove_trace_listener(self.on_trace)

    # ------------------------------------------------------------------ readers (any thread)
    def watch(self) -> PoolSnapshot | None:
        """A page looks: publish the pool after every step for the next WATCH_S seconds. Returns the latest."""
        self._watched_until = time.monotonic() + WATCH_S
        return self.pool

    def steps(self) -> tuple[StepPoint, ...]:
        with self._lock:
            return tuple(self._steps)

    def last_step(self) -> StepPoint | None:
        with self._lock:
            return self._steps[-1] if self._steps else None

    def finished(self) -> tuple[RequestTiming, ...]:
        with self._lock:
            return tuple(self._finished)

    # ------------------------------------------------------------------ the engine thread's writes
    def on_trace(self, trace: StepTrace) -> None:
        point = StepPoint(time.time(), trace.step, trace.num_prefill_tokens, trace.num_decode_tokens,
                          trace.kv_usage, trace.num_running, trace.num_waiting)
        with self._lock:
            self._steps.append(point)

    def publish_pool(self, engine) -> PoolSnapshot | None:
        """After every step and batch of commands: the pool's picture while watched, else nothing (None)."""
        watched = time.monotonic() < self._watched_until
        pool = engine.kv_cache_manager.block_pool.snapshot() if watched else None
        self.pool = pool
        return pool

    def observe(self, out: RequestOutput, delta: bool) -> None:
        """One output of a request this engine streams (delta: its token_ids are only the new ones)."""
        m = out.metrics
        if m is None or m.first_token_time is None:
            return
        count, times = self._tokens.pop(out.request_id, (0, []))
        new = len(out.outputs[0].token_ids) if out.outputs else 0
        count = count + new if delta else max(count, new)
        if m.last_token_time is not None and (not times or m.last_token_time != times[-1]):
            times.append(m.last_token_time)
        if not out.finished:
            self._tokens[out.request_id] = (count, times)          # re-inserted: the newest last
            if len(self._tokens) > TRACKED_MAX:
                del self._tokens[next(iter(self._tokens))]
            return
        if out.outputs[0].finish_reason not in ("stop", "length"):
            return
        first, last = m.first_token_time, m.last_token_time or m.first_token_time
        end = m.finished_time or last
        timing = RequestTiming(
            out.request_id, end, (m.first_scheduled_time or first) - m.arrival_time, first - m.arrival_time,
            (last - first) / (count - 1) if count > 1 else None, end - m.arrival_time,
            tuple(b - a for a, b in zip(times, times[1:])), count)
        with self._lock:
            self._finished.append(timing)
