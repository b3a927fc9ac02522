"""cache_salt (vLLM's field): prompts with different salts never share prefix-cache blocks, equal salts do, and
the answer is the same either way. The salt enters block 0's key (Request.block_key), so through the hash chain
every later block's too. Offline as {"prompt": ..., "cache_salt": ...}, and in the server's request bodies."""

from __future__ import annotations

import pytest
import torch

from minivllm import SamplingParams
from minivllm.core.journal import StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request

PROMPT = "A long shared context for the prefix cache. " * 8


def cached_request(kv: KVCacheManager, tokens: list[int], salt: str | None) -> Request:
    """A request whose whole prompt is computed and hashed into the prefix cache."""
    req = Request("cached", tokens, SamplingParams(), cache_salt=salt)
    req.journal = kv.journal
    assert kv.allocate_slots(req, len(tokens))
    req.num_computed_tokens = len(tokens)
    kv.cache_blocks(req, len(tokens))
    return req


@pytest.mark.parametrize("first, second, hits", [("a", "a", 3), ("a", "b", 0), (None, "a", 0), ("a", None, 0),
                                                 (None, None, 3)])
def test_only_equal_salts_share_blocks(first, second, hits):
    kv = KVCacheManager(16, 4, StepJournal())
    tokens = list(range(100, 113))                           # 3 full blocks and one token
    cached_request(kv, tokens, first)
    assert len(kv.get_computed_blocks(Request("new", tokens, SamplingParams(), cache_salt=second))) == hits


@pytest.mark.slow
def test_salted_prompts_share_only_within_their_salt_and_answer_the_same(llm):
    engine = llm.llm_engine
    engine.reset_prefix_cache()
    greedy = SamplingParams(temperature=0, max_tokens=6)

    def run(salt):
        prompt = {"prompt": PROMPT} if salt is None else {"prompt": PROMPT, "cache_salt": salt}
        return llm.generate(prompt, greedy, use_tqdm=False)[0]
    first, same, other, plain = run("tenant-a"), run("tenant-a"), run("tenant-b"), run(None)
    assert first.num_cached_tokens == 0
    assert same.num_cached_tokens == (len(same.prompt_token_ids) - 1) // engine.config.block_size * engine.config.block_size
    assert other.num_cached_tokens == 0 and plain.num_cached_tokens == 0
    assert first.outputs[0].token_ids == same.outputs[0].token_ids == other.outputs[0].token_ids \
        == plain.outputs[0].token_ids
    for bad in ("", 7):
        with pytest.raises(ValueError, match="cache_salt is"):
            llm.generate({"prompt": PROMPT, "cache_salt": bad}, greedy, use_tqdm=False)
    assert not engine.has_unfinished_requests()
