"""What the dashboard and /metrics read about a running AsyncLLMEngine: latency histograms, the snapshot, and the
recorder that keeps them.

Owns: the record of what the engine thread saw (steps, events, finishes, latencies, the latest stats and queues),
behind one lock. Only the engine thread writes it (StatsRecorder's methods); readers get an EngineSnapshot, a copy.
It never calls the engine: the async engine hands it what the engine returned.
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

from minivllm.core.block_pool import PoolSnapshot
from minivllm.engine.engine_stats import Histogram
from minivllm.engine.trace import StepTrace
from minivllm.engine.llm_engine import EngineQueues, EngineStats
from minivllm.outputs import RequestOutput

# Histogram bucket upper bounds in seconds (a subset of vLLM's), wide enough for a CPU and a GPU.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
RECENT_REQUESTS = 1000        # finished requests (reason, preemption steps) remembered for the dashboard


@dataclass(frozen=True)
class EngineSnapshot:
    """What the dashboard and /metrics read: a consistent copy, taken under the lock, never live state."""
    stats: EngineStats
    queues: EngineQueues                      # the queues at the moment `stats` was taken (the same counts)
    trace: StepTrace | None                   # the latest step (None before the first one)
    recent_traces: tuple[StepTrace, ...]      # the last `trace_history` steps, oldest first
    events: tuple[str, ...]                   # log lines, oldest first: the engine's step events and ours
    paused: bool
    loop_alive: bool
    num_requests: int                         # requests in flight through this engine (added, not finished)
    finished: dict[str, int]                  # finish reason ("stop", "length", "abort", "error") -> count
    recent_finished: tuple[tuple[str, str], ...]   # (request_id, finish reason) of the last finished ones
    num_prompt_tokens: int                    # prompt tokens of every request accepted so far
    num_step_errors: int
    ttft: Histogram                           # time to first token: arrival -> first token
    itl: Histogram                            # inter-token latency: between two tokens of one request
    e2e: Histogram                            # arrival -> finished, for requests that stopped or hit length
    pool: PoolSnapshot | None = None          # every block's ref count, when asked for (snapshot(with_pool=True))
    preempted_at: dict[str, tuple[int, ...]] = field(default_factory=dict)   # request id -> steps that preempted
    # it, for the last RECENT_REQUESTS preempted ids (the trace window forgets a long request's early steps)


class StatsRecorder:
    """The engine thread's record for the dashboard and /metrics; `snapshot()` copies it for any other thread.

    Written only by the engine thread (a trace listener, and the async engine after each step and command);
    every write and the copy hold `lock`, so a snapshot never mixes two moments.
    """

    def __init__(self, stats: EngineStats, queues: EngineQueues, trace_history: int, event_history: int):
        self.lock = threading.Lock()
        self.stats, self.queues = stats, queues            # taken together, at the same moment: they agree
        self.traces: collections.deque[StepTrace] = collections.deque(maxlen=trace_history)
        self.events: collections.deque[str] = collections.deque(maxlen=event_history)
        self.finished: collections.Counter[str] = collections.Counter()
        self.recent_finished: collections.deque[tuple[str, str]] = collections.deque(maxlen=RECENT_REQUESTS)
        # request id -> the steps that preempted it, kept past the trace window for the last RECENT_REQUESTS ids
        self.preempted_at: dict[str, list[int]] = {}
        self.num_prompt_tokens = 0
        self.num_step_errors = 0
        self.ttft, self.itl, self.e2e = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS), Histogram(E2E_BUCKETS)

    def snapshot(self, paused: bool, loop_alive: bool, num_requests: int,
                 pool: PoolSnapshot | None) -> EngineSnapshot:
        with self.lock:
            return EngineSnapshot(
                stats=self.stats, queues=self.queues, trace=self.traces[-1] if self.traces else None,
                recent_traces=tuple(self.traces), events=tuple(self.events), paused=paused,
                loop_alive=loop_alive, num_requests=num_requests,
                finished=dict(self.finished), recent_finished=tuple(self.recent_finished),
                preempted_at={rid: tuple(steps) for rid, steps in self.preempted_at.items()},
                num_prompt_tokens=self.num_prompt_tokens, num_step_errors=self.num_step_errors,
                ttft=self.ttft.copy(), itl=self.itl.copy(), e2e=self.e2e.copy(), pool=pool)

    def finish_reason_of(self, request_id: str) -> str | None:
        with self.lock:
            return next((reason for rid, reason in reversed(self.recent_finished) if rid == request_id), None)

    # ------------------------------------------------------------------ the engine thread's writes
    def on_trace(self, trace: StepTrace) -> None:
        """Trace listener: called by engine.step() on the engine thread."""
        with self.lock:
            self.traces.append(trace)
            self.events.extend(f"step {trace.step}: {line}" for line in trace.events)
            for request_id in trace.preempted:
                self.preempted_at.setdefault(request_id, []).append(trace.step)
                if len(self.preempted_at) > RECENT_REQUESTS:                # forget the oldest id
                    del self.preempted_at[next(iter(self.preempted_at))]

    def publish(self, stats: EngineStats, queues: EngineQueues) -> None:
        """After every step and every batch of commands: the counts and the queues, taken together."""
        with self.lock:
            self.stats, self.queues = stats, queues

    def log(self, line: str) -> None:
        with self.lock:
            step = self.traces[-1].step if self.traces else 0
            self.events.append(f"after step {step}: {line}")

    def record_finish(self, request_id: str, reason: str | None) -> None:
        with self.lock:
            self.finished[reason or "unknown"] += 1
            self.recent_finished.append((request_id, reason or "unknown"))

    def add_prompt_tokens(self, num_tokens: int) -> None:
        with self.lock:
            self.num_prompt_tokens += num_tokens

    def step_failed(self) -> None:
        with self.lock:
            self.num_step_errors += 1

    def observe_latency(self, last_token_time: float | None, out: RequestOutput, now: float) -> float | None:
        """Count one output's TTFT or ITL, and its end-to-end time if it finished by stop or length. Takes the
        request's last token time so far and returns the new one (the caller keeps it per request)."""
        m = out.metrics
        with self.lock:
            if m is not None and m.last_token_time is not None and m.last_token_time != last_token_time:
                if last_token_time is None and m.first_token_time is not None:
                    self.ttft.observe(m.first_token_time - m.arrival_time)
                elif last_token_time is not None:
                    self.itl.observe(m.last_token_time - last_token_time)
                last_token_time = m.last_token_time
            if out.finished and out.outputs[0].finish_reason in ("stop", "length") and m is not None:
                self.e2e.observe((m.finished_time or now) - m.arrival_time)
        return last_token_time
