"""Structured output (SamplingParams.structured_outputs, xgrammar): every output is in its language.

Oracles: `jsonschema` validates every JSON output against its schema, `re.fullmatch` every regex output, the choice
list every choice, xgrammar's own `apply_token_bitmask_inplace` the sampler's mask. Each test also shows the
constraint fired: the same prompt without it gives an output that is not in the language.
"""

from __future__ import annotations

import json
import math
import re

import jsonschema
import pytest
import torch

from minivllm import LLM, SamplingParams, StructuredOutputsParams
from minivllm.core.structured_output import choice_grammar, no_additional_properties
from minivllm.worker.sampler import apply_grammar_bitmask

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "age", "city"],
}
PROMPTS = ["Give me a JSON object describing a person.", "Describe a cat.", "The capital of France is"]


def json_params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=120, structured_outputs=StructuredOutputsParams(json=PERSON), **kw)


def test_json_schema_outputs_validate_greedy_and_sampled(llm):
    greedy = llm.generate(PROMPTS, json_params(temperature=0), use_tqdm=False)
    sampled = llm.generate(PROMPTS * 2, json_params(temperature=0.8, seed=7), use_tqdm=False)
    for out in greedy + sampled:
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        jsonschema.validate(json.loads(c.text), PERSON)
    # The constraint fired: without it, the same greedy requests are not JSON at all.
    free = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    for out in free:
        with pytest.raises(ValueError):
            json.loads(out.outputs[0].text)


def test_schema_property_order_is_the_outputs_order(llm):
    out = llm.generate(PROMPTS[:1], json_params(temperature=0), use_tqdm=False)[0].outputs[0].text
    keys = list(json.loads(out))
    assert keys == [k for k in PERSON["properties"] if k in keys], keys


def test_choice_regex_ebnf_lark_and_json_object(llm):
    def one(prompt, temperature=0.0, **so):
        sp = SamplingParams(temperature=temperature, seed=3, max_tokens=150, structured_outputs=StructuredOutputsParams(**so))
        c = llm.generate([prompt], sp, use_tqdm=False)[0].outputs[0]
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
        return c.text

    choices = ["positive", "negative", "neutral"]
    for t in (0.0, 1.0):
        assert one("Review: I loved this film. Sentiment:", t, choice=choices) in choices
        assert re.fullmatch(r"\d{3}-\d{4}", one("Call me at", t, regex=r"\d{3}-\d{4}"))
        assert one("Answer:", t, grammar='root ::= "yes" | "no" | "maybe " [0-9]') in (
            {"yes", "no"} | {f"maybe {d}" for d in range(10)})
        assert one("Answer:", t, grammar='start: "left" | "right"') in ("left", "right")      # Lark
    # json_object: any JSON object (not an array, which the builtin JSON grammar would allow: this prompt gives one).
    grammar = llm.llm_engine.structured_output_manager.grammar_for(StructuredOutputsParams(json_object=True))
    assert not grammar.matcher.accept_string("[1, 2]")      # what the builtin JSON grammar gives for this prompt
    assert json.loads(one('Return the JSON object {"ok": true}.\n', json_object=True))["ok"] is True
    assert json.loads(one('A JSON object with a key "answer" set to 42:', json_object=True)) == {"answer": 42}


def test_compact_json_and_no_additional_properties(llm):
    sp = SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"]}, disable_any_whitespace=True))
    text = llm.generate(PROMPTS[:1], sp, use_tqdm=False)[0].outputs[0].text
    assert text == json.dumps(json.loads(text)), text      # one fixed layout: no free whitespace anywhere
    assert set(json.loads(text)) == {"a", "b"}
    assert no_additional_properties({"type": "object", "properties": {"x": {"type": "object"}}}) == {
        "type": "object", "additionalProperties": False,
        "properties": {"x": {"type": "object", "additionalProperties": False}}}


