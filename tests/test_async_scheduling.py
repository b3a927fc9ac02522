"""Async scheduling (vLLM's `async_scheduling`): the next batch is planned and issued while the one before it is
still in flight, its decodes reading that batch's sampled tokens on the device. It must change no output: greedy
equals Hugging Face token for token; sampled, seeded, logprobs, stop strings, penalties, n > 1, preemption and
aborts equal the synchronous engine's; and each test shows that batches really ran ahead (the scheduler gave
requests output placeholders, and two batches were in the queue at once). A failed step rolls back with a batch in
flight: tests/test_fault_injection.py::test_fault_injection_fuzzer_with_async_scheduling."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from tests.oracle import PROMPTS, hf_greedy

NUM_TOKENS = 24


class Spy:
    """Counts what async scheduling did in an engine: placeholder decodes, prefill chunks run ahead of their batch,
    the most batches in the queue at once, and which requests ever ran ahead."""

    def __init__(self, llm: LLM):
        self.engine = engine = llm.llm_engine
        self.placeholders = self.chunks_ahead = self.max_queue = 0
        self.ran_ahead: set[str] = set()
        self.swapped_out = 0
        self.scored_ahead = 0            # batches whose logprobs were scored on the device as they were sampled
        schedule, step, issue = engine.scheduler.schedule, engine.step, engine.executor.issue
        swap_out = engine.kv_cache_manager.swap_out

        def spy_swap_out(request):
            self.swapped_out += 1
            return swap_out(request)
        engine.kv_cache_manager.swap_out = spy_swap_out

        def spy_schedule():
            out = schedule()
            self.placeholders += len(out.num_output_placeholders)
            self.chunks_ahead += len(set(out.num_computed_ahead) - set(out.num_output_placeholders))
            self.ran_ahead |= set(out.num_computed_ahead)
            return out

        def spy_issue(*args, **kwargs):          # the batch issued, and those still in flight
            self.max_queue = max(self.max_queue, len(engine.batch_queue) + 1)
            batch = issue(*args, **kwargs)
            self.scored_ahead += batch.logprobs_ahead is not None
            return batch

        def spy_step(**kwargs):
            outputs = step(**kwargs)
            engine.check_integrity()
            return outputs
        engine.scheduler.schedule, engine.step, engine.executor.issue = spy_schedule, spy_step, spy_issue


def make(model_dir, async_scheduling: bool, **kw) -> LLM:
    return LLM(str(model_dir), device="cpu", dtype="float32", async_scheduling=async_scheduling, **kw)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


@pytest.fixture(scope="module")
def hf_reference(hf_model, prompt_ids):
    return [hf_greedy(hf_model, p, NUM_TOKENS) for p in prompt_ids]


def drained(engine) -> None:
    """No request left, every block back in the pool, the core consistent."""
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
    assert not engine.scheduler.in_flight


@pytest.mark.slow
def test_greedy_equals_hf_token_for_token_with_the_next_batch_always_ahead(model_dir, prompt_ids, hf_reference):
    """Chunked prefill (a 32-token budget) and decodes: every decode after the first runs ahead of its batch."""
    llm = make(model_dir, True, max_num_batched_tokens=32, max_num_seqs=6, num_kv_blocks=64)
    spy = Spy(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                        SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True), use_tqdm=False)
    for i, (out, want) in enumerate(zip(outs, hf_reference)):
        assert out.outputs[0].token_ids == want, f"prompt {i} diverges from HF"
    assert spy.max_queue == 2
    assert spy.placeholders >= len(prompt_ids) * (NUM_TOKENS - 3), spy.placeholders    # nearly every decode
    assert spy.chunks_ahead > 0                # the long prompt's next chunk went in before the last came back
    drained(llm.llm_engine)
    llm.shutdown()


@pytest.mark.slow
def test_decodes_through_the_cuda_graph_buffers_read_the_previous_batchs_tokens(model_dir, prompt_ids, hf_reference):
    """The graph path's half of async scheduling, rehearsed on a CPU (DecodeGraphs with capture=False runs the same
    static buffers eagerly): the tokens still on the device are written into the static input ids after the host's
    copy, and the greedy tokens stay HF's."""
    from minivllm.worker.cuda_graph import DecodeGraphs
    llm = make(model_dir, True, num_kv_blocks=64, max_num_seqs=8)
    engine = llm.llm_engine
    runner = engine.model_runner
    runner.graphs = graphs = DecodeGraphs(runner.forward, 8, engine.max_model_len, runner.block_size, runner.device,
                                          capture=False)
    spy = Spy(llm)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids],
                        SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_reference
    assert graphs.stats.replays > NUM_TOKENS // 2 and spy.placeholders > 0
    runner.graphs = None
    llm.shutdown()


