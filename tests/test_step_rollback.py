"""A step that fails leaves nothing wrong behind: the core rolls back, and the engine keeps serving correctly.

The oracle is the engine's own greedy output from before the failure (itself equal to Hugging Face's, see
test_parity.py) and a fingerprint of the whole core state taken before the failed step.
"""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams
from minivllm.core.request import Request, RequestStatus

PROMPT = "The capital of France is a city where people"      # 9 tokens: block_size 4 gives full blocks


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **kw)


@pytest.fixture(scope="module")
def small_llm(model_dir):
    return LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=24, block_size=4,
               max_num_batched_tokens=64, max_num_seqs=8)


@pytest.fixture
def engine(small_llm):
    engine = small_llm.llm_engine
    engine.reset_prefix_cache()
    yield engine
    for rid in list(engine.requests):
        engine.abort_request(rid)
    engine.check_integrity()


def fingerprint(engine) -> tuple:
    """Everything the core holds, as plain values: equal fingerprints mean equal states."""
    kv, sched = engine.kv_cache_manager, engine.scheduler
    pool = kv.block_pool
    reqs = tuple((r.request_id, r.status, r.num_computed_tokens, tuple(r.block_table), tuple(r.output_token_ids),
                  r.num_preemptions, r.num_cached_tokens) for r in sched.running + sched.waiting)
    blocks = tuple((b.ref_count, b.block_hash, b.token_ids) for b in pool.blocks)
    return (reqs, [r.request_id for r in sched.running], [r.request_id for r in sched.waiting], blocks,
            tuple(pool.clean_free), tuple(pool.cached_free.items()), dict(pool.hash_to_block),
            {k: tuple(v) for k, v in kv.swap_space.tables.items()}, tuple(kv.swap_space.free),
            dict(kv.num_cached_blocks), kv.prefix_cache_queries, kv.prefix_cache_hits, pool.num_evictions,
            sched.num_preemptions, engine.num_steps, engine.num_generated_tokens)


def fail_once(obj, name: str, exc: BaseException, after_call: bool = False):
    """Make `obj.name(...)` raise `exc` on its next call (after running, with after_call), then behave again."""
    original = getattr(obj, name)

    def broken(*args, **kwargs):
        setattr(obj, name, original)
        if after_call:
            original(*args, **kwargs)
        raise exc
    setattr(obj, name, broken)


