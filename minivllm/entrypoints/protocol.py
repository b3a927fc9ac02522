"""The OpenAI API's request bodies and error body (vLLM's entrypoints/openai/protocol.py).

Owns: which fields each route takes, reading a request body (JSON object, field types, ranges, unsupported
options) into engine terms (SamplingParams), and the error body every bad request gets. Chat messages and the
chat template are chat_utils.py's; the prompts, stream options and vLLM's extra fields (priority,
truncation_side, return_token_ids, ...) are read by request_options.py; the response bodies and stream chunks
are response_shapes.py's. Pure functions of the body: no engine, no HTTP. Nothing is accepted and ignored: a
field a route does not read (ACCEPTED_FIELDS; docs/api.md lists them) is refused. Anything wrong raises APIError
naming the field (OpenAI's `param`), which the server turns into a 400 (a 404 for a model not served here):

    {"error": {"message": "temperature is -1; it must be >= 0 (0 means greedy).",
               "type": "invalid_request_error", "param": "temperature", "code": null}}
"""

from __future__ import annotations

import difflib
import json
import math
import sys
from dataclasses import dataclass

from minivllm.core.sampling_params import MAX_LOGPROBS, RequestOutputKind, SamplingParams, StructuredOutputsParams
from minivllm.engine.input_processor import logprobs_over_limit

INT64 = (-(2 ** 63), 2 ** 63 - 1)     # torch generators and tensors take no wider ints
FLOAT_MAX = sys.float_info.max       # a JSON integer beyond it is valid JSON but fits no float

# What each route reads, field by field. Anything else in a body is a 400 naming the field: a typo, or a
# field vLLM or OpenAI knows that minivllm does not implement (NOT_IMPLEMENTED says which). Implementing a
# sampling option is one line: move it from NOT_IMPLEMENTED to SAMPLING_FIELDS (and read it below).
SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "seed", "n", "max_tokens", "stop", "stop_token_ids",
                   "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "bad_words",
                   "allowed_token_ids", "logit_bias", "truncate_prompt_tokens", "use_beam_search", "length_penalty"}
