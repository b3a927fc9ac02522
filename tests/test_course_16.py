"""Lesson 16's switch (lessons/your_engine.py): with every solution plugged in, the engine's tokens are the
reference engine's; a wrong function is caught (a YourEngineError naming it); leaving the switch restores the
engine."""

import sys
from pathlib import Path

import pytest
import torch

LESSONS = Path(__file__).resolve().parents[1] / "lessons"
if str(LESSONS) not in sys.path:
    sys.path.insert(0, str(LESSONS))

from course import solution  # noqa: E402
from your_engine import NAMES, YourEngineError, your_engine, written  # noqa: E402

pytestmark = pytest.mark.slow

LESSON_OF = {"blocks_held": "00", "longest_cached_prefix": "01", "take_blocks": "02", "schedule_step": "03",
             "preempt": "04", "tp_linear": "07", "stage_layers": "08",
             "slot_mapping": "05", "paged_attention_one": "06", "stream_deltas": "09", "decode_memory_floor_ms": "10",
             "pad_decode_batch": "11", "plan_ahead": "11", "quantize_activations": "11", "top_p_filter": "12",
             "ngram_propose": "13", "get_num_new_matched_tokens": "14", "fit": "15"}
SOLUTIONS = {name: solution(f"{LESSON_OF[name]}.{name}") for name in NAMES}
SYSTEM = "You are a helpful assistant who answers every question in one short paragraph. Question: "   # 17 tokens
PROMPTS = [SYSTEM + q for q in ("What is the capital of France?", "Why is the sky blue?", "Who wrote Hamlet?")]


@pytest.fixture(scope="module")
def llm():
    from minivllm import LLM
    torch.set_num_threads(1)
    # A pool of 10 blocks of 8 tokens for three requests of about 45 tokens each: one is preempted.
    with LLM(device="cpu", dtype="float32", num_kv_blocks=10, block_size=8, max_num_seqs=4,
             max_num_batched_tokens=32, seed=0) as llm:
        yield llm


def _greedy(llm):
    from minivllm import SamplingParams
    llm.llm_engine.reset_prefix_cache()
    with llm.llm_engine.record_traces() as traces:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    return outs, traces


def _sampled(llm):
    from minivllm import SamplingParams
    llm.llm_engine.reset_prefix_cache()
    params = [SamplingParams(temperature=1.0, top_p=p, max_tokens=8, seed=3 + i, ignore_eos=True)
              for i, p in enumerate([0.5, 0.9, 0.97])]
    return llm.generate(["Once upon a time", "The sea is", "A recipe:"], params, use_tqdm=False)


@pytest.fixture(scope="module")
def reference(llm):
    outs, traces = _greedy(llm)
    assert any(t.preempted for t in traces) and any(t.prefix_hit_blocks for t in traces)   # the workload's point
    return outs, _sampled(llm)


def test_the_solutions_plugged_in_give_the_reference_tokens(llm, reference):
    with your_engine(llm, **SOLUTIONS) as yours:
        greedy, traces = _greedy(llm)
        sampled = _sampled(llm)
    yours.compare(greedy, reference[0])
    yours.compare(sampled, reference[1])
    assert any(t.preempted for t in traces)
    for name in ("blocks_held", "longest_cached_prefix", "take_blocks", "schedule_step", "preempt", "slot_mapping",
                 "paged_attention_one", "tp_linear", "stage_layers", "decode_memory_floor_ms", "pad_decode_batch",
                 "quantize_activations", "top_p_filter"):
        assert yours.calls[name] > 0, name
    for name in ("plan_ahead", "ngram_propose", "get_num_new_matched_tokens", "fit", "stream_deltas"):
        assert yours.calls[name] == 0, name          # this engine has no such seam at work


def test_leaving_the_switch_puts_minivllm_back(llm, reference):
    import minivllm.core.async_scheduler as async_scheduler
    import minivllm.worker.sampler as sampler
    module_functions = (sampler.apply_top_k_top_p, async_scheduler.plan_ahead)
    engine = llm.llm_engine
    with your_engine(llm, **SOLUTIONS):
        assert sampler.apply_top_k_top_p is not module_functions[0]
    assert (sampler.apply_top_k_top_p, async_scheduler.plan_ahead) == module_functions
    for obj in (engine, engine.scheduler, engine.kv_cache_manager, engine.model_runner, engine.model_runner.backend):
        assert not set(vars(obj)) & {"step", "schedule", "_preempt", "_choose_victim", "get_computed_blocks",
                                     "allocate_slots", "prepare_inputs", "forward"}, type(obj).__name__
    assert engine.model_runner.graphs is None
    attention = engine.model_runner.model.layers[0].self_attn
    assert not (attention.qkv_proj._forward_pre_hooks or attention.qkv_proj._forward_hooks
                or attention.o_proj._forward_hooks)


