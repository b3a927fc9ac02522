"""`python app.py`: the minivllm server: an OpenAI-compatible API and a live dashboard on one engine.

    python app.py                                   # http://127.0.0.1:8000/ the dashboard, /v1 the API
    python app.py --port 8001 --num-kv-blocks 256 --api-key secret
    python app.py --model /path/to/checkpoint --attention-backend triton      # on a GPU

Owns: the command line and wiring: EngineConfig -> LLMEngine -> AsyncLLMEngine -> FastAPI app (OpenAI
routes, /health, /metrics) with the Gradio dashboard mounted at "/", run by uvicorn. `build_app` does the
same in-process for tests.
"""

from __future__ import annotations

if __name__ == "__main__":              # before torch is imported: re-start with tcmalloc preloaded
    from minivllm.platforms.cpu import reexec_with_cpu_runtime     # when installed (minivllm/platforms/cpu/runtime.py)
    reexec_with_cpu_runtime()

import argparse
import contextlib
import logging
import os
import signal
import sys

import uvicorn

from minivllm.entrypoints.api_server import build_api_server
from minivllm.entrypoints.utils import LOOPBACK_NAMES
from minivllm.engine.async_llm import AsyncLLMEngine
from minivllm.config import EngineConfig, add_engine_args
from minivllm.platforms.cpu import describe_runtime

logger = logging.getLogger("minivllm.app")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python app.py", description="Serve minivllm: an OpenAI-compatible API "
                                "under /v1 and a live dashboard at /, on one engine.")
    p.add_argument("--served-model-name", default=None, help="the name /v1/models lists (default: the "
                   "checkpoint directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or None,
                   help="require 'Authorization: Bearer <key>' on /v1/* (default: $VLLM_API_KEY, as vLLM)")
    p.add_argument("--no-dashboard", action="store_true", help="serve the API only")
    p.add_argument("--allowed-hosts", default=None, help="names a request's Host header may give, comma-separated "
                   "('*': any). Default: bound to a loopback address, only localhost, 127.0.0.1 and [::1] (a web page "
                   "cannot reach the server through DNS rebinding); bound elsewhere, any")
    p.add_argument("--trust-request-chat-template", action="store_true", help="run a request's own "
                   "'chat_template' (a template is a program: by default such requests are refused, as vLLM)")
    p.add_argument("--enable-auto-tool-choice", action="store_true", help="answer tool_choice 'auto' (the default "
                   "when a chat request sends tools): the model's tool calls are read out of its text by "
                   "--tool-call-parser, as vLLM")
    p.add_argument("--tool-call-parser", default=None, help="the format the model writes tool calls in, for "
                   "--enable-auto-tool-choice (vLLM's names: hermes)")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true", help="with tool_choice 'none', "
                   "leave the request's tools out of the chat template (default: the template gets them, as vLLM)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true", help="write logprobs tokens as "
                   "'token_id:N' unless a request's return_tokens_as_token_ids says otherwise (vLLM's flag)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true", help="serve GET /tokenizer_info, the "
                   "tokenizer's configuration with its chat template (off by default, as vLLM)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--warmup-tokens", type=int, default=512, help="a dummy prefill of this many tokens before "
                   "serving, so the first real batch does not pay the first large step's one-time costs (0: off; "
                   "single process only)")
    p.add_argument("--dp-routing", choices=("load", "prefix"), default="load", help="with --data-parallel-size N: "
                   "send each request to the least-loaded replica (load), or first to the replica that served the same "
                   "leading prompt blocks, whose prefix cache holds them (prefix)")
    add_engine_args(p)
    return p


