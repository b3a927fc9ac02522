"""The OpenAI-compatible server, tested as a client sees it: a real uvicorn server on a free port, the official
`openai` client (and raw httpx for what the client refuses to send), concurrent and disconnecting clients.

The app is the one `python app.py` serves (`app.build_app`: API + dashboard on one engine) with a small KV
pool, so the load tests also run the engine near its limits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from minivllm.entrypoints.api_server import build_api_server, run_server_in_thread
from minivllm.config import EngineConfig

MODEL = "SmolLM2-135M-Instruct"
NUM_KV_BLOCKS = 256
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server():
    from app import build_app

    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # the engine thread gets one core, the clients and the HTTP loop the other
    app, async_engine = build_app(EngineConfig(num_kv_blocks=NUM_KV_BLOCKS, device="cpu", dtype="float32"))
    srv = run_server_in_thread(app)
    srv.engine, srv.app = async_engine, app
    yield srv
    srv.stop()
    async_engine.shutdown()
    torch.set_num_threads(threads)
    assert not async_engine.is_running


class ErrorLog(logging.Handler):
    """Collects ERROR records: the server must not log a single exception while these tests run."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(autouse=True)
def no_server_errors():
    log = ErrorLog()
    watched = [logging.getLogger(name) for name in ("uvicorn.error", "minivllm")]
    for logger in watched:
        logger.addHandler(log)
    yield
    for logger in watched:
        logger.removeHandler(log)
    assert not log.records, "the server logged errors:\n" + "\n".join(
        f"{r.name}: {r.getMessage()}\n{r.exc_text or ''}" for r in log.records)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def drained(server, timeout: float = 60.0):
    """Wait until the engine holds no request and every block is free again; returns the last snapshot."""
    deadline = time.time() + timeout
    while True:
        snap = server.engine.snapshot()
        if snap.num_requests == 0 and snap.stats.num_free_blocks == snap.stats.num_kv_blocks:
            return snap
        assert time.time() < deadline, f"not drained: {snap.num_requests} requests, {snap.stats}"
        time.sleep(0.05)


def check_integrity(server):
    server.engine.call(lambda engine: engine.check_integrity()).result(timeout=30)


def record_traces(server):
    """Start recording StepTraces (the listener is added on the engine thread); returns (traces, stop)."""
    traces = []
    server.engine.call(lambda engine: engine.add_trace_listener(traces.append)).result(timeout=30)
    return traces, lambda: server.engine.call(lambda e: e.remove_trace_listener(traces.append)).result(timeout=30)


# ---------------------------------------------------------------------- the basics, with the official client
def test_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == server.engine.max_model_len
    # The model's path is accepted as its name too, as in vLLM.
    out = client.completions.create(model=models[0].root, prompt="Hello", max_tokens=2, temperature=0)
    assert out.model == MODEL


def test_completion_is_the_engines_greedy_continuation(client, hf_model, hf_tokenizer):
    from tests.oracle import hf_greedy

    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    ids = hf_tokenizer.encode("The capital of France is", add_special_tokens=False)
    expected = hf_tokenizer.decode(hf_greedy(hf_model, ids, 8), skip_special_tokens=True)
    choice = out.choices[0]
    assert choice.text == expected
    assert choice.finish_reason == "length"
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (len(ids), 8,
                                                                                             len(ids) + 8)


def test_chat_uses_the_chat_template_and_stops_at_eos(client, hf_tokenizer):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=32, temperature=0)
    prompt_ids = hf_tokenizer.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True)
    if not isinstance(prompt_ids, list):                 # newer transformers return a BatchEncoding
        prompt_ids = prompt_ids["input_ids"]
    assert out.usage.prompt_tokens == len(prompt_ids)
    msg = out.choices[0].message
    assert msg.role == "assistant" and "Paris" in msg.content
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens < 32   # EOS, not the limit
    assert out.object == "chat.completion" and out.id.startswith("chatcmpl-")


def test_streamed_chat_adds_up_to_the_unstreamed_answer(client):
    kwargs = dict(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in with_choices][-1] == whole.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"
    usage_chunk = chunks[-1]                             # OpenAI: a last chunk with usage and no choices
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_server_sent_events_end_with_done(server):
    body = {"model": MODEL, "prompt": "One, two, three,", "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)
    payloads = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in p for p in payloads)       # no stream_options: no usage chunk


@pytest.mark.slow
def test_stop_strings_seed_top_k_and_top_p(client):
    out = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 7"])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].stop_reason == " 7"
    assert " 7" not in out.choices[0].text and out.choices[0].text.startswith(" 5, 6,")
    sampled = dict(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=1.0, top_p=0.9, seed=7,
                   extra_body={"top_k": 40})
    first = client.completions.create(**sampled).choices[0].text
    assert client.completions.create(**sampled).choices[0].text == first      # a seed makes it reproducible
    other = {client.completions.create(**{**sampled, "seed": s}).choices[0].text for s in (8, 9)}
    assert other - {first}                                                     # and other seeds differ


