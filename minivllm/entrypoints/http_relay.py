"""Relaying an OpenAI request to another minivllm server and its answer back, streamed or not: what the
disaggregation proxy (disagg_proxy.py) and the data-parallel router (dp_router.py) share.

`relay` returns once the other server has answered with its status and headers; the body then flows through as it
comes (a server-sent-event stream chunk by chunk). If the server cannot be reached or does not answer within the
timeout, `relay` raises `RelayError` before anything was sent to the client, so the caller may try another server.
A client that goes away closes the relayed connection too, and the server behind aborts the request."""

from __future__ import annotations

import logging

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

logger = logging.getLogger(__name__)

PASSED_HEADERS = ("authorization", "content-type", "x-request-id")


class RelayError(Exception):
    """The server behind could not be reached (502) or did not answer in time (504)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def error_response(status: int, message: str, kind: str) -> JSONResponse:
    """An OpenAI error body."""
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def relay_error_response(e: RelayError) -> JSONResponse:
    return error_response(e.status, str(e), "gateway_timeout" if e.status == 504 else "bad_gateway")


def passed_headers(request: Request) -> dict[str, str]:
    return {k: v for k, v in request.headers.items() if k.lower() in PASSED_HEADERS}


async def read_json_object(request: Request) -> dict | JSONResponse:
    """The request's JSON body, or the 400 to answer."""
    try:
        body = await request.json()
    except ValueError:
        return error_response(400, "the request body is not valid JSON", "invalid_request_error")
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object", "invalid_request_error")
    return body


async def relay(url: str, body: dict, headers: dict[str, str], timeout_s: float,
                on_done=None) -> StreamingResponse:
    """POST `body` to `url` and pass the answer through. `on_done()` runs once the answer is over (or broke off)."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s))
    try:
        r = await client.send(client.build_request("POST", url, json=body, headers=headers), stream=True)
    except httpx.TimeoutException as e:
        await client.aclose()
        raise RelayError(504, f"{url} did not answer within {timeout_s} s ({type(e).__name__})") from None
    except httpx.HTTPError as e:
        await client.aclose()
        raise RelayError(502, f"{url} could not be reached ({type(e).__name__}: {e})") from None

    async def passthrough():
        try:
            async for chunk in r.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:          # the server went away mid-answer: end the stream
            logger.warning("%s broke off: %s", url, e)
        finally:
            await r.aclose()
            await client.aclose()
            if on_done is not None:
                on_done()
    return StreamingResponse(passthrough(), status_code=r.status_code,
                             media_type=r.headers.get("content-type", "application/json"))
