"""Bad input raises ValueError naming the value and the limit, before anything runs."""

from __future__ import annotations

import pytest

from minivllm import LLM, SamplingParams


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_tokens=0), ["max_tokens is 0", ">= 1"]),
    (dict(temperature=-0.5), ["temperature is -0.5", ">= 0"]),
    (dict(top_p=0.0), ["top_p is 0.0", "(0, 1]"]),
    (dict(top_p=1.5), ["top_p is 1.5", "(0, 1]"]),
    (dict(top_k=-3), ["top_k is -3"]),
    (dict(max_tokens=2.5), ["max_tokens is 2.5", "int"]),
    (dict(n=200), ["n is 200", "[1, 128]"]),
    (dict(stop=[""]), ["stop contains ''"]),
    (dict(temperature=float("nan")), ["temperature is nan", "finite"]),
    (dict(top_p=float("inf")), ["top_p is inf", "finite"]),
    (dict(top_k=10 ** 30), ["top_k is 1000000000000000000000000000000", "64-bit"]),
    (dict(seed=-(2 ** 64)), ["seed is -18446744073709551616", "64-bit"]),
])
def test_bad_sampling_params_are_refused(kwargs, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    for w in words:
        assert w in str(e.value)


def test_unknown_sampling_keys_are_refused():
    with pytest.raises(ValueError, match=r"unknown sampling parameter\(s\) \['temprature'\]"):
        SamplingParams.from_dict({"temprature": 0.5})


def test_unknown_engine_keys_are_refused():
    with pytest.raises(ValueError, match=r"unknown engine argument\(s\) \['max_num_seq'\]"):
        LLM(max_num_seq=4)


@pytest.mark.parametrize("kwargs, budget, seqs", [
    (dict(max_num_batched_tokens=32), 32, 256),                        # max_num_seqs at its default
    (dict(max_num_seqs=64, max_num_batched_tokens=63), 63, 64),
])
def test_token_budget_below_max_num_seqs_is_refused_with_both_values_and_the_fix(kwargs, budget, seqs):
    """As vLLM: a step must fit one decode token for each of max_num_seqs running requests."""
    with pytest.raises(ValueError) as e:
        LLM(**kwargs)                                   # refused before any model is loaded
    message = str(e.value)
    assert f"max_num_batched_tokens is {budget}, below max_num_seqs ({seqs})" in message
    assert f"max_num_batched_tokens to at least {seqs}" in message and f"max_num_seqs to at most {budget}" in message
    from minivllm.config import EngineConfig
    assert EngineConfig.from_kwargs(max_num_seqs=seqs, max_num_batched_tokens=seqs).max_num_batched_tokens == seqs


def _assert_engine_idle(llm):
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks


def test_empty_prompt_is_refused_before_anything_runs(llm):
    steps = llm.llm_engine.num_steps
    with pytest.raises(ValueError, match="prompt 1: prompt is empty"):
        llm.generate(["fine", ""], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.llm_engine.num_steps == steps
    _assert_engine_idle(llm)


def test_prompt_over_max_model_len_names_both_numbers(llm):
    limit = llm.llm_engine.max_model_len
    with pytest.raises(ValueError) as e:
        llm.generate({"prompt_token_ids": [42] * (limit + 5)}, use_tqdm=False)
    assert f"prompt has {limit + 5} tokens" in str(e.value) and f"max_model_len is {limit}" in str(e.value)
    _assert_engine_idle(llm)


@pytest.mark.slow
def test_request_larger_than_the_pool_names_both_numbers(model_dir):
    small = LLM(str(model_dir), device="cpu", dtype="float32", num_kv_blocks=8)      # 128 token slots
    with pytest.raises(ValueError) as e:
        small.generate({"prompt_token_ids": [42] * 100}, SamplingParams(max_tokens=64), use_tqdm=False)
    assert "needs 11 KV blocks" in str(e.value) and "whole pool has 8 blocks" in str(e.value)
    _assert_engine_idle(small)


def test_bad_token_ids_and_prompt_shapes(llm):
    with pytest.raises(ValueError, match=r"token ids must be ints in \[0, 49152\)"):
        llm.generate({"prompt_token_ids": [1, 999999]}, use_tqdm=False)
    with pytest.raises(ValueError, match="unknown key"):
        llm.generate({"prompt_ids": [1, 2]}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"stop_token_ids has token id\(s\) \[49152\]; token ids must be in "
                                         r"\[0, 49152\)"):
        llm.generate("hi", SamplingParams(stop_token_ids=[2, 49152]), use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 2 entries for 3 prompts"):
        llm.generate(["a", "b", "c"], [SamplingParams(), SamplingParams()], use_tqdm=False)
    _assert_engine_idle(llm)


def test_stop_strings_are_cut_and_stop_reason_set(llm):
    base = llm.generate("Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert " 6" in base.text
    out = llm.generate("Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=12, stop=[" 6"]),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 6"
    assert out.text == base.text[:base.text.index(" 6")]


def test_stop_token_ids_and_max_tokens(llm):
    base = llm.generate("Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    stop_tok = base.token_ids[3]
    out = llm.generate("Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=8,
                       stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:base.token_ids.index(stop_tok) + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert base.finish_reason == "length" and len(base.token_ids) == 8


def test_bad_parallel_settings_are_refused_with_the_fix(model_dir):
    with pytest.raises(ValueError, match="distributed_executor_backend is 'slurm'; choose one of auto, uni, mp, "
                                         "external_launcher, ray"):
        LLM(str(model_dir), device="cpu", distributed_executor_backend="slurm")
    with pytest.raises(ValueError, match="needs RANK, WORLD_SIZE.*start the program with torchrun"):
        LLM(str(model_dir), device="cpu", tensor_parallel_size=3, distributed_executor_backend="external_launcher")
    with pytest.raises(ValueError, match="'uni' runs one rank, but tensor_parallel_size is 3"):
        LLM(str(model_dir), device="cpu", tensor_parallel_size=3, distributed_executor_backend="uni")


def test_numbers_too_large_for_a_float_are_a_clear_error():
    """A 400-digit int used to raise OverflowError inside math.isfinite instead of a ValueError naming the field."""
    for field in ("temperature", "top_p", "max_tokens", "seed"):
        with pytest.raises(ValueError, match=f"{field} is an integer of 401 digits"):
            SamplingParams(**{field: 10 ** 400})


def test_stop_strings_are_looked_for_only_after_min_tokens(llm, tokenizer):
    """vLLM: a stop string in the text of the first min_tokens tokens does not stop the request."""
    prompt, min_tokens = "The capital of France is", 6
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0]
    assert "." in tokenizer.decode(base.token_ids[:2])           # " Paris." would stop at once without min_tokens
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=["."],
                                              min_tokens=min_tokens), use_tqdm=False)[0].outputs[0]
    head = len(tokenizer.decode(base.token_ids[:min_tokens]))
    cut = base.text.find(".", head)
    assert len(out.token_ids) > min_tokens
    if cut == -1:
        assert out.finish_reason == "length" and out.text == base.text
    else:
        assert out.finish_reason == "stop" and out.text == base.text[:cut]


def test_the_core_does_not_stop_on_a_stop_token_or_eos_before_min_tokens():
    """The sampler masks them before min_tokens; the core's own check does not rely on that (speculative drafts and
    a grammar's forced tokens do not pass through the mask the same way)."""
    from minivllm.core.journal import StepJournal
    from minivllm.core.kv_cache_manager import KVCacheManager
    from minivllm.core.request import Request, RequestStatus
    from minivllm.core.scheduler import Scheduler

    scheduler = Scheduler(KVCacheManager(8, 4, StepJournal()), 4, 64, 64)
    req = Request("r", [1, 2, 3], SamplingParams(min_tokens=3, stop_token_ids=[7], max_tokens=10),
                  eos_token_ids=frozenset({0}))
    assert scheduler._append_token(req, 7) is None and scheduler._append_token(req, 0) is None
    assert scheduler._append_token(req, 7) is RequestStatus.FINISHED_STOPPED        # the 3rd token may stop it
