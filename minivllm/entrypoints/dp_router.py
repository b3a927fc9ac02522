"""Data parallelism: N engine replicas, each in its own process with the whole model, behind one OpenAI server that
sends each request to the replica with the least load (vLLM's `--data-parallel-size`, whose front end balances
requests over its engine cores by their queue lengths).

    client -> router (this module: app.py with --data-parallel-size N)
                 picks a replica: fewest requests in flight (running + waiting as the router sees them: it counts
                 each request from routing to its last byte), then the lowest KV cache usage (polled from each
                 replica's /metrics), then the fewest routed so far;
                 --dp-routing prefix first tries the replica that last served the same leading prompt blocks, so
                 their KV is in its prefix cache (unless it is busier than the least loaded by more than a margin)
              -> replica i: an OpenAI server on its own port and process (LLMEngine + AsyncLLMEngine, its own TP/PP)
    client <- the replica's answer, passed through as it comes (http_relay.py)

A replica that cannot be reached is marked down and the request goes to another one (nothing was sent to the client
yet); the poller marks it up again when its /metrics answers. /metrics is every replica's, each series labelled
`engine="i"` as vLLM labels its engines, plus the sum over replicas without that label (the mean for ratios).
Replicas on one machine are processes, or Ray actors anywhere (dp_replicas.py `start_replicas`); replicas started
by hand are URLs (`python -m minivllm.entrypoints.dp_router --replica URL ...`). `/` shows each replica's state and
its live view (its own dashboard) in a frame, picked from a list.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
import logging
import re
from collections import OrderedDict

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, PlainTextResponse, Response

from minivllm.entrypoints.dp_replicas import Replica, stop_replicas
from minivllm.entrypoints.http_relay import (RelayError, error_response, passed_headers, read_json_object, relay,
                                             relay_error_response)

logger = logging.getLogger(__name__)

PREFIX_BLOCKS = 4              # leading blocks of a prompt that name it for prefix-aware routing
PREFIX_SLACK = 4               # a prefix owner is picked unless it has this many more requests than the least loaded


class Router:
    """Which replica a request goes to (see the module docstring)."""

    def __init__(self, replicas: list[Replica], routing: str = "load", tokenizer=None, block_size: int = 16):
        if routing not in ("load", "prefix"):
            raise ValueError(f"routing is {routing!r}; choose 'load' or 'prefix'.")
        if routing == "prefix" and tokenizer is None:
            raise ValueError("prefix-aware routing needs the model's tokenizer.")
        self.replicas, self.routing, self.tokenizer, self.block_size = replicas, routing, tokenizer, block_size
        self.owners: OrderedDict[tuple[int, ...], int] = OrderedDict()     # leading tokens -> replica index

    def _prefix(self, body: dict, path: str) -> tuple[int, ...]:
        try:
            if path.endswith("/chat/completions"):
                ids = self.tokenizer.apply_chat_template(body.get("messages", []), tokenize=True,
                                                         add_generation_prompt=True)
            else:
                prompt = body.get("prompt", "")
                ids = prompt if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) else \
                    self.tokenizer.encode(prompt if isinstance(prompt, str) else str(prompt), add_special_tokens=False)
        except Exception:                        # the replica will say what is wrong with it
            return ()
        if isinstance(ids, dict):
            ids = ids["input_ids"]
        n = min(len(ids) // self.block_size, PREFIX_BLOCKS) * self.block_size
        return tuple(ids[:n])

    def pick(self, body: dict, path: str, exclude: set[int] = frozenset()) -> Replica | None:
        live = [r for r in self.replicas if r.up and r.index not in exclude]
        if not live:
            return None
        least = min(live, key=lambda r: (r.in_flight, r.kv_usage, r.num_routed))
        if self.routing == "prefix":
            prefix = self._prefix(body, path)
            for n in range(len(prefix), 0, -self.block_size):       # the longest known prefix first
                owner = self.owners.get(prefix[:n])
                if owner is not None and owner not in exclude and self.replicas[owner].up \
                        and self.replicas[owner].in_flight <= least.in_flight + PREFIX_SLACK:
                    least = self.replicas[owner]
                    break
            for n in range(self.block_size, len(prefix) + 1, self.block_size):
                self.owners[prefix[:n]] = least.index
                self.owners.move_to_end(prefix[:n])
            while len(self.owners) > 1 << 16:
                self.owners.popitem(last=False)
        return least


def merge_metrics(texts: list[str | None]) -> str:
    """Each replica's series with an `engine` label, then the sum over replicas (the mean for ratios)."""
    head: list[str] = []
    seen_head: set[str] = set()
    per_engine: list[str] = []
    totals: OrderedDict[str, list[float]] = OrderedDict()
    sample = re.compile(r"^([^\s{]+)(\{[^}]*\})?\s+(\S+)$")
    for i, text in enumerate(texts):
        for line in (text or "").splitlines():
            if line.startswith("#"):
                if line not in seen_head:
                    seen_head.add(line)
                    head.append(line)
                continue
            m = sample.match(line)
            if not m:
                continue
            name, labels, value = m.group(1), (m.group(2) or "{}")[1:-1], m.group(3)
            per_engine.append(f'{name}{{engine="{i}"{"," + labels if labels else ""}}} {value}')
            totals.setdefault(f"{name}{{{labels}}}" if labels else name, []).append(float(value))
    summed = []
    for key, values in totals.items():
        ratio = re.search(r"_(perc|rate)[{]|_(perc|rate)$|engine_paused", key)
        total = sum(values) / len(values) if ratio else sum(values)
        summed.append(f"{key} {total:g}")
    return "\n".join(head + per_engine + summed) + "\n"


