"""vLLM's extra request fields, as a client sees them (the official `openai` client, vLLM's fields through
`extra_body`, against real servers on one engine): `return_token_ids`, `return_tokens_as_token_ids` (and the server
flag `--return-tokens-as-token-ids`), `truncation_side`, chat's `prompt_logprobs` and `echo`,
`stream_options.continuous_usage_stats`, `GET /tokenizer_info` (behind `--enable-tokenizer-info-endpoint`) and
`priority`. Each is checked against an oracle of its own: Hugging Face's tokenizer and chat template for token ids,
Hugging Face's log_softmax for prompt logprobs, the offline engine for generated tokens and for the order
priorities give, the checkpoint's tokenizer_config.json for the tokenizer info.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch

from minivllm import SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLMEngine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.api_server import build_api_server, run_server_in_thread

from test_api_server import MODEL, hf_tokenizer, no_server_errors  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow       # real servers for this module, each answer checked against an oracle

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def servers():
    """Three servers on one engine: `main` with --enable-tokenizer-info-endpoint, `ids` with
    --return-tokens-as-token-ids, `plain` with neither."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # the engine thread gets one core, the clients and the HTTP loop the other
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(num_kv_blocks=128, device="cpu", dtype="float32")))
    main = run_server_in_thread(build_api_server(engine, enable_tokenizer_info_endpoint=True))
    ids = run_server_in_thread(build_api_server(engine, return_tokens_as_token_ids=True))
    plain = run_server_in_thread(build_api_server(engine))
    yield {"main": main, "ids": ids, "plain": plain}
    for srv in (main, ids, plain):
        srv.stop()
    engine.shutdown()
    torch.set_num_threads(threads)


def client_of(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(servers):
    return client_of(servers["main"])


def extra(obj, name):
    """A field vLLM adds to OpenAI's response objects (the client keeps unknown fields as extras)."""
    return (obj.model_extra or {}).get(name)


def chat_ids(hf_tokenizer, messages, **kw) -> list[int]:
    ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kw)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


# ---------------------------------------------------------------------- return_token_ids
def test_return_token_ids_gives_the_prompts_and_the_generated_ids_of_a_completion(client, hf_tokenizer, llm):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert extra(choice, "prompt_token_ids") == hf_tokenizer(PROMPT)["input_ids"]
    assert extra(choice, "token_ids") == list(want.token_ids)
    assert hf_tokenizer.decode(extra(choice, "token_ids")) == choice.text
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert extra(plain.choices[0], "token_ids") is None            # only when asked

    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True}))
    with_prompt = [c for c in chunks if extra(c.choices[0], "prompt_token_ids") is not None]
    assert with_prompt == [chunks[0]]                               # the prompt's ids once, in the first chunk
    assert extra(chunks[0].choices[0], "prompt_token_ids") == hf_tokenizer(PROMPT)["input_ids"]
    assert [t for c in chunks for t in extra(c.choices[0], "token_ids")] == list(want.token_ids)


def test_return_token_ids_on_chat_puts_the_prompt_at_the_top_as_vllm(client, hf_tokenizer):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                         extra_body={"return_token_ids": True})
    assert extra(out, "prompt_token_ids") == chat_ids(hf_tokenizer, CHAT)
    ids = extra(out.choices[0], "token_ids")
    assert len(ids) == out.usage.completion_tokens and hf_tokenizer.decode(ids) == out.choices[0].message.content

    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert extra(chunks[0], "prompt_token_ids") == chat_ids(hf_tokenizer, CHAT)      # the role chunk
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [t for c in chunks[1:] for t in extra(c.choices[0], "token_ids")] == ids


# ---------------------------------------------------------------------- return_tokens_as_token_ids
def test_logprobs_tokens_as_token_ids_name_the_same_tokens(servers, client, hf_tokenizer):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2)
    text = client.completions.create(**kw, extra_body={"return_token_ids": True}).choices[0]
    as_ids = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    token_ids = extra(text, "token_ids")
    assert as_ids.logprobs.tokens == [f"token_id:{t}" for t in token_ids]
    assert as_ids.logprobs.token_logprobs == pytest.approx(text.logprobs.token_logprobs, abs=1e-5)
    for by_id, by_text in zip(as_ids.logprobs.top_logprobs, text.logprobs.top_logprobs):
        decoded = {hf_tokenizer.decode([int(k.removeprefix("token_id:"))]): v for k, v in by_id.items()}
        assert decoded == pytest.approx(by_text, abs=1e-5)

    # --return-tokens-as-token-ids makes it the default; a request's own false wins
    ids_client = client_of(servers["ids"])
    assert ids_client.completions.create(**kw).choices[0].logprobs.tokens == as_ids.logprobs.tokens
    assert ids_client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": False}
                                         ).choices[0].logprobs.tokens == text.logprobs.tokens

    chat = dict(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    out = client.chat.completions.create(**chat, extra_body={"return_tokens_as_token_ids": True,
                                                             "return_token_ids": True})
    content = out.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in extra(out.choices[0], "token_ids")]
    assert all(c.bytes == list(c.token.encode()) for c in content)
    assert all(t.token.startswith("token_id:") for c in content for t in c.top_logprobs)


