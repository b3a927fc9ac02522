"""Streaming n tokens costs O(n): DELTA outputs carry only what is new, so the bytes handed to a reader grow
linearly with the output, where cumulative outputs (what every stream carried before) grow quadratically.

A tiny random model (2 layers, hidden 64) makes 3,072 decode steps affordable on a CPU (about 7 ms each, most of
it the engine's own step); the cost measured here is the engine's and the stream's, not the model's.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tracemalloc

import pytest

from minivllm.config import EngineConfig
from minivllm.core.sampling_params import RequestOutputKind, SamplingParams
from minivllm.engine.async_llm import AsyncLLMEngine
from minivllm.engine.llm_engine import LLMEngine

N = 2048


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from minivllm.model.random_checkpoint import write_random_checkpoint

    path = write_random_checkpoint("tiny-qwen3", tmp_path_factory.mktemp("tiny") / "ckpt", dtype="float32")
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 8192                 # room for N tokens and more (RoPE has no hard limit)
    (path / "config.json").write_text(json.dumps(config))
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="float32", num_kv_blocks=300))
    yield engine
    engine.shutdown()


def payload_bytes(out) -> int:
    o = out.outputs[0]
    return sys.getsizeof(o.text) + sys.getsizeof(o.token_ids)


def stream(ae: AsyncLLMEngine, n: int, kind: RequestOutputKind, trace: bool = False) -> tuple[int, int, int, int]:
    """(outputs read, tokens received, bytes handed to the reader, peak traced memory or 0) for one n-token
    stream; `trace` runs it under tracemalloc (which slows every allocation: only the long stream needs it)."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=kind)

    async def main():
        count = tokens = size = 0
        async for out in ae.generate({"prompt_token_ids": [1, 2, 3]}, params):
            count += 1
            tokens += len(out.outputs[0].token_ids)
            size += payload_bytes(out)
        return count, tokens, size

    if not trace:
        return (*asyncio.run(main()), 0)
    tracemalloc.start()
    try:
        count, tokens, size = asyncio.run(main())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return count, tokens, size, peak


@pytest.mark.slow
def test_streaming_2048_tokens_costs_linear_bytes(tiny_engine):
    ae = AsyncLLMEngine(tiny_engine)
    try:
        count, tokens, size, peak = stream(ae, N, RequestOutputKind.DELTA, trace=True)
        small = stream(ae, N // 4, RequestOutputKind.DELTA)
        cumulative = stream(ae, N // 4, RequestOutputKind.CUMULATIVE)
    finally:
        ae.shutdown(shutdown_engine=False)
    assert tokens == N and count >= N // 2                   # a reader that keeps up gets about one per token
    assert size < 250 * N, size                              # bytes per token stay constant ...
    assert size / small[2] < 4 * 1.3                         # ... 4x the tokens, about 4x the bytes
    # cumulative outputs carry everything so far: c outputs over n tokens carry about 8 bytes per token id times
    # n * c / 2 (n^2 / 2 when the reader keeps up, one output per token; fewer, longer ones when it falls behind
    # and outputs merge). At a quarter of the length that is already more than the whole DELTA stream.
    outputs = cumulative[0]
    assert cumulative[2] > 8 * (N // 4) * outputs / 2 * 0.9
    if outputs >= 0.9 * (N // 4):
        assert cumulative[2] > size
    assert peak < 4 * 2 ** 20, peak                          # never a queue of copies (n^2 / 2 x 8 B: 16 MiB)
