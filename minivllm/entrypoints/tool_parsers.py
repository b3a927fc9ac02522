"""Reading tool calls out of a chat answer's text (vLLM's entrypoints/openai/tool_parsers/).

Owns: the registry of the model formats `--tool-call-parser NAME` selects (vLLM's names: `hermes`), and the readers of
the two forced tool choices, whose text the grammar shapes (NamedToolCall: the arguments object of one function;
RequiredToolCalls: a JSON array of {"name", "parameters"}). What a request asks for is tool_calls.py's.

Every parser reads one choice's output, as vLLM's ToolParser does, in two ways that say the same thing:
`extract_tool_calls_streaming(delta_text, finished)` reads it piece by piece and returns stream deltas;
`extract_tool_calls(text)` reads it whole, as one piece, and folds those deltas into a message. So a stream's deltas,
joined, are exactly the full answer, wherever the text was split. A delta is what a chat stream chunk's `delta` holds:

    {"content": "Let me look that up."}
    {"tool_calls": [{"index": 0, "id": "chatcmpl-tool-<hex>", "type": "function", "function": {"name": "get_weather"}}]}
    {"tool_calls": [{"index": 0, "function": {"arguments": "{\\"city\\": \\"Paris\\"}"}}]}

`hermes` (Hermes 2 Pro and later, Qwen2.5, ...): each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` block
is a call, its arguments re-serialized with json.dumps; a last block the output ends inside counts when its JSON is
whole. The text outside the blocks is the content (None when it is only whitespace and there are calls). A block that
is not such JSON stays in the content, tags and all. A stream holds back text that may be the start of `<tool_call>`,
and a block until it closes: each call is sent whole, as its name delta then its arguments delta.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(name: str):
    """Class decorator: the parser `--tool-call-parser name` selects."""
    def register(cls):
        TOOL_PARSERS[name] = cls
        return cls
    return register


def get_tool_parser(name: str) -> type[ToolParser]:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser is {name!r}; the tool-call parsers are: "
                         f"{', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]


def make_tool_call_id() -> str:
    """A tool call's id, as vLLM writes it."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def call_deltas(index: int, name: str, arguments: str | None) -> list[dict]:
    """A tool call as stream deltas: its id, type and name first, then its arguments (if any yet)."""
    head = {"tool_calls": [{"index": index, "id": make_tool_call_id(), "type": "function", "function": {"name": name}}]}
    return [head] + ([arguments_delta(index, arguments)] if arguments else [])


def arguments_delta(index: int, arguments: str) -> dict:
    return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


@dataclass
class ExtractedToolCalls:
    """A whole answer, read: its tool calls (OpenAI's message.tool_calls) and its content."""
    tools_called: bool
    tool_calls: list[dict]
    content: str | None


def fold(deltas: list[dict]) -> ExtractedToolCalls:
    """Stream deltas joined into one message, as a client joins a stream."""
    content: list[str] = []
    calls: dict[int, dict] = {}
    for delta in deltas:
        if "content" in delta:
            content.append(delta["content"])
        for piece in delta.get("tool_calls", ()):
            call = calls.setdefault(piece["index"], {"id": None, "type": "function",
                                                     "function": {"name": None, "arguments": ""}})
            if "id" in piece:
                call["id"] = piece["id"]
            function = piece.get("function", {})
            if "name" in function:
                call["function"]["name"] = function["name"]
            call["function"]["arguments"] += function.get("arguments", "")
    text = "".join(content)
    tool_calls = [calls[i] for i in sorted(calls)]
    return ExtractedToolCalls(bool(tool_calls), tool_calls, (text or None) if tool_calls else text)


def merged(deltas: list[dict]) -> list[dict]:
    """Consecutive content deltas as one."""
    out: list[dict] = []
    for delta in deltas:
        if "content" in delta and out and set(out[-1]) == {"content"}:
            out[-1] = {"content": out[-1]["content"] + delta["content"]}
        elif delta:
            out.append(delta)
    return out


class ToolParser:
    """One choice's output read for tool calls. A parser is stateful: one per choice, fed in order."""

    def __init__(self):
        self.num_calls = 0
        self._held = ""            # leading whitespace of the content: dropped if the answer turns out to be calls only
        self._spoke = False        # some content that is not whitespace was sent

    def extract_tool_calls_streaming(self, delta_text: str, finished: bool) -> list[dict]:
        """The deltas this new piece of text makes (the last piece comes with finished=True)."""
        raise NotImplementedError

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """A whole answer, read as one piece."""
        return fold(self.extract_tool_calls_streaming(text, finished=True))

    def _call(self, name: str, arguments: str | None, out: list[dict]) -> None:
        out += call_deltas(self.num_calls, name, arguments)
        self.num_calls += 1

    def _content(self, text: str, out: list[dict]) -> None:
        if not text:
            return
        if not self._spoke:
            if not text.strip():
                self._held += text
                return
            text, self._held, self._spoke = self._held + text, "", True
        out.append({"content": text})

    def _finish(self, out: list[dict]) -> None:
        """At the end: leading whitespace is the content when there was nothing else (no call, no other text)."""
        if self._held and not self.num_calls:
            out.append({"content": self._held})
        self._held = ""


