"""Beam search (minivllm/beam_search.py: LLM.beam_search; entrypoints/serving_beam_search.py: the API's
use_beam_search) held to Hugging Face's `model.generate(num_beams=k, num_return_sequences=k, do_sample=False)`.

Both keep, at every step, the k best continuations by cumulative logprob among 2k candidates per step (vLLM: the
2k most likely tokens of each beam; HF: the 2k best of all beams' tokens, which include the k best non-EOS ones
whenever at most k candidates are EOS). What they do with EOS and length differs:

- Length penalty. vLLM (and minivllm) rank the final beams by cum_logprob / L ** length_penalty with L the beam's
  tokens *including the prompt's*, less a final EOS (vllm/beam_search.py get_beam_search_score). HF (5.x) divides
  by the generated length, EOS included.
- Which EOS endings count. vLLM keeps every EOS candidate among a beam's 2k (and the best k of them compete at the
  end); HF admits an EOS candidate only if it ranks among the k best of the step's 2k candidates.
- Stopping. vLLM runs to max_tokens (minivllm stops a prompt's search early only when no live beam can still
  enter its k best: the same answer); HF's early_stopping=False stops on a heuristic, "never" only when no
  improvement is possible.

So the rules agree, and every one of the k beams matches token for token, when:
1. ignore_eos=True (HF: eos_token_id=None): every beam has max_tokens tokens, the length penalty divides all
   scores alike, and only cumulative logprobs decide (any prompt, k = 2 and 4, max_tokens 10);
2. length_penalty=0 with EOS on (HF: early_stopping="never"): scores are cumulative logprobs in both; on the chat
   prompts below the EOS endings both admit are the same (beams end on EOS at different lengths);
and the best beam matches with the defaults (length_penalty=1, HF early_stopping=False) on the chat prompts.
The rules visibly differ on "The capital of France is" (k=2): vLLM's rules return " Paris." + EOS first (cumulative
logprob -3.57, better than any beam HF returns). HF never admits it: at its step that EOS candidate was not among
the 2 best of the step's candidates (and at length_penalty 1 HF's score, -3.57 / 3, would rank it below its 10-token
beams, where vLLM's, -3.57 / (5 + 2), ranks it first).
Cumulative logprobs equal HF's sequences_scores * its length (length_penalty 1) or sequences_scores (0) within 1e-4.
"""

from __future__ import annotations

import logging
import math
import random
import re
import threading
import time

import httpx
import openai
import pytest
import torch

from minivllm import BeamSearchParams
from minivllm.beam_search import get_beam_search_score
from tests.oracle import PROMPTS

MODEL = "SmolLM2-135M-Instruct"
EOS = 2
QUESTIONS = ["What is the capital of France?", "Say hi.", "What is 2+2?"]


# ---------------------------------------------------------------------- parameters and score (no engine)
@pytest.mark.parametrize("kwargs,message", [
    (dict(beam_width=0), "beam_width is 0; it must be in [1, 10]"),
    (dict(beam_width=11), "beam_width is 11; it must be in [1, 10]"),
    (dict(beam_width=2.0), "beam_width is 2.0 (float); it must be an int"),
    (dict(beam_width=True), "beam_width is True (bool)"),
    (dict(max_tokens=0), "max_tokens is 0; it must be >= 1"),
    (dict(temperature=-1), "temperature is -1; it must be >= 0"),
    (dict(length_penalty=math.inf), "length_penalty is inf; it must be a finite number"),
    (dict(length_penalty=11), "length_penalty is 11; it must be in [-10.0, 10.0]"),
    (dict(ignore_eos="yes"), "ignore_eos is 'yes'; it must be True or False"),
])
def test_params_are_checked_with_value_and_limit(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})
    assert BeamSearchParams(beam_width=2, max_tokens=4, temperature=1e-9).temperature == 0.0


def test_the_score_is_vllms_length_penalty_rule():
    """Length counts every token, prompt included, except a final EOS (vLLM's get_beam_search_score)."""
    assert get_beam_search_score([5, 6, 7, EOS], -3.0, EOS, 1.0) == -1.0
    assert get_beam_search_score([5, 6, 7, 8], -4.0, EOS, 2.0) == -0.25
    assert get_beam_search_score([5, 6, 7, 8], -4.0, EOS, 0.0) == -4.0