# ---------------------------------------------------------------------- truncation_side
@pytest.mark.parametrize("side", ["left", "right"])
def test_truncation_side_keeps_the_last_or_the_first_k_tokens(client, hf_tokenizer, llm, side):
    ids = hf_tokenizer(PROMPT + " a city of art, of food and of")["input_ids"]
    k = 5
    kept = ids[-k:] if side == "left" else ids[:k]
    out = client.completions.create(model=MODEL, prompt=PROMPT + " a city of art, of food and of", max_tokens=4,
                                    temperature=0, extra_body={"truncate_prompt_tokens": k, "truncation_side": side,
                                                               "return_token_ids": True})
    want = llm.generate({"prompt_token_ids": kept}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0]
    assert extra(out.choices[0], "prompt_token_ids") == kept and out.usage.prompt_tokens == k
    assert out.choices[0].text == want.outputs[0].text
    messages = [{"role": "user", "content": "Name three colours of the rainbow, please."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                          extra_body={"truncate_prompt_tokens": k, "truncation_side": side,
                                                      "return_token_ids": True})
    template = chat_ids(hf_tokenizer, messages)
    assert extra(chat, "prompt_token_ids") == (template[-k:] if side == "left" else template[:k])


def test_a_bad_truncation_side_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 3, "truncation_side": "middle"})
    assert e.value.body["param"] == "truncation_side" and "'right'" in e.value.body["message"]


# ---------------------------------------------------------------------- chat prompt_logprobs, echo, -1
def test_chat_prompt_logprobs_are_hf_log_softmax_at_the_top_of_the_answer(client, hf_tokenizer, hf_model):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0,
                                         extra_body={"prompt_logprobs": 2, "return_token_ids": True})
    ids = extra(out, "prompt_token_ids")
    entries = extra(out, "prompt_logprobs")
    assert ids == chat_ids(hf_tokenizer, CHAT) and len(entries) == len(ids) and entries[0] is None
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)    # (len, vocab)
    for pos in range(1, len(ids)):
        entry = {int(t): v for t, v in entries[pos].items()}
        assert ids[pos] in entry and 2 <= len(entry) <= 3          # the prompt's token and the 2 most likely
        assert entry[ids[pos]]["logprob"] == pytest.approx(logprobs[pos - 1, ids[pos]].item(), abs=2e-3)
        top = logprobs[pos - 1].topk(2)
        ranked = {t: v for t, v in entry.items() if v["rank"] <= 2}
        assert sorted(ranked) == sorted(top.indices.tolist()) or abs(top.values[0] - top.values[1]) < 2e-3
    assert extra(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1), "prompt_logprobs") is None


def test_chat_echo_starts_the_answer_with_the_message_it_continues(client):
    messages = CHAT + [{"role": "assistant", "content": "The capital of France"}]
    kw = dict(model=MODEL, messages=messages, max_tokens=5, temperature=0)
    opts = {"add_generation_prompt": False, "continue_final_message": True}
    plain = client.chat.completions.create(**kw, extra_body=opts).choices[0].message.content
    echoed = client.chat.completions.create(**kw, extra_body={**opts, "echo": True}).choices[0].message.content
    assert echoed == "The capital of France" + plain
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        **kw, stream=True, extra_body={**opts, "echo": True}))
    assert streamed == echoed
    # the last message is the user's, not the answer's role: nothing to echo (vLLM's rule)
    fresh = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0)
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                           extra_body={"echo": True})
    assert again.choices[0].message.content == fresh.choices[0].message.content


