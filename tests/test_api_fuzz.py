"""A fuzz of the server's request surface with hostile values (issue 49): every field a route reads or knows, set to
wrong types, NaN and infinities, huge numbers, Unicode digits, lone surrogates, deep nesting and long strings; bodies
that are not JSON objects, too big or nested too deep; every content type and method. Each answer must be a 2xx or a
4xx with OpenAI's error body (never a 5xx); a request still running after 15 s (a valid long one) is hung up on,
and /health must answer at once (never a hang); and the server must then answer a fixed greedy request exactly
as before.

Each run draws MINIVLLM_FUZZ_SCALE x 300 (field, value) cases from all of them (a new seed each run, printed on a
failure); `MINIVLLM_FUZZ_SCALE=10` goes through nearly all."""

from __future__ import annotations

import json
import os
import random

import httpx
import pytest

from minivllm.entrypoints.protocol import ACCEPTED_FIELDS, NOT_IMPLEMENTED
from tests.test_api_server import CHAT, MODEL, server  # noqa: F401  (the module-scoped server fixture)

FUZZ_SCALE = float(os.environ.get("MINIVLLM_FUZZ_SCALE", "1"))
BASE = {"/v1/completions": {"model": MODEL, "prompt": "Hello", "max_tokens": 1},
        "/v1/chat/completions": {"model": MODEL, "messages": CHAT, "max_tokens": 1},
        "/tokenize": {"model": MODEL, "prompt": "Hello"},
        "/detokenize": {"model": MODEL, "tokens": [1, 2]}}


def nested(depth: int, leaf=1):
    for _ in range(depth):
        leaf = [leaf]
    return leaf


HOSTILE = [None, True, False, 0, -1, 1, 2 ** 31, 2 ** 63, -(2 ** 63) - 1, 10 ** 400, 1e308, -1e308, 0.5, -0.0,
           float("nan"), float("inf"), float("-inf"), "", "1", "²", "①", "０", "٣", "\ud800", "x" * 100_000,
           "<|im_start|>", [], [None], [1, "a"], ["\ud800"], [2 ** 70], nested(500), {}, {"a": 1},
           {"type": "json_schema"}, {"²": 1}, {"0": 1e308}, {"1": float("nan")}, list(range(5000)),
           {"type": "array", "items": nested(200, {})}]


def dumps(body) -> bytes:
    """JSON as a hostile client writes it: NaN and Infinity literals, lone surrogates as \\ud800 escapes."""
    return json.dumps(body, allow_nan=True).encode()


def check(r: httpx.Response, case, openai_body: bool = True) -> None:
    """A 2xx, or a 4xx; from the API's own routes, with OpenAI's error body (a method a route does not take may
    fall through to the dashboard's mount, whose 404 is Starlette's)."""
    assert r.status_code < 500, (case, r.status_code, r.text[:500])
    if r.status_code >= 400 and openai_body:
        error = r.json()["error"]                     # OpenAI's error body, never plain text
        assert isinstance(error["message"], str) and error["message"], (case, r.text[:500])


def greedy(url: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "The capital of France is",
                                                  "max_tokens": 6, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def field_cases() -> list[tuple[str, str, object]]:
    cases = []
    for route, base in BASE.items():
        for field in sorted(ACCEPTED_FIELDS[route] | set(NOT_IMPLEMENTED) | {"unknown_field"}):
            cases += [(route, field, i) for i in range(len(HOSTILE))]
    return cases


@pytest.mark.slow
def test_hostile_field_values_get_a_4xx_never_a_5xx_or_a_hang(server):  # noqa: F811
    before = greedy(server.url)
    seed = random.randrange(2 ** 32)
    cases = random.Random(seed).sample(field_cases(), k=min(len(field_cases()), round(300 * FUZZ_SCALE)))
    with httpx.Client(base_url=server.url, timeout=15) as client:
        for route, field, i in cases:
            body = dict(BASE[route])
            body[field] = HOSTILE[i]
            try:
                r = client.post(route, content=dumps(body), headers={"content-type": "application/json"})
            except httpx.TimeoutException:
                # A valid request may be long (max_tokens None: the rest of the context); hanging up aborts it.
                # A hang is a server that stops answering: /health must still answer at once.
                health = httpx.get(server.url + "/health", timeout=2)
                assert health.status_code == 200, f"seed {seed}: {route} {field}={HOSTILE[i]!r:.80} hung the server"
                continue
            check(r, (seed, route, field, repr(HOSTILE[i])[:80]))
    assert greedy(server.url) == before


@pytest.mark.slow
def test_hostile_bodies_methods_and_content_types_get_a_4xx(server):  # noqa: F811
    before = greedy(server.url)
    bodies = [b"", b"null", b"[]", b"1", b'"x"', b"{", b"\xff\xfe", b"{}" * 1000, b'{"model": NaN}',
              b"[" * 100_000 + b"]" * 100_000, b'{"prompt": "' + b"a" * (9 << 20) + b'"}',
              dumps({"model": MODEL, "prompt": "x" * 2_000_000, "max_tokens": 1})]
    types = ["application/json", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
             "application/json; charset=latin-1", "", "application/jsonx"]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for route in BASE:
            for body in bodies:
                check(client.post(route, content=body, headers={"content-type": "application/json"}), (route, body[:40]))
            for content_type in types:
                r = client.post(route, content=dumps(BASE[route]), headers={"content-type": content_type})
                check(r, (route, content_type))
            for method in ("GET", "PUT", "DELETE", "PATCH", "OPTIONS"):
                check(client.request(method, route), (route, method), openai_body=False)
        for method in ("POST", "PUT", "DELETE"):
            for path in ("/health", "/metrics", "/v1/models", "/version"):
                check(client.request(method, path), (path, method), openai_body=False)
    assert greedy(server.url) == before
