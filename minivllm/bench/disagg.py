"""`python -m minivllm.bench disagg`: what moving a prompt's KV costs against the prefill it saves.

Owns: N requests of random prompts (`--input-len-min`..`--input-len-max` tokens), for each connector in turn
(SharedStorageConnector in a temporary directory, TCPConnector on loopback): an engine without a connector runs
them with max_tokens 1 (the prefill alone, the baseline), then a producer engine runs them with
max_tokens 1 (the prefill, and the saves), then a consumer engine runs them with max_tokens 1 (the loads, and one
token each). It reports both times, the prompt tokens each computed, the bytes moved, and whether the consumer's
first tokens equal the producer's. Fresh prompts each round; the engines are built once per connector.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

from minivllm.bench.workload import TOKEN_ID_HIGH, TOKEN_ID_LOW, greedy_params
from minivllm.config import EngineConfig
from minivllm.entrypoints.llm import LLM


@dataclass
class DisaggResult:
    connector: str
    num_requests: int
    prompt_tokens: int                        # per round (the mean)
    plain_s: list[float] = field(default_factory=list)          # an engine without a connector: prefill alone
    prefill_s: list[float] = field(default_factory=list)        # producer: prefill + saves, per round
    load_s: list[float] = field(default_factory=list)           # consumer: loads + one token per request
    consumer_tokens_computed: int = 0         # per round
    bytes_moved: int = 0                      # per round
    first_tokens_equal: bool = True

    @property
    def save_overhead(self) -> float:
        """Producer time / plain prefill time (medians) - 1: what saving adds to the prefill."""
        return statistics.median(self.prefill_s) / statistics.median(self.plain_s) - 1

    @property
    def ratio(self) -> float:
        """Consumer time / producer time (medians): below 1, moving the KV is cheaper than computing it."""
        return statistics.median(self.load_s) / statistics.median(self.prefill_s)


def _engines(engine_kw: dict, connector: str, path: str) -> tuple[LLM, LLM, object]:
    if connector == "SharedStorageConnector":
        kv = {"kv_connector": connector, "kv_connector_extra_config": {"shared_storage_path": path}}
        return (LLM(**engine_kw, kv_transfer_config={**kv, "kv_role": "kv_producer"}),
                LLM(**engine_kw, kv_transfer_config={**kv, "kv_role": "kv_consumer"}), None)
    consumer = LLM(**engine_kw, kv_transfer_config={"kv_connector": connector, "kv_role": "kv_consumer",
                                                    "kv_port": 0})
    store = consumer.llm_engine.scheduler.connector.store
    producer = LLM(**engine_kw, kv_transfer_config={"kv_connector": connector, "kv_role": "kv_producer",
                                                    "kv_port": store.port})
    return producer, consumer, store


def bench_disagg(engine_kw: dict, connector: str, num_requests: int, lens: tuple[int, int], rounds: int,
                 seed: int) -> DisaggResult:
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as path:
        producer, consumer, store = _engines(engine_kw, connector, path)
        plain = LLM(**engine_kw)
        result = DisaggResult(connector, num_requests, 0)
        for _ in range(rounds):
            prompts = [{"prompt_token_ids": [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH)
                                             for _ in range(rng.randint(*lens))]} for _ in range(num_requests)]
            result.prompt_tokens += sum(len(p["prompt_token_ids"]) for p in prompts) // rounds
            start = time.perf_counter()
            plain.generate(prompts, greedy_params(1), use_tqdm=False)
            result.plain_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            want = [o.outputs[0].token_ids for o in producer.generate(prompts, greedy_params(1), use_tqdm=False)]
            result.prefill_s.append(time.perf_counter() - start)
            computed = consumer.llm_engine.num_prompt_tokens_computed
            start = time.perf_counter()
            got = [o.outputs[0].token_ids for o in consumer.generate(prompts, greedy_params(1), use_tqdm=False)]
            result.load_s.append(time.perf_counter() - start)
            result.consumer_tokens_computed = consumer.llm_engine.num_prompt_tokens_computed - computed
            result.first_tokens_equal &= got == want
        if store is not None:
            result.bytes_moved = store.size // rounds
        else:
            from pathlib import Path
            result.bytes_moved = sum(f.stat().st_size for f in Path(path).rglob("*.kv")) // rounds
        for llm in (plain, producer, consumer):
            llm.shutdown()
    return result


def main_disagg(args: argparse.Namespace, config: EngineConfig) -> int:
    kw = asdict(config)
    kw.pop("kv_transfer_config")
    results = []
    try:
        for connector in ("SharedStorageConnector", "TCPConnector"):
            results.append(bench_disagg(kw, connector, args.num_requests, (args.input_len_min, args.input_len_max),
                                        args.rounds, args.seed))
    except (ValueError, FileNotFoundError) as e:
        args.parser.error(str(e))
    for r in results:
        print(f"{r.connector}: {r.num_requests} requests, {r.prompt_tokens} prompt tokens a round, "
              f"{r.bytes_moved / 2**20:.1f} MiB moved a round")
        print(f"  plain engine (prefill):    {' '.join(f'{t:.2f}' for t in r.plain_s)} s")
        print(f"  producer (prefill + save): {' '.join(f'{t:.2f}' for t in r.prefill_s)} s "
              f"(saving adds {r.save_overhead:+.0%})")
        print(f"  consumer (load + 1 token): {' '.join(f'{t:.2f}' for t in r.load_s)} s "
              f"({r.consumer_tokens_computed} prompt tokens computed): {r.ratio:.2f}x the producer's time")
        print(f"  first tokens equal: {r.first_tokens_equal}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "disagg", "results": [{**asdict(r), "ratio": r.ratio, "save_overhead": r.save_overhead}
                                                      for r in results]}, f, indent=2)
    return 0