STRUCTURED_OUTPUT_FIELDS = {"response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                            "guided_grammar", "guided_decoding_backend"}
# vLLM's extra fields, read by request_options.py
EXTRA_FIELDS = {"priority", "truncation_side", "return_token_ids", "return_tokens_as_token_ids"}
COMMON_FIELDS = ({"model", "stream", "stream_options", "user", "cache_salt"} | SAMPLING_FIELDS
                 | STRUCTURED_OUTPUT_FIELDS | EXTRA_FIELDS)
MAX_USER_CHARS = 256            # OpenAI's `user` is an opaque id: minivllm checks it and does not use it
CHAT_TEMPLATE_FIELDS = {"add_generation_prompt", "continue_final_message", "chat_template"}
TOOL_FIELDS = {"tools", "tool_choice", "parallel_tool_calls"}      # read by tool_calls.py
ACCEPTED_FIELDS = {
    "/v1/completions": COMMON_FIELDS | {"prompt", "logprobs", "echo", "prompt_logprobs"},
    "/v1/chat/completions": COMMON_FIELDS | CHAT_TEMPLATE_FIELDS | TOOL_FIELDS | {"messages", "max_completion_tokens",
                                                                                   "logprobs", "top_logprobs", "echo",
                                                                                   "prompt_logprobs"},
    "/tokenize": {"model", "prompt", "messages", "add_special_tokens", "tools"} | CHAT_TEMPLATE_FIELDS,
    "/detokenize": {"model", "tokens"},
}
# Fields vLLM or OpenAI define that change the answer in ways minivllm does not (yet) implement: refused
# unless left at a value that means "off" (clients such as vLLM's benchmark send some of them that way).
# top_logprobs (completions) and the tool fields are implemented on one route only.
NOT_IMPLEMENTED = {
    "top_logprobs": (None, 0), "suffix": (None,), "best_of": (None, 1),
    "guided_whitespace_pattern": (None,), "tools": (None, []),
    "functions": (None, []), "tool_choice": (None, "none"), "parallel_tool_calls": (None,),
    "chat_template_kwargs": (None, {}), "documents": (None,), "spaces_between_special_tokens": (None, True),
}


def check_fields(body: dict, route: str) -> None:
    """Refuse any field `route` does not read, naming it (and the field meant, for a typo)."""
    accepted = ACCEPTED_FIELDS[route]
    for name, value in body.items():
        if name in accepted:
            continue
        if name in NOT_IMPLEMENTED:
            if any(value == off and isinstance(value, bool) == isinstance(off, bool)
                   for off in NOT_IMPLEMENTED[name]):
                continue
            raise APIError(f"'{name}' is {describe(value)}; minivllm does not implement it. Leave it out (or "
                           f"at {json.dumps(NOT_IMPLEMENTED[name][-1])}).", param=name)
        close = difflib.get_close_matches(name, sorted(accepted), n=1)
        hint = f"Did you mean '{close[0]}'? " if close else ""
        raise APIError(f"'{name}' is not a field of {route}; {hint}The fields it takes are: "
                       f"{', '.join(sorted(accepted))}.", param=name)


class APIError(Exception):
    """Becomes OpenAI's error body. `param` names the offending field, as OpenAI does."""

    def __init__(self, message: str, param: str | None = None, status_code: int = 400,
                 type: str = "invalid_request_error", code: str | int | None = None):
        super().__init__(message)
        self.message, self.param, self.status_code, self.type, self.code = message, param, status_code, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------------- reading a request
def check_json_content_type(request) -> None:
    """A POST body must say it is JSON, as vLLM requires (415 otherwise): a web page may send a cross-site
    text/plain or form POST without asking the browser first, but not an application/json one."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(f"the request body's Content-Type is {media_type or 'missing'!r}; send JSON with "
                       "'Content-Type: application/json'.", status_code=415, type="unsupported_media_type")


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


def read_logit_bias(body: dict) -> dict[int, float] | None:
    """OpenAI's logit_bias: a JSON object whose keys are token ids written as strings ({"42": 5})."""
    bias = read_field(body, "logit_bias", "object")
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        # ASCII digits only: str.isdigit() also takes "²", "①" (int() then fails) and "٣", "０" (int() reads them).
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) < 19):
            raise APIError(f"'logit_bias' has the key {describe(key)}; keys must be token ids, e.g. \"42\".",
                           param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or abs(value) > FLOAT_MAX:
            raise APIError(f"'logit_bias' gives token {key} the bias {describe(value)}; a bias must be a finite "
                           "number (vLLM clamps it to [-100, 100]).", param="logit_bias")
        out[int(key)] = float(value)
    return out


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


def requested_max_tokens(body: dict, chat: bool) -> tuple[str, int | None]:
    """The output-length field's name and value (None if absent). Chat takes OpenAI's newer
    max_completion_tokens or the older max_tokens. A completion with echo may ask for 0 tokens (OpenAI's and
    vLLM's way to score a prompt): the engine then samples one token that the answer leaves out."""
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    value = read_field(body, name, "int")
    if value == 0 and not chat and body.get("echo") is True:
        return name, 0
    if value is not None and value < 1:
        raise APIError(f"'{name}' is {value}; it must be >= 1 (0 only with 'echo': true, on /v1/completions).",
                       param=name)
    return name, value


@dataclass(frozen=True)
class LogprobsLimit:
    """The engine's bounds on a field that asks for the k most likely tokens: max_logprobs (EngineConfig's, the
    server's --max-logprobs; -1: none) and the vocabulary's size, what vLLM's -1 asks for (None: not known, so -1
    passes only without a limit). The default is vLLM's default server's."""
    max_logprobs: int = MAX_LOGPROBS
    vocab_size: int | None = None

    def read(self, body: dict, name: str) -> int | None:
        """body[name]: None, or k >= 0 within the limit; -1 (the whole vocabulary) comes back as the vocabulary's size,
        so the answer writes every token."""
        value = read_field(body, name, "int")
        if value is not None and value < -1:
            raise APIError(f"'{name}' is {value}; it must be >= 0 (how many of the most likely tokens to return per "
                           "position) or -1 (the whole vocabulary).", param=name)
        error = logprobs_over_limit(f"'{name}'", value, self.max_logprobs, self.vocab_size, where="server")
        if error:
            raise APIError(error, param=name)
        return self.vocab_size if value == -1 and self.vocab_size is not None else value


@dataclass(frozen=True)
class LogprobsRequest:
    """What a body asks for in logprobs, in one shape for both routes. num_logprobs: SamplingParams.logprobs
    (completions' `logprobs`; chat's `top_logprobs` when `logprobs` is true); echo: completions' echo (the prompt's
    text, tokens and logprobs in front of each choice; chat's echo is text only, serving_chat.py); prompt_logprobs:
    what the engine computes (vLLM's `prompt_logprobs`, else with echo completions' `logprobs` or chat's
    `top_logprobs`, 0 by default); return_prompt_logprobs: the answer carries them (completions: in each choice,
    when the body asked for `prompt_logprobs`; chat: at the top, whenever they were computed, as vLLM)."""
    num_logprobs: int | None = None
    echo: bool = False
    echo_only: bool = False                 # echo with max_tokens 0: the prompt alone, no output token
    prompt_logprobs: int | None = None
    return_prompt_logprobs: bool = False


def read_logprobs_request(body: dict, chat: bool, limit: LogprobsLimit = LogprobsLimit()) -> LogprobsRequest:
    echo = read_field(body, "echo", "bool", False)
    prompt_k = limit.read(body, "prompt_logprobs")
    if prompt_k and body.get("stream") is True:
        raise APIError(f"'prompt_logprobs' is {body['prompt_logprobs']}; prompt logprobs are not available when "
                       "'stream' is true (as vLLM). Use echo with logprobs to stream the prompt's logprobs.",
                       param="prompt_logprobs")
    if chat:
        wanted = read_field(body, "logprobs", "bool", False)
        top = limit.read(body, "top_logprobs")
        if top and not wanted:       # vLLM: top_logprobs 0 without logprobs means off
            raise APIError(f"'top_logprobs' is {body['top_logprobs']} but 'logprobs' is not true; set 'logprobs': "
                           "true to get log-probabilities (top_logprobs says how many alternatives each token lists).",
                           param="top_logprobs")
        prompt_k = prompt_k if prompt_k is not None else ((top or 0) if echo else None)
        return LogprobsRequest(num_logprobs=(top or 0) if wanted else None, prompt_logprobs=prompt_k,
                               return_prompt_logprobs=prompt_k is not None)
    k = limit.read(body, "logprobs")
    return LogprobsRequest(k, echo, echo and requested_max_tokens(body, chat)[1] == 0,
                           prompt_k if prompt_k is not None else (k if echo else None), prompt_k is not None)


# Structured output in a request body: OpenAI's response_format, vLLM's structured_outputs object, and vLLM's
# older guided_* fields (still sent by many clients), each turned into one StructuredOutputsParams.
STRUCTURED_OUTPUTS_KEYS = {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                           "disable_additional_properties"}
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                 "guided_grammar": "grammar"}
GUIDED_BACKENDS = (None, "auto", "xgrammar")


