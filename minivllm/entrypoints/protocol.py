"""The OpenAI API's request and response bodies (vLLM's entrypoints/openai/protocol.py).

Owns: reading a request body (JSON object, field types, ranges, unsupported options) into engine terms
(a prompt and SamplingParams), the error body every bad request gets, and the shapes of the response
bodies and stream chunks. Pure functions of the body: no engine, no HTTP. Anything wrong raises APIError
naming the field (OpenAI's `param`), which the server turns into a 400:

    {"error": {"message": "temperature is -1; it must be >= 0 (0 means greedy).",
               "type": "invalid_request_error", "param": "temperature", "code": null}}
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass

from minivllm.core.sampling_params import RequestOutputKind, SamplingParams
from minivllm.outputs import RequestOutput

CHAT_ROLES = ("system", "developer", "user", "assistant")
INT64 = (-(2 ** 63), 2 ** 63 - 1)     # torch generators and tensors take no wider ints
FLOAT_MAX = sys.float_info.max       # a JSON integer beyond it is valid JSON but fits no float
# Fields that change the answer in ways minivllm does not implement: refused unless left at their default.
UNSUPPORTED = {"logprobs": (None, False), "top_logprobs": (None, 0), "echo": (None, False), "suffix": (None,),
               "best_of": (None, 1), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
               "repetition_penalty": (None, 1), "logit_bias": (None, {}), "tools": (None, []),
               "functions": (None, []), "tool_choice": (None, "none"),
               "response_format": (None, {"type": "text"})}


class APIError(Exception):
    """Becomes OpenAI's error body. `param` names the offending field, as OpenAI does."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status_code, self.type, self.code = message, param, status_code, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------- reading a request
def parse_json_body(raw: bytes) -> dict:
    """The request body as a JSON object."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON ({e}); send a JSON object with "
                       "'Content-Type: application/json'.") from None
    except RecursionError:           # Python's parser recurses once per nested array or object
        raise APIError("the request body nests arrays or objects too deeply for the JSON parser (about "
                       f"{sys.getrecursionlimit()} levels at most); no field of this API needs more than 3.") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body is a JSON {json_type(body)}; it must be a JSON object.")
    return body


def read_field(body: dict, name: str, kind: str, default=None):
    """body[name] checked against `kind` (int, number, bool, string, list, object); null counts as absent."""
    value = body.get(name)
    if value is None:
        return default
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "string": isinstance(value, str),
        "list": isinstance(value, list),
        "object": isinstance(value, dict),
    }[kind]
    if not ok:
        raise APIError(f"'{name}' is {describe(value)} ({json_type(value)}); it must be "
                       f"{'an' if kind in ('int', 'object') else 'a'} {kind}.", param=name)
    if kind == "number" and isinstance(value, int) and not -FLOAT_MAX <= value <= FLOAT_MAX:
        # Valid JSON, but math and tensors need a float, and float(value) would raise OverflowError.
        raise APIError(f"'{name}' is an integer of {len(str(abs(value)))} digits; it must be a finite number "
                       f"(|value| <= {FLOAT_MAX:.4g}).", param=name)
    if kind == "number" and not math.isfinite(value):
        raise APIError(f"'{name}' is {value}; it must be a finite number.", param=name)
    if kind == "int" and not INT64[0] <= value <= INT64[1]:
        raise APIError(f"'{name}' is {describe(value)}; it must fit in 64 bits (|value| < 2**63).", param=name)
    return value


def read_text(text: str, param: str) -> str:
    """A string the tokenizer can take. JSON's \\u escapes can put a lone surrogate (\\ud800) in a Python
    str: no UTF-8 text holds one, and the tokenizer raises TypeError on it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"'{param}' holds a lone surrogate (\\u{ord(text[e.start]):04x}) at character {e.start}: "
                       "it is not Unicode text. Send UTF-8, or escape a character outside the BMP as a "
                       "surrogate pair (\\ud83d\\ude00 is one emoji).", param=param) from None
    return text


def describe(value) -> str:
    """A JSON value as an error message quotes it: escaped (a lone surrogate stays printable), short."""
    try:
        text = json.dumps(value)
    except (RecursionError, ValueError):        # nested about as deep as the parser allows; a 4,300+ digit int
        text = f"a very large {json_type(value)}"
    return text if len(text) <= 60 else text[:57] + "..."


def json_type(value) -> str:
    for t, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
                    (dict, "object")):
        if isinstance(value, t):
            return name
    return "null"


def check_model(body: dict, accepted_names: set[str], served_name: str) -> None:
    model = read_field(body, "model", "string")
    if model is not None and model not in accepted_names:
        raise APIError(f"model {describe(model)} is not served here; this server serves '{served_name}' (see "
                       "/v1/models).", param="model", code="model_not_found")


def requested_max_tokens(body: dict, chat: bool) -> tuple[str, int | None]:
    """The output-length field's name and value (None if absent). Chat takes OpenAI's newer
    max_completion_tokens or the older max_tokens."""
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    value = read_field(body, name, "int")
    if value is not None and value < 1:
        raise APIError(f"'{name}' is {value}; it must be >= 1.", param=name)
    return name, value