def selector_page(replicas: list[Replica]) -> str:
    """The router's page: each replica's state, and its live view (its own dashboard) in a frame below."""
    options = "".join(f'<option value="{html.escape(r.url)}/">engine {r.index}: {html.escape(r.url)}</option>'
                      for r in replicas)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>minivllm: {len(replicas)} replicas</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>body{{font-family:system-ui,sans-serif;margin:0}} header{{padding:8px 12px;display:flex;gap:12px;
flex-wrap:wrap;align-items:center}} table{{border-collapse:collapse}} td,th{{padding:2px 8px;text-align:right}}
iframe{{border:0;width:100%;height:calc(100vh - 110px)}}</style></head><body>
<header><label>live view of <select id="pick">{options}</select></label>
<table id="states"><tr><th>engine</th><th>up</th><th>in flight</th><th>routed</th><th>KV usage</th></tr></table>
</header><iframe id="view" title="the chosen replica's dashboard"></iframe>
<script>
const pick = document.getElementById("pick"), view = document.getElementById("view");
pick.onchange = () => {{ view.src = pick.value; }};
view.src = pick.value;
async function refresh() {{
  const rows = await (await fetch("replicas")).json();
  document.getElementById("states").innerHTML = "<tr><th>engine</th><th>up</th><th>in flight</th><th>routed</th>"
    + "<th>KV usage</th></tr>" + rows.map(r => `<tr><td>${{r.engine}}</td><td>${{r.up ? "yes" : "no"}}</td>`
    + `<td>${{r.in_flight}}</td><td>${{r.routed}}</td><td>${{(100 * r.kv_usage).toFixed(1)}}%</td></tr>`).join("");
}}
refresh(); setInterval(refresh, 1000);
</script></body></html>"""


async def poll(client: httpx.AsyncClient, replicas: list[Replica]) -> list[str | None]:
    """Each replica's /metrics text (None when it does not answer); marks replicas up or down, reads KV usage."""
    texts: list[str | None] = []
    for r in replicas:
        try:
            text = (await client.get(r.url + "/metrics")).text
            m = re.search(r"^vllm:kv_cache_usage_perc\S* (\S+)$", text, re.M)
            r.kv_usage, r.up = (float(m.group(1)) if m else 0.0), True
            texts.append(text)
        except httpx.HTTPError:
            if r.up:
                logger.warning("data-parallel replica %d at %s is down", r.index, r.url)
            r.up = False
            texts.append(None)
    return texts


