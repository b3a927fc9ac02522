"""AsyncLLMEngine: streams, aborts on disconnect, teaching controls, and a loop that survives every failure.

One LLMEngine is loaded for the module; each test wraps it in a fresh AsyncLLMEngine (one engine thread at a
time) and shuts that down afterwards without shutting the engine down.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from minivllm import SamplingParams
from minivllm.core.sampling_params import RequestOutputKind
from minivllm.engine.async_llm import AsyncLLMEngine, RequestError
from minivllm.config import EngineConfig
from minivllm.engine.llm_engine import LLMEngine

NUM_KV_BLOCKS = 64


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def delta(n: int) -> SamplingParams:
    """Greedy, streamed as vLLM streams: each output holds only its new text and token ids."""
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, output_kind=RequestOutputKind.DELTA)


@pytest.fixture(scope="module")
def engine(model_dir):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # the engine thread gets one core, the test's event loop the other
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32",
                                    num_kv_blocks=NUM_KV_BLOCKS))
    yield engine
    engine.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture
def async_engine(engine):
    ae = AsyncLLMEngine(engine)
    yield ae
    ae.shutdown(shutdown_engine=False)
    assert not ae.is_running and not engine.trace_listeners
    assert not engine.has_unfinished_requests()
    engine.check_integrity()
    assert engine.get_stats().num_free_blocks == NUM_KV_BLOCKS


def wait_until(predicate, timeout: float = 30.0) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        time.sleep(0.02)


def drained(ae: AsyncLLMEngine) -> bool:
    snap = ae.snapshot()
    return snap.num_requests == 0 and snap.stats.num_free_blocks == snap.stats.num_kv_blocks


def test_generate_streams_the_greedy_tokens_one_delta_at_a_time(async_engine, hf_model):
    from tests.oracle import hf_greedy

    prompt = "The capital of France is"

    async def main():
        return [out async for out in async_engine.generate(prompt, delta(10))]

    outs = asyncio.run(main())
    ids = async_engine.tokenizer.encode(prompt, add_special_tokens=False)
    streamed = [t for o in outs for t in o.outputs[0].token_ids]
    assert streamed == hf_greedy(hf_model, ids, 10)
    assert [len(o.outputs[0].token_ids) for o in outs] == [1] * 10        # one output per token
    assert "".join(o.outputs[0].text for o in outs) == async_engine.tokenizer.decode(streamed,
                                                                                        skip_special_tokens=True)
    assert [o.finished for o in outs] == [False] * 9 + [True]
    assert outs[-1].outputs[0].finish_reason == "length"


@pytest.mark.slow
def test_concurrent_requests_share_steps_and_match_running_alone(async_engine):
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(6)]

    async def collect(prompt):
        text = ""
        async for out in async_engine.generate(prompt, delta(8)):
            text += out.outputs[0].text
        return text

    async def together():
        return await asyncio.gather(*(collect(p) for p in prompts))

    async def one_by_one():
        return [await collect(p) for p in prompts]

    batched = asyncio.run(together())
    traces = async_engine.snapshot().recent_traces
    assert max(t.num_running for t in traces) == 6                        # all six in one step
    assert batched == asyncio.run(one_by_one())


def test_leaving_the_stream_early_aborts_the_request_and_frees_its_blocks(async_engine):
    async def main():
        gen = async_engine.generate("Tell me a long story about the sea.", greedy(200), request_id="early")
        async for out in gen:
            if len(out.outputs[0].token_ids) == 3:
                break
        await gen.aclose()                    # what an HTTP server does when the client hangs up

    asyncio.run(main())
    wait_until(lambda: async_engine.finish_reason_of("early") == "abort")
    wait_until(lambda: drained(async_engine))
    assert any("abort early" in e for e in async_engine.snapshot().events)


def test_a_cancelled_consumer_aborts_its_request(async_engine):
    async def consume():
        async for _ in async_engine.generate("Count to one hundred:", greedy(200), request_id="cancelled"):
            pass

    async def main():
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    wait_until(lambda: async_engine.finish_reason_of("cancelled") == "abort")
    wait_until(lambda: drained(async_engine))


def test_a_bad_request_raises_valueerror_and_the_others_finish(async_engine):
    async def collect(prompt, params, rid):
        final = None
        async for final in async_engine.generate(prompt, params, request_id=rid):
            pass
        return final.outputs[0].finish_reason

    async def main():
        return await asyncio.gather(
            collect("Hello there", greedy(6), "good-1"),
            collect("", greedy(6), "empty"),                               # 0 tokens
            collect(list(range(9000)), greedy(6), "too-long"),            # over max_model_len
            collect("Hello", greedy(NUM_KV_BLOCKS * 16 + 10), "too-big"),   # more KV than the pool
            collect("Good morning", greedy(6), "good-2"),
            return_exceptions=True)

    results = asyncio.run(main())
    assert results[0] == results[4] == "length"
    for err, words in zip(results[1:4], ("empty", "max_model_len", "pool")):
        assert isinstance(err, ValueError) and words in str(err)
    assert async_engine.is_running


def test_add_requests_adds_all_in_one_command_or_none(async_engine, engine):
    """add_requests runs `build` on the engine thread and adds what it returns: all of it, or (if `build` or any
    request is refused) none, with no counter moved."""
    from minivllm.engine.async_llm import NewRequest

    def build(e, bad=None):
        assert threading.current_thread() is async_engine._thread          # tokenizing on the engine thread
        _, ids = e.tokenize("Hello there")
        news = [NewRequest({"prompt_token_ids": ids}, greedy(4), f"ok-{i}") for i in range(2)]
        return news + ([bad] if bad else [])

    async def add(make):
        return await async_engine.add_requests(make)

    before = engine.get_stats()
    for make, error in ((lambda e: build(e, NewRequest("Hi", greedy(NUM_KV_BLOCKS * 16 + 10), "too-big")), "pool"),
                        (lambda e: build(e, NewRequest("Hi", greedy(4), "ok-0")), "already in use"),
                        (lambda e: 1 / 0, "division")):
        with pytest.raises((ValueError, ZeroDivisionError), match=error):
            asyncio.run(add(make))
        assert not engine.has_unfinished_requests() and async_engine.snapshot().num_requests == 0
    after = engine.get_stats()
    assert after == before and async_engine.snapshot().num_prompt_tokens == 0

    async def run_both():
        streams = await async_engine.add_requests(build)
        finals = []
        for stream in streams:
            async with stream:
                async for out in stream:
                    pass
            finals.append(out)
        return finals

    with engine.record_traces() as traces:
        finals = asyncio.run(run_both())
    assert finals[0].outputs[0].token_ids == finals[1].outputs[0].token_ids
    assert [len(f.outputs[0].token_ids) for f in finals] == [4, 4]
    assert traces[0].num_prefill_tokens == 2 * len(finals[0].prompt_token_ids)   # both in the first step


@pytest.mark.slow
def test_a_failing_step_ends_its_requests_with_an_error_and_the_loop_goes_on(async_engine, engine):
    runner = engine.model_runner
    real = runner.execute_model
    calls = {"n": 0}

    def fail_once(sched):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected failure")
        return real(sched)

    async def collect(rid):
        text = ""
        async for out in async_engine.generate("Once upon a time", delta(20), request_id=rid):
            text += out.outputs[0].text
        return text

    async def main():
        return await asyncio.gather(collect("a"), collect("b"), return_exceptions=True)

    async_engine.call(lambda e: setattr(runner, "execute_model", fail_once)).result()
    try:
        results = asyncio.run(main())
    finally:
        async_engine.call(lambda e: setattr(runner, "execute_model", real)).result()
    assert all(isinstance(r, RequestError) and "injected failure" in str(r) for r in results)
    snap = async_engine.snapshot()
    assert snap.num_step_errors == 1 and snap.finished["error"] == 2 and snap.loop_alive
    wait_until(lambda: drained(async_engine))
    assert asyncio.run(collect("after")) != ""                            # and it serves the next one


def test_a_stream_whose_event_loop_is_gone_is_aborted_without_hurting_others(async_engine):
    async def add_and_leave():                # adds a request, then its loop closes with nobody reading
        await async_engine.add_request("An orphan request", greedy(100), request_id="orphan")

    threading.Thread(target=asyncio.run, args=(add_and_leave(),)).start()

    async def main():
        final = None
        async for final in async_engine.generate("A request with a reader", greedy(12)):
            pass
        return final.outputs[0].finish_reason

    assert asyncio.run(main()) == "length"
    wait_until(lambda: async_engine.finish_reason_of("orphan") == "abort")
    wait_until(lambda: drained(async_engine))
    assert async_engine.is_running


def test_a_request_whose_delivery_raises_fails_alone(async_engine):
    def broken(item):
        raise ValueError("this reader is broken")

    async def main():
        bad = await async_engine.add_request("A broken reader", greedy(50), request_id="broken")
        bad.put = broken                       # the engine thread's next delivery to it raises
        final = None
        async for final in async_engine.generate("A healthy reader", greedy(12), request_id="healthy"):
            pass
        return final

    final = asyncio.run(main())
    assert final.outputs[0].finish_reason == "length" and len(final.outputs[0].token_ids) == 12
    assert async_engine.finish_reason_of("broken") == "error"
    wait_until(lambda: drained(async_engine))
    assert async_engine.is_running and async_engine.snapshot().num_step_errors == 0


def test_pause_single_step_and_resume(async_engine):
    async_engine.pause()

    async def main():
        stream = await async_engine.add_request("Step by step:", greedy(5), request_id="stepped")
        await asyncio.sleep(0.3)
        steps = async_engine.snapshot().stats.num_steps
        assert async_engine.snapshot().paused
        assert async_engine.snapshot().stats.num_waiting == 1                    # added, not run
        seen = []
        for expected in (1, 2):
            async_engine.step_once()
            out = await asyncio.wait_for(stream.__anext__(), 30)                  # exactly one token per step
            seen.append(len(out.outputs[0].token_ids))
            await asyncio.sleep(0.2)
            assert async_engine.snapshot().stats.num_steps == steps + expected
        async_engine.resume()
        async with stream:
            async for out in stream:
                pass
        return seen, out

    seen, final = asyncio.run(main())
    assert seen == [1, 2] and final.outputs[0].finish_reason == "length"
    assert not async_engine.snapshot().paused
    assert [e.split(": ", 1)[1] for e in async_engine.snapshot().events if e.endswith(("paused", "resumed"))] == [
        "paused", "resumed"]


def test_single_step_with_nothing_to_run_is_not_saved_for_later(async_engine):
    async_engine.step_once()                  # nothing waiting: no step is owed

    async def main():
        stream = await async_engine.add_request("Later", greedy(3))
        await asyncio.sleep(0.3)
        return async_engine.snapshot().stats.num_waiting, stream

    waiting, stream = asyncio.run(main())
    assert waiting == 1
    async_engine.resume()
    wait_until(lambda: drained(async_engine))


def test_shutdown_ends_open_requests_with_an_error(engine):
    ae = AsyncLLMEngine(engine)
    called = []
    engine.shutdown = lambda: called.append(True)     # stands in for the tensor-parallel workers' shutdown
    try:
        async def main():
            stream = await ae.add_request("Never finished", greedy(200))
            ae.pause()
            await asyncio.sleep(0.2)
            threading.Thread(target=ae.shutdown).start()
            with pytest.raises(RequestError, match="shutting down"):
                async for _ in stream:
                    pass

        asyncio.run(main())
        wait_until(lambda: not ae.is_running)
        assert called == [True]
        with pytest.raises(RequestError):
            ae.call(lambda e: None).result()
    finally:
        del engine.shutdown
    assert not engine.has_unfinished_requests() and engine.get_stats().num_free_blocks == NUM_KV_BLOCKS


def test_snapshot_histograms_count_every_token(async_engine):
    async def run(i):
        return [out async for out in async_engine.generate(f"Item {i}:", greedy(5))]

    async def main():
        await asyncio.gather(*(run(i) for i in range(3)))

    asyncio.run(main())
    snap = async_engine.snapshot()
    assert snap.ttft.count == 3 and snap.itl.count == 3 * 4 and snap.e2e.count == 3
    assert sum(snap.ttft.counts) == 3 and snap.ttft.sum > 0
    assert snap.finished == {"length": 3}
    steps = [t.step for t in snap.recent_traces]
    assert steps == sorted(steps) and snap.trace.step == steps[-1]


# ---------------------------------------------------------------------- Core v2: the async defects
def test_shutdown_resolves_commands_queued_behind_a_running_one(engine):
    """A command queued while another runs, then a shutdown: its caller used to wait forever."""
    ae = AsyncLLMEngine(engine)
    slow = ae.call(lambda e: time.sleep(0.5))
    time.sleep(0.1)                                   # the slow one is running on the engine thread
    queued = ae.call(lambda e: "ran")
    ae.shutdown(shutdown_engine=False)
    slow.result(timeout=5)
    try:
        assert queued.result(timeout=5) == "ran"      # it may still run before the loop stops ...
    except RequestError as e:                         # ... or fail cleanly; it never hangs
        assert "shut down" in str(e)
    assert not ae.is_running


def test_two_single_steps_queued_together_run_two_steps(async_engine):
    async_engine.pause()

    async def main():
        stream = await async_engine.add_request("Two steps:", greedy(8))
        await asyncio.sleep(0.2)
        steps = async_engine.snapshot().stats.num_steps
        async_engine.step_once()
        async_engine.step_once()                      # queued together with the first
        wait_until(lambda: async_engine.snapshot().stats.num_steps == steps + 2)
        await asyncio.sleep(0.3)
        assert async_engine.snapshot().stats.num_steps == steps + 2       # and no more
        async_engine.resume()
        async with stream:
            async for _ in stream:
                pass

    asyncio.run(main())


@pytest.mark.slow
def test_a_failed_step_fails_only_its_own_requests(model_dir):
    """With one sequence per step, a failed step scheduled only the running request: the waiting one is untouched
    and later gives exactly the tokens it gives alone."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=32,
                                    max_num_seqs=1, max_num_batched_tokens=64))
    want = None
    ae = AsyncLLMEngine(engine)
    try:
        async def alone():
            return [t async for out in ae.generate("Second in line", delta(6)) for t in out.outputs[0].token_ids]
        want = asyncio.run(alone())
        runner, real = engine.model_runner, engine.model_runner.execute_model
        calls = {"n": 0}

        def fail_third(mi):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected failure")
            return real(mi)

        async def main():
            first = await ae.add_request("First in line", delta(20), request_id="first")
            second = await ae.add_request("Second in line", delta(6), request_id="second")
            results = []
            for stream in (first, second):
                try:
                    results.append([t async for out in stream for t in out.outputs[0].token_ids])
                except RequestError as e:
                    results.append(e)
            return results

        ae.call(lambda e: setattr(runner, "execute_model", fail_third)).result()
        try:
            first, second = asyncio.run(main())
        finally:
            ae.call(lambda e: setattr(runner, "execute_model", real)).result()
        assert isinstance(first, RequestError) and "injected failure" in str(first)
        assert second == want
        assert ae.snapshot().finished == {"length": 2, "error": 1}
    finally:
        ae.shutdown()
    engine.check_integrity()


