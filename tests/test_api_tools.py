"""Tool calling on /v1/chat/completions, as vLLM serves it: `tools`, `tool_choice` ("none", "auto", "required", a
named function) and `parallel_tool_calls`. The forced choices are grammar-constrained, so every answer's arguments
are checked with `jsonschema`; "auto" reads the model's own format with the hermes parser, unit-tested here on
literal texts (the small default model does not write tool calls by itself), and end to end with a regex that makes
it write one. A stream, joined, must be the full answer. A conversation goes on after a call (the assistant's
`tool_calls`, then `role: "tool"` answers), rendered by the chat template as vLLM passes it.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch

from minivllm.config import EngineConfig
from minivllm.entrypoints.api_server import build_api_server, run_server_in_thread
from minivllm.entrypoints.tool_calls import ToolCallOutput, ToolConfig, read_tool_request
from minivllm.entrypoints.tool_parsers import HermesToolParser, NamedToolCall, RequiredToolCalls, fold

from test_api_server import MODEL, hf_tokenizer, no_server_errors  # noqa: F401  (fixtures)

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


# ---------------------------------------------------------------------- the parsers, on literal texts
HERMES_CASES = {
    "one call": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                 '</tool_call>', None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    "two calls": ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
                  '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>\n',
                  None, [("add", '{"a": 1, "b": 2}'), ("add", '{"a": 3, "b": 4}')]),
    "text around": ('Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Köln"}}</tool_call>'
                    ' Done.', "Let me check.  Done.", [("get_weather", '{"city": "Köln"}')]),
    "malformed JSON": ('<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call> ok',
                       '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call> ok', []),
    "no name": ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    "one good, one bad": ('<tool_call>{"name": "add", "arguments": {}}</tool_call><tool_call>oops</tool_call>',
                          "<tool_call>oops</tool_call>", [("add", "{}")]),
    "unclosed last block": ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', None,
                            [("add", '{"a": 1, "b": 2}')]),
    "cut inside the end tag": ('<tool_call>{"name": "add", "arguments": {}}</tool_c',
                               '<tool_call>{"name": "add", "arguments": {}}</tool_c', []),
    "plain text": ("1 < 2 and <tool_ca", "1 < 2 and <tool_ca", []),
    "only whitespace": ("  \n", "  \n", []),
}


def _calls(extracted) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in extracted.tool_calls]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES.values(), ids=HERMES_CASES.keys())
def test_hermes_reads_calls_and_leaves_the_rest_as_content(text, content, calls):
    got = HermesToolParser().extract_tool_calls(text)
    assert (got.content, _calls(got), got.tools_called) == (content, calls, bool(calls))
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in got.tool_calls)


@pytest.mark.parametrize("text", [case[0] for case in HERMES_CASES.values()], ids=HERMES_CASES.keys())
def test_hermes_streamed_at_any_split_is_the_whole_answer(text):
    whole = HermesToolParser().extract_tool_calls(text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        parser = HermesToolParser()
        deltas = [d for p in pieces for d in parser.extract_tool_calls_streaming(p, finished=False)]
        deltas += parser.extract_tool_calls_streaming("", finished=True)
        got = fold(deltas)
        assert (got.content, _calls(got)) == (whole.content, _calls(whole)), pieces
        for d in deltas:          # a call's name comes first, with its id, then its arguments
            for call in d.get("tool_calls", ()):
                assert set(call) in ({"index", "id", "type", "function"}, {"index", "function"})


def test_required_and_named_readers():
    text = '[{"name": "get_weather", "parameters": {"city": "a}\\"{b", "unit": "celsius"}}, {"name": "add", ' \
           '"parameters": {"a": 1, "b": 2}}, {"name": "add", "param'
    for pieces in ([text], list(text)):
        parser = RequiredToolCalls()
        got = fold([d for p in pieces for d in parser.extract_tool_calls_streaming(p, finished=False)])
        assert _calls(got) == [("get_weather", '{"city": "a}\\"{b", "unit": "celsius"}'), ("add", '{"a": 1, "b": 2}')]
    named = NamedToolCall("add")
    deltas = named.extract_tool_calls_streaming("", False) + named.extract_tool_calls_streaming('{"a": 1, ', False)
    deltas += named.extract_tool_calls_streaming('"b": 2}', True)
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "add"}
    assert _calls(fold(deltas)) == [("add", '{"a": 1, "b": 2}')]


def test_parallel_tool_calls_false_keeps_the_first_call():
    config = ToolConfig(True, "hermes")
    output = read_tool_request({"tools": TOOLS, "parallel_tool_calls": False}, config).output(config)
    choice = {"message": {"role": "assistant", "content": HERMES_CASES["two calls"][0]}, "finish_reason": "stop"}
    output.write_message(choice)
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == ['{"a": 1, "b": 2}']
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None


def test_required_builds_vllms_array_schema_and_tool_choice_defaults():
    config = ToolConfig(True, "hermes")
    schema = read_tool_request({"tools": TOOLS, "tool_choice": "required"}, config).constraint.json
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["get_weather"], ["add"]]
    assert read_tool_request({"tools": TOOLS}, config).choice == "auto"                  # vLLM's default with tools
    assert read_tool_request({"tools": [], "tool_choice": "required"}, config).choice == "none"   # OpenAI's rule
    assert read_tool_request({"tools": TOOLS, "tool_choice": "none"}, config).template_tools == TOOLS
    assert read_tool_request({"tools": TOOLS, "tool_choice": "none"},
                             ToolConfig(exclude_tools_when_tool_choice_none=True)).template_tools is None
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        ToolConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="hermes"):
        ToolConfig(True, "no-such-parser")


def test_the_flags_parse():
    from app import build_parser
    args = build_parser().parse_args(["--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                      "--exclude-tools-when-tool-choice-none"])
    assert args.enable_auto_tool_choice and args.exclude_tools_when_tool_choice_none
    assert args.tool_call_parser == "hermes"


# ---------------------------------------------------------------------- a server with --enable-auto-tool-choice
@pytest.fixture(scope="module")
def servers():
    """Two servers on one engine: one as `--enable-auto-tool-choice --tool-call-parser hermes` (and trusting request
    chat templates), one with neither flag."""
    from app import build_app

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    app, engine = build_app(EngineConfig(num_kv_blocks=256, device="cpu", dtype="float32"), dashboard=False,
                            trust_request_chat_template=True, enable_auto_tool_choice=True, tool_call_parser="hermes")
    auto, plain = run_server_in_thread(app), run_server_in_thread(build_api_server(engine))
    yield auto, plain
    auto.stop()
    plain.stop()
    engine.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers[0].url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _streamed(chunks) -> tuple[str, list[tuple[str, str]], str]:
    """A stream joined as a client joins it: (content, [(name, arguments)], finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for call in choice.delta.tool_calls or []:
                entry = calls.setdefault(call.index, ["", ""])
                if call.id is not None:
                    assert call.id.startswith("chatcmpl-tool-") and call.type == "function" and call.function.name
                entry[0] += call.function.name or ""
                entry[1] += call.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


def _answer(choice) -> tuple[str, list[tuple[str, str]], str]:
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
    return choice.message.content or "", calls, choice.finish_reason


def _check_calls(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.slow
@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_forced_tool_calls_validate_greedy_sampled_and_streamed(client, tool_choice):
    kwargs = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=tool_choice, max_tokens=120)
    finish = "tool_calls" if tool_choice == "required" else "stop"
    greedy = client.chat.completions.create(**kwargs, temperature=0)
    content, calls, reason = _answer(greedy.choices[0])
    assert content == "" and calls and reason == finish and greedy.choices[0].message.tool_calls[0].id.startswith(
        "chatcmpl-tool-")
    _check_calls(calls)
    if tool_choice == NAMED:
        assert [name for name, _ in calls] == ["get_weather"]
    assert _streamed(client.chat.completions.create(**kwargs, temperature=0, stream=True)) == (content, calls, reason)
    sampled = client.chat.completions.create(**kwargs, temperature=1.0, seed=7, n=3)
    for choice in sampled.choices:
        content, calls, reason = _answer(choice)
        # a named function's arguments are whole once the grammar lets the output end; "required" may be cut by
        # max_tokens after some whole calls (an element it was cut inside is no call)
        assert content == "" and calls and reason in ((finish, "length") if tool_choice == "required" else (finish,))
        _check_calls(calls)
    streamed = _streamed(client.chat.completions.create(**kwargs, temperature=1.0, seed=7, stream=True))
    assert streamed == _answer(sampled.choices[0])          # seed 7 is sample 0's seed


@pytest.mark.slow
def test_auto_returns_plain_content_or_a_parsed_hermes_call(client):
    plain = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=12, temperature=0)
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "length"
    assert _streamed(client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, max_tokens=12,
                                                    temperature=0, stream=True)) == _answer(plain.choices[0])
    # A regex makes the small model write a hermes block: "auto" reads it as a call, streamed or not.
    regex = r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", "unit": "celsius"\}\}' \
            r'</tool_call>'
    kwargs = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="auto", max_tokens=200, temperature=0,
                  extra_body={"structured_outputs": {"regex": regex}})
    out = client.chat.completions.create(**kwargs)
    assert _answer(out.choices[0]) == ("Sure. ", [("get_weather", '{"city": "Paris", "unit": "celsius"}')],
                                       "tool_calls")
    assert _streamed(client.chat.completions.create(**kwargs, stream=True)) == _answer(out.choices[0])