async def route(router: Router, request: Request, path: str, timeout_s: float) -> Response:
    """Relay one request to the replica `router` picks; a replica that cannot be reached is marked down and the
    next one tried (nothing has reached the client yet)."""
    body = await read_json_object(request)
    if not isinstance(body, dict):
        return body
    tried: set[int] = set()
    error = RelayError(503, "no data-parallel replica is up")
    while (replica := router.pick(body, path, tried)) is not None:
        tried.add(replica.index)
        replica.in_flight += 1
        replica.num_routed += 1

        def done(r=replica) -> None:
            r.in_flight -= 1
        try:
            return await relay(replica.url + path, body, passed_headers(request), timeout_s, on_done=done)
        except RelayError as e:
            done()
            error = e
            if e.status == 502:                # not reachable: down until the poller sees it again
                replica.up = False
                logger.warning("data-parallel replica %d is down (%s); trying another", replica.index, e)
                continue
            break
    return relay_error_response(error) if error.status != 503 else error_response(
        503, str(error), "service_unavailable")


def build_dp_router(replicas: list[Replica], routing: str = "load", tokenizer=None, block_size: int = 16,
                    timeout_s: float = 600.0, poll_s: float = 1.0) -> FastAPI:
    """The front server over `replicas`. Its shutdown stops the replica processes it was given."""
    router = Router(replicas, routing, tokenizer, block_size)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async def poller():
            async with httpx.AsyncClient(timeout=5) as client:
                while True:
                    await poll(client, replicas)
                    await asyncio.sleep(poll_s)
        task = asyncio.create_task(poller())
        yield
        task.cancel()
        stop_replicas(replicas)

    app = FastAPI(title="minivllm data-parallel router", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.router = router

    def routed(path: str):
        async def endpoint(request: Request) -> Response:
            return await route(router, request, path, timeout_s)
        return endpoint

    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        app.add_api_route(path, routed(path), methods=["POST"])

    @app.get("/v1/models")
    async def models(request: Request):
        for r in replicas:
            with contextlib.suppress(httpx.HTTPError):
                async with httpx.AsyncClient(timeout=10) as client:
                    got = await client.get(r.url + "/v1/models", headers=passed_headers(request))
                return Response(got.content, status_code=got.status_code, media_type="application/json")
        return error_response(503, "no data-parallel replica is up", "service_unavailable")

    @app.get("/replicas")
    async def replica_states():
        return [{"engine": r.index, "url": r.url, "up": r.up, "in_flight": r.in_flight, "routed": r.num_routed,
                 "kv_usage": r.kv_usage} for r in replicas]

    @app.get("/", response_class=HTMLResponse)
    async def replica_selector():
        return HTMLResponse(selector_page(replicas))

    @app.get("/health")
    async def health():
        return Response(status_code=200 if any(r.up for r in replicas) else 503)

    @app.get("/metrics")
    async def metrics():
        async with httpx.AsyncClient(timeout=10) as client:
            texts = await poll(client, replicas)
        return PlainTextResponse(merge_metrics(texts), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def main(argv: list[str] | None = None) -> int:
    """The router alone, over replicas started elsewhere (`python app.py --host 0.0.0.0 --port P` on each machine)."""
    import argparse

    import uvicorn

    p = argparse.ArgumentParser(prog="python -m minivllm.entrypoints.dp_router",
                                description="One OpenAI endpoint over minivllm replicas, by load.")
    p.add_argument("--replica", nargs="+", required=True, help="the replicas' base URLs")
    p.add_argument("--dp-routing", choices=("load", "prefix"), default="load")
    p.add_argument("--model", default=None, help="the checkpoint (its tokenizer, for --dp-routing prefix)")
    p.add_argument("--block-size", type=int, default=16, help="the replicas' block size (--dp-routing prefix)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    args = p.parse_args(argv)
    tokenizer = None
    if args.dp_routing == "prefix":
        from minivllm.model.loader import load_tokenizer, resolve_model_path
        tokenizer = load_tokenizer(resolve_model_path(args.model))
    replicas = [Replica(i, u.rstrip("/")) for i, u in enumerate(args.replica)]
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(build_dp_router(replicas, args.dp_routing, tokenizer, args.block_size), host=args.host,
                port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
