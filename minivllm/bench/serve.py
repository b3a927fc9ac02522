"""Online benchmark: `python -m minivllm.bench serve --base-url http://127.0.0.1:8000 --request-rate 4`.

Owns: sending a seeded stream of completion requests to a running OpenAI-compatible server (our
`python app.py`, or vLLM's) at Poisson arrival times, reading every streamed token as it arrives, and
reporting what a user of the server feels, as vLLM's serving benchmark does:

    TTFT   time to first token: request sent -> first streamed text
    ITL    inter-token latency: the gap between consecutive streamed text chunks (a token each,
           except where the detokenizer holds text back)
    E2E    request sent -> last chunk
    throughput   output tokens (from the final chunk's usage) / wall time of the whole run

Arrivals: request i is sent at the sum of i exponential gaps of mean 1 / rate (a Poisson process);
rate "inf" sends everything at once. It talks HTTP only, so it measures the server as clients see it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import dataclass, field

from minivllm.bench.workload import percentile

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact river garden window music story paper light water").split()


@dataclass
class RequestResult:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


@dataclass
class ServeReport:
    num_requests: int
    num_ok: int
    request_rate: float
    wall_s: float
    output_tokens: int
    ttft_s: list[float]
    itl_s: list[float]
    e2e_s: list[float]
    errors: list[str]

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s else 0.0

    def to_json(self) -> dict:
        out = {"num_requests": self.num_requests, "num_ok": self.num_ok, "request_rate": self.request_rate,
               "wall_s": self.wall_s, "output_tokens": self.output_tokens,
               "output_tokens_per_s": self.output_tokens_per_s, "errors": self.errors[:10]}
        for name, xs in (("ttft", self.ttft_s), ("itl", self.itl_s), ("e2e", self.e2e_s)):
            for q in (50, 90, 99):
                out[f"{name}_p{q}_ms"] = percentile(xs, q) * 1000
        return out


def make_prompts(num_requests: int, input_words: tuple[int, int], seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(*input_words))) for _ in range(num_requests)]


async def _one_request(client, url: str, model: str, prompt: str, max_tokens: int, headers: dict) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    last = None
    usage_tokens = 0
    result = RequestResult(ok=False)
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):                     # the last chunk: the exact token count
                    usage_tokens = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                result.output_tokens += 1
        result.e2e_s = time.perf_counter() - start
        result.output_tokens = usage_tokens or result.output_tokens
        result.ok = result.output_tokens > 0
        if not result.ok:
            result.error = "no tokens streamed"
    except Exception as e:                      # a refused connection, a reset stream: count it, go on
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_serve_benchmark(base_url: str, num_requests: int, request_rate: float,
                              output_len: tuple[int, int], input_words: tuple[int, int] = (16, 64), seed: int = 0, model: str | None = None,
                              api_key: str | None = None) -> ServeReport:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = base_url.rstrip("/")
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        if model is None:
            resp = await client.get(f"{base}/v1/models", headers=headers)
            resp.raise_for_status()
            model = resp.json()["data"][0]["id"]
        prompts = make_prompts(num_requests, input_words, seed)
        rng = random.Random(seed + 1)
        max_tokens = [rng.randint(*output_len) for _ in prompts]        # U[a, b], exactly (ignore_eos)
        tasks = []
        start = time.perf_counter()
        for prompt, n in zip(prompts, max_tokens):
            tasks.append(asyncio.create_task(
                _one_request(client, f"{base}/v1/completions", model, prompt, n, headers)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))        # Poisson arrivals
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - start
    ok = [r for r in results if r.ok]
    return ServeReport(num_requests, len(ok), request_rate, wall, sum(r.output_tokens for r in ok),
                       [r.ttft_s for r in ok], [x for r in ok for x in r.itl_s], [r.e2e_s for r in ok],
                       [r.error for r in results if not r.ok])


def print_serve_report(rep: ServeReport) -> None:
    j = rep.to_json()
    print(f"requests:             {rep.num_ok} of {rep.num_requests} completed, rate {rep.request_rate} req/s")
    print(f"wall time:            {rep.wall_s:.2f} s")
    print(f"output throughput:    {rep.output_tokens_per_s:.1f} tokens/s ({rep.output_tokens} tokens)")
    for name in ("ttft", "itl", "e2e"):
        print(f"{name.upper():<5} p50 / p90 / p99: {j[f'{name}_p50_ms']:.0f} / {j[f'{name}_p90_ms']:.0f} / "
              f"{j[f'{name}_p99_ms']:.0f} ms")
    for err in rep.errors[:5]:
        print(f"error:                {err}")


def main_serve(args: argparse.Namespace) -> int:
    """Output lengths U[--output-len-min, --output-len-max] (ignore_eos); prompts of --input-len-min..max words."""
    import httpx

    if args.request_rate <= 0:
        args.parser.error(f"--request-rate is {args.request_rate}; it must be > 0 (or inf).")
    try:
        rep = asyncio.run(run_serve_benchmark(args.base_url, args.num_requests, args.request_rate,
                                              (args.output_len_min, args.output_len_max),
                                              (args.input_len_min, args.input_len_max),
                                              args.seed, args.served_model, args.api_key))
    except (OSError, httpx.HTTPError) as e:
        args.parser.error(f"cannot reach {args.base_url} ({type(e).__name__}: {e}); start the server first: "
                          "python app.py")
    print_serve_report(rep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "serve", "base_url": args.base_url, **rep.to_json()}, f, indent=2)
    return 0 if rep.num_ok == rep.num_requests else 1