@pytest.mark.slow
def test_tool_choice_none_and_parallel_tool_calls(client, servers):
    plain = openai.OpenAI(base_url=servers[1].url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = plain.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="none", max_tokens=4,
                                        temperature=0)
    assert out.choices[0].message.content and not out.choices[0].message.tool_calls
    one = client.chat.completions.create(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, max_tokens=120, temperature=1.0, seed=1)
    assert len(one.choices[0].message.tool_calls) == 1


@pytest.mark.slow
def test_tokenize_renders_the_tools_into_the_template(servers, hf_tokenizer):
    template = ("{% if tools %}{% for t in tools %}<tool>{{ t.function.name }}: {{ t.function.parameters | tojson }}"
                "</tool>\n{% endfor %}{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    body = {"model": MODEL, "messages": CHAT, "chat_template": template}
    bare = httpx.post(servers[0].url + "/tokenize", json=body).json()
    with_tools = httpx.post(servers[0].url + "/tokenize", json={**body, "tools": TOOLS}).json()
    want = hf_tokenizer.apply_chat_template(CHAT, tools=TOOLS, chat_template=template, tokenize=False)
    assert with_tools["tokens"] == hf_tokenizer.encode(want, add_special_tokens=False)
    assert with_tools["count"] > bare["count"]
    bad = httpx.post(servers[0].url + "/tokenize", json={"model": MODEL, "prompt": "hi", "tools": TOOLS})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tools"


CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                         "arguments": '{"city": "Paris", "unit": "celsius"}'}}
AFTER_A_CALL = CHAT + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
TOOL_USE_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.tool_calls %}{% for c in m.tool_calls %}"
                     "<call id={{ c.id }}>{{ c.function.name }}({{ c.function.arguments | tojson }})</call>"
                     "{% endfor %}{% endif %}{% if m.tool_call_id %}[{{ m.tool_call_id }}] {% endif %}{{ m.content }}\n"
                     "{% endfor %}<|assistant|>")