@pytest.mark.parametrize("route, body, param", [
    ("chat", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat", {"prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"logprobs": -1}, "logprobs"),
    ("chat", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
])
def test_whole_vocabulary_logprobs_are_refused_as_vllm_does_at_its_default_max(client, route, body, param):
    base = {"model": MODEL, "max_tokens": 1, **({"messages": CHAT} if route == "chat" else {"prompt": PROMPT})}
    r = httpx.post(f"{client.base_url}{'chat/completions' if route == 'chat' else 'completions'}",
                   json={**base, **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---------------------------------------------------------------------- continuous_usage_stats
def test_continuous_usage_stats_put_the_running_usage_on_every_chunk(client, hf_tokenizer):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
                                            stream_options=opts, extra_body={"return_token_ids": True}))
    n_prompt = len(hf_tokenizer(PROMPT)["input_ids"])
    assert all(c.usage is not None and c.usage.prompt_tokens == n_prompt for c in chunks)
    so_far = 0
    for c in chunks[:-1]:
        so_far += len(extra(c.choices[0], "token_ids"))
        assert c.usage.completion_tokens == so_far and c.usage.total_tokens == n_prompt + so_far
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == so_far == 6

    chat = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, stream=True,
                                               stream_options=opts))
    assert chat[0].usage.completion_tokens == 0 and chat[0].usage.prompt_tokens == len(chat_ids(hf_tokenizer, CHAT))
    assert all(c.usage is not None for c in chat) and chat[-1].usage.completion_tokens == 4
    # without include_usage it does nothing, as vLLM
    bare = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                          stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in bare)


# ---------------------------------------------------------------------- /tokenizer_info
def test_tokenizer_info_is_the_tokenizer_config_behind_its_flag(servers, model_dir, hf_tokenizer):
    r = httpx.get(servers["main"].url + "/tokenizer_info", timeout=30)
    assert r.status_code == 200
    info = r.json()
    on_disk = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert info["tokenizer_class"] == type(hf_tokenizer).__name__
    for key in ("eos_token", "bos_token", "pad_token", "unk_token", "model_max_length"):
        assert info[key] == on_disk[key], key
    assert "vocab_file" not in info and "merges_file" not in info
    assert httpx.get(servers["plain"].url + "/tokenizer_info", timeout=30).status_code == 404


# ---------------------------------------------------------------------- fields still checked
def test_unknown_fields_are_still_a_400_naming_them(client):
    for route, body in (("completions", {"prompt": PROMPT}), ("chat/completions", {"messages": CHAT})):
        r = httpx.post(f"{client.base_url}{route}", json={"model": MODEL, **body, "return_token_idz": True},
                       timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "return_token_idz"
        assert "return_token_ids" in r.json()["error"]["message"]         # the field meant


# ---------------------------------------------------------------------- priority
def test_priority_orders_api_requests_as_the_offline_engine_orders_them(model_dir):
    """max_num_seqs=1: one request runs while the others wait. `late` (priority -5) arrives after `early` (5), and
    runs first, as the offline engine runs the same requests added with the same priorities."""
    config = EngineConfig(num_kv_blocks=64, device="cpu", dtype="float32", max_num_seqs=1)
    offline = LLMEngine(config)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for rid, priority in (("early", 5), ("late", -5)):
        offline.add_request(PROMPT, params, request_id=rid, priority=priority)
    want = []
    while offline.has_unfinished_requests():
        want += [o.request_id for o in offline.step() if o.finished]
    assert want == ["late", "early"]

    engine = AsyncLLMEngine(LLMEngine(config))
    srv = run_server_in_thread(build_api_server(engine))
    try:
        api = client_of(srv)
        done: list[str] = []
        blocker = api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=48, temperature=0, stream=True,
                                         extra_body={"ignore_eos": True})
        next(iter(blocker))                                      # it runs: the others must wait behind it

        def send(name: str, priority: int) -> None:
            api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                   extra_body={"ignore_eos": True, "priority": priority})
            done.append(name)
        early = threading.Thread(target=send, args=("early", 5))
        early.start()
        while engine.snapshot().num_requests < 2:
            time.sleep(0.01)
        late = threading.Thread(target=send, args=("late", -5))
        late.start()
        while engine.snapshot().num_requests < 3:
            time.sleep(0.01)
        for _ in blocker:
            pass
        early.join(60)
        late.join(60)
        assert done == want
        with pytest.raises(openai.BadRequestError) as e:
            api.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, extra_body={"priority": "high"})
        assert e.value.body["param"] == "priority"
    finally:
        srv.stop()
        engine.shutdown()