def toy_step(search, seed: int) -> list:
    """One step of a made-up model over 6 tokens (0 is EOS): each beam's logprobs, a function of its tokens."""
    from minivllm.outputs import CompletionOutput, Logprob, RequestOutput

    outputs = []
    for prompt in search.requests():
        rng = random.Random(f"{seed}:{prompt['prompt_token_ids']}")
        logits = [rng.gauss(0, 2) for _ in range(6)]
        norm = math.log(sum(math.exp(x) for x in logits))
        ranked = sorted(range(6), key=lambda t: -logits[t])[:2 * search.params.beam_width]
        entry = {t: Logprob(logits[t] - norm, rank + 1) for rank, t in enumerate(ranked)}
        outputs.append(RequestOutput("", None, prompt["prompt_token_ids"],
                                     [CompletionOutput(0, "", [ranked[0]], logprobs=[entry])], True))
    return outputs


def test_ending_a_search_that_cannot_improve_gives_the_same_beams(monkeypatch):
    """BeamSearch stops a prompt once no live beam can enter its best (exact, unlike HF's early_stopping=False):
    on a made-up model, the beams are those of running every search to max_tokens."""
    from minivllm.beam_search import BeamSearch

    def search(params, seed, prune: bool):
        if not prune:
            monkeypatch.setattr(BeamSearch, "_cannot_improve", lambda self, inst: False)
        s = BeamSearch([(None, [1, 2, 3], None), (None, [4], None)], params, frozenset({0}), 100)
        while not s.finished:
            s.advance(toy_step(s, seed))
        monkeypatch.undo()
        return s.num_steps, [[(b.tokens, round(b.cum_logprob, 9), b.finish_reason) for b in r.sequences]
                             for r in s.outputs(lambda ids: "")]

    saved = 0
    for seed in range(60):
        for lp in (-0.5, 0.0, 1.0, 2.0):
            params = BeamSearchParams(beam_width=1 + seed % 3, max_tokens=12, length_penalty=lp)
            (pruned_steps, pruned), (steps, full) = search(params, seed, True), search(params, seed, False)
            assert pruned == full, (seed, lp)
            saved += steps - pruned_steps
    assert saved > 0, saved


# ---------------------------------------------------------------------- the Hugging Face oracle
def hf_beams(hf_model, prompt_ids: list[int], k: int, max_new_tokens: int, **kwargs) -> tuple[list, list[float]]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=int),
                                num_beams=k, num_return_sequences=k, do_sample=False, max_new_tokens=max_new_tokens,
                                output_scores=True, return_dict_in_generate=True, **kwargs)
    beams = [s[len(prompt_ids):].tolist() for s in out.sequences]
    beams = [b[:b.index(EOS) + 1] if EOS in b and kwargs.get("eos_token_id", EOS) is not None else b for b in beams]
    return beams, out.sequences_scores.tolist()


def chat_prompts(tokenizer) -> list[str]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            for q in QUESTIONS]


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4])
def test_without_eos_every_beam_equals_hf(llm, hf_model, tokenizer, k):
    """ignore_eos: all beams of all prompts (searched together, in one batch per step) equal HF's, in order."""
    prompts = PROMPTS[:4]
    results = llm.beam_search(prompts, BeamSearchParams(beam_width=k, max_tokens=10, ignore_eos=True))
    for prompt, result in zip(prompts, results):
        want, scores = hf_beams(hf_model, tokenizer.encode(prompt), k, 10, eos_token_id=None)
        assert [s.output_token_ids for s in result.sequences] == want, prompt
        for seq, score in zip(result.sequences, scores):
            assert seq.cum_logprob == pytest.approx(score * 10, abs=1e-4)
            assert seq.finish_reason == "length" and len(seq.logprobs) == 10
            assert seq.text == tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)


@pytest.mark.slow
@pytest.mark.parametrize("k", [2, 4])
def test_with_eos_and_no_length_penalty_every_beam_equals_hf(llm, hf_model, tokenizer, k):
    prompts = chat_prompts(tokenizer)
    results = llm.beam_search(prompts, BeamSearchParams(beam_width=k, max_tokens=12, length_penalty=0.0))
    ended = 0
    for prompt, result in zip(prompts, results):
        want, scores = hf_beams(hf_model, tokenizer.encode(prompt), k, 12, length_penalty=0.0, early_stopping="never")
        assert [s.output_token_ids for s in result.sequences] == want, prompt
        for seq, score in zip(result.sequences, scores):
            assert seq.cum_logprob == pytest.approx(score, abs=1e-4)
            assert (seq.finish_reason == "stop") == (seq.output_token_ids[-1] == EOS)
            ended += seq.finish_reason == "stop"
            assert EOS not in tokenizer.encode(seq.text)            # the EOS's text is left out
    assert ended >= len(prompts)                                     # EOS endings took part


