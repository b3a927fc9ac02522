"""Logprobs in the OpenAI API, as a client sees them (the official `openai` client against a real server, as in
test_api_server.py): completions' `logprobs` / `echo` / vLLM's `prompt_logprobs`, chat's `logprobs` /
`top_logprobs`, streamed and not, each value checked against the offline engine's logprobs (which
test_logprobs.py and test_prompt_logprobs.py hold to Hugging Face's log_softmax), and the 400s."""

from __future__ import annotations

import openai
import pytest
import torch

from minivllm import SamplingParams

from test_api_server import CHAT, MODEL, client, no_server_errors, server  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow       # a real server for this module, and each answer checked offline too

PROMPT = "The capital of France is"


def offline(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(temperature=0, **kw), use_tqdm=False)[0]


def test_completion_logprobs_are_the_engines(client, llm):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3)
    want = offline(llm, PROMPT, max_tokens=5, logprobs=3).outputs[0]
    lp = out.choices[0].logprobs
    assert out.choices[0].text == want.text
    assert lp.tokens == [e[t].decoded_token for t, e in zip(want.token_ids, want.logprobs)]
    assert lp.token_logprobs == pytest.approx([e[t].logprob for t, e in zip(want.token_ids, want.logprobs)],
                                              abs=1e-4)
    for top, entry in zip(lp.top_logprobs, want.logprobs):
        assert len(top) <= 4                                    # the sampled token and the 3 most likely
        assert top == pytest.approx({v.decoded_token: v.logprob for v in entry.values()}, abs=1e-4)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    assert "".join(lp.tokens) == out.choices[0].text


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text and echoed.choices[0].logprobs is None
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 4


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_asks(client, llm, hf_model, tokenizer):
    """lm-eval's log-likelihood request: max_tokens=1, echo=True, logprobs=1; every prompt token after the first
    gets HF's log-softmax, and n choices each carry them."""
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                    logprobs=1, n=2)
    ids = tokenizer.encode(PROMPT)
    want = offline(llm, PROMPT, max_tokens=1, logprobs=1, prompt_logprobs=1)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)
    for choice in out.choices:
        lp = choice.logprobs
        assert choice.text == PROMPT + want.outputs[0].text
        assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.tokens[0] == tokenizer.decode(ids[:1])
        assert lp.token_logprobs[1:len(ids)] == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))],
                                                              abs=1e-4)
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(
            [want.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))], abs=1e-4)
        assert lp.token_logprobs[-1] == pytest.approx(ref[-1].max().item(), abs=1e-4)     # greedy: the argmax
        assert lp.text_offset[len(ids)] == len(PROMPT)
    assert out.usage.completion_tokens == 2


def test_echo_with_max_tokens_zero_returns_the_prompt_alone(client, tokenizer):
    """As vLLM (and OpenAI's old API): max_tokens=0 with echo scores the prompt and generates nothing."""
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    ids = tokenizer.encode(PROMPT)
    choice = out.choices[0]
    assert choice.text == PROMPT and len(choice.logprobs.tokens) == len(ids)
    assert choice.logprobs.token_logprobs[0] is None and all(v < 0 for v in choice.logprobs.token_logprobs[1:])
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as e:                 # without echo 0 is still refused
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0)
    assert e.value.body["param"] == "max_tokens" and "echo" in e.value.message


def test_prompt_logprobs_field_returns_vllms_prompt_logprobs(client, llm):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                    extra_body={"prompt_logprobs": 2})
    want = offline(llm, PROMPT, max_tokens=2, prompt_logprobs=2)
    got = out.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(want.prompt_logprobs)
    for entry, ref in zip(got[1:], want.prompt_logprobs[1:]):
        assert list(entry) == [str(t) for t in ref]
        for tid, v in ref.items():
            assert entry[str(tid)]["logprob"] == pytest.approx(v.logprob, abs=1e-4)
            assert entry[str(tid)]["rank"] == v.rank and entry[str(tid)]["decoded_token"] == v.decoded_token
    assert out.choices[0].logprobs is None


@pytest.mark.parametrize("stop", [None, ["\n\n"]], ids=["plain", "text_held_back_for_a_stop_string"])
def test_streamed_completion_logprobs_add_up_to_the_full_answer(client, stop):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, echo=True, stop=stop)
    full = client.completions.create(**kw).choices[0]
    text, tokens, values, tops, offsets = "", [], [], [], []
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                values += c.logprobs.token_logprobs
                tops += c.logprobs.top_logprobs
                offsets += c.logprobs.text_offset
    assert text == full.text and text.startswith(PROMPT)
    assert tokens == full.logprobs.tokens and offsets == full.logprobs.text_offset
    assert values[0] is None and values[1:] == pytest.approx(full.logprobs.token_logprobs[1:], abs=1e-4)
    assert tops[0] is None and tops[1:] == [pytest.approx(t, abs=1e-4) for t in full.logprobs.top_logprobs[1:]]


def test_chat_logprobs_are_the_engines_with_top_logprobs_in_rank_order(client, llm):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, logprobs=True,
                                         top_logprobs=3)
    want = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=5, logprobs=3), use_tqdm=False)[0].outputs[0]
    content = out.choices[0].logprobs.content
    assert out.choices[0].message.content == want.text and len(content) == len(want.token_ids)
    for item, token, entry in zip(content, want.token_ids, want.logprobs):
        assert item.token == entry[token].decoded_token and item.bytes == list(item.token.encode())
        assert item.logprob == pytest.approx(entry[token].logprob, abs=1e-4)
        ranked = sorted((v for v in entry.values() if v.rank <= 3), key=lambda v: v.rank)
        assert [t.token for t in item.top_logprobs] == [v.decoded_token for v in ranked]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([v.logprob for v in ranked], abs=1e-4)
        assert item.top_logprobs[0].token == item.token                # greedy: the sampled token is rank 1
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0, logprobs=True)
    assert all(item.top_logprobs == [] for item in plain.choices[0].logprobs.content)
    none = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0)
    assert none.choices[0].logprobs is None


def test_streamed_chat_logprobs_add_up_to_the_full_answer(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    full = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            if c.logprobs is not None:
                streamed += c.logprobs.content
    assert [t.token for t in streamed] == [t.token for t in full]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in full], abs=1e-4)


BAD = [
    ("completions", {"prompt": "hi", "logprobs": 21}, "logprobs", "at most 20 logprobs per token (--max-logprobs 20)"),
    ("completions", {"prompt": "hi", "logprobs": -1}, "logprobs", "start the server with --max-logprobs -1"),
    ("completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs", "--max-logprobs -1"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "20"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "echo"),
    ("completions", {"prompt": "hi", "top_logprobs": 2}, "top_logprobs", "does not implement"),
    ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "20"),
    ("chat", {"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "'logprobs': true"),
    ("chat", {"messages": CHAT, "logprobs": 3}, "logprobs", "bool"),
    ("chat", {"messages": CHAT, "echo": 1}, "echo", "bool"),
    ("chat", {"messages": CHAT, "prompt_logprobs": 21}, "prompt_logprobs", "20"),
    ("chat", {"messages": CHAT, "prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "stream"),
    ("chat", {"messages": CHAT, "logprobs": True, "top_logprobs": -1}, "top_logprobs", "vocabulary"),
]


@pytest.mark.parametrize("route,body,param,says", BAD, ids=[f"{r}-{'-'.join(map(str, b.items()))}"[:60]
                                                           for r, b, _, _ in BAD])
def test_bad_logprobs_fields_are_a_400_naming_the_field_and_the_limit(server, route, body, param, says):
    import httpx

    path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
    r = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error
