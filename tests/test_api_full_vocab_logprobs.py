"""The server under `--max-logprobs -1` (vLLM's: no limit): chat's `top_logprobs=-1`, completions' `logprobs=-1` and
`prompt_logprobs=-1` return the whole vocabulary at each position, each value the offline engine's (which
test_full_vocab_logprobs.py holds to Hugging Face's log_softmax). The default server refuses them with a 400 naming
the field and the flag (test_api_logprobs.py's BAD cases)."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from minivllm import SamplingParams
from minivllm.config import EngineConfig
from minivllm.engine.async_llm import AsyncLLMEngine
from minivllm.engine.llm_engine import LLMEngine
from minivllm.entrypoints.api_server import build_api_server, run_server_in_thread

from test_api_server import CHAT, MODEL, no_server_errors  # noqa: F401  (fixtures)

pytestmark = pytest.mark.slow       # a real server with its own engine; answers of the whole vocabulary

PROMPT = "The capital of"


@pytest.fixture(scope="module")
def server():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # the engine thread gets one core, the clients and the HTTP loop the other
    engine = AsyncLLMEngine(LLMEngine(EngineConfig(num_kv_blocks=64, device="cpu", dtype="float32",
                                                   max_logprobs=-1)))
    srv = run_server_in_thread(build_api_server(engine))
    srv.engine = engine
    yield srv
    srv.stop()
    engine.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_chat_top_logprobs_minus_one_lists_every_token_of_the_vocabulary(client, llm):
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, temperature=0, logprobs=True,
                                         top_logprobs=-1)
    want = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=2, logprobs=20), use_tqdm=False)[0].outputs[0]
    vocab = llm.llm_engine.input_processor.vocab_size
    content = out.choices[0].logprobs.content
    assert out.choices[0].message.content == want.text and len(content) == 2
    for item, token, entry in zip(content, want.token_ids, want.logprobs):
        assert len(item.top_logprobs) == vocab                            # every token, most likely first
        assert item.logprob == pytest.approx(entry[token].logprob, abs=1e-4)
        top = sorted(entry.values(), key=lambda lp: lp.rank)[:20]
        assert [t.token for t in item.top_logprobs[:20]] == [lp.decoded_token for lp in top]
        assert [t.logprob for t in item.top_logprobs[:20]] == pytest.approx([lp.logprob for lp in top], abs=1e-4)
        values = [t.logprob for t in item.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert sum(torch.tensor(values).double().exp()).item() == pytest.approx(1.0, abs=1e-3)   # a distribution


def test_completions_logprobs_and_prompt_logprobs_minus_one(server, llm):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1,
                                                          "temperature": 0, "logprobs": -1, "prompt_logprobs": -1},
                   timeout=300)
    assert r.status_code == 200, r.text[:500]
    choice = r.json()["choices"][0]
    vocab = llm.llm_engine.input_processor.vocab_size
    want = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=1, logprobs=0, prompt_logprobs=0),
                        use_tqdm=False)[0]
    prompt_lp = choice["prompt_logprobs"]
    assert prompt_lp[0] is None and len(prompt_lp) == len(want.prompt_token_ids)
    for i in range(1, len(prompt_lp)):
        assert len(prompt_lp[i]) == vocab                                 # {token id: {logprob, rank, ...}}
        token = want.prompt_token_ids[i]
        assert prompt_lp[i][str(token)]["logprob"] == pytest.approx(want.prompt_logprobs[i][token].logprob, abs=1e-4)
    top = choice["logprobs"]["top_logprobs"][0]          # {text: logprob}: tokens of the same text share a key
    assert len(top) > 20
    assert choice["logprobs"]["token_logprobs"][0] == pytest.approx(
        want.outputs[0].logprobs[0][want.outputs[0].token_ids[0]].logprob, abs=1e-4)


def test_over_the_vocabulary_is_still_a_400_naming_the_field(server):
    vocab = server.engine.engine.input_processor.vocab_size
    r = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, "max_tokens": 1,
                                                               "logprobs": True, "top_logprobs": vocab + 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert f"the vocabulary has {vocab} tokens" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="it must be >= 0"):
        openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=1, logprobs=-2)
