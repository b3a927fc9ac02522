"""What the HTTP side does with request streams (vLLM's entrypoints/utils.py and merge_async_iterators): merge
several requests' outputs, close them, and stop work for a client that hung up; and OpenAI's error body as
an HTTP response.

Owns: nothing that outlives a response. Closing a stream aborts its request (RequestStream.close): that is the
only way anything here reaches the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from minivllm.engine.async_llm import EngineShutdownError, RequestError
from minivllm.engine.request_stream import RequestStream
from minivllm.entrypoints.protocol import APIError
from minivllm.outputs import RequestOutput


def request_error(e: RequestError) -> APIError:
    """The API's answer to a request the engine ended: 503 when the server is shutting down, else 500."""
    if isinstance(e, EngineShutdownError):
        return APIError(str(e), status_code=503, type="service_unavailable")
    return APIError(str(e), status_code=500, type="internal_server_error")


def error_response(err: APIError) -> Response:
    # Rendered with json.dumps' default ensure_ascii: a message quoting client text (even a lone surrogate,
    # which UTF-8 cannot encode) always renders; JSONResponse would raise UnicodeEncodeError, a 500.
    return Response(json.dumps(err.body()), status_code=err.status_code, media_type="application/json")


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
        return error_response(request_error(e))


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "[::1]"})


def host_name(host_header: str) -> str:
    """The name in a Host header, without its port, lowercased: "LocalHost:8000" -> "localhost", "[::1]:80" -> "[::1]"."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[:host.find("]") + 1] if "]" in host else host
    name, colon, port = host.rpartition(":")
    return name if colon and port.isdigit() else host


class HostCheck:
    """ASGI middleware: a request (HTTP or WebSocket, the API and the dashboard alike) whose Host header names none
    of `allowed` is refused with a 400. A server bound to loopback answers only to loopback names this way, so a
    web page whose own name was re-pointed at 127.0.0.1 (DNS rebinding) cannot read from it."""

    def __init__(self, app, allowed: frozenset[str]):
        self.app, self.allowed = app, allowed

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            headers = dict(scope.get("headers") or [])
            host = headers.get(b"host", b"").decode("latin-1")
            if host_name(host) not in self.allowed:
                if scope["type"] == "websocket":
                    await send({"type": "websocket.close", "code": 1008})
                    return
                err = APIError(f"the request's Host header is {host!r}; this server answers only to "
                               f"{', '.join(sorted(self.allowed))}. Connect by one of those names, or start it with "
                               "--allowed-hosts NAME,... (or '*' for any).", param="Host")
                await error_response(err)(scope, receive, send)
                return
        await self.app(scope, receive, send)
