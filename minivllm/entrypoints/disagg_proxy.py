"""The prefill/decode disaggregation proxy: one OpenAI endpoint in front of a prefill instance and a decode instance
(vLLM's `disagg_proxy` examples). Each completion or chat request goes

    client -> proxy -> prefill instance   the same request with max_tokens 1, not streamed: it computes the prompt,
                                          and its KV connector (kv_role kv_producer) saves the prompt's blocks
                   -> decode instance     the client's request as it came: its connector (kv_consumer) loads those
                                          blocks, so it computes only the last prompt token, then streams the answer
    client <- proxy <- decode instance    passed through as it comes, streamed or not

    python app.py --port 8100 --kv-transfer-config '{"kv_connector": "TCPConnector", "kv_role": "kv_producer",
                                                     "kv_port": 14579}'
    python app.py --port 8200 --kv-transfer-config '{"kv_connector": "TCPConnector", "kv_role": "kv_consumer",
                                                     "kv_port": 14579}'
    python -m minivllm.entrypoints.disagg_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

Failures: a prefill instance that is down, slow past --timeout or answers 5xx costs only speed (the proxy logs it
and the decode instance computes the prompt itself); a 4xx from it is the client's to see (bad input). A decode
instance that is down answers 502, one that does not answer within --timeout 504, each as an OpenAI error body:
the proxy never hangs. With several URLs per role, requests take them in turn.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import logging

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response

from minivllm.entrypoints.http_relay import (RelayError, error_response, passed_headers, read_json_object, relay,
                                             relay_error_response)

logger = logging.getLogger(__name__)


def prefill_body(body: dict) -> dict:
    """The request the prefill instance gets: one token, not streamed, nothing that needs more tokens."""
    body = copy.deepcopy(body)
    for key in ("stream", "stream_options", "min_tokens", "best_of"):
        body.pop(key, None)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["n"] = 1
    return body


def build_proxy(prefill_urls: list[str], decode_urls: list[str], timeout_s: float = 60.0) -> FastAPI:
    if not prefill_urls or not decode_urls:
        raise ValueError("the proxy needs at least one --prefill and one --decode URL.")
    app = FastAPI(title="minivllm disaggregation proxy", docs_url=None, redoc_url=None)
    prefills, decodes = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)
    timeout = httpx.Timeout(timeout_s)
    app.state.num_prefill_failures = 0

    async def prefill(path: str, body: dict, headers: dict) -> Response | None:
        """Run the prompt on a prefill instance; an answer for the client only when the request is bad (4xx)."""
        url = next(prefills) + path
        try:
            async with httpx.AsyncClient(timeout=timeout) as client:
                r = await client.post(url, json=prefill_body(body), headers=headers)
        except httpx.HTTPError as e:
            r, why = None, f"{type(e).__name__}: {e}"
        else:
            why = f"HTTP {r.status_code}"
            if 400 <= r.status_code < 500:
                return Response(r.content, status_code=r.status_code, media_type="application/json")
            if r.status_code < 400:
                return None
        app.state.num_prefill_failures += 1
        logger.warning("prefill at %s failed (%s): the decode instance computes the prompt itself", url, why)
        return None

    async def forward(request: Request, path: str) -> Response:
        body = await read_json_object(request)
        if not isinstance(body, dict):
            return body
        headers = passed_headers(request)
        refused = await prefill(path, body, headers)
        if refused is not None:
            return refused
        try:
            return await relay(next(decodes) + path, body, headers, timeout_s)
        except RelayError as e:
            return relay_error_response(e)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await forward(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models(request: Request):
        url = decode_urls[0] + "/v1/models"
        headers = passed_headers(request)
        try:
            async with httpx.AsyncClient(timeout=timeout) as client:
                r = await client.get(url, headers=headers)
        except httpx.HTTPError as e:
            return error_response(502, f"the decode instance at {url} could not be reached ({e})", "bad_gateway")
        return Response(r.content, status_code=r.status_code, media_type="application/json")

    @app.get("/health")
    async def health():
        try:
            async with httpx.AsyncClient(timeout=timeout) as client:
                codes = [(await client.get(u + "/health")).status_code for u in prefill_urls + decode_urls]
        except httpx.HTTPError as e:
            return error_response(503, f"an instance is not reachable: {e}", "service_unavailable")
        return Response(status_code=200 if all(c == 200 for c in codes) else 503)

    return app


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minivllm.entrypoints.disagg_proxy",
                                description="One OpenAI endpoint in front of prefill and decode instances.")
    p.add_argument("--prefill", nargs="+", required=True, help="prefill instances' base URLs (kv_producer)")
    p.add_argument("--decode", nargs="+", required=True, help="decode instances' base URLs (kv_consumer)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for an instance (default 60)")
    args = p.parse_args(argv)
    import uvicorn
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(build_proxy([u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode],
                            args.timeout), host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
