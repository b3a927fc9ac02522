"""Tool calling on /v1/chat/completions, as vLLM's server does it: a request's `tools`, `tool_choice` and
`parallel_tool_calls`, the constraint a forced choice puts on the output, and the answer's tool calls.

Owns: reading and checking those fields (a 400 naming `tools[i]...`, `tool_choice` or `parallel_tool_calls`), the
server's tool options (ToolConfig: `--enable-auto-tool-choice`, `--tool-call-parser`,
`--exclude-tools-when-tool-choice-none`), the JSON schema a forced choice compiles (xgrammar, as any structured
output), and ToolCallOutput, which turns each choice's text into tool calls for the full answer and the stream
alike. The formats themselves are read by tool_parsers.py.

    tool_choice                      the output is            read by                   finish_reason on "stop"
    "none"                           free text                nothing (content)         "stop"
    "auto" (the default with tools)  free text                --tool-call-parser         "tool_calls" if it called
    "required"                       a JSON array of calls    RequiredToolCalls          "tool_calls"
    {"type": "function", ...}        that function's args     NamedToolCall              "stop"

The tools go to the chat template as `tools=` whatever the choice (with "none" too, unless the server runs with
`--exclude-tools-when-tool-choice-none`), as vLLM. "auto" needs a parser (a 400 without `--enable-auto-tool-choice`,
as vLLM); "required" with an empty `tools` list means "none" (OpenAI's rule, as vLLM). A forced choice's message has
content "" and its tool_calls; a forced choice with response_format or another constraint is a 400.
`parallel_tool_calls: false` keeps only the first call.
"""

from __future__ import annotations

from dataclasses import dataclass

from minivllm.core.sampling_params import StructuredOutputsParams
from minivllm.entrypoints.protocol import APIError, describe, read_field, read_text, structured_outputs_param
from minivllm.entrypoints.serving_engine import ResponseMeta, make_choice
from minivllm.entrypoints.tool_parsers import NamedToolCall, RequiredToolCalls, ToolParser, get_tool_parser

TOOL_KEYS = {"type", "function"}
FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
TOOL_SHAPE = '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'
NAMED_SHAPE = '{"type": "function", "function": {"name": ...}}'
NO_PARAMETERS = {"type": "object", "properties": {}}       # what a function without `parameters` takes (vLLM's)
AUTO_NEEDS_PARSER = ('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set (as vLLM; '
                     'tool_choice is "auto" by default when tools are sent). Send tool_choice "none", "required" or '
                     f'{NAMED_SHAPE}, or start the server with --enable-auto-tool-choice --tool-call-parser hermes.')


@dataclass(frozen=True)
class ToolConfig:
    """The server's tool options (vLLM's flags of the same names)."""
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (e.g. hermes): the format the "
                             "model writes its tool calls in")
        if self.tool_call_parser is not None:
            get_tool_parser(self.tool_call_parser)          # a name no parser has: refused at startup

    @property
    def parser(self) -> type[ToolParser] | None:
        """The parser "auto" reads answers with; None without --enable-auto-tool-choice."""
        return get_tool_parser(self.tool_call_parser) if self.enable_auto_tool_choice else None


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tool fields, checked."""
    tools: list[dict] | None = None
    choice: str = "none"                  # "none", "auto", "required" or "named"
    name: str | None = None               # the named function
    parallel: bool = True
    template_tools: list[dict] | None = None      # what the chat template gets as `tools`
    constraint: StructuredOutputsParams | None = None
    constraint_param: str | None = None           # where a constraint that does not compile points

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def output(self, config: ToolConfig) -> ToolCallOutput | None:
        """The reader of this request's answers; None when its text is plain content."""
        if self.forced or (self.choice == "auto" and self.tools):
            return ToolCallOutput(self, config.parser)
        return None