def sampling_params_from_body(body: dict, chat: bool, default_max_tokens: int) -> SamplingParams:
    """The request's SamplingParams; raises APIError naming the field for anything wrong or unsupported."""
    for name, defaults in UNSUPPORTED.items():
        if name in body and body[name] not in defaults:
            raise APIError(f"'{name}' is {describe(body[name])}; minivllm does not support it. Leave it "
                           f"out (or at {json.dumps(defaults[-1])}).", param=name)
    n = read_field(body, "n", "int", 1)
    if n != 1:
        raise APIError(f"'n' is {n}; minivllm generates one choice per request (n=1). Send the request "
                       "several times (with different seeds) instead.", param="n")
    max_tokens_name, max_tokens = requested_max_tokens(body, chat)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                           and all(isinstance(s, str) for s in stop))):
        raise APIError(f"'stop' is {describe(stop)}; it must be a string or a list of strings.",
                       param="stop")
    stop_token_ids = read_field(body, "stop_token_ids", "list", [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 63 for t in stop_token_ids):
        raise APIError(f"'stop_token_ids' is {describe(stop_token_ids)}; it must be a list of "
                       "non-negative token ids.", param="stop_token_ids")
    kwargs = dict(
        temperature=read_field(body, "temperature", "number", 1.0),
        top_p=read_field(body, "top_p", "number", 1.0),
        top_k=read_field(body, "top_k", "int", -1),
        seed=read_field(body, "seed", "int"),
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        stop=stop, stop_token_ids=stop_token_ids,
        ignore_eos=read_field(body, "ignore_eos", "bool", False),
        skip_special_tokens=read_field(body, "skip_special_tokens", "bool", True),
    )
    try:
        # Every request runs as deltas: a stream forwards each new piece, a full answer joins them (O(n) both).
        return SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
    except ValueError as e:
        # SamplingParams' messages start with the field's name ("top_p is 1.5; ..."): that is OpenAI's param.
        field_name = str(e).split(" ", 1)[0]
        raise APIError(str(e), param=max_tokens_name if field_name == "max_tokens"
                       else field_name if field_name in kwargs else None) from None


@dataclass(frozen=True)
class ParsedRequest:
    """A request body checked and turned into engine terms; what the completion routes share."""
    prompt: str | list[int]
    body: dict
    stream: bool
    include_usage: bool
    prompt_param: str              # where a prompt error points: "prompt" or "messages"


def parse_stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage). stream_options is only allowed with stream=true, as in OpenAI's API."""
    stream = read_field(body, "stream", "bool", False)
    options = read_field(body, "stream_options", "object")
    if options is None:
        return stream, False
    if not stream:
        raise APIError("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    return stream, read_field(options, "include_usage", "bool", False)


def parse_prompt(body: dict) -> str | list[int]:
    """A completion prompt: a string or a list of token ids (or a list holding exactly one of those)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError("'prompt' is required: a string, or a list of token ids.", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                      # a batch of one
    if isinstance(prompt, str):
        return read_text(prompt, "prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(f"'prompt' is a batch of {len(prompt)} prompts; minivllm takes one prompt per request. "
                       "Send one request per prompt (they are batched on the server anyway).", param="prompt")
    raise APIError(f"'prompt' is {describe(prompt)}; it must be a string or a list of token ids.",
                   param="prompt")


def parse_messages(body: dict) -> list[dict]:
    """Chat messages as {"role", "content": str}. Content may be a string or a list of text parts."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        got = "missing" if messages is None else describe(messages)
        raise APIError(f"'messages' is {got}; it must be a non-empty list of {{'role', 'content'}} objects.",
                       param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"{where} is {describe(m)}; each message must be an object with 'role' and "
                           "'content'.", param=where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise APIError(f"{where}.role is {describe(role)}; it must be one of {list(CHAT_ROLES)}.",
                           param=f"{where}.role")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(f"{where}.content[{j}] is {describe(part)}; only text parts "
                                   "({'type': 'text', 'text': ...}) are supported.", param=f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise APIError(f"{where}.content is {describe(content)}; it must be a string or a list of "
                           "text parts.", param=f"{where}.content")
        out.append({"role": "system" if role == "developer" else role,
                    "content": read_text(content, f"{where}.content")})
    return out


# ---------------------------------------------------------------------- responses
@dataclass(frozen=True)
class ResponseMeta:
    """What every body and chunk of one response repeats: its id, creation time, model and kind."""
    request_id: str
    created: int
    model: str
    chat: bool

    def envelope(self, choices: list, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}


def usage_of(final: RequestOutput, completion_tokens: int) -> dict:
    """The usage object: prompt and cached tokens from the request's final output; completion tokens counted
    over its deltas by the caller."""
    prompt_tokens = len(final.prompt_token_ids)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": final.num_cached_tokens}}


def make_choice(meta: ResponseMeta, text: str, finish_reason: str | None, stop_reason, stream: bool,
                first: bool = False) -> dict:
    """One entry of `choices`: a chat message, a chat stream delta (the first one carries the role), or text."""
    choice: dict = {"index": 0}
    if meta.chat and stream:
        choice["delta"] = ({"role": "assistant", "content": text} if first else {"content": text}) \
            if (first or text) else {}
    elif meta.chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    choice.update(logprobs=None, finish_reason=finish_reason, stop_reason=stop_reason)
    return choice