@pytest.mark.slow
def test_a_conversation_goes_on_after_a_tool_call(servers, client, hf_tokenizer):
    """An assistant message with tool_calls and the tool's answer (role "tool", tool_call_id) reach the chat template
    as vLLM passes them: the call's arguments parsed into an object, the id beside the result."""
    body = {"model": MODEL, "messages": AFTER_A_CALL, "chat_template": TOOL_USE_TEMPLATE}
    rendered = hf_tokenizer.decode(httpx.post(servers[0].url + "/tokenize", json=body).json()["tokens"])
    assert rendered == hf_tokenizer.apply_chat_template(
        [*CHAT, {"role": "assistant", "content": "", "tool_calls": [
            {**CALL, "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}}]},
         AFTER_A_CALL[2]], chat_template=TOOL_USE_TEMPLATE, tokenize=False)
    assert '<call id=call_1>get_weather({"city": "Paris", "unit": "celsius"})</call>' in rendered
    assert "<|tool|>[call_1] 18 degrees and sunny" in rendered
    # the model's own template renders the tool's answer too; the server answers the whole conversation
    out = client.chat.completions.create(model=MODEL, messages=AFTER_A_CALL, tools=TOOLS, max_tokens=8, temperature=0)
    default = hf_tokenizer.apply_chat_template(AFTER_A_CALL[:1] + [{"role": "assistant", "content": ""},
                                                                  AFTER_A_CALL[2]], tools=TOOLS, tokenize=False,
                                               add_generation_prompt=True)
    assert "<|im_start|>tool\n18 degrees and sunny<|im_end|>" in default
    assert out.usage.prompt_tokens == len(hf_tokenizer.encode(default, add_special_tokens=False))
    for bad, param in ((dict(AFTER_A_CALL[1], tool_calls=[{"function": {"arguments": "{}"}}]),
                        "messages[1].tool_calls[0]"),
                       (dict(AFTER_A_CALL[1], tool_calls=[dict(CALL, function={"name": "f", "arguments": "{oops"})]),
                        "messages[1].tool_calls[0].function.arguments"),
                       (dict(AFTER_A_CALL[2], role="user"), "messages[1].tool_call_id")):
        messages = [AFTER_A_CALL[0], bad]
        r = httpx.post(servers[0].url + "/v1/chat/completions", json={"model": MODEL, "messages": messages})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.slow
def test_streamed_tool_calls_carry_every_token_id_once(client, hf_tokenizer):
    """return_token_ids with a tool call: the stream holds back text while it reads a call, never the token ids."""
    kw = dict(model=MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED, max_tokens=40, temperature=0,
              extra_body={"return_token_ids": True})
    full = client.chat.completions.create(**kw)
    ids = full.choices[0].model_extra["token_ids"]
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert [t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])] == ids
    assert hf_tokenizer.decode(ids, skip_special_tokens=True) == full.choices[0].message.tool_calls[0].function.arguments


BAD_TOOL_REQUESTS = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": ["get_weather"]}, "tools[0]"),
    ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": [{"type": "function"}]}, "tools[0].function"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {"description": "no name"}}]}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "{}"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "params": {}}}]}, "tools[0].function.params"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"function": {"name": "add"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "guided_regex": "a+"}, "guided_regex"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}],
      "tool_choice": "required"}, "tools"),
]