def run_both(model_dir, prompts, params, **kw):
    """The same requests through a synchronous and an async engine of the same config: (sync, async, async spy)."""
    results = []
    for a in (False, True):
        llm = make(model_dir, a, **kw)
        spy = Spy(llm)
        results.append((llm.generate(prompts, params, use_tqdm=False), spy))
        drained(llm.llm_engine)
        llm.shutdown()
    (sync, _), (asyn, spy) = results
    return sync, asyn, spy


def same_outputs(sync, asyn) -> None:
    for a, b in zip(sync, asyn):
        assert len(a.outputs) == len(b.outputs)
        for x, y in zip(a.outputs, b.outputs):
            assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (y.token_ids, y.text, y.finish_reason,
                                                                             y.stop_reason), a.request_id
            if x.logprobs is not None:
                assert [sorted(d) for d in x.logprobs] == [sorted(d) for d in y.logprobs]
                for dx, dy in zip(x.logprobs, y.logprobs):
                    for t in dx:
                        assert dx[t].logprob == dy[t].logprob or abs(dx[t].logprob - dy[t].logprob) < 1e-4  # -inf


@pytest.mark.slow
def test_seeded_sampling_logprobs_stops_and_n_equal_the_synchronous_engine(model_dir):
    """Seeded sampling draws from each request's own generator, so async scheduling draws the same tokens; stop
    strings and stop tokens end a request one batch late on the device, and that extra token is dropped."""
    prompts = PROMPTS[:4] + [PROMPTS[5]]
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=20, logprobs=2),
              SamplingParams(temperature=1.0, seed=3, max_tokens=20, n=2),
              SamplingParams(temperature=0, max_tokens=30, stop=[" the"]),
              SamplingParams(temperature=0.7, seed=11, max_tokens=25, min_p=0.05),
              SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=1)]   # a long prompt, in chunks
    sync, asyn, spy = run_both(model_dir, prompts, params, max_num_seqs=8, max_num_batched_tokens=16)
    same_outputs(sync, asyn)
    assert sync[2].outputs[0].finish_reason == "stop" and sync[2].outputs[0].stop_reason == " the"
    want, got = sync[4].prompt_logprobs, asyn[4].prompt_logprobs
    assert len(want) == len(got) > 16 and want[0] is None and got[0] is None
    for a, b in zip(want[1:], got[1:]):
        assert sorted(a) == sorted(b) and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    assert spy.placeholders > 0 and spy.max_queue == 2 and spy.chunks_ahead > 0
    assert len(spy.ran_ahead) == 6                # every request, n = 2's two samples included
    assert spy.scored_ahead >= 20                 # logprobs (and prompt logprobs) scored on the device, not collect


@pytest.mark.slow
def test_requests_whose_sampling_reads_their_outputs_never_run_ahead(model_dir):
    """Penalties and min_tokens read the request's own output tokens, and a grammar's mask needs its last token,
    which the host does not have yet for a placeholder: those requests wait for their batch (and still equal the
    synchronous engine, the grammar's output matching its regex), the others run ahead. The grammar's logprobs are
    scored on the masked logits it sampled from, in both engines (vLLM's too)."""
    import re

    from minivllm import StructuredOutputsParams
    prompts = PROMPTS[:4]
    # At most 6 words of at most 8 letters: the grammar ends within 54 characters, so within max_tokens whatever
    # the draw (an unbounded word length let a seeded draw on one CPU spell 90 letters and stop at the limit).
    pattern = r"[a-z]{1,8}( [a-z]{1,8}){2,5}\."
    params = [SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, seed=5, max_tokens=16, presence_penalty=0.5, min_tokens=4),
              SamplingParams(temperature=0, max_tokens=16),
              SamplingParams(temperature=0.8, seed=2, max_tokens=60, logprobs=3,
                             structured_outputs=StructuredOutputsParams(regex=pattern))]
    sync, asyn, spy = run_both(model_dir, prompts, params)
    same_outputs(sync, asyn)
    first = asyn[3].outputs[0].logprobs[0]          # masked: only tokens the regex allows first (lower-case words)
    assert len(first) >= 3 and all(re.fullmatch("[a-z]+", lp.decoded_token) for lp in first.values()), first
    assert re.fullmatch(pattern, asyn[3].outputs[0].text), asyn[3].outputs[0].text
    assert asyn[3].outputs[0].finish_reason == "stop"           # the grammar ended it, not max_tokens
    ids = {o.prompt: o.request_id for o in asyn}
    assert spy.ran_ahead == {ids[PROMPTS[2]]}


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_prefix_hits_give_the_synchronous_engines_tokens(model_dir, prompt_ids, mode):
    """A pool too small for the batch: requests are preempted (never one in flight), swapped out or dropped, and
    come back (through the prefix cache, when dropped); greedy tokens equal the synchronous engine's."""
    prompts = [{"prompt_token_ids": p} for p in prompt_ids] * 2
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    sync, asyn, spy = run_both(model_dir, prompts, params, num_kv_blocks=24, max_num_seqs=8,
                               max_num_batched_tokens=64, preemption_mode=mode)
    same_outputs(sync, asyn)
    stats = spy.engine.get_stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert (spy.swapped_out > 0) == (mode == "swap")
    assert spy.placeholders > 0