def test_bitmask_matches_xgrammar_and_rows_without_grammar_are_untouched():
    import xgrammar as xgr
    g = torch.Generator().manual_seed(0)
    vocab = 49152
    logits = torch.randn(4, vocab, generator=g)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    bitmask[2] = -1                                         # a row without a grammar
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab)
    got = apply_grammar_bitmask(logits, bitmask)
    assert torch.equal(got, expected)
    assert torch.equal(got[2], logits[2])
    assert choice_grammar(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


def test_n_children_each_have_their_own_grammar(llm):
    out = llm.generate(PROMPTS[:1], json_params(temperature=1.0, seed=11, n=4), use_tqdm=False)[0]
    assert len(out.outputs) == 4
    texts = [c.text for c in out.outputs]
    for t in texts:
        jsonschema.validate(json.loads(t), PERSON)
    assert len(set(texts)) > 1, texts                       # independent samples, each constrained


def test_logprobs_see_the_mask(llm):
    """As in vLLM, the grammar mask is applied before the sampler, so logprobs are of the masked logits: forbidden
    tokens have -inf, and once the choice is complete EOS is the only allowed token: logprob 0."""
    sp = SamplingParams(temperature=0, max_tokens=20, logprobs=3,
                        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]))
    c = llm.generate(["Pick one:"], sp, use_tqdm=False)[0].outputs[0]
    assert c.text in ("alpha", "beta")
    for step, token in zip(c.logprobs, c.token_ids):
        assert step[token].logprob > float("-inf")
        assert sum(math.exp(lp.logprob) for lp in step.values()) <= 1 + 1e-5 or token in step
    assert c.token_ids[-1] in llm.llm_engine.eos_token_ids
    assert c.logprobs[-1][c.token_ids[-1]].logprob == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_the_grammar_in_step(model_dir, mode):
    """A pool too small for everyone: requests are preempted mid-JSON and come back; the matcher is untouched by
    preemption, so the outputs equal those of an engine that never preempts."""
    prompts = [f"Person number {i} as JSON:" for i in range(6)]
    schema = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                               "city": PERSON["properties"]["city"]}, "required": ["age", "city"]}
    sp = SamplingParams(temperature=0, max_tokens=30, structured_outputs=StructuredOutputsParams(json=schema))
    small = LLM(str(model_dir), dtype="float32", num_kv_blocks=12, block_size=4, preemption_mode=mode,
                max_num_seqs=6)
    got = small.generate(prompts, sp, use_tqdm=False)
    assert small.get_stats().num_preemptions > 0
    big = LLM(str(model_dir), dtype="float32", num_kv_blocks=256, block_size=4)
    want = big.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    for o in got:
        jsonschema.validate(json.loads(o.outputs[0].text), schema)


def test_a_failed_step_does_not_advance_the_grammar(llm):
    """The output processor raises after the scheduler accepted the step's tokens into the grammars: the rollback
    must put every matcher back, so the retried steps give exactly the clean run's output."""
    engine = llm.llm_engine
    sp = json_params(temperature=0.7, seed=5)
    want = llm.generate(PROMPTS[:2], sp, use_tqdm=False)
    reqs = [engine.add_request(p, sp) for p in PROMPTS[:2]]
    real = engine.output_processor.process_outputs
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] in (3, 6, 7):
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    engine.output_processor.process_outputs = flaky
    outputs, failures = {}, 0
    try:
        while engine.has_unfinished_requests():
            try:
                for out in engine.step():
                    outputs[out.request_id] = out
            except RuntimeError:
                failures += 1
                for r in reqs:       # the matcher holds exactly the committed tokens
                    assert r.grammar.num_accepted == r.num_output_tokens
                engine.check_integrity()
    finally:
        engine.output_processor.process_outputs = real
    assert failures == 3
    assert [outputs[r.request_id].outputs[0].text for r in reqs] == [o.outputs[0].text for o in want]


def test_a_grammar_that_refuses_its_token_fails_that_request_alone(llm):
    """vLLM's FINISHED_ERROR: an error confined to one request (here its matcher refuses the sampled token) ends
    that request with finish_reason "error"; the step is rolled back and the other requests go on unchanged."""
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[1:3], greedy, use_tqdm=False)]
    bad = engine.add_request(PROMPTS[0], json_params(temperature=0))
    others = [engine.add_request(p, greedy) for p in PROMPTS[1:3]]
    engine.step()
    engine.step()
    bad.grammar.accept = lambda token: False          # from now on it refuses what the mask allowed
    failed_steps = engine.num_failed_steps
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
        engine.check_integrity()
    assert outputs[bad.request_id].finished and outputs[bad.request_id].outputs[0].finish_reason == "error"
    assert [list(outputs[r.request_id].outputs[0].token_ids) for r in others] == [list(w) for w in want]
    assert engine.num_failed_steps == failed_steps + 1 and engine.failed_request_ids
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_kv_blocks