def read_structured_outputs(body: dict) -> StructuredOutputsParams | None:
    """The request's constraint, from exactly one of response_format, structured_outputs or a guided_* field."""
    sources: dict[str, dict] = {}
    fmt = read_field(body, "response_format", "object")
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            sources["response_format"] = {"json_object": True}
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise APIError("'response_format' of type json_schema needs "
                               "\"json_schema\": {\"name\": ..., \"schema\": {...}} with the schema as a JSON object.",
                               param="response_format")
            sources["response_format"] = {"json": schema}
        elif kind != "text":
            raise APIError(f"'response_format.type' is {describe(kind)}; it must be 'text', 'json_object' or "
                           "'json_schema'.", param="response_format")
    so = read_field(body, "structured_outputs", "object")
    if so is not None:
        unknown = sorted(set(so) - STRUCTURED_OUTPUTS_KEYS)
        if unknown:
            raise APIError(f"'structured_outputs' has {', '.join(map(repr, unknown))}, which minivllm does not "
                           f"implement or know; it takes {', '.join(sorted(STRUCTURED_OUTPUTS_KEYS))}.",
                           param="structured_outputs")
        sources["structured_outputs"] = so
    for name, key in GUIDED_FIELDS.items():
        if body.get(name) is not None:
            sources[name] = {key: body[name]}
    backend = body.get("guided_decoding_backend")
    if backend not in GUIDED_BACKENDS:
        raise APIError(f"'guided_decoding_backend' is {describe(backend)}; minivllm's grammar engine is xgrammar "
                       "(leave it out, or send 'xgrammar' or 'auto').", param="guided_decoding_backend")
    if not sources:
        return None
    if len(sources) > 1:
        raise APIError(f"the request constrains its output twice ({', '.join(sources)}); send one of them.",
                       param=list(sources)[1])
    (param, values), = sources.items()
    try:
        return StructuredOutputsParams(**values)
    except ValueError as e:
        raise APIError(str(e), param=param) from None


