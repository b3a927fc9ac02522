"""Lesson 14's checks: `get_num_new_matched_tokens` on hand-made prompts and stores with known answers, against
minivllm's connector (KVConnectorBase_V1.get_num_new_matched_tokens) on random ones, and inside a real engine: a
kv_both instance whose scheduler-side connector asks your function instead, with a cold and a warm local prefix
cache and with a corrupt block in the store. The greedy output, the prompt tokens computed and the tokens loaded
must be those of the real connector."""

import atexit
import logging
import random
import shutil
import tempfile
from pathlib import Path

import torch

from course import ExerciseFailed, expect_equal

_ENGINE = {}
BS = 4                                               # the hand-made cases' block size
TAG = "lesson-14"


def _keys(tokens, block_size=BS, tag=TAG):
    from minivllm.kv_transfer import block_keys
    return [k for k, _ in block_keys(list(tokens), block_size, tag)]


def _case(fn, prompt, num_computed, stored, expected, what, block_size=BS, tag=TAG):
    """`stored`: the keys the store holds."""
    stored = set(stored)
    actual = fn(list(prompt), num_computed, block_size, tag, lambda key: key in stored)
    if not isinstance(actual, int) or isinstance(actual, bool):
        raise ExerciseFailed(f"{what}: expected a number of tokens (an int), got {actual!r}")
    expect_equal(actual, expected, f"{what} (a prompt of {len(prompt)} tokens, block_size {block_size}, "
                                   f"num_computed_tokens={num_computed}): the tokens to load")


def _real(prompt, num_computed, block_size, tag, stored):
    """What minivllm's own connector answers, over an in-memory store holding `stored` (tiny blocks)."""
    from minivllm.core.request import Request
    from minivllm.core.sampling_params import SamplingParams
    from minivllm.kv_transfer import KVConnectorBase_V1, KVConnectorRole, block_keys, encode_block
    from minivllm.kv_transfer.base import BlockStore

    frames = {key: encode_block(key, n, torch.zeros(1, dtype=torch.uint8))
              for key, n in block_keys(list(prompt[:-1]), block_size, tag) if key in stored}

    class Store(BlockStore):
        def contains(self, key):
            return key in frames

        def get(self, key):
            return frames.get(key)

    connector = KVConnectorBase_V1(KVConnectorRole.SCHEDULER, "kv_consumer", Store(), block_size, tag, (1,),
                                   torch.uint8)
    return connector.get_num_new_matched_tokens(Request("r", list(prompt), SamplingParams()), num_computed)


def check_get_num_new_matched_tokens(fn):
    p11 = list(range(100, 111))                      # 11 tokens: [0, 10) moves, blocks of 4, 4 and 2 tokens
    k11 = _keys(p11[:-1])
    p9 = list(range(200, 209))                       # 9 tokens: [0, 8) moves, two whole blocks
    k9 = _keys(p9[:-1])
    _case(fn, p11, 0, k11, 10, "all three blocks of tokens [0, P-1) are in the store, the last one partial")
    _case(fn, p9, 0, k9, 8, "both whole blocks of tokens [0, P-1) are in the store (P-1 = 8)")
    _case(fn, p11, 0, [], 0, "the store is empty")
    _case(fn, [7], 0, [], 0, "a prompt of one token: nothing before its last token moves")
    yield "the leading blocks of the prompt's tokens [0, P-1), the last one possibly partial"
    _case(fn, p11, 4, k11, 6, "block 0 is already computed here (prefix cache): only blocks 1 and 2 are new")
    _case(fn, p11, 8, k11, 2, "blocks 0 and 1 are already computed here: only the partial block 2 is new")
    _case(fn, p9, 8, k9, 0, "every block before the last token is already computed here")
    _case(fn, p11, 4, k11[1:], 6, "block 0 is computed here but not in the store; blocks 1 and 2 are")
    yield "only the tokens past num_computed_tokens, counted from the first block not computed here"
    _case(fn, p11, 0, [k11[0], k11[2]], 4, "block 1 is missing: block 2 after it cannot be used")
    _case(fn, p11, 0, k11[1:], 0, "block 0 is missing: nothing after it can be used")
    other = p11[:4] + [1, 2, 3, 4, 5, 6, 7]          # the same first block, then other tokens
    _case(fn, p11, 0, _keys(other[:-1]), 4, "the store holds another prompt that shares only block 0")
    _case(fn, p11, 0, _keys(p11[:-1], tag="another model"), 0, "the store holds this prompt's blocks of another "
          "model (another tag)")
    yield "a miss ends the count: keys are a chain, and another prompt's or model's blocks never match"
    rng = random.Random(0)
    for i in range(200):
        block_size = rng.choice([2, 3, 4, 16])
        prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
        keys = _keys(prompt[:-1], block_size)
        stored = {k for k in keys if rng.random() < 0.8}
        num_computed = block_size * rng.randrange(0, (len(prompt) - 1) // block_size + 1)
        _case(fn, prompt, num_computed, stored, _real(prompt, num_computed, block_size, TAG, stored),
              f"random case {i}: as minivllm's connector", block_size)
    yield "200 random prompts and stores: the number minivllm's connector returns"
    runs = _engine_runs(fn)
    yield (f"inside the engine: {runs} runs (cold and warm prefix cache, a corrupt block) with the same greedy "
           f"output, prompt tokens computed and tokens loaded as the real connector")


def _engine():
    if not _ENGINE:
        from minivllm import LLM
        path = tempfile.mkdtemp(prefix="minivllm-lesson12-")
        atexit.register(shutil.rmtree, path, ignore_errors=True)
        _ENGINE["path"] = Path(path)
        _ENGINE["llm"] = LLM(num_kv_blocks=32, max_num_seqs=4, seed=0, kv_transfer_config={
            "kv_connector": "SharedStorageConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": path}})
    return _ENGINE["llm"], _ENGINE["path"]