@pytest.mark.slow
def test_aborting_a_request_whose_batch_is_in_flight(model_dir, prompt_ids, hf_reference):
    """Between steps a batch stays on the device (the victim's decode in it ran ahead of the batch before). Abort
    the victim then: its row is dropped when the batch comes back, its blocks are freed once, the others still
    equal HF."""
    llm = make(model_dir, True, num_kv_blocks=64)
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)
    reqs = [engine.add_request({"prompt_token_ids": p}, params) for p in prompt_ids[:3]]
    victim = reqs[1]
    outputs = {}
    while not (engine.batch_queue and victim in engine.batch_queue[-1].sched.scheduled
               and victim.request_id in engine.batch_queue[-1].sched.num_output_placeholders):
        for o in engine.step():
            outputs[o.request_id] = o
    num_tokens = victim.num_output_tokens
    engine.abort_request(victim.request_id)
    assert victim not in engine.scheduler.in_flight
    engine.check_integrity()
    while engine.has_unfinished_requests():
        for o in engine.step():
            outputs[o.request_id] = o
            assert o.request_id != victim.request_id
    assert victim.num_output_tokens == num_tokens             # its in-flight token was dropped
    for i in (0, 2):
        assert outputs[reqs[i].request_id].outputs[0].token_ids == hf_reference[i]
    drained(engine)
    llm.shutdown()


@pytest.mark.slow
def test_the_serving_engine_streams_hfs_tokens_with_async_scheduling(model_dir, prompt_ids, hf_reference):
    """The server's AsyncLLMEngine over an async-scheduling engine: concurrent streams, one token per delta, HF's
    greedy tokens; a stream left early aborts its request while its batch is in flight, and nothing leaks."""
    import asyncio

    from minivllm.config import EngineConfig
    from minivllm.core.sampling_params import RequestOutputKind
    from minivllm.engine.async_llm import AsyncLLMEngine
    from minivllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64,
                                    async_scheduling=True))
    spy = Spy(type("L", (), {"llm_engine": engine})())
    ae = AsyncLLMEngine(engine)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def stream(ids):
        return [o async for o in ae.generate({"prompt_token_ids": ids}, params)]

    async def leave_early():
        gen = ae.generate({"prompt_token_ids": prompt_ids[4]}, params)
        async for _ in gen:
            break
        await gen.aclose()

    async def main():
        return await asyncio.gather(*(stream(p) for p in prompt_ids[:4]), leave_early())

    try:
        results = asyncio.run(main())[:4]
    finally:
        ae.shutdown(shutdown_engine=False)
    for outs, want in zip(results, hf_reference):
        assert [t for o in outs for t in o.outputs[0].token_ids] == want
        assert outs[-1].finished
    assert spy.placeholders > 0
    drained(engine)
    engine.shutdown()


@pytest.mark.slow
def test_a_paused_server_engine_has_nothing_in_flight_and_steps_one_token_at_a_time(model_dir, prompt_ids,
                                                                                   hf_reference):
    """The dashboard's pause and single step over an async-scheduling engine (the default on a GPU): pausing
    finishes the batch in flight, so the picture shows all there is; each single step then runs one batch all
    the way and hands every running request exactly one token; resumed, it schedules ahead again."""
    import asyncio
    import time

    from minivllm.config import EngineConfig
    from minivllm.engine.async_llm import AsyncLLMEngine
    from minivllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64,
                                    async_scheduling=True))
    spy = Spy(type("L", (), {"llm_engine": engine})())
    ae = AsyncLLMEngine(engine)
    params = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True)

    def wait_until(predicate, timeout=30.0):
        deadline = time.time() + timeout
        while not predicate():
            assert time.time() < deadline, "timed out"
            time.sleep(0.01)

    def tokens() -> list[int]:                  # read while paused: the engine thread is not stepping
        return [engine.requests[f"p{i}"].num_output_tokens for i in range(2)]

    async def main():
        streams = [await ae.add_request({"prompt_token_ids": p}, params, request_id=f"p{i}")
                   for i, p in enumerate(prompt_ids[:2])]
        wait_until(lambda: ae.snapshot().stats.num_steps >= 4)          # running ahead, a batch in flight
        ae.pause()
        wait_until(lambda: ae.snapshot().paused and not engine.batch_queue)
        time.sleep(0.2)
        steps, before = ae.snapshot().stats.num_steps, tokens()
        assert 0 < min(before) and max(before) < NUM_TOKENS
        for k in (1, 2, 3):
            ae.step_once()
            wait_until(lambda: ae.snapshot().stats.num_steps == steps + k)
            time.sleep(0.1)
            assert not engine.batch_queue and tokens() == [n + k for n in before]   # one token each, none ahead
        ae.resume()
        return [[o async for o in s] for s in streams]

    try:
        results = asyncio.run(main())
    finally:
        ae.shutdown(shutdown_engine=False)
    for outs, want in zip(results, hf_reference[:2]):
        assert list(outs[-1].outputs[0].token_ids) == want
    assert spy.placeholders > 0                            # it did schedule ahead, before the pause and after
    drained(engine)
    engine.shutdown()