# ---------------------------------------------------------------------- reading a request
def read_tools(body: dict) -> list[dict] | None:
    """`tools`: a list of OpenAI function definitions, each checked (a 400 naming tools[i]... otherwise)."""
    tools = read_field(body, "tools", "list")
    if tools is None:
        return None
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise APIError(f"{where} is {describe(tool)}; each tool must be {TOOL_SHAPE}.", param=where)
        if tool.get("type") != "function":
            raise APIError(f"{where}.type is {describe(tool.get('type'))}; minivllm's tools are functions: "
                           f"{TOOL_SHAPE}.", param=f"{where}.type")
        _refuse_unknown(tool, TOOL_KEYS, where)
        function = tool.get("function")
        if not isinstance(function, dict):
            raise APIError(f"{where}.function is {describe(function)}; it must be an object: {TOOL_SHAPE}.",
                           param=f"{where}.function")
        _refuse_unknown(function, FUNCTION_KEYS, f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(f"{where}.function.name is {describe(name)}; it must be the function's name, a non-empty "
                           "string.", param=f"{where}.function.name")
        read_text(name, f"{where}.function.name")
        for key, kind, what in (("description", str, "a string"), ("parameters", dict, "a JSON schema object"),
                                ("strict", bool, "true or false")):
            value = function.get(key)
            if value is not None and not isinstance(value, kind):
                raise APIError(f"{where}.function.{key} is {describe(value)}; it must be {what}.",
                               param=f"{where}.function.{key}")
    return tools


def _refuse_unknown(obj: dict, known: set[str], where: str) -> None:
    unknown = sorted(set(obj) - known)
    if unknown:
        raise APIError(f"{where} has {', '.join(map(repr, unknown))}, which minivllm does not read; it takes "
                       f"{', '.join(sorted(known))} ({TOOL_SHAPE}).", param=f"{where}.{unknown[0]}")


def read_tool_choice(body: dict, tools: list[dict] | None) -> tuple[str, str | None]:
    """(choice, function name): "none", "auto", "required" or "named" with its name. Absent, "auto" when tools are
    sent (vLLM's default) and "none" otherwise."""
    choice = body.get("tool_choice")
    if choice is None:
        return ("auto" if tools else "none"), None
    if choice == "none":
        return "none", None
    if tools is None:
        raise APIError(f"'tool_choice' is {describe(choice)} but there are no 'tools'; send the functions the model "
                       "may call in 'tools' (or leave tool_choice out).", param="tool_choice")
    if choice in ("auto", "required"):
        return ("none" if choice == "required" and not tools else choice), None
    if not isinstance(choice, dict):
        raise APIError(f"'tool_choice' is {describe(choice)}; it must be 'none', 'auto', 'required' or "
                       f"{NAMED_SHAPE}.", param="tool_choice")
    function = choice.get("function")
    if (choice.get("type") != "function" or set(choice) != TOOL_KEYS or not isinstance(function, dict)
            or set(function) != {"name"} or not isinstance(function["name"], str)):
        raise APIError(f"'tool_choice' is {describe(choice)}; a named function is {NAMED_SHAPE}.", param="tool_choice")
    names = [t["function"]["name"] for t in tools]
    if function["name"] not in names:
        raise APIError(f"'tool_choice' names the function {describe(function['name'])}, which is not in 'tools' "
                       f"(they are: {', '.join(map(describe, names)) or 'none'}).", param="tool_choice")
    return "named", function["name"]


def read_tool_request(body: dict, config: ToolConfig) -> ToolRequest:
    """A chat body's tools, tool_choice and parallel_tool_calls; raises APIError naming the field."""
    tools = read_tools(body)
    choice, name = read_tool_choice(body, tools)
    parallel = read_field(body, "parallel_tool_calls", "bool", True)
    if choice == "auto" and config.parser is None:
        raise APIError(AUTO_NEEDS_PARSER, param="tool_choice")
    template_tools = None if choice == "none" and config.exclude_tools_when_tool_choice_none else tools
    if choice not in ("required", "named"):
        return ToolRequest(tools, choice, name, parallel, template_tools)
    other = structured_outputs_param(body)
    if other is not None:
        raise APIError(f"'{other}' constrains the output, and so does tool_choice {describe(body['tool_choice'])} "
                       "(its JSON is the tool call); send one of them.", param=other)
    schema, param = forced_schema(tools, choice, name)
    try:
        constraint = StructuredOutputsParams(json=schema)
    except ValueError as e:
        raise APIError(str(e), param=param) from None
    return ToolRequest(tools, choice, name, parallel, template_tools, constraint, param)


def forced_schema(tools: list[dict], choice: str, name: str | None) -> tuple[dict, str]:
    """The JSON schema a forced choice's output must match, and the field it comes from. Named: the function's
    `parameters`. "required": vLLM's array of one or more {"name": <a tool's name>, "parameters": <its schema>} (each
    function's `$defs` moved to the top, where its `$ref`s point)."""
    if choice == "named":
        i = next(i for i, t in enumerate(tools) if t["function"]["name"] == name)
        return tools[i]["function"].get("parameters") or NO_PARAMETERS, f"tools[{i}].function.parameters"
    items, defs = [], {}
    for i, tool in enumerate(tools):
        parameters = dict(tool["function"].get("parameters") or NO_PARAMETERS)     # only its top level changes
        for key, schema in (parameters.pop("$defs", None) or {}).items():
            if defs.setdefault(key, schema) != schema:
                raise APIError(f"tools[{i}].function.parameters defines $defs.{key} differently from another tool; "
                               "tool_choice 'required' puts every tool's $defs in one schema.",
                               param=f"tools[{i}].function.parameters")
        items.append({"properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if defs:
        schema["$defs"] = defs
    return schema, "tools"


# ---------------------------------------------------------------------- writing the answer
class ToolCallOutput:
    """One response's tool calls: each choice's text read by its own parser (one per choice, as vLLM), for the full
    answer (`write_message`) or the stream (`stream_choices`), which say the same."""

    def __init__(self, request: ToolRequest, auto_parser: type[ToolParser] | None):
        self.request = request
        self.auto_parser = auto_parser
        self.parsers: dict[int, ToolParser] = {}

    def new_parser(self) -> ToolParser:
        if self.request.choice == "named":
            return NamedToolCall(self.request.name)
        return RequiredToolCalls() if self.request.choice == "required" else self.auto_parser()

    def finish_reason(self, engine_reason: str | None, called: bool) -> str | None:
        """"tool_calls" for "auto" with calls and for "required", when the output ended by itself; a named
        function's answer ends as any other ("stop"), as OpenAI and vLLM."""
        choice = self.request.choice
        if engine_reason == "stop" and (choice == "required" or (choice == "auto" and called)):
            return "tool_calls"
        return engine_reason

    def keep(self, delta: dict) -> dict | None:
        """parallel_tool_calls false: only the first call's deltas."""
        if self.request.parallel or "tool_calls" not in delta:
            return delta
        calls = [c for c in delta["tool_calls"] if c["index"] == 0]
        return {**delta, "tool_calls": calls} if calls else None

    def write_message(self, choice: dict) -> None:
        """A full answer's choice: its text read for tool calls, message and finish_reason rewritten."""
        got = self.new_parser().extract_tool_calls(choice["message"]["content"])
        calls = got.tool_calls if self.request.parallel else got.tool_calls[:1]
        if self.request.forced:
            choice["message"] = {"role": "assistant", "content": "", "tool_calls": calls}
        elif calls:
            choice["message"] = {"role": "assistant", "content": got.content, "tool_calls": calls}
        else:
            choice["message"]["content"] = got.content
        choice["finish_reason"] = self.finish_reason(choice["finish_reason"], bool(calls))

    def stream_choices(self, meta: ResponseMeta, k: int, text: str, finish_reason: str | None, stop_reason,
                       logprobs: dict | None) -> list[dict]:
        """The stream choices for choice k's new text: none while it is held back, else one per delta (the
        logprobs with the first, finish_reason with the last)."""
        parser = self.parsers.setdefault(k, self.new_parser())
        finished = finish_reason is not None
        deltas = [d for d in map(self.keep, parser.extract_tool_calls_streaming(text, finished)) if d]
        if finished:
            finish_reason = self.finish_reason(finish_reason, parser.num_calls > 0)
        if not deltas and not finished and logprobs is None:
            return []
        choices = []
        for j, delta in enumerate(deltas or [{}]):
            last = j == max(len(deltas), 1) - 1
            choice = make_choice(meta, k, "", finish_reason if last else None, stop_reason if last else None,
                                 stream=True, logprobs=logprobs if j == 0 else None)
            choice["delta"] = delta
            choices.append(choice)
        return choices