def one_slot_off(block_table, start, end, block_size):
    return [block_table[p // block_size] * block_size + p % block_size + 1 for p in range(start, end)]


def not_scattered_back(logits, top_p):
    """Filters the sorted row and returns it sorted: token ids lose their place."""
    sorted_logits, _ = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    p = torch.tensor(top_p, dtype=probs.dtype)[:, None]
    return sorted_logits.masked_fill(probs.cumsum(-1) - probs >= p, float("-inf"))


def whole_prompts_only(running, waiting, max_num_batched_tokens, max_num_seqs):
    """Admits a waiting prompt only when all of it fits what is left of the budget (no chunked prefill)."""
    plan = SOLUTIONS["schedule_step"](running, [], max_num_batched_tokens, max_num_seqs)
    budget, seats = max_num_batched_tokens - sum(plan.values()), max_num_seqs - len(running)
    for request_id, need in waiting:
        if need > budget or seats == 0:
            break
        plan[request_id], budget, seats = need, budget - need, seats - 1
    return plan


def earliest_arrival(running, waiting):
    """Preempts the request that arrived first."""
    victim = min(running, key=lambda s: (-s.priority, s.arrival))
    back = victim._replace(status="preempted", num_computed_tokens=0, block_table=())
    return [s for s in running if s is not victim], [back] + waiting, list(reversed(victim.block_table))


def no_scale(q, key_cache, value_cache, block_table, seq_len, scale):
    return SOLUTIONS["paged_attention_one"](q, key_cache, value_cache, block_table, seq_len, 1.0)


def blocks_of_all_tokens(num_prompt_tokens, num_output_tokens, block_size):
    """Counts the newest token's KV too (it is computed by the next step)."""
    return -(-(num_prompt_tokens + num_output_tokens) // block_size)


def undo_reads_the_loop_variable(free, table, n, journal):
    """Each undo puts back `block_id` as it is when the rollback runs: the last block taken, n times."""
    if n > len(free):
        return False
    for _ in range(n):
        block_id = free.popleft()
        journal.record(lambda: free.appendleft(block_id))
        table.append(block_id)
        journal.record(table.pop)
    return True


def row_parallel_without_the_sum(x, weight, tp_size, kind):
    """Concatenates the ranks' results for both kinds (row parallel needs their sum)."""
    shards = list(weight.chunk(tp_size, dim=0 if kind == "column" else 1))
    xs = x.chunk(tp_size, dim=-1) if kind == "row" else [x] * tp_size
    y = torch.cat([xr @ w.T for xr, w in zip(xs, shards)], dim=-1)
    return shards, y if kind == "column" else y[:, :weight.shape[0]]


def first_block_only(token_ids, block_size, lookup):
    return SOLUTIONS["longest_cached_prefix"](token_ids, block_size, lookup)[:1]


@pytest.mark.parametrize("name, wrong, run, match", [
    ("slot_mapping", one_slot_off, _greedy, "slot_mapping"),
    ("top_p_filter", not_scattered_back, _sampled, "top_p_filter"),
    ("schedule_step", whole_prompts_only, _greedy, "schedule_step"),
    ("preempt", earliest_arrival, _greedy, "preempt"),
    ("paged_attention_one", no_scale, _greedy, "paged_attention_one"),
    ("blocks_held", blocks_of_all_tokens, _greedy, "blocks_held"),
    ("longest_cached_prefix", first_block_only, _greedy, "longest_cached_prefix"),
    ("take_blocks", undo_reads_the_loop_variable, _greedy, "take_blocks.*rollback"),
    ("tp_linear", row_parallel_without_the_sum, _greedy, "tp_linear, row parallel"),
    ("stage_layers", lambda num_layers, pp_size: [(0, num_layers)] * pp_size, _greedy, "stage_layers"),
])
def test_a_wrong_function_is_caught_and_named(llm, reference, name, wrong, run, match):
    expected = reference[1] if run is _sampled else reference[0]
    with pytest.raises(YourEngineError, match=match):
        with your_engine(llm, **{**SOLUTIONS, name: wrong}) as yours:
            outs = run(llm)[0] if run is _greedy else run(llm)
        yours.compare(outs, expected)
    assert not llm.llm_engine.has_unfinished_requests()        # a failed run leaves nothing behind


def test_an_unwritten_function_is_left_out_or_named(llm, reference):
    def slot_mapping(block_table, start, end, block_size):
        raise NotImplementedError

    assert written([slot_mapping, SOLUTIONS["blocks_held"]]) == [SOLUTIONS["blocks_held"]]
    with pytest.raises(YourEngineError, match="slot_mapping is not written yet"):
        with your_engine(llm, slot_mapping):
            _greedy(llm)
    with pytest.raises(ValueError, match="no seam for"):
        with your_engine(llm, schedule=SOLUTIONS["schedule_step"]):
            pass
