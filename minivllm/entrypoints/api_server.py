"""An OpenAI-compatible HTTP API on an AsyncLLMEngine (vLLM's `vllm serve` / openai/api_server.py).

Owns: turning OpenAI request bodies into prompts and SamplingParams, checking every field before anything
reaches the engine, the response and server-sent-event formats, API-key checks, and the /metrics text.
It never calls the LLMEngine: everything goes through the AsyncLLMEngine's command queue.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream true or false),
GET /health, GET /metrics (Prometheus text format).

Bad input is always a 400 with OpenAI's error body, never a 500 and never a dead engine:

    {"error": {"message": "temperature is -1; it must be >= 0 (0 means greedy).",
               "type": "invalid_request_error", "param": "temperature", "code": null}}

A client that hangs up (mid-stream, or while waiting for a non-streamed answer) gets its request aborted:
its blocks are free before the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from minivllm.engine.async_llm import AsyncLLMEngine, EngineSnapshot, Histogram, RequestError, RequestStream
from minivllm.outputs import RequestOutput
from minivllm.core.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CHAT_ROLES = ("system", "developer", "user", "assistant")
INT64 = (-(2 ** 63), 2 ** 63 - 1)     # torch generators and tensors take no wider ints
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


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code)


# ---------------------------------------------------------------------- reading request fields
def _field(body: dict, name: str, kind: str, default=None):
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
        raise APIError(f"'{name}' is {json.dumps(value)[:60]} ({_json_type(value)}); it must be "
                       f"{'an' if kind in ('int', 'object') else 'a'} {kind}.", param=name)
    if kind == "number" and not math.isfinite(value):
        raise APIError(f"'{name}' is {value}; it must be a finite number.", param=name)
    if kind == "int" and not INT64[0] <= value <= INT64[1]:
        raise APIError(f"'{name}' is {value}; it must fit in 64 bits (|value| < 2**63).", param=name)
    return value


def _json_type(value) -> str:
    for t, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
                    (dict, "object")):
        if isinstance(value, t):
            return name
    return "null"


def requested_max_tokens(body: dict, chat: bool) -> tuple[str, int | None]:
    """The output-length field's name and value (None if absent). Chat takes OpenAI's newer
    max_completion_tokens or the older max_tokens."""
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    value = _field(body, name, "int")
    if value is not None and value < 1:
        raise APIError(f"'{name}' is {value}; it must be >= 1.", param=name)
    return name, value


def sampling_params_from_body(body: dict, chat: bool, default_max_tokens: int) -> SamplingParams:
    """The request's SamplingParams; raises APIError naming the field for anything wrong or unsupported."""
    for name, defaults in UNSUPPORTED.items():
        if name in body and body[name] not in defaults:
            raise APIError(f"'{name}' is {json.dumps(body[name])[:60]}; minivllm does not support it. Leave it "
                           f"out (or at {json.dumps(defaults[-1])}).", param=name)
    n = _field(body, "n", "int", 1)
    if n != 1:
        raise APIError(f"'n' is {n}; minivllm generates one choice per request (n=1). Send the request "
                       "several times (with different seeds) instead.", param="n")
    max_tokens_name, max_tokens = requested_max_tokens(body, chat)
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                           and all(isinstance(s, str) for s in stop))):
        raise APIError(f"'stop' is {json.dumps(stop)[:60]}; it must be a string or a list of strings.",
                       param="stop")
    stop_token_ids = _field(body, "stop_token_ids", "list", [])
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2 ** 63 for t in stop_token_ids):
        raise APIError(f"'stop_token_ids' is {json.dumps(stop_token_ids)[:60]}; it must be a list of "
                       "non-negative token ids.", param="stop_token_ids")
    kwargs = dict(
        temperature=_field(body, "temperature", "number", 1.0),
        top_p=_field(body, "top_p", "number", 1.0),
        top_k=_field(body, "top_k", "int", -1),
        seed=_field(body, "seed", "int"),
        max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
        stop=stop, stop_token_ids=stop_token_ids,
        ignore_eos=_field(body, "ignore_eos", "bool", False),
        skip_special_tokens=_field(body, "skip_special_tokens", "bool", True),
    )
    try:
        return SamplingParams(**kwargs)
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