@pytest.mark.parametrize("kw, words", [
    (dict(tensor_parallel_size=2), "tensor_parallel_size 2"),
    (dict(pipeline_parallel_size=2), "pipeline_parallel_size 2"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative_config"),
    (dict(async_scheduling="yes"), "it must be True or False"),
])
def test_what_async_scheduling_cannot_do_is_refused_with_the_reason(kw, words):
    from minivllm.config import EngineConfig
    with pytest.raises(ValueError, match=words):
        EngineConfig.from_kwargs(async_scheduling=kw.pop("async_scheduling", True), **kw)


SAMPLED = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True),
           SamplingParams(temperature=0.7, seed=3, min_p=0.05, max_tokens=16, ignore_eos=True),
           SamplingParams(temperature=1.0, top_k=20, max_tokens=16, ignore_eos=True),
           SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]


@pytest.mark.parametrize("kw, device_type, on", [
    ({}, "cuda", True),                                   # vLLM's default: on unless something cannot use it
    ({}, "cpu", False),                                   # nothing to overlap on a CPU
    (dict(tensor_parallel_size=2), "cuda", False),
    (dict(pipeline_parallel_size=2), "cuda", False),
    (dict(distributed_executor_backend="mp"), "cuda", False),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "cuda", False),
    (dict(async_scheduling=True), "cpu", True),           # set: what was asked, wherever
    (dict(async_scheduling=False), "cuda", False),
])
def test_unset_async_scheduling_is_on_where_it_works_and_pays(kw, device_type, on):
    from minivllm.config import EngineConfig
    config = EngineConfig.from_kwargs(**kw)
    assert config.async_scheduling is kw.get("async_scheduling")
    assert config.async_scheduling_on(device_type) is on


@pytest.mark.slow
def test_an_engine_left_unset_on_a_cpu_schedules_one_batch_at_a_time(model_dir):
    with LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=64) as llm:
        engine = llm.llm_engine
        assert not engine.async_scheduling and engine.scheduler.async_scheduling is False
        assert engine.max_concurrent_batches == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="host syncs are a GPU matter")
@pytest.mark.parametrize("enforce_eager", [True, False])
@pytest.mark.parametrize("sampled", ["greedy", "sampled", "logprobs"])
def test_on_a_gpu_the_batch_ahead_is_issued_and_sampled_without_waiting(model_dir, enforce_eager, sampled):
    """What async scheduling is for: planning, issuing and sampling the next decode batch queues GPU work and waits
    for none of it (its inputs come from the batch before, on the device; the sampler's small tensors are copied
    without a stream sync; logprobs are scored there too); the one wait is `collect` bringing the older batch's
    tokens (and scores) to the host."""
    with LLM(str(model_dir), device="cuda", enforce_eager=enforce_eager, max_num_seqs=8,
             async_scheduling=True) as llm:
        engine = llm.llm_engine
        for i, prompt in enumerate(PROMPTS[:4]):
            params = (SAMPLED[i] if sampled == "sampled" else
                      SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                     logprobs=2 if sampled == "logprobs" and i % 2 else None))
            engine.add_request(prompt, params, request_id=f"s{i}")
        while not (engine.batch_queue and len(engine.batch_queue[-1].sched.num_output_placeholders) == 4):
            engine.step()
        engine.scheduler.begin_step()
        sched = engine.scheduler.schedule()               # the batch after the one on the device, by hand
        assert len(sched.num_output_placeholders) == 4    # every decode reads a token the device has not given yet
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            batch = engine.executor.issue(sched, engine.batch_queue[-1])
        finally:
            torch.cuda.set_sync_debug_mode(0)
            engine.scheduler.rollback_step()
        assert batch.sampled is not None and batch.sampled.is_cuda
        assert (batch.logprobs_ahead is not None) == (sampled == "logprobs")