# ---------------------------------------------------------------------- concurrency and disconnects
@pytest.mark.slow
def test_sixteen_concurrent_streams_are_batched_together(server):
    traces, stop_recording = record_traces(server)

    async def one(client, i):
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Count from {i} to {i + 20}."}], max_tokens=12,
            temperature=0, stream=True, extra_body={"ignore_eos": True})
        text, reason = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(16)))

    try:
        results = asyncio.run(main())
    finally:
        stop_recording()
    assert [reason for _, reason in results] == ["length"] * 16 and all(text for text, _ in results)
    assert max(t.num_running for t in traces) >= 8, [t.num_running for t in traces]
    drained(server)
    check_integrity(server)


@pytest.mark.slow
def test_a_request_sent_during_a_step_joins_the_very_next_step(client, server):
    """The route tokenizes, sizes and adds a request in one trip to the engine thread (add_requests). Each trip
    waits for the step in flight, so a tokenize and then an add joined the batch a whole step later: this test
    slows every step to 0.3 s, sends a request just after one began, and finds its prefill in the next step."""
    import threading

    traces, stop_recording = record_traces(server)
    started, inflight = threading.Event(), []

    def slow_steps(engine):
        step = engine.step

        def slow_step():
            inflight.append(len(traces))      # the index in `traces` of the trace this step will append
            started.set()
            time.sleep(0.3)
            return step()
        engine.step = slow_step

    server.engine.call(slow_steps).result(timeout=30)
    try:
        long_one = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        chunks = iter(long_one)
        next(chunks)                           # it is decoding now, one slow step after another
        started.clear()
        assert started.wait(10)
        in_flight = inflight[-1]
        out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=1,
                                        temperature=0)
        list(chunks)
    finally:
        server.engine.call(lambda engine: engine.__dict__.pop("step")).result(timeout=30)
        stop_recording()
    assert out.choices[0].finish_reason == "length"
    prefills = [i for i, t in enumerate(traces) if i > in_flight and t.num_prefill_tokens]
    assert prefills and prefills[0] == in_flight + 1, (in_flight, prefills)
    drained(server)
    check_integrity(server)


def test_a_client_that_hangs_up_mid_stream_is_aborted_and_its_blocks_freed(client, server):
    stream = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=300, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True})
    request_id, seen = None, 0
    for chunk in stream:
        request_id = chunk.id
        seen += bool(chunk.choices and chunk.choices[0].delta.content)
        if seen == 3:
            break
    assert server.engine.snapshot().stats.num_free_blocks < NUM_KV_BLOCKS     # it holds blocks now
    stream.close()                                                            # hang up
    snap = drained(server)
    assert server.engine.finish_reason_of(request_id) == "abort"
    assert snap.stats.num_free_blocks == snap.stats.num_kv_blocks
    check_integrity(server)


def test_a_client_that_gives_up_on_a_non_streamed_answer_is_aborted(server):
    before = server.engine.snapshot().finished.get("abort", 0)
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    snap = drained(server)
    assert snap.finished.get("abort", 0) == before + 1
    assert snap.stats.num_generated_tokens < 10_000      # it did not run to 400 tokens unseen
    check_integrity(server)


