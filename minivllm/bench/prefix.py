"""`python -m minivllm.bench prefix`: what prefix caching saves on requests behind one system prompt.

Owns: N requests that share a prompt prefix of random ids (unique tails of 16-64 tokens), run with prefix
caching off and then on, on two fresh engines; it counts the prompt tokens each computed and checks that
the greedy outputs are equal. Caching should compute the shared prefix about once, not N times.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
from dataclasses import asdict, dataclass

from minivllm.bench.workload import TOKEN_ID_HIGH, TOKEN_ID_LOW, greedy_params
from minivllm.config import EngineConfig
from minivllm.entrypoints.llm import LLM


@dataclass
class PrefixResult:
    """The shared-prefix workload with prefix caching off and on, in one run."""
    num_requests: int
    shared_len: int
    prefill_tokens_off: int             # prompt tokens run through the model, caching off
    prefill_tokens_on: int              # ... caching on
    shared_tokens_computed_on: int      # of the shared prefix, how many tokens caching on still computed
    hit_rate_on: float
    outputs_equal: bool

    @property
    def shared_reduction(self) -> float:
        """1 - (shared-prefix tokens computed with caching) / (without): at least 0.9 is the goal."""
        return 1 - self.shared_tokens_computed_on / (self.num_requests * self.shared_len)


def bench_prefix(engine_kw: dict, num_requests: int, shared_len: int, seed: int) -> PrefixResult:
    """N requests behind one shared system prompt (random ids) with unique tails of 16-64 tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH) for _ in range(shared_len)]
    prompts = [{"prompt_token_ids": shared + [rng.randrange(TOKEN_ID_LOW, TOKEN_ID_HIGH)
                                              for _ in range(rng.randint(16, 64))]} for _ in range(num_requests)]
    results = {}
    for caching in (False, True):
        llm = LLM(**{**engine_kw, "enable_prefix_caching": caching})
        outs = llm.generate(prompts, greedy_params(8), use_tqdm=False)
        stats = llm.get_stats()
        results[caching] = ([o.outputs[0].token_ids for o in outs], stats)
        llm.shutdown()
        del llm
        gc.collect()
    (ids_off, off), (ids_on, on) = results[False], results[True]
    unique = off.num_prompt_tokens_computed - num_requests * shared_len     # the tails, computed either way
    return PrefixResult(num_requests, shared_len, off.num_prompt_tokens_computed, on.num_prompt_tokens_computed,
                        on.num_prompt_tokens_computed - unique, on.prefix_cache_hit_rate, ids_off == ids_on)


def main_prefix(args: argparse.Namespace, config: EngineConfig) -> int:
    kw = asdict(config)
    kw.pop("enable_prefix_caching")                        # the mode runs with it off, then on
    try:
        r = bench_prefix(kw, args.num_requests, args.shared_prefix_len, args.seed)
    except (ValueError, FileNotFoundError) as e:
        args.parser.error(str(e))
    print(f"requests:                      {r.num_requests} behind one {r.shared_len}-token shared prefix")
    print(f"prefill tokens, caching off:   {r.prefill_tokens_off}")
    print(f"prefill tokens, caching on:    {r.prefill_tokens_on} (hit rate {r.hit_rate_on:.1%})")
    print(f"shared-prefix tokens computed: {r.num_requests * r.shared_len} off, {r.shared_tokens_computed_on} on "
          f"({r.shared_reduction:.1%} fewer)")
    print(f"greedy outputs equal:          {r.outputs_equal}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mode": "prefix", **asdict(r), "shared_reduction": r.shared_reduction}, f, indent=2)
    return 0
