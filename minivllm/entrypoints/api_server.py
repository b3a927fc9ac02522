"""An OpenAI-compatible HTTP API on an AsyncLLMEngine (vLLM's `vllm serve` / openai/api_server.py).

Owns: the routes, the API-key check, turning APIError (and anything unexpected) into OpenAI's error body,
running a parsed request on the engine, and the response and server-sent-event streams. What a request
body may hold and what a response looks like is protocol.py's; the /metrics text is metrics.py's.
It never calls the LLMEngine: everything goes through the AsyncLLMEngine's command queue.

Routes: GET /v1/models, POST /v1/completions (one prompt or a list), POST /v1/chat/completions (stream
true or false, n choices), POST /tokenize, POST /detokenize, GET /version, GET /health, GET /metrics
(Prometheus text format).

Logprobs, as vLLM serves them: /v1/completions' `logprobs` (k), `echo` (the prompt in front of the text and, with
logprobs, of the tokens: the engine then computes prompt logprobs too; `max_tokens` 0 with echo returns the prompt
alone) and vLLM's `prompt_logprobs`; /v1/chat/completions' `logprobs` and `top_logprobs`. Streamed chunks carry
their own tokens' logprobs.

Bad input is always a 400 with OpenAI's error body (protocol.APIError), never a 500 and never a dead
engine; a field a route does not read is a 400 too (protocol.ACCEPTED_FIELDS), and an unknown model a 404.
A client that hangs up (mid-stream, or while waiting for a non-streamed answer) gets its request
aborted: its blocks are free before the engine's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

import minivllm
from minivllm.core.sampling_params import SamplingParams
from minivllm.engine.async_llm import AsyncLLMEngine, NewRequest, RequestError
from minivllm.engine.request_stream import RequestStream
from minivllm.entrypoints.metrics import render_metrics
from minivllm.entrypoints.protocol import (APIError, LogprobsRequest, ParsedRequest, ResponseMeta, chat_logprobs,
                                           check_fields, check_model, completion_logprobs, make_choice,
                                           parse_chat_options, parse_json_body, parse_messages, parse_prompt,
                                           parse_stream, parse_token_ids, prompt_logprobs_json, read_field,
                                           read_logprobs_request, read_text, requested_max_tokens,
                                           sampling_params_from_body, structured_outputs_param, usage_of)
from minivllm.outputs import RequestOutput

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def error_response(err: APIError) -> Response:
    # Rendered with json.dumps' default ensure_ascii: a message quoting client text (even a lone surrogate,
    # which UTF-8 cannot encode) always renders; JSONResponse would raise UnicodeEncodeError, a 500.
    return Response(json.dumps(err.body()), status_code=err.status_code, media_type="application/json")


async def read_json(request: Request) -> dict:
    return parse_json_body(await request.body())


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

    async def read_body(request: Request) -> dict:
        """What both completion routes check first: the API key, a JSON object, a model served here."""
        check_api_key(request)
        body = await read_json(request)
        check_model(body, accepted_names, name)
        return body

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_body(request)
        prompts = parse_prompt(body)
        return await serve(request, ParsedRequest(prompts, body, *parse_stream(body), "prompt"), chat=False)

    def render_chat(messages: list[dict], options: dict) -> str:
        """The chat template (the model's, or the request's `chat_template`) applied to messages, as text.
        Only renders (no tokenizer state is touched), so the HTTP thread may call it."""
        try:
            return async_engine.tokenizer.apply_chat_template(messages, tokenize=False, **options)
        except Exception as e:      # the template's own checks (jinja2 raises on e.g. bad role order)
            param = "chat_template" if "chat_template" in options else "messages"
            raise APIError(f"the chat template rejected these messages: {e}", param=param) from None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_body(request)
        check_fields(body, "/v1/chat/completions")
        prompt = render_chat(parse_messages(body), parse_chat_options(body))
        return await serve(request, ParsedRequest([prompt], body, *parse_stream(body), "messages"), chat=True)

    # ------------------------------------------------------------------ vLLM's tokenizer routes
    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await read_body(request)
        check_fields(body, "/tokenize")
        if ("prompt" in body) == ("messages" in body):
            raise APIError("/tokenize takes either 'prompt' (text) or 'messages' (a chat), exactly one.",
                           param="prompt")
        if "messages" in body:     # as vLLM: the template carries the special tokens, so none are added
            text = render_chat(parse_messages(body), parse_chat_options(body))
            add_special_tokens = read_field(body, "add_special_tokens", "bool", False)
        else:
            prompt = read_field(body, "prompt", "string")
            if prompt is None:
                raise APIError("'prompt' is null; it must be a string.", param="prompt")
            text = read_text(prompt, "prompt")
            add_special_tokens = read_field(body, "add_special_tokens", "bool", True)
        ids = await async_engine.call_async(lambda e: e.tokenizer.encode(text, add_special_tokens=add_special_tokens))
        return {"count": len(ids), "max_model_len": async_engine.max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await read_body(request)
        check_fields(body, "/detokenize")
        ids = parse_token_ids(body, "tokens", len(async_engine.tokenizer))
        return {"prompt": await async_engine.call_async(lambda e: e.tokenizer.decode(ids))}

    @app.get("/version")
    async def version():
        return {"version": minivllm.__version__}

    # ------------------------------------------------------------------ running a request
    async def serve(request: Request, parsed: ParsedRequest, chat: bool):
        checked = sampling_params_from_body(parsed.body, chat, default_max_tokens=1)   # bad fields first: no engine work
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:16]}"
        echo_texts: list[EchoText] = []       # filled on the engine thread by plan(), read after it answered

        def build(engine) -> list[NewRequest]:
            prompts, params = plan(engine, parsed, chat, checked, echo_texts)
            return [NewRequest(prompt, p, request_id if len(prompts) == 1 else f"{request_id}-{i}")
                    for i, (prompt, p) in enumerate(zip(prompts, params))]   # one engine request per prompt, as vLLM

        try:
            streams = await async_engine.add_requests(build)
        except ValueError as e:                    # the engine's own checks: length, pool size, token ids
            raise APIError(str(e), param=parsed.prompt_param) from None
        except RequestError as e:
            raise APIError(str(e), status_code=503, type="service_unavailable") from None
        meta = ResponseMeta(request_id, int(time.time()), name, chat)
        shape = ChoiceShape(checked.n, read_logprobs_request(parsed.body, chat), echo_texts)
        if parsed.stream:
            # The background task runs once the response is over, even when the client hung up before the
            # first event (the generator never started, so its `async with` never ran).
            return StreamingResponse(stream_events(streams, shape, meta, parsed.include_usage),
                                     media_type="text/event-stream",
                                     background=BackgroundTask(close_async, streams))
        return await until_disconnect(request, full_response(streams, shape, meta), streams)

    def plan(engine, parsed: ParsedRequest, chat: bool, checked: SamplingParams,
             echo_texts: list[EchoText]) -> tuple[list[dict], list[SamplingParams]]:
        """On the engine thread, in the same command that adds the requests (AsyncLLMEngine.add_requests): each
        prompt, tokenized once and passed on as ids, and its SamplingParams; for echo, each prompt's text goes
        into `echo_texts`. An explicit max_tokens must fit the context with the prompt (400 otherwise, as vLLM).
        Without one, completions take 16 tokens (OpenAI's default) and chat the rest of the context, both capped
        by it."""
        if checked.structured_outputs is not None:     # compile now (cached): a bad grammar is its field's 400
            try:
                engine.structured_output_manager.grammar_for(checked.structured_outputs)
            except ValueError as e:
                raise APIError(str(e), param=structured_outputs_param(parsed.body)) from None
        max_tokens_name, max_tokens = requested_max_tokens(parsed.body, chat)
        try:
            tokenized = [engine.tokenize(p) for p in parsed.prompts]
        except ValueError as e:
            raise APIError(str(e), param=parsed.prompt_param) from None
        if not chat and read_logprobs_request(parsed.body, chat).echo:
            # the prompt's text (decoded for a prompt of token ids) and its first token's, as echo shows them
            echo_texts.extend(EchoText(text if text is not None else engine.tokenizer.decode(ids),
                                       engine.tokenizer.decode(ids[:1])) for text, ids in tokenized)
        prompts, params = [], []
        limit = async_engine.max_model_len
        for text, ids in tokenized:
            if max_tokens is not None and len(ids) < limit < len(ids) + max_tokens:
                raise APIError(f"prompt ({len(ids)} tokens) + '{max_tokens_name}' ({max_tokens}) is "
                               f"{len(ids) + max_tokens} tokens; max_model_len is {limit}. Lower "
                               f"'{max_tokens_name}' to at most {limit - len(ids)} or shorten the prompt.",
                               param=max_tokens_name)
            room = max(1, async_engine.max_request_tokens - len(ids))
            default = room if chat else min(16, max(1, limit - len(ids)))
            prompts.append({"prompt": text, "prompt_token_ids": ids} if text is not None else ids)
            params.append(sampling_params_from_body(parsed.body, chat, default_max_tokens=default))
        return prompts, params

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


# ---------------------------------------------------------------------- responses
async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several requests' streams as the outputs arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:                       # RequestError: re-raised by the reader
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


@dataclass(frozen=True)
class EchoText:
    """A prompt as echo shows it: its text, and its first token's (the one token with no logprob)."""
    text: str
    first_token: str


@dataclass(frozen=True)
class ChoiceShape:
    """What the choices of one response hold besides their text: n per prompt, logprobs, the echoed prompts."""
    n: int
    logprobs: LogprobsRequest
    echo: list[EchoText]                       # per prompt; empty without echo


def with_echo(shape: ChoiceShape, i: int, out: RequestOutput, prompt_logprobs, text: str, token_ids: list[int],
              entries: list, first: bool) -> tuple[str, list[int], list]:
    """A choice's (text, token ids, logprobs entries), with prompt i in front for its first piece when echo is on
    (vLLM's way). echo with max_tokens 0 leaves the sampled token out."""
    if shape.logprobs.echo_only:
        text, token_ids, entries = "", [], []
    if first and shape.logprobs.echo:
        ids = out.prompt_token_ids
        text, token_ids = shape.echo[i].text + text, ids + token_ids
        entries = (prompt_logprobs or [None] * len(ids)) + entries
    return text, token_ids, entries


def logprobs_of(meta: ResponseMeta, shape: ChoiceShape, i: int, token_ids: list[int], entries: list,
                text_offset: int) -> dict | None:
    k = shape.logprobs.num_logprobs
    if k is None:
        return None
    if meta.chat:
        return chat_logprobs(token_ids, entries, k)
    first_token = shape.echo[i].first_token if shape.echo else ""
    return completion_logprobs(token_ids, entries, k, text_offset, lambda _: first_token)


def end_of(shape: ChoiceShape, finish_reason, stop_reason) -> tuple:
    """echo with max_tokens 0 ends by length, whatever ended its hidden token."""
    return ("length", None) if shape.logprobs.echo_only and finish_reason is not None else (finish_reason, stop_reason)


async def full_response(streams: list[RequestStream], shape: ChoiceShape, meta: ResponseMeta) -> dict:
    """The whole answer: each sample's deltas joined into one choice (index prompt_index * n + sample)."""
    n = shape.n
    pieces: dict[int, list[str]] = defaultdict(list)
    token_ids: dict[int, list[int]] = defaultdict(list)
    entries: dict[int, list] = defaultdict(list)
    ends: dict[int, tuple] = {}
    finals: dict[int, RequestOutput] = {}
    prompt_logprobs: dict[int, list] = {}
    num_tokens = 0
    try:
        async for i, out in merged(streams):
            if out.prompt_logprobs is not None:       # complete, in the prompt's first output
                prompt_logprobs[i] = out.prompt_logprobs
            for o in out.outputs:
                k = i * n + o.index
                pieces[k].append(o.text)
                token_ids[k] += o.token_ids
                entries[k] += o.logprobs or []
                num_tokens += 0 if shape.logprobs.echo_only else len(o.token_ids)
                if o.finished:
                    ends[k] = end_of(shape, o.finish_reason, o.stop_reason)
            finals[i] = out
    finally:
        close_all(streams)                   # no-op for finished requests; aborts the rest
    choices = []
    for k in range(len(streams) * n):
        i = k // n
        text, ids, lps = with_echo(shape, i, finals[i], prompt_logprobs.get(i), "".join(pieces[k]), token_ids[k],
                                   entries[k], first=True)
        choice = make_choice(meta, k, text, *ends.get(k, (None, None)), stream=False,
                             logprobs=logprobs_of(meta, shape, i, ids, lps, 0))
        if shape.logprobs.return_prompt_logprobs:          # vLLM's extra field
            choice["prompt_logprobs"] = (prompt_logprobs_json(prompt_logprobs[i]) if i in prompt_logprobs
                                         else None)
        choices.append(choice)
    body = meta.envelope(choices, stream=False)
    body["usage"] = usage_of([finals[i] for i in range(len(streams))], num_tokens)
    return body


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def stream_events(streams: list[RequestStream], shape: ChoiceShape, meta: ResponseMeta,
                        include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: one chunk per new piece of a choice's text (its index says which) and, with logprobs,
    per new tokens, the choice's last with finish_reason, an optional usage chunk (choices: []), then
    `data: [DONE]`. With echo a choice's first chunk starts with the prompt. If the client hangs up, Starlette
    cancels this generator and close_all aborts the requests."""
    n = shape.n
    try:
        num_tokens, finals, prompt_logprobs = 0, {}, {}
        sent_chars: dict[int, int] = defaultdict(int)     # text already streamed per choice (text_offset)
        started: set[int] = set()
        async for i, out in merged(streams):          # each output holds only what is new (DELTA)
            if meta.chat and i not in finals:
                # OpenAI opens a chat stream with the role, once per choice; as vLLM, only once the engine's
                # first output is here, so a client's time to first token includes the prefill.
                for k in range(i * n, (i + 1) * n):
                    yield _sse(meta.envelope([make_choice(meta, k, "", None, None, stream=True, first=True)],
                                             stream=True))
            if out.prompt_logprobs is not None:
                prompt_logprobs[i] = out.prompt_logprobs
            for o in out.outputs:
                k = i * n + o.index
                text, ids, lps = with_echo(shape, i, out, prompt_logprobs.get(i), o.text, o.token_ids,
                                           o.logprobs or [], first=k not in started)
                started.add(k)
                has_logprobs = shape.logprobs.num_logprobs is not None and ids
                if text or o.finished or has_logprobs:
                    logprobs = logprobs_of(meta, shape, i, ids, lps, sent_chars[k]) if has_logprobs else None
                    yield _sse(meta.envelope([make_choice(meta, k, text, *end_of(shape, o.finish_reason,
                                                                                 o.stop_reason),
                                                          stream=True, logprobs=logprobs)], stream=True))
                sent_chars[k] += len(text)
                num_tokens += 0 if shape.logprobs.echo_only else len(o.token_ids)
            finals[i] = out
        if include_usage:
            yield _sse({**meta.envelope([], stream=True),
                        "usage": usage_of([finals[i] for i in range(len(streams))], num_tokens)})
    except RequestError as e:
        yield _sse(APIError(str(e), status_code=500, type="internal_server_error").body())
    finally:
        close_all(streams)
    yield "data: [DONE]\n\n"


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def close_async(streams: list[RequestStream]) -> None:
    close_all(streams)


async def until_disconnect(request: Request, work: Awaitable[dict], streams: list[RequestStream]):
    """Await a non-streamed answer, unless the client hangs up first: then cancel it (which aborts the
    requests) instead of computing an answer nobody will read."""
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
            close_all(streams)
    if not answer.done() or answer.cancelled():
        with contextlib.suppress(asyncio.CancelledError):
            await answer                      # let the cancellation finish before answering nobody
        return Response(status_code=499)      # nginx's "client closed request"; nobody reads it
    try:
        return JSONResponse(answer.result())
    except RequestError as e:
        return error_response(APIError(str(e), status_code=500, type="internal_server_error"))
