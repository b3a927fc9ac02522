"""Prompt logprobs (`SamplingParams(prompt_logprobs=k)`): None for the first prompt token, then each prompt token's
log-probability and rank and the k most likely tokens, against Hugging Face's own `log_softmax` of its logits over
the prompt (fp32, CPU, to 1e-4): whole prompts, prompts prefilled in chunks, with a prefix-cache hit available (not
taken), through recompute preemption and through a failed step."""

from __future__ import annotations

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.core.sampling_params import RequestOutputKind
from minivllm.outputs import Logprob

from tests.oracle import PROMPTS

LONG = PROMPTS[5]            # about 40 tokens: several blocks, several chunks


def hf_prompt_logprobs(hf_model, prompt_ids: list[int]) -> torch.Tensor:
    """(len(prompt_ids) - 1, vocab): row i is HF's log-softmax at position i, which scores prompt token i + 1."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt_ids])).logits[0].float()
    return logits[:-1].log_softmax(dim=-1)


def assert_matches_hf(hf_model, prompt_ids: list[int], prompt_logprobs: list, k: int) -> None:
    ref = hf_prompt_logprobs(hf_model, prompt_ids)
    assert len(prompt_logprobs) == len(prompt_ids) and prompt_logprobs[0] is None
    for i in range(1, len(prompt_ids)):
        entry, row, token = prompt_logprobs[i], ref[i - 1], prompt_ids[i]
        top_lp, top_ids = row.topk(k) if k else (row[:0], row[:0].long())
        assert list(entry)[0] == token                                      # the actual prompt token first
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        for rank, (tid, lp) in enumerate(zip(top_ids.tolist(), top_lp.tolist()), start=1):
            assert entry[tid].logprob == pytest.approx(lp, abs=1e-4) and entry[tid].rank == rank
        assert set(entry) == set(top_ids.tolist()) | {token}


@pytest.fixture(scope="module")
def small_llm(model_dir):
    """Chunked prefill (12 tokens a step) and a pool so small that three requests preempt each other (recompute)."""
    return LLM(str(model_dir), dtype="float32", device="cpu", block_size=4, num_kv_blocks=16,
               max_num_batched_tokens=12, max_num_seqs=3, preemption_mode="recompute")


@pytest.mark.parametrize("k", [0, 5])
def test_prompt_logprobs_are_hfs_log_softmax_over_the_prompt(llm, hf_model, tokenizer, k):
    out = llm.generate(LONG, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=k), use_tqdm=False)[0]
    assert_matches_hf(hf_model, out.prompt_token_ids, out.prompt_logprobs, k)
    token = out.prompt_token_ids[1]
    assert out.prompt_logprobs[1][token].decoded_token == tokenizer.decode([token])
    assert out.outputs[0].logprobs is None                        # prompt logprobs do not imply sample logprobs


@pytest.mark.slow
def test_chunked_prefill_gives_the_same_prompt_logprobs(small_llm, hf_model):
    engine = small_llm.llm_engine
    outs = small_llm.generate(LONG, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    assert len(outs[0].prompt_token_ids) > 2 * engine.config.max_num_batched_tokens     # really split in chunks
    assert_matches_hf(hf_model, outs[0].prompt_token_ids, outs[0].prompt_logprobs, 3)


@pytest.mark.slow
def test_a_request_with_prompt_logprobs_does_not_read_the_prefix_cache(llm, hf_model):
    plain = SamplingParams(temperature=0, max_tokens=1)
    llm.generate(LONG, plain, use_tqdm=False)
    assert llm.generate(LONG, plain, use_tqdm=False)[0].num_cached_tokens >= 32        # a hit is available
    out = llm.generate(LONG, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0                                                 # ... and not taken
    assert_matches_hf(hf_model, out.prompt_token_ids, out.prompt_logprobs, 2)


def test_requests_without_prompt_logprobs_get_none(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=2, logprobs=1), use_tqdm=False)[0]
    assert out.prompt_logprobs is None


def test_a_one_token_prompt_has_only_the_leading_none(llm):
    out = llm.generate({"prompt_token_ids": [504]}, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1),
                       use_tqdm=False)[0]
    assert out.prompt_logprobs == [None]


@pytest.mark.slow
def test_n_samples_carry_the_prompt_logprobs_once_on_the_request_output(llm, hf_model):
    params = SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=3, prompt_logprobs=1)
    out = llm.generate(PROMPTS[3], params, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    assert_matches_hf(hf_model, out.prompt_token_ids, out.prompt_logprobs, 1)
    engine = llm.llm_engine                   # streamed (DELTA): in the first output only
    engine.add_request(PROMPTS[3], SamplingParams(temperature=1.0, seed=5, n=3, max_tokens=3, prompt_logprobs=1,
                                                  output_kind=RequestOutputKind.DELTA))
    carried = []
    while engine.has_unfinished_requests():
        carried += [o.prompt_logprobs for o in engine.step()]
    assert carried[0] == out.prompt_logprobs and all(p is None for p in carried[1:])


@pytest.mark.slow
def test_delta_outputs_carry_the_complete_prompt_logprobs_once(small_llm, hf_model):
    engine = small_llm.llm_engine
    req = engine.add_request(LONG, SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2,
                                                  output_kind=RequestOutputKind.DELTA))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[0].outputs[0].token_ids                      # no output before the first token
    assert_matches_hf(hf_model, outs[0].prompt_token_ids, outs[0].prompt_logprobs, 2)
    assert all(o.prompt_logprobs is None for o in outs[1:]) and outs[-1].request_id == req.request_id


@pytest.mark.slow
def test_recompute_preemption_does_not_score_the_prompt_twice(small_llm, hf_model, tokenizer):
    engine = small_llm.llm_engine
    before = engine.scheduler.num_preemptions
    prompts = [PROMPTS[3], PROMPTS[4], PROMPTS[1]]
    outs = small_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                      prompt_logprobs=1), use_tqdm=False)
    assert engine.scheduler.num_preemptions > before                      # the pool forced preemption
    for out in outs:
        assert_matches_hf(hf_model, out.prompt_token_ids, out.prompt_logprobs, 1)


def test_a_failed_step_leaves_no_half_recorded_prompt_logprobs(small_llm, hf_model):
    engine = small_llm.llm_engine
    processor = engine.output_processor
    engine.add_request(LONG, SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2))
    engine.step()                                                         # the first chunk, committed
    real = processor.process_outputs

    def process_then_fail(*args, **kwargs):                               # the second chunk's logprobs computed ...
        processor.process_outputs = real
        real(*args, **kwargs)
        raise RuntimeError("injected")                                    # ... then the step fails
    processor.process_outputs = process_then_fail
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    st = next(iter(processor.states.values()))
    assert len(st.prompt_logprobs) == 1 + engine.config.max_num_batched_tokens    # [None] + the first chunk's
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert_matches_hf(hf_model, outs[-1].prompt_token_ids, outs[-1].prompt_logprobs, 2)


def test_logprob_entries_are_vllms_logprob_type(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert all(isinstance(v, Logprob) for entry in out.prompt_logprobs[1:] for v in entry.values())


def test_a_slow_streams_merged_deltas_keep_every_tokens_logprobs_and_the_prompt_logprobs():
    from minivllm.engine.request_stream import _merge_deltas
    from minivllm.outputs import CompletionOutput, RequestOutput

    lp = [{t: Logprob(-float(t), 1, str(t))} for t in range(4)]
    prompt = [None, {7: Logprob(-0.5, 1, "7")}]
    outs = [RequestOutput("r", "p", [6, 7], [CompletionOutput(0, "a", [0, 1], logprobs=lp[:2])], False,
                          prompt_logprobs=prompt),
            RequestOutput("r", "p", [6, 7], [CompletionOutput(0, "b", [2, 3], "length", logprobs=lp[2:])], True)]
    merged = _merge_deltas(outs)
    assert merged.outputs[0].logprobs == lp and merged.outputs[0].token_ids == [0, 1, 2, 3]
    assert merged.prompt_logprobs == prompt and merged.finished


def test_a_long_prompts_logprobs_are_scored_a_chunk_at_a_time_and_match_hf(hf_model, tokenizer, monkeypatch):
    """Issue 49 item 5: prompt_logprobs on a long prompt took several (prompt, vocab) copies of memory at once (an
    8,000-token prompt: 2.4 -> 9 GB). Scored SCORE_CHUNK_ROWS rows at a time, even when the whole prompt is one
    step (long_prefill_token_threshold=0), no log_softmax sees more rows, and the values are still HF's."""
    from minivllm.worker import logprobs
    llm = LLM(device="cpu", dtype="float32", num_kv_blocks=128, long_prefill_token_threshold=0)
    text = " ".join(PROMPTS)
    prompt_ids = tokenizer.encode(text * (3 * logprobs.SCORE_CHUNK_ROWS // len(tokenizer.encode(text)) + 1))
    rows, real = [], torch.Tensor.log_softmax
    monkeypatch.setattr(torch.Tensor, "log_softmax", lambda self, *a, **k: rows.append(self.shape[0]) or real(
        self, *a, **k))
    with llm.llm_engine.record_traces() as traces:
        out = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(max_tokens=1, prompt_logprobs=3),
                           use_tqdm=False)[0]
    monkeypatch.undo()
    assert traces[0].num_prefill_tokens == len(prompt_ids)                   # the whole prompt in one step
    assert max(rows) == logprobs.SCORE_CHUNK_ROWS and len(rows) >= 4          # and it was scored in chunks
    assert_matches_hf(hf_model, prompt_ids, out.prompt_logprobs, 3)
