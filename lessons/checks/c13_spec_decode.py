"""Lesson 13's checks: `ngram_propose` on hand-made token lists with known answers, against minivllm's own
NgramProposer on random lists, and inside a real engine with n-gram speculation: its proposer replaced by
yours, the greedy output must not change and the drafts proposed and accepted must be the same."""

import random

from course import ExerciseFailed, a_kind, expect_equal

_ENGINE = {}
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}


def _case(fn, tokens, k, min_n, max_n, expected, what):
    actual = fn(list(tokens), k, min_n, max_n)
    if not isinstance(actual, (list, tuple)):
        raise ExerciseFailed(f"expected a list of token ids, got {a_kind(actual)}: {what}")
    expect_equal([int(t) for t in actual], expected,
                 f"{what} (tokens {tokens}, k={k}, n from {max_n} down to {min_n}): the drafts")


PASSAGE = ("The quick brown fox jumps over the lazy dog, and the lazy dog sleeps in the warm sun all "
           "afternoon.")


def _engine():
    """The engine with n-gram speculation, its two chat prompts, and its greedy outputs and speculation counters
    with its own proposer (greedy: the same every run)."""
    if not _ENGINE:
        from minivllm import LLM, SamplingParams
        llm = LLM(num_kv_blocks=64, max_num_seqs=4, seed=0, speculative_config=SPEC)
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": ask}], tokenize=False,
                                                 add_generation_prompt=True)
                   for ask in ("Copy this text word for word: " + PASSAGE, "Count from one to twenty in words.")]
        params = SamplingParams(temperature=0, max_tokens=40)
        expected, counts = _run(llm, prompts, params)
        _ENGINE.update(llm=llm, prompts=prompts, params=params, expected=expected, counts=counts)
    return _ENGINE


def _run(llm, prompts, params):
    """Greedy outputs and the engine's speculation counters for this run alone."""
    engine = llm.llm_engine
    engine.reset_prefix_cache()
    before = engine.get_stats()
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    after = engine.get_stats()
    return outs, (after.num_spec_draft_tokens - before.num_spec_draft_tokens,
                  after.num_spec_accepted_tokens - before.num_spec_accepted_tokens)


def check_ngram_propose(fn):
    _case(fn, [1, 2, 3, 4, 5], 3, 1, 3, [], "no earlier occurrence of any suffix")
    _case(fn, [7, 8, 9, 7, 8], 3, 2, 2, [9, 7, 8], "the last 2 tokens [7, 8] occurred at the start")
    _case(fn, [7, 8, 1, 7, 8, 2, 7, 8], 2, 2, 2, [2, 7], "[7, 8] occurs twice before: the latest occurrence wins")
    _case(fn, [5, 6, 7, 9, 9, 6, 7, 1, 5, 6, 7], 2, 2, 3, [9, 9],
          "[5, 6, 7] (n=3) matches at the start, [6, 7] (n=2) later too: the longest n wins")
    _case(fn, [5, 6, 7, 9, 8, 6, 7, 1, 9, 6, 7], 2, 2, 3, [1, 9],
          "no 3-token match, so n=2: [6, 7] occurs at 1 and 5, the latest is followed by [1, 9]")
    yield "the latest occurrence of the longest matching suffix, n from max_n down to min_n"
    _case(fn, [4, 4, 4], 3, 1, 2, [4], "[4, 4, 4]: [4, 4] occurs at 0, overlapping the suffix; 1 token follows")
    _case(fn, [3, 1, 2, 3, 1], 5, 2, 2, [2, 3, 1], "the match is near the end: fewer than k tokens follow")
    _case(fn, [9, 9], 2, 2, 4, [], "too few tokens for n=2 plus an earlier occurrence")
    _case(fn, [1, 2, 1, 2], 0, 1, 2, [], "k=0")
    yield "overlapping matches, fewer than k tokens, too short a list, k=0"
    from minivllm.spec_decode.ngram_proposer import NgramProposer
    rng = random.Random(0)
    for i in range(300):
        tokens = [rng.randrange(rng.choice([2, 3, 5, 20])) for _ in range(rng.randrange(0, 40))]
        min_n = rng.randrange(1, 4)
        max_n = rng.randrange(min_n, 6)
        k = rng.randrange(0, 6)
        expected = NgramProposer(k, min_n, max_n).propose(tokens)
        _case(fn, tokens, k, min_n, max_n, expected, f"random case {i}: as minivllm's NgramProposer")
    yield "300 random token lists propose what minivllm's NgramProposer proposes"

    e = _engine()
    llm, prompts, params, expected, counts = e["llm"], e["prompts"], e["params"], e["expected"], e["counts"]
    proposer = llm.llm_engine.model_runner.proposer
    real, calls = proposer.propose, []

    def yours(token_ids, max_tokens=None):
        k = proposer.k if max_tokens is None else min(proposer.k, max_tokens)
        calls.append(k)
        return [int(t) for t in fn(list(token_ids), k, proposer.min_n, proposer.max_n)]

    proposer.propose = yours
    try:
        actual, your_counts = _run(llm, prompts, params)
    except ExerciseFailed:
        raise
    except Exception as exc:
        _ENGINE.clear()                                       # a step failed midway: the next run builds anew
        raise ExerciseFailed(f"inside the engine, a step failed with your proposer: {type(exc).__name__}: "
                             f"{exc}") from None
    finally:
        proposer.propose = real
    if not calls:
        raise ExerciseFailed("the engine never called the proposer (a bug of the check, not yours)")
    for prompt, a, want in zip(prompts, actual, expected):
        expect_equal(a, want, f"the engine's greedy output for prompt {prompts.index(prompt)} with your proposer")
    expect_equal(your_counts, counts, "the engine's (draft tokens verified, drafts accepted) with your proposer")
    yield (f"inside the engine: {len(calls)} proposals, {your_counts[0]} drafts verified, {your_counts[1]} "
           f"accepted, the same greedy output")
