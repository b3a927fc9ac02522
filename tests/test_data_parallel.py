"""Data parallelism as a client sees it: two engine replicas in their own processes behind the router
(minivllm/entrypoints/dp_router.py, what `python app.py --data-parallel-size 2` serves), used over HTTP and through
the official OpenAI client. The oracle is Hugging Face's greedy text; each replica's own /metrics (the router labels
them engine="0" and "1") shows where the requests ran."""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import pytest
from openai import OpenAI

from minivllm import LLM
from minivllm.config import EngineConfig
from minivllm.entrypoints.api_server import run_server_in_thread
from minivllm.entrypoints.dp_replicas import Replica, start_replicas
from minivllm.entrypoints.dp_router import Router, build_dp_router, merge_metrics
from tests.oracle import PROMPTS, hf_greedy

NUM_TOKENS = 8
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def dp():
    replicas = start_replicas(EngineConfig(num_kv_blocks=96, device="cpu", dtype="float32", data_parallel_size=2))
    srv = run_server_in_thread(build_dp_router(replicas, poll_s=0.5))
    srv.replicas = replicas
    yield srv
    srv.stop()                                 # the router's shutdown stops the replica processes
    assert not any(r.process.is_alive() for r in replicas)


def _metric(text: str, name: str, engine: str | None) -> float:
    label = f'engine="{engine}",' if engine is not None else ""
    m = re.search(rf'^{re.escape(name)}\{{{label}model_name="[^"]*"\}} (\S+)$', text, re.M)
    return float(m.group(1))


def _complete(url, prompt, **kw):
    r = httpx.post(url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": NUM_TOKENS, "temperature": 0, **kw})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.mark.slow
def test_concurrent_requests_spread_over_both_replicas_and_each_answer_is_hf_greedy(dp, hf_model, tokenizer):
    before = httpx.get(dp.url + "/metrics").text
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        texts = list(pool.map(lambda p: _complete(dp.url, p), PROMPTS))
    for prompt, text in zip(PROMPTS, texts):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert text == tokenizer.decode(hf_greedy(hf_model, ids, NUM_TOKENS))
    after = httpx.get(dp.url + "/metrics").text
    name = "vllm:generation_tokens_total"
    per_replica = [_metric(after, name, e) - _metric(before, name, e) for e in ("0", "1")]
    assert sum(per_replica) == len(PROMPTS) * NUM_TOKENS == _metric(after, name, None) - _metric(before, name, None)
    assert min(per_replica) >= 2 * NUM_TOKENS            # by load: six at once go three and three, not all to one
    assert all(r.in_flight == 0 for r in dp.replicas)


@pytest.mark.slow
def test_a_streamed_chat_through_the_router_equals_the_whole_answer(dp):
    client = OpenAI(base_url=dp.url + "/v1", api_key="none")
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=NUM_TOKENS, temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=NUM_TOKENS, temperature=0,
                                            stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content and "Paris" in text


@pytest.mark.slow
def test_a_client_that_goes_away_aborts_its_request_on_the_replica(dp):
    with httpx.stream("POST", dp.url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}) as r:
        next(r.iter_lines())                               # the first event: it is running on a replica
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        text = httpx.get(dp.url + "/metrics").text
        if _metric(text, "vllm:num_requests_running", None) == 0 and all(r.in_flight == 0 for r in dp.replicas):
            break
        time.sleep(0.2)
    else:
        pytest.fail("the request kept running after its client went away")
    assert _metric(text, "vllm:kv_cache_usage_perc", None) == 0


@pytest.mark.slow
def test_a_killed_replica_is_routed_around_and_the_other_keeps_its_blocks_straight(dp, hf_model, tokenizer):
    victim, survivor = dp.replicas
    victim.process.kill()
    victim.process.join(10)
    ids = tokenizer.encode(PROMPTS[0], add_special_tokens=False)
    want = tokenizer.decode(hf_greedy(hf_model, ids, NUM_TOKENS))
    for _ in range(3):                                     # the first may be routed to the dead one and retried
        assert _complete(dp.url, PROMPTS[0]) == want
    assert not victim.up and survivor.up
    assert httpx.get(dp.url + "/health").status_code == 200
    text = httpx.get(dp.url + "/metrics").text
    assert 'engine="1"' in text and 'engine="0"' not in text
    assert _metric(text, "vllm:num_free_kv_blocks", "1") == _metric(text, "vllm:num_kv_blocks", "1")


def _replicas(*loads):
    return [Replica(i, f"http://r{i}", in_flight=n, kv_usage=u) for i, (n, u) in enumerate(loads)]


def test_the_router_picks_the_fewest_in_flight_then_the_emptiest_cache():
    assert Router(_replicas((2, 0.1), (1, 0.9))).pick({}, "/v1/completions").index == 1
    assert Router(_replicas((1, 0.5), (1, 0.2))).pick({}, "/v1/completions").index == 1
    reps = _replicas((0, 0.0), (0, 0.0))
    reps[0].up = False
    assert Router(reps).pick({}, "/v1/completions").index == 1
    assert Router(reps).pick({}, "/v1/completions", exclude={1}) is None


def test_prefix_routing_sends_a_shared_prefix_back_to_its_replica_unless_it_is_much_busier(tokenizer):
    reps = _replicas((0, 0.0), (0, 0.0))
    router = Router(reps, "prefix", tokenizer)
    shared = PROMPTS[5] * 2                                # > 4 blocks of tokens
    first = router.pick({"prompt": shared + " A"}, "/v1/completions")
    first.in_flight += 1                                   # now the busier one
    assert router.pick({"prompt": shared + " B"}, "/v1/completions") is first
    other = router.pick({"prompt": PROMPTS[1]}, "/v1/completions")
    assert other is not first                              # no shared prefix: by load
    first.in_flight += 10
    assert router.pick({"prompt": shared + " C"}, "/v1/completions") is not first


def test_merged_metrics_label_each_engine_and_sum_counts_but_average_ratios():
    one = '# TYPE vllm:x counter\nvllm:x_total{model_name="m"} 3\nvllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
    two = '# TYPE vllm:x counter\nvllm:x_total{model_name="m"} 4\nvllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
    text = merge_metrics([one, two, None])
    assert text.count("# TYPE vllm:x counter") == 1
    assert 'vllm:x_total{engine="1",model_name="m"} 4' in text and 'vllm:x_total{model_name="m"} 7' in text
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.375' in text


@pytest.mark.slow
def test_one_engine_with_data_parallel_size_2_says_how_to_serve_replicas(model_dir):
    with pytest.raises(ValueError, match=r"data_parallel_size is 2, but one engine is one replica: serve replicas "
                                         r"with `python app.py --data-parallel-size N`"):
        LLM(str(model_dir), device="cpu", data_parallel_size=2)



def test_the_router_page_lists_each_replica_and_frames_its_live_view():
    from fastapi.testclient import TestClient

    reps = _replicas((1, 0.25), (0, 0.0))
    with TestClient(build_dp_router(reps, poll_s=60)) as client:
        page = client.get("/").text
        assert '<option value="http://r0/">engine 0: http://r0</option>' in page and "engine 1: http://r1" in page
        assert "<iframe" in page and 'fetch("replicas")' in page
        states = client.get("/replicas").json()
    assert [(s["engine"], s["in_flight"], s["kv_usage"]) for s in states] == [(0, 1, 0.25), (1, 0, 0.0)]
    assert not any(s["up"] for s in states)                  # nothing answers at r0 and r1: both marked down