@pytest.mark.slow
def test_load_64_clients_a_quarter_hanging_up(server):
    """64 clients at once; 16 hang up at random moments (mid-stream, or while waiting for an answer). Every
    other request must come back exactly as it does alone (greedy, same text and finish reason), nothing
    may leak, and the server must answer normally afterwards."""
    rng = random.Random(6)
    hangers = set(rng.sample(range(64), 16))
    prompts = ["The three primary colors are", "A good breakfast has", "Rivers flow into", "My favorite book is"]
    questions = ["Name a fruit.", "What is 2 + 2?", "Say hello in French.", "What color is the sky?"]

    def request_of(i: int) -> dict:
        """The i-th client's request. Its kind (chat / completion) and prompt decide the answer; whether it
        is streamed must not change it."""
        kind, p = ("chat", "completion")[i % 2], i // 2 % 4
        body = {"model": MODEL, "temperature": 0, "max_tokens": (6, 8, 10, 12)[p], "stream": i % 4 >= 2}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": questions[p]}]
        else:
            body.update(prompt=prompts[p], stop=["\n"] if p % 2 == 0 else None)
        if i in hangers:
            body.update(max_tokens=200, ignore_eos=True)
        return {"kind": kind, "body": body, "key": (kind, p)}

    async def run(client: openai.AsyncOpenAI, i: int, hang_up: bool) -> dict:
        req = request_of(i)
        body = dict(req["body"])
        create = client.chat.completions.create if req["kind"] == "chat" else client.completions.create
        stream = body.pop("stream")
        extra = {"ignore_eos": body.pop("ignore_eos")} if "ignore_eos" in body else None
        if not stream:
            call = create(**body, extra_body=extra)
            if hang_up:              # give up at a random moment while the answer is being computed
                with pytest.raises(asyncio.TimeoutError):
                    await asyncio.wait_for(call, timeout=rng.uniform(0.05, 1.5))
                return {"hung_up": True}
            out = await call
            c = out.choices[0]
            text = c.message.content if req["kind"] == "chat" else c.text
            return {"text": text, "finish_reason": c.finish_reason, "tokens": out.usage.completion_tokens}
        response = await create(**body, extra_body=extra, stream=True)
        text, reason, chunks, stop_after = "", None, 0, rng.randint(1, 4)
        async for chunk in response:
            c = chunk.choices[0]
            text += (c.delta.content or "") if req["kind"] == "chat" else c.text
            reason = c.finish_reason or reason
            chunks += 1
            if hang_up and chunks == stop_after:
                await response.close()
                return {"hung_up": True, "id": chunk.id}
        return {"text": text, "finish_reason": reason}

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0,
                                      timeout=300) as client:
            loaded = await asyncio.gather(*(run(client, i, i in hangers) for i in range(64)))
            drained(server)                    # every hang-up has been noticed and aborted by now
            # The oracle: each distinct request once more, alone, after the load.
            alone = {}
            for i in range(64):
                key = request_of(i)["key"]
                if i not in hangers and key not in alone:
                    alone[key] = await run(client, i, hang_up=False)
            return loaded, alone

    finished_before = server.engine.snapshot().finished
    traces, stop_recording = record_traces(server)
    try:
        loaded, alone = asyncio.run(main())
    finally:
        stop_recording()
    snap = drained(server)
    print(f"load: {len(traces)} steps, at most {max(t.num_running for t in traces)} running, "
          f"{snap.stats.num_preemptions} preemptions so far, finished {snap.finished}")
    assert max(t.num_running for t in traces) >= 32          # the clients really were served together
    for i, result in enumerate(loaded):
        if i in hangers:
            assert result["hung_up"]
            if "id" in result:                 # a stream we hung up on: its request was aborted
                assert server.engine.finish_reason_of(result["id"]) == "abort", i
            continue
        expected = alone[request_of(i)["key"]]
        assert (result["text"], result["finish_reason"]) == (expected["text"], expected["finish_reason"]), i
        assert result["finish_reason"] in ("stop", "length")
        if "tokens" in result:
            max_tokens = request_of(i)["body"]["max_tokens"]
            assert (result["finish_reason"] == "length") == (result["tokens"] == max_tokens)
    done = {reason: snap.finished.get(reason, 0) - finished_before.get(reason, 0) for reason in snap.finished}
    assert done.get("stop", 0) + done.get("length", 0) == 48 + len(alone)    # every answer ended once
    # A client that gave up before its request reached the engine leaves no request to abort.
    streamed_hangers = sum("id" in r for r in loaded)
    assert streamed_hangers <= done.get("abort", 0) <= 16
    assert done.get("error", 0) == 0
    assert snap.stats.num_free_blocks == NUM_KV_BLOCKS and snap.stats.num_running == snap.stats.num_waiting == 0
    check_integrity(server)
    assert httpx.get(server.url + "/health").status_code == 200


# ---------------------------------------------------------------------- bad input: 400, OpenAI's error body
LONG_IDS = list(range(100, 9100))         # 9,000 tokens: over max_model_len (8,192)

