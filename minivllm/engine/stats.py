"""What the dashboard and /metrics read about a running AsyncLLMEngine: latency histograms and the snapshot.

Owns: plain data only. The async engine's thread fills these under its lock; readers get copies.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from minivllm.core.block_pool import PoolSnapshot
from minivllm.core.trace import StepTrace
from minivllm.engine.llm_engine import EngineQueues, EngineStats

# Histogram bucket upper bounds in seconds (a subset of vLLM's), wide enough for a CPU and a GPU.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)



@dataclass
class Histogram:
    """Prometheus-style: `counts[i]` observations <= buckets[i] (not cumulative), the last one for +Inf."""
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def copy(self) -> Histogram:
        return Histogram(self.buckets, list(self.counts), self.sum, self.count)


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