def test_a_slow_reader_gets_merged_deltas_and_the_stream_holds_one_output():
    """The stream never queues stale copies: unread DELTA outputs are joined when read, and a CUMULATIVE one
    replaces the unread one."""
    from minivllm.engine.request_stream import RequestStream
    from minivllm.outputs import CompletionOutput, RequestOutput

    def out(i, text, ids, finished=False):
        return RequestOutput("r", None, [1], [CompletionOutput(0, text, ids, "length" if finished else None)],
                             finished)

    async def main():
        loop = asyncio.get_running_loop()
        delta_stream = RequestStream("r", loop, abort=lambda rid: None, delta=True)
        for i in range(100):
            delta_stream.put(out(i, f"{i},", [i], finished=i == 99))
        await asyncio.sleep(0)
        merged = [o async for o in delta_stream]
        cumulative = RequestStream("r", loop, abort=lambda rid: None, delta=False)
        for i in range(1, 101):
            cumulative.put(out(i, "x" * i, list(range(i)), finished=i == 100))
        await asyncio.sleep(0)
        assert len(cumulative._unread) == 1
        return merged, [o async for o in cumulative]

    merged, latest = asyncio.run(main())
    assert len(merged) == 1 and merged[0].finished
    assert merged[0].outputs[0].token_ids == list(range(100))
    assert merged[0].outputs[0].text == "".join(f"{i}," for i in range(100))
    assert len(latest) == 1 and latest[0].outputs[0].text == "x" * 100