def structured_outputs_param(body: dict) -> str | None:
    """The field a request's constraint came from (where a grammar that does not compile points)."""
    return next((name for name in ["response_format", "structured_outputs", *GUIDED_FIELDS]
                 if body.get(name) is not None), None)


def sampling_params_from_body(body: dict, chat: bool, default_max_tokens: int,
                              limit: LogprobsLimit = LogprobsLimit()) -> SamplingParams:
    """The request's SamplingParams; raises APIError naming the field for anything wrong or unsupported. `limit`:
    the engine's bounds on logprobs (vLLM's default, 20, unless the server passes its own)."""
    check_fields(body, "/v1/chat/completions" if chat else "/v1/completions")
    max_tokens_name, max_tokens = requested_max_tokens(body, chat)
    if max_tokens == 0:                           # echo only: one token is sampled and left out of the answer
        max_tokens = 1
    lp = read_logprobs_request(body, chat, limit)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                           and all(isinstance(s, str) for s in stop))):
        raise APIError(f"'stop' is {describe(stop)}; it must be a string or a list of strings.", param="stop")
    for text in [stop] if isinstance(stop, str) else stop or []:
        read_text(text, "stop")                      # no lone surrogate: a stop string is matched against text
    user = body.get("user")
    if user is not None and not (isinstance(user, str) and len(user) <= MAX_USER_CHARS):
        raise APIError(f"'user' is {describe(user)}; it must be a string of at most {MAX_USER_CHARS} characters "
                       "(an id for your end user; minivllm does not use it).", param="user")
    stop_token_ids = read_field(body, "stop_token_ids", "list", [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 63 for t in stop_token_ids):
        raise APIError(f"'stop_token_ids' is {describe(stop_token_ids)}; it must be a list of "
                       "non-negative token ids.", param="stop_token_ids")
    kwargs = dict(
        temperature=read_field(body, "temperature", "number", 1.0),
        top_p=read_field(body, "top_p", "number", 1.0),
        top_k=read_field(body, "top_k", "int", -1),
        seed=read_field(body, "seed", "int"),
        n=read_field(body, "n", "int", 1),
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        stop=stop, stop_token_ids=stop_token_ids,
        ignore_eos=read_field(body, "ignore_eos", "bool", False),
        skip_special_tokens=read_field(body, "skip_special_tokens", "bool", True),
        include_stop_str_in_output=read_field(body, "include_stop_str_in_output", "bool", False),
        presence_penalty=read_field(body, "presence_penalty", "number", 0.0),
        frequency_penalty=read_field(body, "frequency_penalty", "number", 0.0),
        repetition_penalty=read_field(body, "repetition_penalty", "number", 1.0),
        min_p=read_field(body, "min_p", "number", 0.0),
        min_tokens=read_field(body, "min_tokens", "int", 0),
        bad_words=read_field(body, "bad_words", "list"),
        allowed_token_ids=read_field(body, "allowed_token_ids", "list"),
        logit_bias=read_logit_bias(body), truncate_prompt_tokens=read_field(body, "truncate_prompt_tokens", "int"),
        logprobs=lp.num_logprobs,
        prompt_logprobs=lp.prompt_logprobs,
        structured_outputs=read_structured_outputs(body),
    )
    try:
        # Every request runs as deltas: a stream forwards each new piece, a full answer joins them (O(n) both).
        return SamplingParams(**kwargs, output_kind=RequestOutputKind.DELTA)
    except ValueError as e:
        # SamplingParams' messages start with the field's name ("top_p is 1.5; ..."): that is OpenAI's param.
        field_name = str(e).split(" ", 1)[0]
        raise APIError(str(e), param=max_tokens_name if field_name == "max_tokens"
                       else field_name if field_name in kwargs else None) from None