# ---------------------------------------------------------------------- the app
def build_api_server(async_engine: AsyncLLMEngine, served_model_name: str | None = None,
                     api_key: str | None = None, app: FastAPI | None = None) -> FastAPI:
    """Add the OpenAI routes, /health and /metrics to `app` (a new FastAPI app by default) and return it.

    served_model_name: what /v1/models lists; requests may name it or the model's path. Defaults to the
    checkpoint directory's name ("SmolLM2-135M-Instruct" for the embedded default model).
    api_key: if set, every /v1/* route requires `Authorization: Bearer <api_key>` (401 otherwise), as vLLM.
    """
    app = app or FastAPI(title="minivllm", docs_url=None, redoc_url=None)
    model_path = Path(async_engine.engine.model_path)
    config_model = async_engine.engine.config.model
    name = served_model_name or (Path(config_model).name if config_model else DEFAULT_MODEL_NAME)
    accepted_names = {name, str(model_path), model_path.name} | ({config_model} if config_model else set())
    created = int(time.time())

    # ------------------------------------------------------------------ errors: always OpenAI's body
    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(APIError(f"invalid request: {first.get('msg', err)}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        kind = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return error_response(APIError(str(err.detail), status_code=err.status_code, type=kind))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, err: Exception):
        # A bug, not bad input (bad input is a 400 above). Starlette logs the traceback after this answer.
        return error_response(APIError(f"internal error: {type(err).__name__}: {err}", status_code=500,
                                       type="internal_server_error"))

    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError("missing or wrong API key: send the header 'Authorization: Bearer <api key>' with "
                           "the key the server was started with (--api-key).", status_code=401,
                           type="authentication_error", code="invalid_api_key")

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            return error_response(APIError("the engine loop is not running.", status_code=503,
                                           type="service_unavailable"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(async_engine.snapshot(), name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_api_key(request)
        return {"object": "list", "data": [{
            "id": name, "object": "model", "created": created, "owned_by": "minivllm", "root": str(model_path),
            "parent": None, "max_model_len": async_engine.max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_api_key(request)
        body = await read_json(request)
        check_model(body)
        prompt = parse_prompt(body)
        return await serve(request, ParsedRequest(prompt, body, *parse_stream(body), "prompt"), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_api_key(request)
        body = await read_json(request)
        check_model(body)
        messages = parse_messages(body)
        add_generation_prompt = _field(body, "add_generation_prompt", "bool", True)
        try:
            prompt = async_engine.chat_prompt(messages, add_generation_prompt)
        except Exception as e:      # the template's own checks (jinja2 raises on e.g. bad role order)
            raise APIError(f"the chat template rejected these messages: {e}", param="messages") from None
        return await serve(request, ParsedRequest(prompt, body, *parse_stream(body), "messages"), chat=True)

    # ------------------------------------------------------------------ parsing
    def check_model(body: dict) -> None:
        model = _field(body, "model", "string")
        if model is not None and model not in accepted_names:
            raise APIError(f"model '{model}' is not served here; this server serves '{name}' (see /v1/models).",
                           param="model", code="model_not_found")

    # ------------------------------------------------------------------ running a request
    async def serve(request: Request, parsed: ParsedRequest, chat: bool):
        prompt, params = await prepare(parsed, chat)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        try:
            stream = await async_engine.add_request(prompt, params, request_id)
        except ValueError as e:                    # the engine's own checks: length, pool size, token ids
            raise APIError(str(e), param=parsed.prompt_param) from None
        except RequestError as e:
            raise APIError(str(e), status_code=503, type="service_unavailable") from None
        meta = ResponseMeta(request_id, int(time.time()), name, chat)
        if parsed.stream:
            # The background task runs once the response is over, even when the client hung up before the
            # first event (the generator never started, so its `async with stream` never ran).
            return StreamingResponse(stream_events(stream, meta, parsed.include_usage),
                                     media_type="text/event-stream", background=BackgroundTask(close_async, stream))
        return await until_disconnect(request, full_response(stream, meta), stream)

    async def prepare(parsed: ParsedRequest, chat: bool) -> tuple[str | list[int] | dict, SamplingParams]:
        """The prompt and SamplingParams to add. Completions default to 16 tokens (OpenAI's default). Chat
        defaults to the rest of the context, which needs the prompt's token count: then the prompt is
        tokenized first (on the engine thread) and passed on as ids, so it is tokenized once."""
        if not chat or requested_max_tokens(parsed.body, chat)[1] is not None:
            return parsed.prompt, sampling_params_from_body(parsed.body, chat, default_max_tokens=16)
        sampling_params_from_body(parsed.body, chat, default_max_tokens=1)   # bad fields first: no engine work
        try:
            text, ids = await async_engine.tokenize(parsed.prompt)
        except ValueError as e:
            raise APIError(str(e), param=parsed.prompt_param) from None
        room = max(1, async_engine.max_request_tokens - len(ids))
        return ({"prompt": text, "prompt_token_ids": ids},
                sampling_params_from_body(parsed.body, chat, default_max_tokens=room))

    return app


def run_server_in_thread(app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
    """Start uvicorn on a background thread (tests, notebooks). Returns a BackgroundServer with `.url`
    and `.stop()`. port=0 takes a free port, bound before the thread starts (no race for it)."""
    import socket

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # log_config=None: leave the process's logging alone (uvicorn's default config would replace the
    # handlers of its loggers, including any a test or notebook added); warnings still reach stderr.
    config = uvicorn.Config(app, log_level=log_level, log_config=None, timeout_graceful_shutdown=2)
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None     # not the main thread: no signal handlers
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not server.started:
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError("uvicorn did not start; see the log above.")
        time.sleep(0.02)
    return BackgroundServer(server, thread, sock, f"http://{host}:{sock.getsockname()[1]}")


@dataclass
class BackgroundServer:
    server: object
    thread: threading.Thread
    sock: object
    url: str

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        self.sock.close()


# ---------------------------------------------------------------------- parsing helpers
async def read_json(request: Request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON ({e}); send a JSON object with "
                       "'Content-Type: application/json'.") from None
    if not isinstance(body, dict):
        raise APIError(f"the request body is a JSON {_json_type(body)}; it must be a JSON object.")
    return body


def parse_stream(body: dict) -> tuple[bool, bool]:
    """(stream, include_usage). stream_options is only allowed with stream=true, as in OpenAI's API."""
    stream = _field(body, "stream", "bool", False)
    options = _field(body, "stream_options", "object")
    if options is None:
        return stream, False
    if not stream:
        raise APIError("'stream_options' is only allowed when 'stream' is true.", param="stream_options")
    return stream, _field(options, "include_usage", "bool", False)


def parse_prompt(body: dict) -> str | list[int]:
    """A completion prompt: a string or a list of token ids (or a list holding exactly one of those)."""
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError("'prompt' is required: a string, or a list of token ids.", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]                      # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise APIError(f"'prompt' is a batch of {len(prompt)} prompts; minivllm takes one prompt per request. "
                       "Send one request per prompt (they are batched on the server anyway).", param="prompt")
    raise APIError(f"'prompt' is {json.dumps(prompt)[:60]}; it must be a string or a list of token ids.",
                   param="prompt")


def parse_messages(body: dict) -> list[dict]:
    """Chat messages as {"role", "content": str}. Content may be a string or a list of text parts."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        got = "missing" if messages is None else json.dumps(messages)[:60]
        raise APIError(f"'messages' is {got}; it must be a non-empty list of {{'role', 'content'}} objects.",
                       param="messages")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"{where} is {json.dumps(m)[:60]}; each message must be an object with 'role' and "
                           "'content'.", param=where)
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise APIError(f"{where}.role is {json.dumps(role)}; it must be one of {list(CHAT_ROLES)}.",
                           param=f"{where}.role")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    raise APIError(f"{where}.content[{j}] is {json.dumps(part)[:60]}; only text parts "
                                   "({'type': 'text', 'text': ...}) are supported.", param=f"{where}.content")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str):
            raise APIError(f"{where}.content is {json.dumps(content)[:60]}; it must be a string or a list of "
                           "text parts.", param=f"{where}.content")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    return out


# ---------------------------------------------------------------------- responses
@dataclass(frozen=True)
class ResponseMeta:
    request_id: str
    created: int
    model: str
    chat: bool

    def envelope(self, choices: list, stream: bool) -> dict:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {"id": self.request_id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}


def usage_of(out: RequestOutput) -> dict:
    completion = len(out.outputs[0].token_ids)
    return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": completion,
            "total_tokens": len(out.prompt_token_ids) + completion,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def _choice(meta: ResponseMeta, text: str, finish_reason: str | None, stop_reason, stream: bool,
            first: bool = False) -> dict:
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


async def full_response(stream: RequestStream, meta: ResponseMeta) -> dict:
    async with stream:
        final = None
        async for out in stream:
            final = out
    o = final.outputs[0]
    body = meta.envelope([_choice(meta, o.text, o.finish_reason, o.stop_reason, stream=False)], stream=False)
    body["usage"] = usage_of(final)
    return body


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_events(stream: RequestStream, meta: ResponseMeta, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per new piece of text, the last with finish_reason, an optional usage
    chunk (choices: []), then `data: [DONE]`. If the client hangs up, Starlette cancels this generator
    and `async with stream` aborts the request."""
    async with stream:
        try:
            if meta.chat:        # OpenAI opens a chat stream with the role
                yield _sse(meta.envelope([_choice(meta, "", None, None, stream=True, first=True)], stream=True))
            final = None
            async for out in stream:
                o = out.outputs[0]
                if out.delta_text or out.finished:
                    yield _sse(meta.envelope([_choice(meta, out.delta_text, o.finish_reason, o.stop_reason,
                                                      stream=True)], stream=True))
                final = out
            if include_usage:
                yield _sse({**meta.envelope([], stream=True), "usage": usage_of(final)})
        except RequestError as e:
            yield _sse(APIError(str(e), status_code=500, type="internal_server_error").body())
    yield "data: [DONE]\n\n"


async def close_async(stream: RequestStream) -> None:
    stream.close()


async def until_disconnect(request: Request, work: Awaitable[dict], stream: RequestStream):
    """Await a non-streamed answer, unless the client hangs up first: then cancel it (which aborts the
    request through `async with stream`) instead of computing an answer nobody will read."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    answer = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({answer, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not answer.done():
            answer.cancel()
            stream.close()
    if not answer.done() or answer.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await answer                      # let the cancellation finish before answering nobody
        return Response(status_code=499)      # nginx's "client closed request"; nobody reads it
    try:
        return JSONResponse(answer.result())
    except RequestError as e:
        return error_response(APIError(str(e), status_code=500, type="internal_server_error"))


# ---------------------------------------------------------------------- /metrics
def render_metrics(snap: EngineSnapshot, model_name: str) -> str:
    """Prometheus text exposition format (version 0.0.4), with vLLM's metric names."""
    label = f'model_name="{_escape_label(model_name)}"'
    s = snap.stats
    lines: list[str] = []

    def metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help}")
        lines.append(f"# TYPE {name} {kind}")
        for suffix_labels, value in samples:
            lines.append(f"{name}{suffix_labels} {_number(value)}")

    def gauge(name: str, help: str, value: float) -> None:
        metric(name, "gauge", help, [(f"{{{label}}}", value)])

    def counter(name: str, help: str, value: float) -> None:
        lines.append(f"# HELP {name}_total {help}")
        lines.append(f"# TYPE {name}_total counter")
        lines.append(f"{name}_total{{{label}}} {_number(value)}")

    def histogram(name: str, help: str, h: Histogram) -> None:
        lines.append(f"# HELP {name} {help}")
        lines.append(f"# TYPE {name} histogram")
        cumulative = 0
        for bound, count in zip([*map(_number, h.buckets), "+Inf"], h.counts):
            cumulative += count
            lines.append(f'{name}_bucket{{{label},le="{bound}"}} {cumulative}')
        lines.append(f"{name}_sum{{{label}}} {_number(h.sum)}")
        lines.append(f"{name}_count{{{label}}} {h.count}")

    gauge("vllm:num_requests_running", "Requests in the running queue (scheduled every step).", s.num_running)
    gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (preempted ones included).",
          s.num_waiting)
    gauge("vllm:num_requests_swapped", "Requests whose KV is in the CPU swap pool.", s.num_swapped)
    gauge("vllm:kv_cache_usage_perc", "Fraction of KV blocks held by requests (1 = full).", s.kv_usage)
    gauge("vllm:num_kv_blocks", "Physical KV blocks in the pool.", s.num_kv_blocks)
    gauge("vllm:num_free_kv_blocks", "Free KV blocks (cached-free included).", s.num_free_blocks)
    gauge("vllm:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / prompt tokens looked up.",
          s.prefix_cache_hit_rate)
    gauge("vllm:engine_paused", "1 while the engine is paused from the dashboard.", int(snap.paused))
    counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries)
    counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits)
    counter("vllm:num_preemptions", "Requests preempted (recompute or swap) since start.", s.num_preemptions)
    counter("vllm:prompt_tokens", "Prompt tokens of accepted requests.", snap.num_prompt_tokens)
    counter("vllm:generation_tokens", "Tokens generated.", s.num_generated_tokens)
    counter("vllm:engine_steps", "Engine steps run.", s.num_steps)
    counter("vllm:engine_step_errors", "Engine steps that raised (their requests ended with an error).",
            snap.num_step_errors)
    lines.append("# HELP vllm:request_success_total Finished requests by finish reason.")
    lines.append("# TYPE vllm:request_success_total counter")
    for reason in sorted({"stop", "length", "abort", "error"} | set(snap.finished)):
        lines.append(f'vllm:request_success_total{{{label},finished_reason="{_escape_label(reason)}"}} '
                     f"{snap.finished.get(reason, 0)}")
    histogram("vllm:time_to_first_token_seconds", "Time from arrival to the first output token.", snap.ttft)
    histogram("vllm:inter_token_latency_seconds", "Time between two consecutive output tokens of a request.",
              snap.itl)
    histogram("vllm:e2e_request_latency_seconds", "Time from arrival to finish (stop or length).", snap.e2e)
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
