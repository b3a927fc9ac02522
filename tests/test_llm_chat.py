"""Offline LLM.chat's template options, as vLLM's LLM.chat takes them (continue_final_message, chat_template, tools,
chat_template_kwargs): the prompt it runs is the tokenizer's own apply_chat_template with the same options (the
oracle), and the answer is the greedy continuation of exactly that prompt."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from minivllm import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6)
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
PLAIN_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    dict(add_generation_prompt=False, continue_final_message=True),
    dict(chat_template=PLAIN_TEMPLATE),
    dict(tools=TOOLS),
    dict(chat_template=PLAIN_TEMPLATE + "{{ suffix }}", chat_template_kwargs={"suffix": " Sure,"}),
])
def test_the_prompt_is_the_templates_own_rendering_with_the_same_options(llm, tokenizer, options):
    conv = [{"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is"}]
    if not options.get("continue_final_message"):
        conv = conv[:1]
    hf_options = {"add_generation_prompt": True} | {k: v for k, v in options.items() if k != "chat_template_kwargs"} \
        | options.get("chat_template_kwargs", {})                  # LLM.chat's default: add_generation_prompt
    text = tokenizer.apply_chat_template(conv, tokenize=False, **hf_options)
    out = llm.chat(conv, GREEDY, use_tqdm=False, **options)[0]
    assert out.prompt == text
    assert out.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert out.outputs[0].token_ids == llm.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY,
                                                    use_tqdm=False)[0].outputs[0].token_ids
    if options.get("continue_final_message"):
        assert text.rstrip().endswith("The capital of France is")      # left open: the model continues it


def test_bad_template_options_are_refused_by_name(llm):
    conv = [{"role": "user", "content": "Hi"}]
    with pytest.raises(ValueError, match="'continue_final_message' and 'add_generation_prompt' are both true"):
        llm.chat(conv, GREEDY, continue_final_message=True, use_tqdm=False)
    with pytest.raises(ValueError, match="tools must be a list"):
        llm.chat(conv, GREEDY, tools=[{"name": "f"}], use_tqdm=False)
    with pytest.raises(ValueError, match="chat_template_kwargs is a list"):
        llm.chat(conv, GREEDY, chat_template_kwargs=["x"], use_tqdm=False)
    with pytest.raises(ValueError, match="chat template rejected"):
        llm.chat(conv, GREEDY, chat_template="{{ raise_exception('no') }}", use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


TOOL_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% for c in m.get('tool_calls', []) %}"
                 "[{{ c['function']['name'] }}(city={{ c['function']['arguments']['city'] }})]{% endfor %}"
                 "{% if m.get('tool_call_id') %} ({{ m['tool_call_id'] }}){% endif %}\n{% endfor %}assistant:")


def test_tool_call_arguments_reach_the_template_as_objects_as_the_server_passes_them(llm, tokenizer):
    """As vLLM's LLM.chat (and minivllm's server, chat_utils.parse_conversation): an assistant's tool-call arguments,
    sent as JSON text, reach the template parsed into an object; a tool message keeps its tool_call_id."""
    from minivllm.entrypoints.chat_utils import apply_chat_template, parse_conversation

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    conv = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    out = llm.chat(conv, GREEDY, chat_template=TOOL_TEMPLATE, use_tqdm=False)[0]
    as_objects = [conv[0], {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, conv[2]]
    want = tokenizer.apply_chat_template(as_objects, tokenize=False, chat_template=TOOL_TEMPLATE,
                                         add_generation_prompt=True)
    assert out.prompt == want and "[get_weather(city=Paris)]" in want and "18 C (call_1)" in want
    served = parse_conversation({"messages": conv}, None).messages          # what the server renders
    assert apply_chat_template(tokenizer, served, {"add_generation_prompt": True, "chat_template": TOOL_TEMPLATE}) \
        == out.prompt
    call["function"]["arguments"] = "{not json"
    with pytest.raises(ValueError, match=r"conversation 0: messages\[1\]\.tool_calls\[0\]\.function\.arguments is "
                                         "not JSON"):
        llm.chat(conv, GREEDY, chat_template=TOOL_TEMPLATE, use_tqdm=False)