def reference(llm, prompt, n: int) -> list[int]:
    return llm.generate(prompt, greedy(n), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("where", ["schedule", "forward", "sampler", "detokenizer"])
@pytest.mark.parametrize("exc", [RuntimeError("injected"), KeyboardInterrupt()])
def test_a_failed_step_changes_nothing(small_llm, engine, where, exc):
    want = reference(small_llm, PROMPT, 12)
    engine.reset_prefix_cache()
    a = engine.add_request(PROMPT, greedy(12))
    b = engine.add_request(PROMPT, greedy(12))
    engine.step()                       # both prefilled (the blocks join the cache as the step commits)
    engine.step()                       # one decode each
    before = fingerprint(engine)
    target = {"schedule": (engine.scheduler, "schedule", True), "forward": (engine.model_runner, "execute_model", False),
              "sampler": (engine.model_runner, "sampler", False),
              "detokenizer": (engine.output_processor, "process_outputs", False)}[where]
    if where == "sampler":
        real = engine.model_runner.sampler

        class Broken:
            def __getattr__(self, name):
                return getattr(real, name)

            def __call__(self, *a, **k):
                engine.model_runner.sampler = real
                real(*a, **k)                     # the draw happens, then the failure: its RNG must come back
                raise exc
        engine.model_runner.sampler = Broken()
    else:
        fail_once(*target[:2], exc, after_call=target[2])
    failed_steps = engine.num_failed_steps
    with pytest.raises(type(exc)):
        engine.step()
    assert fingerprint(engine) == before
    assert engine.num_failed_steps == failed_steps + 1
    assert sorted(engine.failed_request_ids) == sorted([a.request_id, b.request_id])
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert a.output_token_ids == b.output_token_ids == want


@pytest.mark.slow
def test_ctrl_c_in_generate_then_the_same_prompt_gives_the_reference_text(small_llm, engine):
    """The issue's scenario: Ctrl-C inside the forward of LLM.generate([p, p]); before the fix the next request
    with that prompt hit blocks that were cached but never computed, and got wrong text."""
    want = small_llm.generate(PROMPT, greedy(12), use_tqdm=False)[0].outputs[0]
    engine.reset_prefix_cache()
    fail_once(engine.model_runner, "execute_model", KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        small_llm.generate([PROMPT, PROMPT], greedy(12), use_tqdm=False)
    assert not engine.requests and not engine.has_unfinished_requests()     # generate aborted its own
    engine.check_integrity()
    got = small_llm.generate(PROMPT, greedy(12), use_tqdm=False)[0].outputs[0]
    assert (got.token_ids, got.text) == (want.token_ids, want.text)


@pytest.mark.slow
def test_a_failed_step_after_a_preemption_distrusts_the_reused_blocks(model_dir):
    """A step that preempts one request and hands its blocks to another, then fails: the rollback gives the victim
    its blocks back, but the failed forward may have written them, so the victim recomputes from the first one."""
    llm = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=7, block_size=4,
              max_num_batched_tokens=32, max_num_seqs=4)
    engine = llm.llm_engine
    want = {p: reference(llm, p, 10) for p in ("The sky is blue because", "Water boils at a temperature of")}
    engine.reset_prefix_cache()
    reqs = [engine.add_request(p, greedy(10)) for p in want]
    preempted = False
    while engine.has_unfinished_requests():
        if engine.kv_cache_manager.num_free_blocks == 0 and not preempted:
            # the pool is full: the next step must preempt; make it fail after its forward ran
            before = engine.scheduler.num_preemptions
            fail_once(engine.model_runner, "execute_model", RuntimeError("injected"), after_call=True)
            with pytest.raises(RuntimeError):
                engine.step()
            preempted = True
            assert engine.scheduler.num_preemptions == before       # the preemption was undone too
            engine.check_integrity()
            continue
        engine.step()
        engine.check_integrity()
    assert preempted
    assert [r.output_token_ids for r in reqs] == list(want.values())


def test_integrity_check_tells_a_computed_block_from_an_uncomputed_one(engine):
    """What the old bug left behind (a block in the prefix cache whose step never ran) is now an integrity error."""
    req = engine.add_request(PROMPT, greedy(4))
    engine.step()                                      # 9 prompt tokens computed: 2 full blocks of 4, hashed
    kv = engine.kv_cache_manager
    assert kv.num_cached_blocks[req.request_id] == 2
    engine.check_integrity()
    req.append_output_token(5)                         # tokens 9-11 exist; 10-11 were never computed
    req.append_output_token(6)
    kv.block_pool.cache_block(req.block_table[2], 12345, tuple(req.all_token_ids[8:12]))
    kv.num_cached_blocks[req.request_id] = 3
    with pytest.raises(AssertionError, match=r"block \d+ \(tokens 8-11\) is in the prefix cache, but only 9 tokens have been computed"):
        engine.check_integrity()
    kv.block_pool.drop_cached(req.block_table[2])      # put it right for the fixture's teardown
    kv.num_cached_blocks[req.request_id] = 2
    req.pop_output_token()
    req.pop_output_token()


def test_only_the_scheduler_writes_num_computed_tokens():
    """The issue asks for exactly one writer: grep the package for assignments to the field."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1] / "minivllm"
    writers = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if re.search(r"num_computed_tokens\s*[+-]?=(?!=)|\"num_computed_tokens\"", p.read_text()))
    assert writers == ["core/scheduler.py"], writers


def test_hashing_a_requests_new_blocks_costs_o_new_blocks(engine):
    """A long request hashes each block once, when its step commits, not a walk over all its blocks every step."""
    kv = engine.kv_cache_manager
    calls = []
    original = kv.block_pool.cache_block
    kv.block_pool.cache_block = lambda *a: (calls.append(a[0]), original(*a))[1]
    try:
        req = engine.add_request({"prompt_token_ids": list(range(100, 140))}, greedy(24, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        kv.block_pool.cache_block = original
    assert len(calls) == len(set(calls)) == (40 + 24 - 1) // 4            # every full computed block, once
    assert req.is_finished


# ---------------------------------------------------------------------- the defects, one test each
def test_priority_must_be_an_int_and_a_refused_request_leaves_no_trace(small_llm, engine):
    for bad in (None, 1.5, "1", True):
        with pytest.raises(ValueError, match="priority is"):
            engine.add_request(PROMPT, greedy(2), request_id="p", priority=bad)
    with pytest.raises(ValueError, match="priority is"):
        small_llm.generate([PROMPT, PROMPT], greedy(2), priority=[0, None], use_tqdm=False)
    assert not engine.requests and not engine.has_unfinished_requests()
    engine.add_request(PROMPT, greedy(2), request_id="p")                  # the id was never taken


def test_a_request_the_scheduler_refuses_keeps_its_id_free(engine, monkeypatch):
    def refuse(request):
        raise RuntimeError("scheduler refused")
    monkeypatch.setattr(engine.scheduler, "add_request", refuse)
    with pytest.raises(RuntimeError):
        engine.add_request(PROMPT, greedy(2), request_id="x")
    monkeypatch.undo()
    assert "x" not in engine.requests and "x" not in engine.output_processor.states
    engine.add_request(PROMPT, greedy(2), request_id="x")


def test_generate_takes_back_the_requests_it_added_when_a_later_add_fails(small_llm, engine, monkeypatch):
    real_add, calls = engine.add_request, []

    def add(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("second add fails")
        return real_add(*args, **kwargs)
    monkeypatch.setattr(engine, "add_request", add)
    with pytest.raises(RuntimeError):
        small_llm.generate([PROMPT, PROMPT, PROMPT], greedy(2), use_tqdm=False)
    monkeypatch.undo()
    assert not engine.requests and not engine.has_unfinished_requests()
    assert len(small_llm.generate(PROMPT, greedy(3), use_tqdm=False)[0].outputs[0].token_ids) == 3


def test_tiny_temperatures_are_greedy(small_llm):
    want = reference(small_llm, PROMPT, 12)
    for t in (1e-38, 1e-6):
        out = small_llm.generate(PROMPT, SamplingParams(temperature=t, max_tokens=12), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == want
    assert SamplingParams(temperature=1e-5).temperature == 1e-5          # vLLM's threshold: 1e-5 still samples


def test_preemption_victim_is_the_lowest_priority_then_the_latest_arrival():
    from minivllm.core.journal import StepJournal
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.scheduler import Scheduler

    kv = KVCacheManager(4, 4, StepJournal())
    sched = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=100)
    reqs = [Request(str(i), [1, 2, 3, 4, 5, 6, 7, 8], greedy(8), arrival_time=1.0) for i in range(2)]   # a tie
    for r in reqs:
        sched.add_request(r)
    sched.begin_step()
    sched.update_from_output(sched.schedule(), {"0": 9, "1": 9})   # 8 prompt tokens each: 2 blocks each, pool full
    sched.commit_step()
    sched.begin_step()
    out = sched.schedule()                                         # both need a 3rd block: one must go
    sched.commit_step()
    assert [r.request_id for r in out.preempted] == ["1"]         # the later of two equal arrivals
    assert reqs[1].status is RequestStatus.PREEMPTED


def test_stop_and_eos_tokens_leave_no_text_unless_asked(small_llm, tokenizer):
    ids = reference(small_llm, PROMPT, 6)
    stop_id = ids[3]
    base = dict(temperature=0, max_tokens=6, skip_special_tokens=False, stop_token_ids=[stop_id])
    out = small_llm.generate(PROMPT, SamplingParams(**base), use_tqdm=False)[0].outputs[0]
    kept = small_llm.generate(PROMPT, SamplingParams(**base, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert out.token_ids == kept.token_ids == ids[:4] and out.stop_reason == stop_id
    assert out.text == tokenizer.decode(ids[:3]) and kept.text == tokenizer.decode(ids[:4])
    eos = tokenizer.eos_token_id
    chat = small_llm.chat([{"role": "user", "content": "Say hi."}],
                    SamplingParams(temperature=0, max_tokens=64, skip_special_tokens=False), use_tqdm=False)[0]
    o = chat.outputs[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] == eos
    assert o.text == tokenizer.decode(o.token_ids[:-1], skip_special_tokens=False)
    assert tokenizer.decode([eos]) not in o.text


@pytest.mark.slow
def test_string_prompts_get_the_tokenizers_special_tokens(model_dir, tmp_path):
    """A tokenizer that adds a BOS (as Llama 2/3's do) gets it on string prompts, as in vLLM and HF."""
    import shutil

    from tokenizers.processors import TemplateProcessing
    from transformers import AutoTokenizer

    ckpt = tmp_path / "bos-model"
    shutil.copytree(model_dir, ckpt, ignore=shutil.ignore_patterns("tokenizer*"))
    tok = AutoTokenizer.from_pretrained(model_dir)
    bos = tok.bos_token or "<|endoftext|>"
    bos_id = tok.convert_tokens_to_ids(bos)
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, bos_id)])
    tok.save_pretrained(ckpt)
    oracle = AutoTokenizer.from_pretrained(ckpt)
    want = oracle("Hello there").input_ids
    assert want[0] == bos_id
    llm = LLM(str(ckpt), device="cpu", dtype="float32", num_kv_blocks=16)
    out = llm.generate("Hello there", greedy(2), use_tqdm=False)[0]
    assert out.prompt_token_ids == want