BAD_REQUESTS = [
    # (case, route, body (bytes are sent raw), the "param" OpenAI's body must name)
    ("malformed_json", "completions", b'{"prompt": "hi", ', None),
    ("body_not_an_object", "completions", b'["hi"]', None),
    ("body_not_utf8", "completions", b'\xff\xfe{"prompt"', None),
    ("missing_prompt", "completions", {"model": MODEL}, "prompt"),
    ("prompt_wrong_type", "completions", {"prompt": 42}, "prompt"),
    ("empty_prompt_list", "completions", {"prompt": []}, "prompt"),
    ("prompt_list_with_a_number", "completions", {"prompt": ["a", 3]}, "prompt"),
    ("empty_prompt", "completions", {"prompt": ""}, "prompt"),
    ("prompt_over_the_context", "completions", {"prompt": LONG_IDS}, "prompt"),
    ("prompt_plus_max_tokens_over_the_kv_pool", "completions", {"prompt": "hi", "max_tokens": 5000}, "prompt"),
    ("token_id_out_of_vocab", "completions", {"prompt": [1, 2, 10 ** 9]}, "prompt"),
    ("model_wrong_type", "completions", {"model": 7, "prompt": "hi"}, "model"),
    ("max_tokens_zero", "completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens_negative", "chat", {"messages": CHAT, "max_tokens": -5}, "max_tokens"),
    ("max_completion_tokens_zero", "chat", {"messages": CHAT, "max_completion_tokens": 0},
     "max_completion_tokens"),
    ("max_tokens_string", "completions", {"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    ("max_tokens_float", "completions", {"prompt": "hi", "max_tokens": 2.5}, "max_tokens"),
    ("max_tokens_bool", "completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("temperature_negative", "completions", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("temperature_string", "chat", {"messages": CHAT, "temperature": "hot"}, "temperature"),
    ("temperature_nan", "completions", b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    ("top_p_zero", "completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("top_p_above_one", "chat", {"messages": CHAT, "top_p": 1.5}, "top_p"),
    ("top_k_below_minus_one", "completions", {"prompt": "hi", "top_k": -2}, "top_k"),
    ("top_k_huge", "completions", {"prompt": "hi", "top_k": 10 ** 30}, "top_k"),
    ("seed_string", "completions", {"prompt": "hi", "seed": "abc"}, "seed"),
    ("n_above_128", "chat", {"messages": CHAT, "n": 129}, "n"),
    ("n_zero", "completions", {"prompt": "hi", "n": 0}, "n"),
    ("max_tokens_past_the_context", "completions", {"prompt": "hi", "max_tokens": 8192}, "max_tokens"),
    ("max_completion_tokens_past_the_context", "chat", {"messages": CHAT, "max_completion_tokens": 9000},
     "max_completion_tokens"),
    ("a_typo", "completions", {"prompt": "hi", "max_tokenz": 3}, "max_tokenz"),
    ("chat_field_on_completions", "completions", {"prompt": "hi", "continue_final_message": True},
     "continue_final_message"),
    ("continue_final_message_and_add_generation_prompt", "chat", {
        "messages": CHAT, "continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
    ("chat_template_that_does_not_parse", "chat", {"messages": CHAT, "chat_template": "{% for %}"},
     "chat_template"),
    ("stop_wrong_type", "completions", {"prompt": "hi", "stop": 5}, "stop"),
    ("bad_words_lone_surrogate", "chat", {"messages": CHAT, "bad_words": ["\ud800"]}, "bad_words"),
    ("stop_list_with_a_number", "completions", {"prompt": "hi", "stop": ["x", 1]}, "stop"),
    ("stop_empty_string", "completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("stream_wrong_type", "chat", {"messages": CHAT, "stream": "yes"}, "stream"),
    ("stream_options_without_stream", "chat", {"messages": CHAT, "stream_options": {"include_usage": True}},
     "stream_options"),
    ("logprobs_above_the_max", "completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("presence_penalty_out_of_range", "chat", {"messages": CHAT, "presence_penalty": 2.5}, "presence_penalty"),
    ("logit_bias_key_not_a_token_id", "completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
    ("logit_bias_not_a_number", "completions", {"prompt": "hi", "logit_bias": {"42": "x"}}, "logit_bias"),
    # Digits str.isdigit() takes but int() does not ("²", "①": once a 500) or reads as another number ("٣", "０").
    ("logit_bias_key_superscript_two", "completions", {"prompt": "hi", "logit_bias": {"²": 1}}, "logit_bias"),
    ("logit_bias_key_circled_one", "chat", {"messages": CHAT, "logit_bias": {"①": 1}}, "logit_bias"),
    ("logit_bias_key_arabic_indic_three", "completions", {"prompt": "hi", "logit_bias": {"٣": 1}}, "logit_bias"),
    ("logit_bias_key_fullwidth_zero", "chat", {"messages": CHAT, "logit_bias": {"０": 1}}, "logit_bias"),
    ("min_p_wrong_type", "chat", {"messages": CHAT, "min_p": "0.1"}, "min_p"),
    ("stop_token_id_at_the_vocabulary_size", "completions", {"prompt": "hi", "stop_token_ids": [49152]},
     "stop_token_ids"),
    ("stop_token_id_far_outside_the_vocabulary", "chat", {"messages": CHAT, "stop_token_ids": [2, 10 ** 12]},
     "stop_token_ids"),
    ("missing_messages", "chat", {"model": MODEL}, "messages"),
    ("empty_messages", "chat", {"messages": []}, "messages"),
    ("messages_not_a_list", "chat", {"messages": "hello"}, "messages"),
    ("message_not_an_object", "chat", {"messages": ["hello"]}, "messages[0]"),
    ("unknown_role", "chat", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("missing_role", "chat", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("content_wrong_type", "chat", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
    ("image_content_part", "chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "messages[0].content"),
    ("chat_over_the_context", "chat", {"messages": [{"role": "user", "content": "hello " * 9000}]}, "messages"),
    # Input that once raised something other than ValueError (OverflowError, RecursionError, TypeError,
    # UnicodeEncodeError) and became a 500.
    ("temperature_too_large_for_a_float", "completions", b'{"prompt": "hi", "temperature": 1' + b"0" * 400 + b"}",
     "temperature"),
    ("top_p_too_large_for_a_float", "chat", b'{"messages": [{"role": "user", "content": "hi"}], "top_p": -'
     + b"9" * 400 + b"}", "top_p"),
    ("body_nested_too_deep", "completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None),
    ("prompt_with_a_lone_surrogate", "completions", b'{"prompt": "caf\\ud800"}', "prompt"),
    ("stop_with_a_lone_surrogate", "completions", b'{"prompt": "hi", "stop": ["ok", "\\ud800"]}', "stop"),
    ("user_not_a_string", "chat", {"messages": CHAT, "user": {"id": 1}}, "user"),
    ("user_too_long", "completions", {"prompt": "hi", "user": "u" * 10_000}, "user"),
    ("content_with_a_lone_surrogate", "chat", b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
     "messages[0].content"),
]


@pytest.mark.parametrize("case,route,body,param", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_is_a_400_with_an_openai_error_body(server, case, route, body, param):
    url = f"{server.url}/v1/{'chat/completions' if route == 'chat' else 'completions'}"
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert len(error["message"]) > 20                    # a sentence naming the value and the fix


@pytest.mark.parametrize("name", ["temperature", "top_p"])
def test_a_json_number_too_large_for_a_float_is_a_400_naming_the_field(server, name):
    """A 400-digit integer is valid JSON but no float holds it: the answer names the field and the limit."""
    body = b'{"prompt": "hi", "max_tokens": 1, "%s": %s}' % (name.encode(), b"9" * 400)
    r = httpx.post(server.url + "/v1/completions", content=body, headers={"content-type": "application/json"},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == name and error["type"] == "invalid_request_error"
    assert f"'{name}' is an integer of 400 digits" in error["message"] and "finite number" in error["message"]


def test_the_official_client_raises_bad_request_and_the_server_keeps_serving(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-1)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-this-one", prompt="hi")
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.slow
def test_no_field_value_makes_a_500(server):
    """Every field, every JSON type: the answer is a 200 or a 400, never a 500, and the engine lives on."""
    values = [None, True, -1, 0, 3, 2.5, 1e308, 10 ** 400, -(10 ** 400), "x", "\ud800", [], [1], ["x"], {},
              {"a": 1}]
    fields = ["prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "n",
              "stream", "stream_options", "ignore_eos", "skip_special_tokens", "model", "logprobs", "echo"]
    bodies = [("completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 1, name: value})
              for name in fields for value in values]
    bodies += [("chat/completions", {"messages": value, "max_tokens": 1}) for value in values]
    bodies += [("chat/completions", {"messages": [{"role": "user", "content": value}], "max_tokens": 1})
               for value in values]

    async def main():                     # all at once: the valid ones are batched, so this stays quick
        async with httpx.AsyncClient(base_url=server.url + "/v1", timeout=120) as http:
            # json.dumps escapes "\ud800" (httpx's own encoder would refuse to send it)
            return await asyncio.gather(*(http.post("/" + route, content=json.dumps(body).encode(),
                                                    headers={"content-type": "application/json"})
                                          for route, body in bodies))

    responses = asyncio.run(main())
    statuses = set()
    for (route, body), r in zip(bodies, responses):
        statuses.add(r.status_code)
        # 404: a model name that is not served (every string but the served name)
        assert r.status_code in (200, 400) or (r.status_code == 404 and isinstance(body.get("model"), str)), \
            (route, body, r.status_code, r.text)
        if r.status_code == 400:
            assert r.json()["error"]["type"] == "invalid_request_error"
        if route == "chat/completions" and not isinstance(body["messages"], list):
            assert r.status_code == 400
    assert statuses == {200, 400, 404}
    drained(server)
    check_integrity(server)
    assert server.engine.snapshot().num_step_errors == 0


def test_fastapi_validation_errors_and_unknown_routes_get_openai_bodies(server):
    app = build_api_server(server.engine)

    @app.get("/v1/typed")                # a typed parameter: FastAPI itself would answer 422
    async def typed(n: int):
        return {"n": n}

    srv = run_server_in_thread(app)
    try:
        r = httpx.get(srv.url + "/v1/typed", params={"n": "seven"})
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "invalid_request_error" and r.json()["error"]["param"] == "n"
        r = httpx.get(srv.url + "/v1/no-such-route")
        assert r.status_code == 404 and r.json()["error"]["message"]
        r = httpx.get(srv.url + "/v1/completions")                      # a POST route
        assert r.status_code == 405 and r.json()["error"]["message"]
    finally:
        srv.stop()


# ---------------------------------------------------------------------- API key, health, metrics
def test_api_key_is_required_on_v1_when_set(server):
    from minivllm.entrypoints.dashboard import mount_dashboard

    app = mount_dashboard(build_api_server(server.engine, api_key="sekret"), server.engine, api_key="sekret")
    keyed = run_server_in_thread(app)
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"},
                        {"Authorization": "Basic sekret"}):
            r = httpx.get(keyed.url + "/v1/models", headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
            r = httpx.post(keyed.url + "/v1/completions", headers=headers, json={"prompt": "hi"})
            assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sekret", max_retries=0)
        assert good.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
        for scheme in ("bearer", "BEARER"):                                # the scheme's case does not matter
            assert httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"{scheme} sekret"}).status_code == 200
        assert httpx.get(keyed.url + "/health").status_code == 200          # outside /v1: open, as vLLM
        assert httpx.head(keyed.url + "/health").status_code == 200
        assert httpx.get(keyed.url + "/metrics").status_code == 200
        # The dashboard asks for a login: any user name, the API key as password.
        with httpx.Client(base_url=keyed.url) as browser:
            assert browser.get("/config").status_code == 401
            assert browser.post("/login", data={"username": "me", "password": "wrong"}).status_code == 400
            assert browser.post("/login", data={"username": "me", "password": "sekret"}).status_code == 200
            assert browser.get("/config").status_code == 200
    finally:
        keyed.stop()


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_a_body_that_is_not_declared_json_is_a_415(server, route, content_type):
    """A web page can POST text/plain or a form to a local server without the browser asking it first (no CORS
    preflight), so only application/json is read, as vLLM: a JSON body sent as anything else is a 415 naming the
    header and the fix, and nothing is generated."""
    body = json.dumps({"/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1},
                       "/v1/chat/completions": {"model": MODEL, "messages": CHAT, "max_tokens": 1},
                       "/tokenize": {"model": MODEL, "prompt": "hi"},
                       "/detokenize": {"model": MODEL, "tokens": [1]}}[route]).encode()
    before = server.engine.snapshot()
    headers = {} if content_type is None else {"content-type": content_type}
    r = httpx.post(server.url + route, content=body, headers=headers, timeout=60)
    assert r.status_code == 415, r.text
    error = r.json()["error"]
    assert error["type"] == "unsupported_media_type" and "Content-Type: application/json" in error["message"]
    assert server.engine.snapshot().num_prompt_tokens == before.num_prompt_tokens      # no request accepted
    # The same bytes declared as JSON (with a charset, in any case) are served.
    ok = httpx.post(server.url + route, content=body, headers={"content-type": "Application/JSON; charset=utf-8"},
                    timeout=60)
    assert ok.status_code == 200, ok.text


def test_api_key_defaults_to_vllm_api_key(monkeypatch):
    import app
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert app.build_parser().parse_args([]).api_key == "from-env"
    assert app.build_parser().parse_args(["--api-key", "flag"]).api_key == "flag"
    monkeypatch.delenv("VLLM_API_KEY")
    assert app.build_parser().parse_args([]).api_key is None


def test_metrics_are_prometheus_text_that_matches_the_engine(client, server):
    before = server.engine.snapshot()
    for _ in range(3):
        client.completions.create(model=MODEL, prompt="Metrics, metrics", max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    drained(server)
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}    # the reference parser
    value = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
             for f in families.values() for s in f.samples}
    snap = server.engine.snapshot()
    assert value[("vllm:num_requests_running", ())] == 0
    assert value[("vllm:num_requests_waiting", ())] == 0
    assert value[("vllm:kv_cache_usage_perc", ())] == 0.0
    assert value[("vllm:num_free_kv_blocks", ())] == NUM_KV_BLOCKS
    assert value[("vllm:prefix_cache_hit_rate", ())] == pytest.approx(snap.stats.prefix_cache_hit_rate)
    assert value[("vllm:num_preemptions_total", ())] == snap.stats.num_preemptions
    assert value[("vllm:generation_tokens_total", ())] == snap.stats.num_generated_tokens
    assert value[("vllm:request_success_total", (("finished_reason", "length"),))] == \
        before.finished.get("length", 0) + 3
    for name in ("vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds"):
        assert families[name].type == "histogram"
        buckets = [s.value for s in families[name].samples if s.name == name + "_bucket"]
        assert buckets == sorted(buckets)                                      # cumulative
        assert buckets[-1] == value[(name + "_count", ())] > 0
    ttft_count = value[("vllm:time_to_first_token_seconds_count", ())]
    assert ttft_count - before.ttft.count == 3                                 # one first token per request
    itl_count = value[("vllm:inter_token_latency_seconds_count", ())]
    assert itl_count - before.itl.count == 3 * 3                               # 4 tokens: 3 gaps each


def test_bench_serve_streams_poisson_requests_and_reports_latencies(server, tmp_path):
    """`python -m minivllm.bench serve` against this server: every request completes with exactly the
    tokens it asked for (ignore_eos), and TTFT / ITL / E2E percentiles come out ordered."""
    from minivllm.bench.cli import main

    out = tmp_path / "serve.json"
    rc = main(["serve", "--base-url", server.url, "--num-requests", "8", "--request-rate", "20",
                     "--input-len-min", "4", "--input-len-max", "12", "--output-len-min", "8", "--output-len-max", "8",
                     "--json", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0 and report["num_ok"] == 8 and report["errors"] == []
    assert report["output_tokens"] == 8 * 8
    assert 0 < report["ttft_p50_ms"] <= report["ttft_p99_ms"] <= report["e2e_p99_ms"]
    assert 0 < report["itl_p50_ms"] <= report["itl_p99_ms"]
    drained(server)


# ---------------------------------------------------------------------- no silent acceptance (issue 14, part 5)
# Each of these was once accepted and ignored: the caller believed it had an effect.
NOT_IMPLEMENTED_VALUES = [("guided_whitespace_pattern", "[ ]?"), ("functions", [{"name": "f"}]),
                          ("best_of", 3), ("suffix", "end")]


@pytest.mark.parametrize("name,value", NOT_IMPLEMENTED_VALUES, ids=[n for n, _ in NOT_IMPLEMENTED_VALUES])
def test_an_unimplemented_field_is_a_400_naming_it(client, name, value):
    for create, kwargs in ((client.completions.create, dict(prompt="hi")),
                           (client.chat.completions.create, dict(messages=CHAT))):
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, max_tokens=2, **kwargs, extra_body={name: value})
        assert e.value.body["param"] == name and "does not implement" in e.value.message


@pytest.mark.slow
def test_penalties_and_filters_reach_the_sampler(client, llm):
    """Each field changes the answer exactly as the same SamplingParams do offline (tests/test_penalties.py holds
    those to Hugging Face and to hand-written references)."""
    from minivllm import SamplingParams

    prompt = "The capital of France is"
    fields = dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5, min_tokens=12,
                  bad_words=["Paris"])
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=fields)
    want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, **fields), use_tqdm=False)[0].outputs[0]
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert out.choices[0].text == want.text != plain.text and "Paris" not in out.choices[0].text
    token = llm.get_tokenizer().encode(" yes", add_special_tokens=False)[0]
    biased = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                       logit_bias={str(token): 100})
    assert biased.choices[0].text == " yes" * 4
    allowed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.9, seed=1,
                                        extra_body={"allowed_token_ids": [token], "min_p": 0.05})
    assert allowed.choices[0].text == " yes" * 4


def test_a_typo_is_a_400_that_names_the_field_meant(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", extra_body={"max_tokenz": 3})
    assert e.value.body["param"] == "max_tokenz" and "Did you mean 'max_tokens'?" in e.value.message


def test_fields_left_at_their_off_value_are_accepted(client):
    """Clients (vLLM's benchmark, the openai SDK's defaults) send some unimplemented fields as 'off'."""
    out = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logprobs=None, best_of=1, echo=False,
                                    presence_penalty=0, extra_body={"min_p": 0.0, "min_tokens": 0}, user="me")
    assert out.usage.completion_tokens <= 2


def test_include_stop_str_in_output_keeps_the_stop_string(client):
    kwargs = dict(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 7"])
    without = client.completions.create(**kwargs).choices[0]
    kept = client.completions.create(**kwargs, extra_body={"include_stop_str_in_output": True}).choices[0]
    assert kept.finish_reason == "stop" and kept.text == without.text + " 7"


def test_an_unknown_model_is_a_404_as_vllm_answers_it(client, server):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    r = httpx.post(server.url + "/v1/completions", json={"model": "gpt-4", "prompt": "hi"})
    error = r.json()["error"]
    assert r.status_code == 404 and error["type"] == "NotFoundError" and error["code"] == 404
    assert error["param"] == "model" and "gpt-4" in error["message"]
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "\\ud800", "prompt": "hi"}',
                   headers={"content-type": "application/json"})     # a name JSON can hold but UTF-8 cannot
    assert r.status_code == 404 and "\\ud800" in r.json()["error"]["message"]


def test_max_tokens_that_fits_the_context_exactly_is_accepted(client, server, hf_tokenizer):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi there", max_tokens=server.engine.max_model_len)
    assert e.value.body["param"] == "max_tokens" and "max_model_len is 8192" in e.value.message
    n = len(hf_tokenizer.encode("Hi there"))
    # The 400 is for the context only; the KV pool's own (smaller) limit is the engine's check.
    assert server.engine.max_request_tokens < server.engine.max_model_len
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi there", max_tokens=server.engine.max_model_len - n)
    assert e.value.body["param"] == "prompt" and "KV blocks" in e.value.message


# ---------------------------------------------------------------------- lists of prompts, n choices
@pytest.mark.slow
def test_a_list_of_prompts_gets_one_choice_each_with_usage_summed(client):
    prompts = ["The capital of France is", "One, two, three,", [504, 3458, 282]]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [a.choices[0].text for a in alone]
    assert [c.finish_reason for c in out.choices] == [a.choices[0].finish_reason for a in alone]
    for field in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(out.usage, field) == sum(getattr(a.usage, field) for a in alone)
    # Streamed: each chunk's choice carries its index; joined per index they are the same texts.
    texts, reasons, usage = {}, {}, None
    for chunk in client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            reasons[c.index] = c.finish_reason or reasons.get(c.index)
    assert texts == {i: c.text for i, c in enumerate(out.choices)}
    assert reasons == {i: c.finish_reason for i, c in enumerate(out.choices)}
    assert usage.completion_tokens == out.usage.completion_tokens and usage.prompt_tokens == out.usage.prompt_tokens


def test_n_choices_are_seeded_samples_streamed_by_index(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0, seed=3, n=3,
                  extra_body={"ignore_eos": True})
    out = client.completions.create(**kwargs)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1                    # the samples differ
    assert out.usage.completion_tokens == 3 * 8                      # every sample counted, the prompt once
    texts, usage = {}, None
    for chunk in client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == {c.index: c.text for c in out.choices}           # seeded: the stream is the same answer
    assert usage.completion_tokens == 24 and usage.prompt_tokens == out.usage.prompt_tokens


@pytest.mark.slow
def test_n_chat_choices_and_prompt_lists_number_choices_as_vllm(client):
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content     # greedy: the same answer
    roles, content = {}, {}
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0, n=2,
                                                stream=True):
        for c in chunk.choices:
            roles[c.index] = c.delta.role or roles.get(c.index)
            content[c.index] = content.get(c.index, "") + (c.delta.content or "")
    assert roles == {0: "assistant", 1: "assistant"}
    assert content == {0: chat.choices[0].message.content, 1: chat.choices[1].message.content}
    # Two prompts, n=2: choice index = prompt_index * n + sample_index.
    prompts = ["The capital of France is", "One, two, three,"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0, n=2)
    greedy = [client.completions.create(model=MODEL, prompt=p, max_tokens=5, temperature=0).choices[0].text
              for p in prompts]
    assert [(c.index, c.text) for c in out.choices] == [(0, greedy[0]), (1, greedy[0]), (2, greedy[1]),
                                                        (3, greedy[1])]


# ---------------------------------------------------------------------- vLLM's tokenizer routes, chat options
def test_tokenize_and_detokenize_match_the_tokenizer(server, hf_tokenizer):
    text = "The capital of France is Paris."
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200
    ids = hf_tokenizer.encode(text)
    assert r.json() == {"count": len(ids), "max_model_len": server.engine.max_model_len, "tokens": ids,
                        "token_strs": None}
    r = httpx.post(server.url + "/tokenize", json={"messages": CHAT})
    chat_ids = hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert r.json()["tokens"] == hf_tokenizer.encode(chat_ids, add_special_tokens=False)
    r = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": text}
    assert httpx.get(server.url + "/version").json() == {"version": __import__("minivllm").__version__}


@pytest.mark.parametrize("route,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": CHAT}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "max_tokens": 3}, "max_tokens"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {"tokens": [1], "prompt": "x"}, "prompt"),
])
def test_tokenizer_routes_refuse_bad_bodies_with_a_400(server, route, body, param):
    r = httpx.post(server.url + route, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_continue_final_message_and_a_per_request_chat_template(client, server, hf_tokenizer, monkeypatch):
    monkeypatch.setattr(server.app.state.renderer, "trust_request_chat_template", True)   # --trust-request-...
    partial = CHAT + [{"role": "assistant", "content": "The capital of France is"}]
    expected = hf_tokenizer.apply_chat_template(partial, tokenize=False, continue_final_message=True)
    assert expected.endswith("The capital of France is")             # the message is left open
    body = {"messages": partial, "continue_final_message": True, "add_generation_prompt": False}
    tokens = httpx.post(server.url + "/tokenize", json=body).json()["tokens"]
    assert tokens == hf_tokenizer.encode(expected, add_special_tokens=False)
    out = client.chat.completions.create(model=MODEL, messages=partial, max_tokens=4, temperature=0,
                                         extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert out.usage.prompt_tokens == len(tokens)
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    rendered = "[user] What is the capital of France?\n"
    r = httpx.post(server.url + "/tokenize", json={"messages": CHAT, "chat_template": template})
    assert r.json()["tokens"] == hf_tokenizer.encode(rendered, add_special_tokens=False)
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                         extra_body={"chat_template": template, "ignore_eos": True})
    assert out.usage.prompt_tokens == r.json()["count"] and out.usage.completion_tokens == 3
    alone = client.completions.create(model=MODEL, prompt=rendered, max_tokens=3, temperature=0)
    assert out.choices[0].message.content == alone.choices[0].text    # the template really was used


def test_streamed_usage_is_exact(client, hf_tokenizer):
    prompt = "Counting: one, two,"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and all(c.usage is None for c in chunks[:-1])
    n = len(hf_tokenizer.encode(prompt))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (n, 7, n + 7)


def test_cache_salt_is_taken_and_a_bad_one_is_a_400_naming_it(client):
    """vLLM's cache_salt: accepted on both routes (tests/test_cache_salt.py checks what it does); not a string: 400."""
    for salt in ("tenant-a", "tenant-b"):
        out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0,
                                        extra_body={"cache_salt": salt})
        assert out.choices[0].text
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body={"cache_salt": "x"})
    assert chat.choices[0].message.content is not None
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"cache_salt": 5})
    assert e.value.body["param"] == "cache_salt" and "cache_salt is 5" in e.value.body["message"]
