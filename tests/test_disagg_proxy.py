"""A disaggregated deployment as a client sees it: a prefill server (kv_producer) and a decode server (kv_consumer),
each `app.py`'s app on a real uvicorn port, sharing KV through the file connector, behind
`minivllm.entrypoints.disagg_proxy`, used through the official OpenAI client. The oracle is Hugging Face's greedy
text; each instance's prefill counter shows which one computed the prompt."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import torch
from openai import OpenAI

from minivllm.config import EngineConfig
from minivllm.entrypoints.api_server import run_server_in_thread
from minivllm.entrypoints.disagg_proxy import build_proxy, prefill_body
from tests.oracle import PROMPTS, hf_greedy

NUM_TOKENS = 8


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from app import build_app

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    kv = {"kv_connector": "SharedStorageConnector",
          "kv_connector_extra_config": {"shared_storage_path": str(tmp_path_factory.mktemp("kv"))}}
    servers = {}
    for role in ("kv_producer", "kv_consumer"):
        app, engine = build_app(EngineConfig(num_kv_blocks=96, device="cpu", dtype="float32",
                                             kv_transfer_config=dict(kv, kv_role=role)), dashboard=False)
        servers[role] = run_server_in_thread(app)
        servers[role].engine = engine
    proxy = run_server_in_thread(build_proxy([servers["kv_producer"].url], [servers["kv_consumer"].url]))
    yield servers["kv_producer"], servers["kv_consumer"], proxy
    proxy.stop()
    for srv in servers.values():
        srv.stop()
        srv.engine.shutdown()
    torch.set_num_threads(threads)


def _computed(srv) -> int:
    return srv.engine.engine.num_prompt_tokens_computed


def _hf_text(hf_model, tokenizer, prompt):
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    return ids, tokenizer.decode(hf_greedy(hf_model, ids, NUM_TOKENS))


@pytest.mark.slow
def test_a_streamed_completion_through_the_proxy_is_hf_greedy_and_only_the_prefill_computes_the_prompt(
        deployment, hf_model, tokenizer):
    prefill, decode, proxy = deployment
    ids, want = _hf_text(hf_model, tokenizer, PROMPTS[5])
    before = _computed(prefill), _computed(decode)
    client = OpenAI(base_url=proxy.url + "/v1", api_key="none")
    stream = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPTS[5], max_tokens=NUM_TOKENS,
                                       temperature=0, stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == want
    assert _computed(prefill) - before[0] == len(ids)         # the whole prompt, once, on the prefill instance
    assert _computed(decode) - before[1] == 1                 # only its last token on the decode instance


@pytest.mark.slow
def test_with_the_prefill_instance_down_the_decode_instance_computes_the_prompt(deployment, hf_model, tokenizer):
    _, decode, _ = deployment
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    proxy = run_server_in_thread(build_proxy([dead], [decode.url], timeout_s=10))
    try:
        ids, want = _hf_text(hf_model, tokenizer, PROMPTS[2])
        before = _computed(decode)
        r = httpx.post(proxy.url + "/v1/completions", timeout=60, json={
            "model": "SmolLM2-135M-Instruct", "prompt": PROMPTS[2], "max_tokens": NUM_TOKENS, "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want
        assert _computed(decode) - before == len(ids)
        assert proxy.server.config.app.state.num_prefill_failures == 1
    finally:
        proxy.stop()


@pytest.mark.slow
def test_a_bad_request_is_answered_by_the_prefill_instance_as_a_400(deployment):
    _, _, proxy = deployment
    r = httpx.post(proxy.url + "/v1/completions", timeout=60,
                   json={"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "temperature": -1})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]


@pytest.mark.slow
def test_a_decode_instance_that_is_down_or_silent_is_a_502_or_504_never_a_hang(deployment):
    prefill, _, _ = deployment
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    silent = socket.create_server(("127.0.0.1", 0))          # accepts connections, never answers
    held = []
    threading.Thread(target=lambda: held.append(silent.accept()), daemon=True).start()
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Hi", "max_tokens": 2}
    try:
        for url, status in ((dead, 502), (f"http://127.0.0.1:{silent.getsockname()[1]}", 504)):
            proxy = run_server_in_thread(build_proxy([prefill.url], [url], timeout_s=2))
            try:
                start = time.monotonic()
                r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=30)
                assert r.status_code == status and r.json()["error"]["code"] == status
                assert time.monotonic() - start < 15
            finally:
                proxy.stop()
    finally:
        silent.close()
    stats = prefill.engine.engine.get_stats()           # the prefill instance answered both and kept no block
    assert stats.num_running == stats.num_waiting == 0 and stats.num_free_blocks == stats.num_kv_blocks


def test_the_prefill_request_asks_for_one_token_unstreamed():
    body = {"prompt": "x", "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "min_tokens": 5, "n": 3}
    assert prefill_body(body) == {"prompt": "x", "max_tokens": 1, "max_completion_tokens": 1, "n": 1}
    assert body["max_tokens"] == 50                          # the client's request is left as it was
