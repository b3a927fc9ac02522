"""Data-parallel replicas: starting and stopping them (processes on this machine, or Ray actors), for the router
(dp_router.py). Each replica is a whole engine (LLMEngine + AsyncLLMEngine, with its own TP/PP ranks if asked) and
its OpenAI server (and, if asked, its dashboard) on a port of its own; the router knows it by URL."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import multiprocessing
import os

import httpx


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


def _serve_replica(config, index: int, host: str, threads: int, ports, warmup_tokens: int = 0,
                   dashboard: bool = False) -> None:
    """A replica process: one engine (warmed up as app.py does) and its OpenAI server on a free port, reported
    through `ports`."""
    import socket

    import torch
    import uvicorn

    from minivllm.engine.async_llm import AsyncLLMEngine
    from minivllm.engine.llm_engine import LLMEngine
    from minivllm.entrypoints.api_server import build_api_server

    torch.set_num_threads(threads)
    llm_engine = LLMEngine(config)
    if warmup_tokens > 0 and config.tensor_parallel_size == config.pipeline_parallel_size == 1:
        llm_engine.model_runner.warm_up(warmup_tokens)
    engine = AsyncLLMEngine(llm_engine)
    app = build_api_server(engine)
    if dashboard:                                  # the live view of this replica, picked on the router's page
        from minivllm.entrypoints.dashboard import mount_dashboard
        app = mount_dashboard(app, engine, path="/")
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


def start_replicas(config, host: str = "127.0.0.1", timeout_s: float = 600.0, warmup_tokens: int = 0,
                   dashboard: bool = False) -> list[Replica]:
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
    procs = [ctx.Process(target=_serve_replica, args=(one, i, host, threads, ports, warmup_tokens, dashboard),
                         name=f"minivllm-dp{i}")
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