def _generate(llm, prompts, max_tokens):
    """(greedy token ids of each prompt, prompt tokens the engine computed, tokens its connector loaded)."""
    from minivllm import SamplingParams
    engine = llm.llm_engine
    computed, loaded = engine.num_prompt_tokens_computed, engine.scheduler.connector.num_loaded_tokens
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return ([list(o.outputs[0].token_ids) for o in outs], engine.num_prompt_tokens_computed - computed,
            engine.scheduler.connector.num_loaded_tokens - loaded)


def _with_yours(connector, fn, run):
    """Run `run()` with the scheduler side asking `fn` how many tokens to load; it then stages the blocks that
    cover that many tokens, as the real method does. Raises ExerciseFailed if `fn` promised blocks that are not
    in the store (the engine computes them instead, so nothing wrong is loaded)."""
    from minivllm.kv_transfer import decode_block
    problems, calls = [], []

    def intact(key):
        frame = connector.store.get(key)
        return frame is not None and decode_block(frame, key, connector.block_shape, connector.dtype) is not None

    def yours(req, num_computed_tokens):
        if not connector.is_consumer or req.sampling_params.prompt_logprobs is not None:
            return 0
        prompt = list(req.prompt_token_ids)
        n = fn(prompt, num_computed_tokens, connector.block_size, connector.tag, intact)
        calls.append(n)
        blocks, covered = [], 0
        for key, k in connector._prompt_keys(req)[num_computed_tokens // connector.block_size:]:
            if covered >= n:
                break
            frame = connector.store.get(key)
            block = None if frame is None else decode_block(frame, key, connector.block_shape, connector.dtype)
            if block is None:
                break
            blocks.append(block)
            covered += k
        if covered != n:
            problems.append(f"for a prompt of {len(prompt)} tokens with num_computed_tokens={num_computed_tokens} "
                            f"your function returned {n!r}, but the leading intact blocks in the store hold "
                            f"{covered} tokens there")
            return 0
        if blocks:
            connector._staged[req.request_id] = blocks
        return n

    connector.get_num_new_matched_tokens = yours
    try:
        result = run()
    finally:
        del connector.get_num_new_matched_tokens
    if problems:
        raise ExerciseFailed("inside the engine: " + problems[0])
    if not calls:
        raise ExerciseFailed("the engine never called your function (a bug of the check, not yours)")
    return result


def _engine_runs(fn):
    llm, path = _engine()
    engine = llm.llm_engine
    connector = engine.scheduler.connector
    tokenizer = llm.get_tokenizer()
    text = ("Paged attention keeps the keys and values of every token in fixed-size blocks, so a request "
            "grows one block at a time and no memory is reserved for tokens it may never produce. A prefix "
            "cache then lets a second request with the same system prompt reuse the blocks of the first one, "
            "and a connector lets another instance of the engine reuse them too.")
    ids = tokenizer.encode(text, add_special_tokens=False)
    prompts = [ids[:40], ids[40:72], ids[5:17]]      # [0, P-1): 2 blocks + 7 tokens, 1 + 15, 0 + 11
    warm = [ids[:32] + [tokenizer.encode(" Yes", add_special_tokens=False)[0]]]   # blocks 0 and 1 of prompts[0]

    def fresh(*warm_with):
        engine.reset_prefix_cache()
        for p in warm_with:
            _generate(llm, p, 1)

    fresh(prompts)                                   # the store now holds the prompts' blocks (kv_both saves)
    scenes = [("a cold local cache", ()), ("blocks 0 and 1 of the first prompt in the local prefix cache", (warm,))]
    for what, warm_with in scenes:
        fresh(*warm_with)
        expected = _generate(llm, prompts, 4)
        fresh(*warm_with)
        actual = _with_yours(connector, fn, lambda: _generate(llm, prompts, 4))
        _compare(actual, expected, what)
    key1 = _keys(prompts[0][:-1], connector.block_size, connector.tag)[1]
    block_file = next(path.rglob(f"{key1}.kv"))
    data = bytearray(block_file.read_bytes())
    data[-3] ^= 0xFF                                 # block 1 of the first prompt: one flipped byte
    block_file.write_bytes(bytes(data))
    quiet = logging.getLogger("minivllm.kv_transfer.base")
    level = quiet.level
    quiet.setLevel(logging.ERROR)                    # the connector's warning about the block: expected here
    try:
        fresh()
        expected = _generate(llm, prompts[:1], 4)
        fresh()
        actual = _with_yours(connector, fn, lambda: _generate(llm, prompts[:1], 4))
    finally:
        quiet.setLevel(level)
    _compare(actual, expected, "block 1 of the first prompt corrupt in the store")
    block_file.unlink()                              # the next check run saves it again
    return len(scenes) + 1


def _compare(actual, expected, what):
    (out, computed, loaded), (want, want_computed, want_loaded) = actual, expected
    expect_equal(loaded, want_loaded, f"inside the engine, {what}: prompt tokens loaded from the store")
    expect_equal(computed, want_computed, f"inside the engine, {what}: prompt tokens computed")
    expect_equal(out, want, f"inside the engine, {what}: the greedy output")