def test_declared_torch_has_what_the_attention_uses():
    """The torch attention path calls SDPA with enable_gqa, new in torch 2.5: the declared floor must allow it."""
    import pathlib
    import re

    import inspect

    from minivllm.model._kernels import kernels

    assert "enable_gqa" in inspect.getsource(kernels.reference)
    pyproject = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    floor = re.search(r'"torch>=(\d+)\.(\d+)', pyproject)
    assert floor and (int(floor[1]), int(floor[2])) >= (2, 5), floor


def test_same_step_prefix_sharing_is_undone_with_its_step(small_llm, engine):
    """Identical prompts admitted together compute their shared full blocks once (the later ones hit the blocks the
    step is computing); when that step fails, the offers, the hits and the ref counts go back with it."""
    want = reference(small_llm, PROMPT, 8)
    engine.reset_prefix_cache()
    reqs = [engine.add_request(PROMPT, greedy(8)) for _ in range(3)]
    before = fingerprint(engine)
    fail_once(engine.model_runner, "execute_model", RuntimeError("injected"))
    with pytest.raises(RuntimeError):
        engine.step()
    assert fingerprint(engine) == before and not engine.kv_cache_manager.pending
    engine.check_integrity()
    with engine.record_traces() as traces:
        while engine.has_unfinished_requests():
            engine.step()
    first = traces[0].by_id
    assert [first[r.request_id].num_cached_tokens for r in reqs] == [0, 8, 8]    # 2 full blocks of 4, shared
    assert traces[0].num_prefill_tokens == 9 + 1 + 1
    assert all(r.output_token_ids == want for r in reqs)