@pytest.mark.slow
@pytest.mark.parametrize("extra,param", BAD_TOOL_REQUESTS, ids=[p for _, p in BAD_TOOL_REQUESTS])
def test_bad_tool_requests_are_400s_naming_the_field(servers, extra, param):
    r = httpx.post(servers[0].url + "/v1/chat/completions", json={"model": MODEL, "messages": CHAT, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.slow
def test_auto_without_the_flag_is_a_400(servers):
    for extra in ({"tool_choice": "auto"}, {}):          # with tools, tool_choice is "auto" unless sent (vLLM)
        r = httpx.post(servers[1].url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": CHAT, "tools": TOOLS, "max_tokens": 2, **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
        assert "--enable-auto-tool-choice" in r.json()["error"]["message"]


def test_tool_call_output_streams_one_choice_per_delta():
    from minivllm.entrypoints.serving_engine import ResponseMeta

    request = read_tool_request({"tools": TOOLS, "tool_choice": NAMED}, ToolConfig())
    output = ToolCallOutput(request, None)
    meta = ResponseMeta("chatcmpl-x", 0, MODEL, True)
    first = output.stream_choices(meta, 0, '{"city": ', None, None, None)
    assert [c["delta"]["tool_calls"][0]["function"] for c in first] == [{"name": "get_weather"},
                                                                        {"arguments": '{"city": '}]
    last = output.stream_choices(meta, 0, "", "stop", None, None)
    assert [(c["delta"], c["finish_reason"]) for c in last] == [({}, "stop")]
