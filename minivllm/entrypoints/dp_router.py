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
Replicas on one machine are processes (`start_replicas`); replicas elsewhere are URLs (`build_dp_router` takes any).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import re
from collections import OrderedDict

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from minivllm.entrypoints.http_relay import (RelayError, error_response, passed_headers, read_json_object, relay,
                                             relay_error_response)

logger = logging.getLogger(__name__)

PREFIX_BLOCKS = 4              # leading blocks of a prompt that name it for prefix-aware routing
PREFIX_SLACK = 4               # a prefix owner is picked unless it has this many more requests than the least loaded


@dataclasses.dataclass
class Replica:
    index: int
    url: str
    process: multiprocessing.process.BaseProcess | None = None
    actor: object = None           # data_parallel_backend "ray": the replica's actor
    owns_ray: bool = False         # ... and Ray was started for the replicas: stopping them stops it
    in_flight: int = 0             # requests routed here whose answer has not ended
    num_routed: int = 0
    kv_usage: float = 0.0          # vllm:kv_cache_usage_perc at the last poll
    up: bool = True


def _serve_replica(config, index: int, host: str, threads: int, ports) -> None:
    """A replica process: one engine and its OpenAI server on a free port, reported through `ports`."""
    import socket

    import torch
    import uvicorn

    from minivllm.engine.async_llm import AsyncLLMEngine
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.entrypoints.api_server import build_api_server

    torch.set_num_threads(threads)
    engine = AsyncLLMEngine(LLMEngine(config))
    app = build_api_server(engine)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    ports.put((index, sock.getsockname()[1]))
    try:
        uvicorn.Server(uvicorn.Config(app, log_level="warning", log_config=None)).run(sockets=[sock])
    finally:
        engine.shutdown()


class RayReplica:
    """A replica as a Ray actor (data_parallel_backend "ray"): its engine and OpenAI server in the actor's process,
    on whichever node Ray placed it, listening on that node's address."""

    def start(self, config, threads: int) -> str:
        import ray
        import torch

        from minivllm.engine.async_llm import AsyncLLMEngine
        from minivllm.engine.llm_engine import LLMEngine
        from minivllm.entrypoints.api_server import build_api_server, run_server_in_thread

        torch.set_num_threads(threads)
        self.engine = AsyncLLMEngine(LLMEngine(config))
        self.server = run_server_in_thread(build_api_server(self.engine), host=ray.util.get_node_ip_address())
        return self.server.url

    def stop(self) -> None:
        self.server.stop()
        self.engine.shutdown()


def start_ray_replicas(config, timeout_s: float = 600.0) -> list[Replica]:
    """config.data_parallel_size replicas as Ray actors (a local cluster, or the one RAY_ADDRESS names)."""
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(include_dashboard=False)
    n = config.data_parallel_size
    one = dataclasses.replace(config, data_parallel_size=1, data_parallel_backend="mp")
    threads = max(1, int(ray.available_resources().get("CPU", 1)) // n)
    actors = [ray.remote(num_cpus=1)(RayReplica).remote() for _ in range(n)]
    try:
        urls = ray.get([a.start.remote(one, threads) for a in actors], timeout=timeout_s)
    except BaseException:
        for a in actors:
            ray.kill(a)
        if started:
            ray.shutdown()
        raise
    return [Replica(i, url, actor=a, owns_ray=started and i == 0) for i, (url, a) in enumerate(zip(urls, actors))]


def start_replicas(config, host: str = "127.0.0.1", timeout_s: float = 600.0) -> list[Replica]:
    """config.data_parallel_size replica processes on this machine, each with the CPU's cores shared out, or with
    data_parallel_backend "ray" Ray actors; returns once every one is listening (its model loaded)."""
    if config.data_parallel_backend == "ray":
        return start_ray_replicas(config, timeout_s)
    n = config.data_parallel_size
    one = dataclasses.replace(config, data_parallel_size=1)
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // n)
    # Not daemonic: a replica with tensor or pipeline parallelism starts worker processes of its own.
    procs = [ctx.Process(target=_serve_replica, args=(one, i, host, threads, ports), name=f"minivllm-dp{i}")
             for i in range(n)]
    for p in procs:
        p.start()
    urls: dict[int, str] = {}
    try:
        while len(urls) < n:
            dead = [p.name for p in procs if not p.is_alive()]
            if dead:
                raise RuntimeError(f"data-parallel replica(s) {dead} exited while starting; see their log above.")
            with contextlib.suppress(Exception):
                i, port = ports.get(timeout=1.0)
                urls[i] = f"http://{host}:{port}"
        replicas = [Replica(i, urls[i], procs[i]) for i in range(n)]
        asyncio.run(_wait_until_serving(replicas, timeout_s))
    except BaseException:
        stop_replicas([Replica(i, "", p) for i, p in enumerate(procs)])
        raise
    return replicas


async def _wait_until_serving(replicas: list[Replica], timeout_s: float) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        for r in replicas:
            for _ in range(int(timeout_s * 10)):
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(r.url + "/health")).status_code == 200:
                        break
                if r.process is not None and not r.process.is_alive():
                    raise RuntimeError(f"data-parallel replica {r.index} exited while starting")
                await asyncio.sleep(0.1)
            else:
                raise RuntimeError(f"data-parallel replica {r.index} did not answer /health in {timeout_s} s")


def stop_replicas(replicas: list[Replica], timeout_s: float = 10.0) -> None:
    actors = [r.actor for r in replicas if r.actor is not None]
    if actors:
        import ray
        with contextlib.suppress(Exception):
            ray.get([a.stop.remote() for a in actors], timeout=timeout_s)
        for a in actors:
            ray.kill(a)
        if any(r.owns_ray for r in replicas):
            ray.shutdown()
    for r in replicas:
        if r.process is not None and r.process.is_alive():
            r.process.terminate()                 # SIGTERM: uvicorn shuts down, the engine with it
    for r in replicas:
        if r.process is not None:
            r.process.join(timeout_s)
            if r.process.is_alive():
                r.process.kill()
                r.process.join()


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


def build_dp_router(replicas: list[Replica], routing: str = "load", tokenizer=None, block_size: int = 16,
                    timeout_s: float = 600.0, poll_s: float = 1.0) -> FastAPI:
    """The front server over `replicas`. Its shutdown stops the replica processes it was given."""
    router = Router(replicas, routing, tokenizer, block_size)

    async def poll(client: httpx.AsyncClient) -> list[str | None]:
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

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async def poller():
            async with httpx.AsyncClient(timeout=5) as client:
                while True:
                    await poll(client)
                    await asyncio.sleep(poll_s)
        task = asyncio.create_task(poller())
        yield
        task.cancel()
        stop_replicas(replicas)

    app = FastAPI(title="minivllm data-parallel router", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.router = router

    async def route(request: Request, path: str) -> Response:
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

    def routed(path: str):
        async def endpoint(request: Request) -> Response:
            return await route(request, path)
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

    @app.get("/health")
    async def health():
        return Response(status_code=200 if any(r.up for r in replicas) else 503)

    @app.get("/metrics")
    async def metrics():
        async with httpx.AsyncClient(timeout=10) as client:
            texts = await poll(client)
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