@pytest.mark.slow
def test_with_the_defaults_the_best_beam_equals_hf_and_the_eos_rule_shows(llm, hf_model, tokenizer):
    prompts = chat_prompts(tokenizer)
    for prompt, result in zip(prompts, llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=12))):
        want, _ = hf_beams(hf_model, tokenizer.encode(prompt), 4, 12)
        assert result.sequences[0].output_token_ids == want[0], prompt
    paris = "The capital of France is"
    best = llm.beam_search(paris, BeamSearchParams(beam_width=2, max_tokens=10))[0].sequences[0]
    hf = hf_beams(hf_model, tokenizer.encode(paris), 2, 10)[0]
    assert best.text == " Paris." and best.finish_reason == "stop" and best.output_token_ids not in hf


# ---------------------------------------------------------------------- the engine under the search
@pytest.mark.slow
def test_the_beams_share_the_prompt_blocks_and_leave_every_block_free(llm, tokenizer):
    prompt = PROMPTS[5]
    n = len(tokenizer.encode(prompt))
    block = llm.llm_engine.config.block_size
    before = llm.get_stats()
    result = llm.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=8, ignore_eos=True))[0]
    after = llm.get_stats()
    assert len(result.sequences) == 4
    # Steps 2..8 run 4 beams each; every beam finds at least the prompt's full blocks in the cache.
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 7 * 4 * (n // block) * block > 0
    assert after.num_free_blocks == after.num_kv_blocks and after.num_running == after.num_waiting == 0


@pytest.mark.slow
def test_a_bad_prompt_is_refused_before_anything_runs(llm):
    steps = llm.get_stats().num_steps
    with pytest.raises(ValueError, match="prompt 1: prompt has 9000 tokens; max_model_len is 8192"):
        llm.beam_search(["hi", [1] * 9000], BeamSearchParams(beam_width=2, max_tokens=4))
    with pytest.raises(ValueError, match="params is a SamplingParams; pass BeamSearchParams"):
        from minivllm import SamplingParams
        llm.beam_search(["hi"], SamplingParams())
    assert llm.get_stats().num_steps == steps


# ---------------------------------------------------------------------- the API
@pytest.fixture(scope="module")
def server():
    from minivllm.engine.async_llm import AsyncLLMEngine
    from minivllm.entrypoints.api_server import build_api_server, run_server_in_thread

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = AsyncLLMEngine.from_engine_args(num_kv_blocks=256, device="cpu", dtype="float32")
    srv = run_server_in_thread(build_api_server(engine))
    srv.engine = engine
    yield srv
    srv.stop()
    engine.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_server_errors():
    """The server logs no error while these tests run (a hang-up mid-search included)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    watched = [logging.getLogger(name) for name in ("uvicorn.error", "minivllm")]
    for logger in watched:
        logger.addHandler(handler)
    yield
    for logger in watched:
        logger.removeHandler(handler)
    assert not records, "the server logged errors:\n" + "\n".join(r.getMessage() for r in records)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def offline(llm, prompts, **kwargs):
    return llm.beam_search(prompts, BeamSearchParams(**kwargs))


@pytest.mark.slow
def test_completions_answer_with_the_n_best_beams_of_each_prompt(client, llm):
    prompts = ["The capital of France is", PROMPTS[1]]
    out = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=8,
                                    extra_body={"use_beam_search": True})
    results = offline(llm, prompts, beam_width=2, max_tokens=8)
    want = [s for r in results for s in r.sequences]
    assert [(c.index, c.text, c.finish_reason) for c in out.choices] == \
        [(i, s.text, s.finish_reason) for i, s in enumerate(want)]
    assert out.choices[0].text == " Paris." and out.choices[0].stop_reason == EOS
    assert out.usage.completion_tokens == sum(len(s.output_token_ids) for s in want)
    assert out.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in results)


@pytest.mark.slow
def test_chat_answers_with_the_n_best_beams(client, llm, tokenizer):
    messages = [{"role": "user", "content": "What is 2+2?"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=12,
                                         extra_body={"use_beam_search": True, "length_penalty": 0.5})
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = offline(llm, [prompt], beam_width=3, max_tokens=12, length_penalty=0.5)[0].sequences
    assert [(c.message.content, c.finish_reason) for c in out.choices] == [(s.text, s.finish_reason) for s in want]
    assert out.choices[0].message.content == "2 + 2 = 4"
    assert out.usage.prompt_tokens == len(tokenizer.encode(prompt))


@pytest.mark.slow
def test_other_clients_are_served_while_a_beam_search_runs(server, client):
    done: list[str] = []
    generated = server.engine.snapshot().stats.num_generated_tokens
    search = threading.Thread(target=lambda: done.append(client.completions.create(
        model=MODEL, prompt=PROMPTS[5], n=4, max_tokens=32, extra_body={"use_beam_search": True,
                                                                       "ignore_eos": True}).choices[0].text))
    search.start()
    try:
        deadline = time.time() + 60
        while server.engine.snapshot().stats.num_generated_tokens == generated and time.time() < deadline:
            time.sleep(0.01)                                               # the search has run a step
        quick = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
        assert quick.choices[0].finish_reason == "length" and not done     # answered while the search runs
    finally:
        search.join()
    assert done and done[0]
    stats = server.engine.snapshot().stats
    assert stats.num_free_blocks == stats.num_kv_blocks


@pytest.mark.slow
def test_a_client_that_hangs_up_stops_the_search(server):
    """The search's requests are aborted with the step under way; no step runs for it afterwards."""
    stats = server.engine.snapshot().stats
    with pytest.raises(httpx.TimeoutException):
        httpx.post(server.url + "/v1/completions", timeout=1.0,
                   json={"model": MODEL, "prompt": PROMPTS[5], "n": 4, "max_tokens": 2000, "use_beam_search": True,
                         "ignore_eos": True})
    deadline = time.time() + 30
    while time.time() < deadline:
        now = server.engine.snapshot().stats
        if now.num_running == now.num_waiting == 0 and now.num_free_blocks == now.num_kv_blocks:
            break
        time.sleep(0.05)
    generated = server.engine.snapshot().stats.num_generated_tokens
    time.sleep(0.5)
    now = server.engine.snapshot().stats
    assert now.num_generated_tokens == generated > stats.num_generated_tokens      # it ran, then stopped
    assert now.num_free_blocks == now.num_kv_blocks


REFUSED = [("stream", True), ("temperature", 0.7), ("top_p", 0.5), ("stop", ["."]), ("seed", 1),
           ("presence_penalty", 0.5), ("min_tokens", 2), ("n", 11), ("response_format", {"type": "json_object"}),
           ("priority", 1), ("return_token_ids", True), ("return_tokens_as_token_ids", True)]


@pytest.mark.slow
@pytest.mark.parametrize("name,value", REFUSED, ids=[n for n, _ in REFUSED])
def test_what_a_beam_search_cannot_honour_is_a_400_naming_it(client, name, value):
    for create, kwargs in ((client.completions.create, dict(prompt="hi")),
                           (client.chat.completions.create, dict(messages=[{"role": "user", "content": "hi"}]))):
        with pytest.raises(openai.BadRequestError) as e:
            create(model=MODEL, max_tokens=2, extra_body={"use_beam_search": True, name: value}, **kwargs)
        assert e.value.body["param"] == name, e.value.message
    with pytest.raises(openai.BadRequestError) as e:                  # chat's logprobs, completions' logprobs
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       logprobs=True, extra_body={"use_beam_search": True})
    assert e.value.body["param"] == "logprobs"


def test_length_penalty_without_beam_search_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"length_penalty": 0.5})
    assert e.value.body["param"] == "length_penalty" and "use_beam_search" in e.value.message
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0,
                                   extra_body={"use_beam_search": False, "length_penalty": 1.0})
    assert ok.choices[0].finish_reason == "length"
    off = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0, top_p=1, stream=False,
                                    logprobs=None, echo=False, extra_body={"use_beam_search": True, "best_of": 1})
    assert len(off.choices) == 1                                       # fields left at "off" are accepted


@pytest.mark.slow
def test_vllms_extra_fields_at_their_off_values_are_accepted(client):
    """priority, return_token_ids, return_tokens_as_token_ids and truncation_side, as clients send them by default."""
    off = {"priority": 0, "return_token_ids": False, "return_tokens_as_token_ids": False, "truncation_side": "left"}
    for create, kwargs in ((client.completions.create, dict(prompt="hi")),
                           (client.chat.completions.create, dict(messages=[{"role": "user", "content": "hi"}]))):
        out = create(model=MODEL, max_tokens=2, n=2, extra_body={"use_beam_search": True, **off}, **kwargs)
        assert len(out.choices) == 2