@pytest.mark.parametrize("so, message", [
    (dict(json={"type": "foo"}), "structured_outputs.json does not compile"),
    (dict(regex="(ab"), "structured_outputs.regex does not compile"),
    (dict(grammar="root ::= "), "structured_outputs.grammar does not compile"),
])
def test_a_constraint_that_does_not_compile_is_refused_and_nothing_is_queued(llm, so, message):
    engine = llm.llm_engine
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.add_request("x", SamplingParams(structured_outputs=StructuredOutputsParams(**so)))
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


@pytest.mark.parametrize("kw, message", [
    (dict(), "set exactly one of"),
    (dict(json={"type": "object"}, regex="a"), "set exactly one of"),
    (dict(json="{not json"), "is not valid JSON"),
    (dict(json=[1]), "a JSON schema is an object"),
    (dict(choice=[]), "non-empty list"),
    (dict(choice="yes"), "non-empty list"),
    (dict(regex=""), "non-empty string"),
    (dict(json_object="yes"), "True or False"),
])
def test_bad_structured_outputs_params(kw, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        StructuredOutputsParams(**kw)


def test_min_tokens_with_a_grammar_is_refused():
    with pytest.raises(ValueError, match="min_tokens is 3 with structured_outputs"):
        SamplingParams(min_tokens=3, structured_outputs=StructuredOutputsParams(choice=["a"]))


def test_ignore_eos_still_ends_when_the_grammar_terminates(llm):
    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=50,
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    out = llm.generate(["Is water wet?"], sp, use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert out.token_ids[-1] in llm.llm_engine.eos_token_ids and len(out.token_ids) < 50   # not run to max_tokens


def test_the_trace_and_the_dashboard_show_the_grammars_state(llm):
    from minivllm.entrypoints.dashboard import render_block_tables
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0, logprobs=2, structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
    with engine.record_traces() as traces:
        req = engine.add_request("Is the sky blue?", sp)
        engine.step()
        first = traces[-1].by_id[req.request_id]
        while engine.has_unfinished_requests():
            engine.step()
    assert first.sampling == "greedy, logprobs=2, choice: 1 token, open" or first.sampling.startswith(
        "greedy, logprobs=2, choice: 1 token, complete"), first.sampling
    assert "choice: 1 token" in render_block_tables(traces[0])
    assert traces[-1].by_id[req.request_id].sampling.endswith("terminated")


def test_sampling_under_a_grammar_mask_follows_the_renormalised_distribution():
    """Chi-square: 20,000 seeded draws at temperature 0.7 from logits masked by a bitmask that allows 5 of 64
    tokens follow softmax(logits / 0.7) renormalised over those 5, and never pick another."""
    from scipy.stats import chisquare

    from minivllm.core.request import Request
    from minivllm.worker.sampler import Sampler
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, generator=g) * 2
    allowed = torch.tensor([3, 17, 31, 32, 60])
    word = torch.zeros(2, dtype=torch.int64)
    for t in allowed.tolist():
        word[t // 32] |= 1 << (t % 32)
    bitmask = torch.where(word >= 2 ** 31, word - 2 ** 32, word).to(torch.int32)   # xgrammar's int32 words
    n = 20_000
    masked = apply_grammar_bitmask(logits.repeat(n, 1), bitmask.repeat(n, 1))
    reqs = [Request(str(i), [1], SamplingParams(temperature=0.7, seed=i)) for i in range(n)]
    tokens = torch.tensor(Sampler(0)(masked, reqs))
    counts = torch.bincount(tokens, minlength=64)
    assert counts.sum() == counts[allowed].sum() == n
    probs = (logits[allowed] / 0.7).double().softmax(-1)
    assert chisquare(counts[allowed].double().numpy(), (probs * n).numpy()).pvalue > 1e-3
