"""truncate_prompt_tokens (vLLM's field): the request runs on the prompt's last k tokens, exactly as a request
whose prompt is those k tokens (the oracle), offline and through the server; -1 keeps max_model_len of them;
anything else is refused by name."""

from __future__ import annotations

import pytest

from minivllm import SamplingParams

PROMPT = "One two three four five six seven eight nine ten, and then the capital of France is"


@pytest.mark.slow
def test_the_last_k_tokens_run_as_a_prompt_of_their_own(llm):
    ids = llm.get_tokenizer().encode(PROMPT)
    k = 9
    cut = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=k),
                       use_tqdm=False)[0]
    alone = llm.generate({"prompt_token_ids": ids[-k:]}, SamplingParams(temperature=0, max_tokens=8),
                         use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-k:] and len(ids) > k
    assert cut.outputs[0].token_ids == alone.outputs[0].token_ids
    whole = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=8, truncate_prompt_tokens=-1),
                         use_tqdm=False)[0]
    assert whole.prompt_token_ids == ids                     # -1: max_model_len tokens, more than it has
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="truncate_prompt_tokens is"):
            SamplingParams(truncate_prompt_tokens=bad)


@pytest.mark.slow
def test_the_server_truncates_and_counts_the_truncated_prompt(llm):
    import openai

    from app import build_app
    from minivllm.config import EngineConfig
    from minivllm.entrypoints.api_server import run_server_in_thread

    app, engine = build_app(EngineConfig(num_kv_blocks=64, device="cpu", dtype="float32", max_model_len=64))
    server = run_server_in_thread(app)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        long_prompt = PROMPT + " " + "and so on " * 30            # over max_model_len (64) without truncation
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=model, prompt=long_prompt, max_tokens=4, temperature=0)
        out = client.completions.create(model=model, prompt=long_prompt, max_tokens=4, temperature=0,
                                        extra_body={"truncate_prompt_tokens": 12})
        ids = llm.get_tokenizer().encode(long_prompt)[-12:]
        want = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert out.usage.prompt_tokens == 12 and out.choices[0].text == want[0].outputs[0].text
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model, prompt="hi", max_tokens=2, extra_body={"truncate_prompt_tokens": 0})
        assert e.value.body["param"] == "truncate_prompt_tokens"
    finally:
        server.stop()
        engine.shutdown()
