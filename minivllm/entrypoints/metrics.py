"""GET /metrics: the engine's counters and latency histograms in Prometheus' text format (version 0.0.4).

Owns: turning an EngineSnapshot into exposition text, with vLLM's metric names, types, units and (for the
per-request histograms) bucket bounds where vLLM has the same metric (`vllm:num_requests_running`,
`vllm:request_queue_time_seconds`, ...; vLLM's v1/metrics/loggers.py), so a vLLM Grafana board reads it unchanged,
and a `model_name` label on every sample. A pure function of the snapshot: it reads nothing else.
"""

from __future__ import annotations

from minivllm.engine.engine_stats import RequestHistograms
from minivllm.engine.stats import EngineSnapshot, Histogram


def render_metrics(snap: EngineSnapshot, model_name: str) -> str:
    """Prometheus text exposition format (version 0.0.4), with vLLM's metric names."""
    label = f'model_name="{_escape_label(model_name)}"'
    s = snap.stats
    lines: list[str] = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help}")
        lines.append(f"# TYPE {name} {kind}")
        for suffix_labels, value in samples:
            lines.append(f"{name}{suffix_labels} {_number(value)}")

    def gauge(name: str, help: str, value: float) -> None:
        metric(name, "gauge", help, [(f"{{{label}}}", value)])

    def counter(name: str, help: str, value: float) -> None:
        lines.append(f"# HELP {name}_total {help}")
        lines.append(f"# TYPE {name}_total counter")
        lines.append(f"{name}_total{{{label}}} {_number(value)}")

    def histogram(name: str, help: str, h: Histogram) -> None:
        lines.append(f"# HELP {name} {help}")
        lines.append(f"# TYPE {name} histogram")
        cumulative = 0
        for bound, count in zip([*(_number(float(b)) for b in h.buckets), "+Inf"], h.counts):   # le="1.0", as vLLM
            cumulative += count
            lines.append(f'{name}_bucket{{{label},le="{bound}"}} {cumulative}')
        lines.append(f"{name}_sum{{{label}}} {_number(h.sum)}")
        lines.append(f"{name}_count{{{label}}} {h.count}")

    gauge("vllm:num_requests_running", "Requests in the running queue (scheduled every step).", s.num_running)
    gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (preempted ones included).",
          s.num_waiting)
    gauge("vllm:num_requests_swapped", "Requests whose KV is in the CPU swap pool.", s.num_swapped)
    gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).", s.kv_usage)
    gauge("vllm:num_kv_blocks", "Physical KV blocks in the pool.", s.num_kv_blocks)
    gauge("vllm:num_free_kv_blocks", "Free KV blocks (cached-free included).", s.num_free_blocks)
    gauge("vllm:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up.",
          s.prefix_cache_hit_rate)
    gauge("vllm:engine_paused", "1 while the engine is paused from the dashboard.", int(snap.paused))
    counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
    counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits)
    counter("vllm:num_preemptions", "Requests preempted (recompute or swap) since start.", s.num_preemptions)
    counter("vllm:prompt_tokens", "Prompt tokens of accepted requests.", snap.num_prompt_tokens)
    counter("vllm:generation_tokens", "Tokens generated.", s.num_generated_tokens)
    counter("vllm:engine_steps", "Engine steps run.", s.num_steps)
    counter("vllm:engine_step_errors", "Engine steps that raised (their requests ended with an error).",
            snap.num_step_errors)
    counter("vllm:spec_decode_num_drafts", "Speculative decoding: verification steps of a request with drafts.",
            s.num_spec_drafts)
    counter("vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.",
            s.num_spec_draft_tokens)
    counter("vllm:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
            s.num_spec_accepted_tokens)
    lines.append("# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Speculative decoding: accepted draft "
                 "tokens by position in the step's drafts.")
    lines.append("# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter")
    for pos, n in enumerate(s.num_spec_accepted_tokens_per_pos):
        lines.append(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{label},position="{pos}"}} {n}')
    lines.append("# HELP vllm:request_success_total Finished requests by finish reason.")
    lines.append("# TYPE vllm:request_success_total counter")
    for reason in sorted({"stop", "length", "abort", "error"} | set(snap.finished)):
        lines.append(f'vllm:request_success_total{{{label},finished_reason="{_escape_label(reason)}"}} '
                     f"{snap.finished.get(reason, 0)}")
    histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first output token.", snap.ttft)
    histogram("vllm:inter_token_latency_seconds", "Time between two consecutive output tokens of a request.",
              snap.itl)
    histogram("vllm:e2e_request_latency_seconds", "Time from arrival to finish (stop or length).", snap.e2e)
    if s.histograms is not None:           # vLLM's per-request histograms (engine_stats.RequestHistograms)
        for name, help, h in _request_histograms(s.histograms):
            histogram(name, help, h)
    return "\n".join(lines) + "\n"


def _request_histograms(r: RequestHistograms) -> list[tuple[str, str, Histogram]]:
    """vLLM's names and help texts; the requests are those that finished by stop or length."""
    return [
        ("vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.", r.queue_time),
        ("vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.", r.prefill_time),
        ("vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.", r.decode_time),
        ("vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
         r.inference_time),
        ("vllm:request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
         r.time_per_output_token),
        ("vllm:request_prompt_tokens", "Number of prefill tokens processed.", r.prompt_tokens),
        ("vllm:request_generation_tokens", "Number of generation tokens processed.", r.generation_tokens),
        ("vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", r.max_tokens),
        ("vllm:request_params_n", "Histogram of the n request parameter.", r.n),
        ("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", r.iteration_tokens),
    ]


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