def partial_tag_length(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (and must wait for the next piece)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


@register_tool_parser("hermes")
class HermesToolParser(ToolParser):
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (vLLM's Hermes2ProToolParser's format)."""
    start, end = "<tool_call>", "</tool_call>"

    def __init__(self):
        super().__init__()
        self._buffer = ""          # text not yet sent: a possible tag's start, or the open block's text
        self._in_block = False
        self._searched = 0         # the open block's text before this holds no end tag

    def extract_tool_calls_streaming(self, delta_text: str, finished: bool) -> list[dict]:
        out: list[dict] = []
        self._buffer += delta_text
        while self._step(out, finished):
            pass
        if finished:
            self._finish(out)
        return merged(out)

    def _step(self, out: list[dict], finished: bool) -> bool:
        """Move past the next tag if the buffer holds it; False when the rest waits for more text."""
        if not self._in_block:
            at = self._buffer.find(self.start)
            if at < 0:
                keep = 0 if finished else partial_tag_length(self._buffer, self.start)
                cut = len(self._buffer) - keep
                self._content(self._buffer[:cut], out)
                self._buffer = self._buffer[cut:]
                return False
            self._content(self._buffer[:at], out)
            self._buffer, self._in_block, self._searched = self._buffer[at + len(self.start):], True, 0
            return True
        at = self._buffer.find(self.end, self._searched)
        if at >= 0:
            self._block(self._buffer[:at], self.start + self._buffer[:at + len(self.end)], out)
            self._buffer, self._in_block = self._buffer[at + len(self.end):], False
            return True
        if finished:                         # the output ended inside a block: a call if its JSON is whole
            self._block(self._buffer, self.start + self._buffer, out)
            self._buffer, self._in_block = "", False
        else:
            self._searched = max(0, len(self._buffer) - len(self.end) + 1)
        return False

    def _block(self, body: str, raw: str, out: list[dict]) -> None:
        call = hermes_call(body)
        if call is None:
            self._content(raw, out)
        else:
            self._call(*call, out)


def hermes_call(body: str) -> tuple[str, str] | None:
    """A block's (name, arguments as JSON text), or None when it is not {"name": str, "arguments": object}."""
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and call["name"]
            and isinstance(call.get("arguments"), dict)):
        return None
    return call["name"], json.dumps(call["arguments"], ensure_ascii=False)


class NamedToolCall(ToolParser):
    """tool_choice naming a function: the whole output is its arguments (the grammar made it valid JSON for the
    function's `parameters`), sent as it comes."""

    def __init__(self, name: str):
        super().__init__()
        self.name = name

    def extract_tool_calls_streaming(self, delta_text: str, finished: bool) -> list[dict]:
        if self.num_calls:
            return [arguments_delta(0, delta_text)] if delta_text else []
        out: list[dict] = []
        self._call(self.name, delta_text, out)
        return out


class RequiredToolCalls(ToolParser):
    """tool_choice "required": the output is a JSON array of {"name": ..., "parameters": {...}} (the grammar's
    schema). Each element is a call once it closes, its arguments json.dumps(parameters) as vLLM writes them; an
    element the output was cut inside (max_tokens) is no call."""

    def __init__(self):
        super().__init__()
        self._depth = 0
        self._in_string = self._escaped = False
        self._element: list[str] | None = None     # the open element's characters

    def extract_tool_calls_streaming(self, delta_text: str, finished: bool) -> list[dict]:
        out: list[dict] = []
        for ch in delta_text:
            if self._element is not None:
                self._element.append(ch)
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "[{":
                self._depth += 1
                if ch == "{" and self._depth == 2:
                    self._element = [ch]
            elif ch in "]}":
                self._depth -= 1
                if ch == "}" and self._depth == 1 and self._element is not None:
                    self._close_element("".join(self._element), out)
                    self._element = None
        return out

    def _close_element(self, text: str, out: list[dict]) -> None:
        try:
            element = json.loads(text)
        except (ValueError, RecursionError):
            return
        if isinstance(element, dict) and isinstance(element.get("name"), str) and "parameters" in element:
            self._call(element["name"], json.dumps(element["parameters"], ensure_ascii=False), out)
