"""Structured output in the OpenAI API, as a client sees it (the official `openai` client against a real server):
OpenAI's `response_format` (json_object, json_schema), vLLM's `structured_outputs` object and its older `guided_*`
fields. Every answer is checked with `jsonschema` / `re.fullmatch` / the choice list, and against the same
SamplingParams offline (tests/test_structured_output.py holds those to the same oracles)."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from minivllm import SamplingParams, StructuredOutputsParams

from test_api_server import CHAT, MODEL, client, no_server_errors, server  # noqa: F401  (fixtures)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
          "required": ["city", "population"]}


@pytest.mark.slow
def test_chat_response_format_json_schema(client, llm):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=0,
                                         response_format=fmt)
    text = out.choices[0].message.content
    jsonschema.validate(json.loads(text), SCHEMA)
    assert out.choices[0].finish_reason == "stop"
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, temperature=0)
    with pytest.raises(ValueError):                    # the constraint fired: unconstrained, the answer is prose
        json.loads(plain.choices[0].message.content)
    want = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=60,
                                         structured_outputs=StructuredOutputsParams(json=SCHEMA)), use_tqdm=False)
    assert text == want[0].outputs[0].text


@pytest.mark.slow
def test_sampled_and_streamed_json_validates(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}}
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=80, temperature=0.9, seed=4, n=3,
                                         response_format=fmt)
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=80, temperature=0.9,
                                                 seed=4, response_format=fmt, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == out.choices[0].message.content         # seed 4 is sample 0's seed


@pytest.mark.slow
def test_completions_json_object_and_vllm_fields(client):
    out = client.completions.create(model=MODEL, prompt='A JSON object with a key "answer" set to 42:',
                                    max_tokens=40, temperature=0,
                                    extra_body={"response_format": {"type": "json_object"}})   # vLLM takes it here too
    assert json.loads(out.choices[0].text) == {"answer": 42}
    choices = ["positive", "negative"]
    for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices}):
        out = client.completions.create(model=MODEL, prompt="Review: great film! Sentiment:", max_tokens=5,
                                        temperature=0, extra_body=extra)
        assert out.choices[0].text in choices
    for extra in ({"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}},
                  {"guided_regex": r"[0-9]{3}-[0-9]{4}", "guided_decoding_backend": "xgrammar"}):
        out = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=12, temperature=0.7, seed=1,
                                        extra_body=extra)
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", out.choices[0].text)
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0,
                                         extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert out.choices[0].message.content in ("yes", "no")
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=60, temperature=0,
                                         extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_the_chat_stream_opens_with_the_role_after_the_first_output(client, server):
    """As vLLM: the role chunk goes out with the engine's first output, so a client's time to first token
    includes the prefill (a role chunk sent on arrival made vLLM's benchmark report a wrong TTFT)."""
    chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and not chunks[0].choices[0].delta.content
    assert any(c.choices and c.choices[0].delta.content for c in chunks[1:])


@pytest.mark.parametrize("extra, param, message", [
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs \"json_schema\""),
    ({"response_format": {"type": "yaml"}}, "response_format", "'response_format.type' is \"yaml\""),
    ({"response_format": "json"}, "response_format", "must be an object"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "set exactly one of"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs", "'whitespace_pattern'"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs", "structured_outputs.regex does not compile"),
    ({"guided_json": {"type": "foo"}}, "guided_json", "structured_outputs.json does not compile"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend", "xgrammar"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "constrains its output twice"),
    ({"guided_regex": "a", "min_tokens": 2}, "min_tokens", "min_tokens is 2 with structured_outputs"),
])
def test_bad_constraints_are_400s_naming_the_field(client, server, extra, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=4, extra_body=extra)
    assert message in e.value.message and e.value.body["param"] == param, (e.value.body, param)
    assert server.engine.snapshot().num_requests == 0
