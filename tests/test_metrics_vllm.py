"""vLLM's per-request and per-step histograms, as vLLM exports them (v1/metrics/loggers.py), so that a vLLM Grafana
board reads minivllm's /metrics unchanged: names, types, units (seconds, tokens), bucket bounds and the `model_name`
label, parsed with prometheus_client's own parser; the values checked against the requests themselves (their
token counts as the client sees them, their own RequestMetrics, the engine's counters)."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from minivllm import SamplingParams
from minivllm.engine.engine_stats import (ITERATION_TOKENS_BUCKETS, PARAMS_N_BUCKETS, REQUEST_LATENCY_BUCKETS,
                                          TIME_PER_OUTPUT_TOKEN_BUCKETS, Histogram, build_1_2_5_buckets)

NAME = "served-name"
MAX_MODEL_LEN = 1024
LATENCY = ["vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
           "vllm:request_inference_time_seconds"]
TOKENS = ["vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_max_tokens"]
BUCKETS = {**{n: REQUEST_LATENCY_BUCKETS for n in LATENCY}, **{n: build_1_2_5_buckets(MAX_MODEL_LEN) for n in TOKENS},
           "vllm:request_time_per_output_token_seconds": TIME_PER_OUTPUT_TOKEN_BUCKETS,
           "vllm:request_params_n": PARAMS_N_BUCKETS, "vllm:iteration_tokens_total": ITERATION_TOKENS_BUCKETS}


def test_vllms_token_buckets_are_1_2_5_up_to_max_model_len():
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(8192) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000)


# ---------------------------------------------------------------------- offline: the engine's own histograms
def delta(after: Histogram, before: Histogram) -> Histogram:
    return Histogram(after.buckets, [a - b for a, b in zip(after.counts, before.counts)], after.sum - before.sum,
                     after.count - before.count)


@pytest.fixture(scope="module")
def llm_with_stats(model_dir):
    """An offline engine that keeps the histograms: vLLM's LLM (and minivllm's) sets disable_log_stats unless asked."""
    from minivllm import LLM
    return LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=512, disable_log_stats=False)


def test_the_offline_llm_keeps_no_histograms_unless_asked_as_vllms(llm, llm_with_stats):
    assert llm.llm_engine.config.disable_log_stats and llm.get_stats().histograms is None
    llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert llm.get_stats().histograms is None and llm.llm_engine.request_histograms is None
    assert not llm_with_stats.llm_engine.config.disable_log_stats
    assert llm_with_stats.get_stats().histograms is not None


def test_the_engine_observes_each_finished_request_from_its_own_times_and_counts(llm_with_stats):
    llm = llm_with_stats
    before = llm.get_stats().histograms
    engine = llm.llm_engine
    tokens_before = engine.num_prompt_tokens_computed + engine.num_generated_tokens
    prompts = ["The capital of France is", "Hello, my name is", "A list of prime numbers: 2, 3, 5, 7,"]
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in (5, 1, 3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    after = llm.get_stats().histograms
    d = {f: delta(getattr(after, f), getattr(before, f)) for f in (
        "queue_time", "prefill_time", "decode_time", "inference_time", "time_per_output_token", "prompt_tokens",
        "generation_tokens", "max_tokens", "n", "iteration_tokens")}
    assert all(h.count == 3 for name, h in d.items() if name != "iteration_tokens")
    ms = [o.metrics for o in outs]
    expect = {"queue_time": [m.first_scheduled_time - m.arrival_time for m in ms],
              "prefill_time": [m.first_token_time - m.first_scheduled_time for m in ms],
              "decode_time": [m.last_token_time - m.first_token_time for m in ms],
              "inference_time": [m.last_token_time - m.first_scheduled_time for m in ms],
              "time_per_output_token": [(m.last_token_time - m.first_token_time) / (len(o.outputs[0].token_ids) - 1)
                                        if len(o.outputs[0].token_ids) > 1 else 0.0 for m, o in zip(ms, outs)],
              "prompt_tokens": [len(o.prompt_token_ids) for o in outs],
              "generation_tokens": [len(o.outputs[0].token_ids) for o in outs],
              "max_tokens": [5, 1, 3], "n": [1, 1, 1]}
    for name, values in expect.items():
        assert d[name].sum == pytest.approx(sum(values), abs=1e-9), name
        assert d[name].counts == _observed(d[name].buckets, values).counts, name
    assert all(m.arrival_time <= m.first_scheduled_time < m.first_token_time <= m.last_token_time for m in ms)
    # every step's tokens: the prompt tokens computed and the tokens generated, as the engine counts them
    assert d["iteration_tokens"].sum == engine.num_prompt_tokens_computed + engine.num_generated_tokens - tokens_before
    assert d["generation_tokens"].sum == 5 + 1 + 3


def _observed(buckets, values) -> Histogram:
    h = Histogram(buckets)
    for v in values:
        h.observe(v)
    return h


def test_n_is_observed_once_per_request_and_every_sample_is_a_request(llm_with_stats):
    llm = llm_with_stats
    before = llm.get_stats().histograms
    out = llm.generate("Once upon a time", SamplingParams(n=3, temperature=0.8, seed=1, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    after = llm.get_stats().histograms
    assert delta(after.n, before.n).count == 1 and delta(after.n, before.n).sum == 3
    assert delta(after.generation_tokens, before.generation_tokens).count == 3        # one per sample, as vLLM
    assert delta(after.generation_tokens, before.generation_tokens).sum == sum(len(c.token_ids) for c in out.outputs)
    assert delta(after.prompt_tokens, before.prompt_tokens).sum == 3 * len(out.prompt_token_ids)


# ---------------------------------------------------------------------- served: /metrics
@pytest.fixture(scope="module")
def server(model_dir):
    from minivllm.engine.async_llm import AsyncLLMEngine
    from minivllm.entrypoints.api_server import build_api_server, run_server_in_thread

    engine = AsyncLLMEngine.from_engine_args(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64,
                                             max_model_len=MAX_MODEL_LEN)
    srv = run_server_in_thread(build_api_server(engine, served_model_name=NAME))
    srv.engine = engine
    yield srv
    srv.stop()
    engine.shutdown()


def scrape(server) -> tuple[dict, dict]:
    """(families by name, {(sample name, labels other than model_name): value}), after checking every sample's
    model_name label."""
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    values = {}
    for f in families.values():
        for s in f.samples:
            assert s.labels.get("model_name") == NAME, s
            values[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
    return families, values


def histogram_of(families, values, name) -> Histogram:
    """The histogram as /metrics gives it (cumulative buckets undone)."""
    bounds = [float(s.labels["le"]) for s in families[name].samples if s.name == name + "_bucket"]
    cumulative = [values[(name + "_bucket", (("le", s.labels["le"]),))]
                  for s in families[name].samples if s.name == name + "_bucket"]
    counts = [int(c - p) for c, p in zip(cumulative, [0] + cumulative[:-1])]
    return Histogram(tuple(bounds[:-1]), counts, values[(name + "_sum", ())], int(values[(name + "_count", ())]))


def test_metrics_are_vllms_histograms_with_vllms_buckets_and_agree_with_the_requests(server):
    families, values = scrape(server)
    before = {name: histogram_of(families, values, name) for name in BUCKETS}
    for name, bounds in BUCKETS.items():                # vLLM's type, unit and bounds (le="1.0" for a count, too)
        assert families[name].type == "histogram", name
        assert before[name].buckets == tuple(float(b) for b in bounds), name
    prompts = ["The capital of France is", "def fibonacci(n):", "In 1969, the first humans to walk on the Moon were"]
    usage, elapsed = [], []
    for prompt, k in zip(prompts, (6, 1, 3)):
        start = time.perf_counter()
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": NAME, "prompt": prompt, "max_tokens": k, "temperature": 0, "ignore_eos": True})
        elapsed.append(time.perf_counter() - start)
        assert r.status_code == 200, r.text
        usage.append(r.json()["usage"])
    start = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": NAME, "prompt": "Once upon a time", "max_tokens": 2, "n": 2, "temperature": 0.7, "seed": 3,
        "ignore_eos": True})
    elapsed.append(time.perf_counter() - start)
    assert r.status_code == 200, r.text
    usage.append(r.json()["usage"])
    families, values = scrape(server)
    d = {name: delta(histogram_of(families, values, name), before[name]) for name in BUCKETS}
    # five requests finished: three, and the two samples of the n=2 one (vLLM counts samples as requests)
    assert {name: h.count for name, h in d.items() if name != "vllm:iteration_tokens_total"} == {
        **{name: 5 for name in BUCKETS if name not in ("vllm:request_params_n", "vllm:iteration_tokens_total")},
        "vllm:request_params_n": 4}
    assert d["vllm:request_prompt_tokens"].sum == sum(u["prompt_tokens"] for u in usage[:3]) + 2 * usage[3]["prompt_tokens"]
    assert d["vllm:request_generation_tokens"].sum == sum(u["completion_tokens"] for u in usage) == 6 + 1 + 3 + 2 * 2
    assert d["vllm:request_params_max_tokens"].sum == 6 + 1 + 3 + 2 * 2
    assert d["vllm:request_params_n"].sum == 1 + 1 + 1 + 2 and d["vllm:request_params_n"].counts[:2] == [3, 1]
    # the time of a request: queue, then inference = prefill + decode; all of it inside what the client waited
    q, p, dec, inf = (d[n].sum for n in LATENCY)
    assert inf == pytest.approx(p + dec, abs=1e-6) and min(q, p, dec) >= 0
    assert q + inf <= sum(elapsed[:3]) + 2 * elapsed[3]       # (each sample of the n=2 request waited its time)
    assert p > 0                                              # a forward ran between scheduled and first token
    # decode time per token after the first, per request (0 for the single-token one)
    assert d["vllm:request_time_per_output_token_seconds"].sum <= dec
    assert d["vllm:iteration_tokens_total"].count > 0
    assert d["vllm:iteration_tokens_total"].sum >= d["vllm:request_generation_tokens"].sum