def build_app(config: EngineConfig, api_key: str | None = None, served_model_name: str | None = None,
              dashboard: bool = True, warmup_tokens: int = 0, trust_request_chat_template: bool = False,
              allowed_hosts: frozenset[str] | None = None, enable_auto_tool_choice: bool = False,
              tool_call_parser: str | None = None, exclude_tools_when_tool_choice_none: bool = False,
              return_tokens_as_token_ids: bool = False, enable_tokenizer_info_endpoint: bool = False):
    """Load the engine (and warm it up with a dummy prefill of `warmup_tokens`, ModelRunner.warm_up) and build
    the app: returns (fastapi_app, async_engine). The app's shutdown shuts the engine down
    (`async_engine.shutdown()` may be called again; the second call does nothing). The tool options are
    build_api_server's (checked before the engine loads)."""
    from fastapi import FastAPI

    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.entrypoints.tool_calls import ToolConfig

    tools = dict(enable_auto_tool_choice=enable_auto_tool_choice, tool_call_parser=tool_call_parser,
                 exclude_tools_when_tool_choice_none=exclude_tools_when_tool_choice_none)
    ToolConfig(**tools)                     # a bad flag fails here, before the model loads
    engine = LLMEngine(config)
    if warmup_tokens > 0:
        if config.tensor_parallel_size == 1 and config.pipeline_parallel_size == 1:
            engine.model_runner.warm_up(warmup_tokens)
        else:
            logger.info("no warm-up: it runs in a single process only (tensor/pipeline parallelism is on)")
    async_engine = AsyncLLMEngine(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        # uvicorn's graceful shutdown (Ctrl-C, SIGTERM) runs this before it re-raises the signal.
        async_engine.shutdown()
        logger.info("engine shut down")

    app = FastAPI(title="minivllm", docs_url=None, redoc_url=None, lifespan=lifespan)
    app = build_api_server(async_engine, served_model_name=served_model_name, api_key=api_key, app=app,
                           trust_request_chat_template=trust_request_chat_template, allowed_hosts=allowed_hosts,
                           return_tokens_as_token_ids=return_tokens_as_token_ids,
                           enable_tokenizer_info_endpoint=enable_tokenizer_info_endpoint, **tools)
    if dashboard:
        from minivllm.entrypoints.dashboard import mount_dashboard
        app = mount_dashboard(app, async_engine, path="/", api_key=api_key)
    return app, async_engine


def allowed_hosts_for(bind_host: str, flag: str | None) -> frozenset[str] | None:
    """--allowed-hosts as a set of names (None: any); unset, the loopback names for a loopback address."""
    if flag is not None:
        names = frozenset(n.strip().lower() for n in flag.split(",") if n.strip())
        return None if "*" in names else names | LOOPBACK_NAMES
    loopback = bind_host in ("localhost", "::1") or bind_host.startswith("127.")
    return LOOPBACK_NAMES | {bind_host} if loopback else None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.threads is not None:
        import torch
        torch.set_num_threads(args.threads)
    try:
        config = EngineConfig.from_cli_args(args)
        if config.data_parallel_size > 1:
            if args.enable_auto_tool_choice or args.exclude_tools_when_tool_choice_none:
                raise ValueError("the tool-calling flags are not passed on to data-parallel replicas; tool_choice "
                                 "'required' and named functions work without them")
            return serve_data_parallel(config, args)
        if args.warmup_tokens < 0:
            raise ValueError(f"--warmup-tokens is {args.warmup_tokens}; it must be 0 (off) or a positive number "
                             f"of tokens")
        app, async_engine = build_app(config, api_key=args.api_key, served_model_name=args.served_model_name,
                                      dashboard=not args.no_dashboard, warmup_tokens=args.warmup_tokens,
                                      trust_request_chat_template=args.trust_request_chat_template,
                                      allowed_hosts=allowed_hosts_for(args.host, args.allowed_hosts),
                                      enable_auto_tool_choice=args.enable_auto_tool_choice,
                                      tool_call_parser=args.tool_call_parser,
                                      exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
                                      return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                                      enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    print(f"minivllm: serving {async_engine.engine.model_path.name} on http://{args.host}:{args.port}/ "
          f"({'' if args.no_dashboard else 'dashboard at /, '}OpenAI API at /v1, metrics at /metrics; "
          f"{describe_runtime()})",
          file=sys.stderr, flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=3)
    try:
        QuietServer(config, before_exit=async_engine.shutdown).run()
    finally:
        async_engine.shutdown()
    return 0


def serve_data_parallel(config: EngineConfig, args) -> int:
    """--data-parallel-size N: N replica processes, each an API server on a port of its own, behind the router."""
    from minivllm.entrypoints.dp_replicas import start_replicas
    from minivllm.entrypoints.dp_router import build_dp_router
    from minivllm.model.loader import load_tokenizer, resolve_model_path

    tokenizer = load_tokenizer(resolve_model_path(config.model)) if args.dp_routing == "prefix" else None
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", force=True)
    replicas = start_replicas(config, warmup_tokens=args.warmup_tokens, dashboard=not args.no_dashboard)
    app = build_dp_router(replicas, args.dp_routing, tokenizer, config.block_size)
    print(f"minivllm: {len(replicas)} data-parallel replicas ({', '.join(r.url for r in replicas)}) behind "
          f"http://{args.host}:{args.port}/v1 ({args.dp_routing} routing)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


class QuietServer(uvicorn.Server):
    """uvicorn's Server, but Ctrl-C / SIGTERM is an ordinary shutdown: uvicorn re-raises the signal after its
    graceful shutdown, and that KeyboardInterrupt cancels the app's lifespan with a logged traceback. And the
    engine stops first (`before_exit`): every open request ends with a 503 (a stream with an error event and
    [DONE]), so the handlers are done before uvicorn closes their connections, and none is cancelled."""

    def __init__(self, config: uvicorn.Config, before_exit=None):
        super().__init__(config)
        self.before_exit = before_exit

    def handle_exit(self, sig, frame) -> None:
        if self.before_exit is not None and not self.should_exit:
            self.before_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self.handle_exit)
        yield


if __name__ == "__main__":
    sys.exit(main())
