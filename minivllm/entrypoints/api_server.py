"""An OpenAI-compatible HTTP API on an AsyncLLMEngine (vLLM's `vllm serve` / openai/api_server.py).

Owns: the routes, the API-key check, and turning APIError (and anything unexpected) into OpenAI's error body.
It only routes: each handler checks the key and hands the request to its serving module (serving_completion.py,
serving_chat.py, serving_tokenization.py, on the shared serving_engine.py; the model names are
serving_models.py's). What a request body may hold is protocol.py's; the /metrics text is metrics.py's.
Nothing here calls the LLMEngine: everything goes through the AsyncLLMEngine's command queue.

Routes: GET /v1/models, POST /v1/completions (one prompt or a list), POST /v1/chat/completions (stream
true or false, n choices), POST /tokenize, POST /detokenize, GET /tokenizer_info (with
--enable-tokenizer-info-endpoint, as vLLM), GET /version, GET /health, GET /metrics (Prometheus text format).
The request fields of each route are listed in docs/api.md.

Bad input is always a 400 with OpenAI's error body (protocol.APIError), never a 500 and never a dead
engine; a field a route does not read is a 400 too (protocol.ACCEPTED_FIELDS), and an unknown model a 404.
A client that hangs up (mid-stream, or while waiting for a non-streamed answer) gets its request
aborted: its blocks are free before the engine's next step.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import minivllm
from minivllm.engine.async_llm import AsyncLLMEngine
from minivllm.entrypoints.metrics import render_metrics
from minivllm.entrypoints.protocol import APIError
from minivllm.entrypoints.renderer import Renderer
from minivllm.entrypoints.serving_chat import OpenAIServingChat
from minivllm.entrypoints.serving_completion import OpenAIServingCompletion
from minivllm.entrypoints.serving_models import OpenAIServingModels
from minivllm.entrypoints.serving_tokenization import OpenAIServingTokenization
from minivllm.entrypoints.tool_calls import ToolConfig
from minivllm.entrypoints.utils import HostCheck, error_response

logger = logging.getLogger(__name__)
HEALTH_STEP_TIMEOUT_S = 60.0      # a CPU's longest steps take seconds (a 96-token chunk at 8,000 tokens: 1.4 s)


# ---------------------------------------------------------------------- the app
def build_api_server(async_engine: AsyncLLMEngine, served_model_name: str | None = None,
                     api_key: str | None = None, app: FastAPI | None = None,
                     trust_request_chat_template: bool = False, health_step_timeout_s: float = HEALTH_STEP_TIMEOUT_S,
                     allowed_hosts: frozenset[str] | None = None, enable_auto_tool_choice: bool = False,
                     tool_call_parser: str | None = None, exclude_tools_when_tool_choice_none: bool = False,
                     return_tokens_as_token_ids: bool = False, enable_tokenizer_info_endpoint: bool = False) -> FastAPI:
    """Add the OpenAI routes, /health and /metrics to `app` (a new FastAPI app by default) and return it.

    served_model_name: what /v1/models lists; requests may name it or the model's path. Defaults to the
    checkpoint directory's name ("SmolLM2-135M-Instruct" for the embedded default model).
    api_key: if set, every /v1/* route requires `Authorization: Bearer <api_key>` (401 otherwise; the scheme's
    case does not matter), as vLLM.
    trust_request_chat_template: run a request's own `chat_template` (refused otherwise, as vLLM); the front end
    that renders, tokenizes and bounds requests is `app.state.renderer` (renderer.py).
    health_step_timeout_s: /health answers 503 while the engine has been in one step longer than this
    (`app.state.health_step_timeout_s`); a slow step is not a dead one, so the default is generous.
    allowed_hosts: the names a request's Host header may give (utils.HostCheck, for every route); None: any.
    enable_auto_tool_choice, tool_call_parser, exclude_tools_when_tool_choice_none: vLLM's tool flags (ToolConfig).
    return_tokens_as_token_ids: logprobs tokens written "token_id:N" unless a request says otherwise (vLLM's flag).
    enable_tokenizer_info_endpoint: serve GET /tokenizer_info (vLLM's flag; off, the route is a 404).
    """
    tool_config = ToolConfig(enable_auto_tool_choice, tool_call_parser, exclude_tools_when_tool_choice_none)
    app = app or FastAPI(title="minivllm", docs_url=None, redoc_url=None)
    models = OpenAIServingModels(async_engine, served_model_name)
    renderer = app.state.renderer = Renderer(async_engine.tokenizer, async_engine.max_model_len,
                                             trust_request_chat_template)
    completion = OpenAIServingCompletion(async_engine, models, renderer, return_tokens_as_token_ids)
    chat = OpenAIServingChat(async_engine, models, renderer, return_tokens_as_token_ids, tool_config=tool_config)
    tokenization = OpenAIServingTokenization(async_engine, models, renderer)
    add_exception_handlers(app)
    if allowed_hosts is not None:
        app.add_middleware(HostCheck, allowed=frozenset(allowed_hosts))
    check_api_key = api_key_check(api_key)

    app.state.health_step_timeout_s = health_step_timeout_s

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        stuck, limit = async_engine.seconds_in_step(), app.state.health_step_timeout_s
        problem = ("the engine loop is not running." if not async_engine.is_running else
                   f"the engine has been in one step for {stuck:.1f} s, more than {limit} s." if stuck > limit else
                   None)
        if problem:
            return error_response(APIError(problem, status_code=503, type="service_unavailable"))
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(async_engine.snapshot(), models.name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models(request: Request):
        check_api_key(request)
        return models.show_available_models()

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_api_key(request)
        return await completion.create_completion(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_api_key(request)
        return await chat.create_chat_completion(request)

    add_tokenizer_routes(app, tokenization, check_api_key, enable_tokenizer_info_endpoint)

    @app.get("/version")
    async def version():
        return {"version": minivllm.__version__}

    return app


def add_tokenizer_routes(app: FastAPI, tokenization: OpenAIServingTokenization, check_api_key,
                         enable_tokenizer_info_endpoint: bool) -> None:
    """vLLM's tokenizer routes: POST /tokenize, POST /detokenize, and GET /tokenizer_info if enabled."""
    @app.post("/tokenize")
    async def tokenize(request: Request):
        check_api_key(request)
        return await tokenization.create_tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        check_api_key(request)
        return await tokenization.create_detokenize(request)

    if enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info(request: Request):
            check_api_key(request)
            return tokenization.get_tokenizer_info()


def api_key_check(api_key: str | None) -> Callable[[Request], None]:
    """What every /v1/* route (and the tokenizer routes) calls first: with a key set, the request must carry it."""
    def check_api_key(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
            raise APIError("missing or wrong API key: send the header 'Authorization: Bearer <api key>' with "
                           "the key the server was started with (--api-key).", status_code=401,
                           type="authentication_error", code="invalid_api_key")
    return check_api_key


def add_exception_handlers(app: FastAPI) -> None:
    """Every error leaves as OpenAI's error body: bad input a 400 (or its own status), a bug a 500."""
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
