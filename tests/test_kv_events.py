"""KV cache events (vLLM's BlockStored, BlockRemoved, AllBlocksCleared), published over ZMQ in vLLM's wire format
and read here with vLLM's own subscriber types (msgspec Structs as in vLLM's examples/online_serving/
kv_events_subscriber.py): the oracle for the format. The oracle for the content is the block pool itself: after
every step, the hashes the stream says are stored are exactly the prefix cache's hash map."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import zmq

from minivllm import LLM, SamplingParams
from minivllm.core.journal import StepJournal
from minivllm.core.kv_cache_manager import KVCacheManager
from minivllm.core.request import Request
from minivllm.engine.kv_events import KVEventsConfig, encode_events


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """vLLM's base class of KV cache events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def apply(stored: dict[int, list[int]], batch: KVEventBatch) -> None:
    for e in batch.events:
        if isinstance(e, BlockStored):
            stored[e.block_hashes[0]] = e.token_ids
        elif isinstance(e, BlockRemoved):
            for h in e.block_hashes:
                del stored[h]
        else:
            stored.clear()


def test_the_pool_records_stored_removed_and_cleared_in_order():
    kv = KVCacheManager(4, 4, StepJournal())
    req = Request("a", list(range(1, 10)), SamplingParams())
    req.journal = kv.journal
    assert kv.allocate_slots(req, 9)
    req.num_computed_tokens = 9
    kv.cache_blocks(req, 9)
    events = kv.block_pool.pop_events().kv_cache
    (_, h0, p0, t0), (_, h1, p1, t1) = events
    assert (p0, t0, p1, t1) == (None, (1, 2, 3, 4), h0, (5, 6, 7, 8))
    assert encode_events(tuple(events), 4)[1] == ["BlockStored", [h1], h0, [5, 6, 7, 8], 4, None, "GPU"]
    kv.free(req)
    kv.reset_prefix_cache()
    events = kv.block_pool.pop_events().kv_cache          # removed in LRU order (the last block was freed first)
    assert sorted(events[:2]) == sorted([("BlockRemoved", h0), ("BlockRemoved", h1)])
    assert events[2:] == [("AllBlocksCleared",)]


def test_bad_config_is_refused_by_name():
    for bad, words in [([], "must be a dict"), ({"publisher": "kafka"}, "publisher is 'kafka'"),
                       ({"endpoint": 5}, "endpoint is 5"), ({"topics": "x"}, "unknown key")]:
        with pytest.raises(ValueError, match=words):
            KVEventsConfig.from_dict(bad)


@pytest.mark.slow
def test_a_subscriber_following_the_stream_knows_the_prefix_cache(model_dir):
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*", "topic": "kv"}
    llm = LLM(str(model_dir), num_kv_blocks=6, block_size=16, kv_events_config=config)
    engine = llm.llm_engine
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.RCVTIMEO, 5000)
    sub.connect(engine.kv_event_publisher.endpoint)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    import time
    time.sleep(0.3)                                   # let the subscription reach the publisher (ZMQ slow joiner)
    stored: dict[int, list[int]] = {}
    seqs = []
    prompts = ["A shared system prompt that is long enough for several blocks of sixteen tokens. " * 2 + q
               for q in ("Question one?", "Question two?", "Another question entirely, three?")]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for prompt in prompts + [p + " Again." for p in prompts]:     # a 6-block pool: blocks are evicted
        engine.add_request(prompt, params)
        while engine.has_unfinished_requests():
            engine.step()
            while len(seqs) < engine.kv_event_publisher.seq:          # every batch sent so far
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv"
                seqs.append(int.from_bytes(seq, "big"))
                apply(stored, DECODER.decode(payload))
            assert set(stored) == set(engine.kv_cache_manager.block_pool.hash_to_block)   # the same cache
    pool = engine.kv_cache_manager.block_pool
    assert seqs == list(range(len(seqs))) and pool.num_evictions > 0        # in order; evictions were published
    for h, tokens in stored.items():
        assert tuple(tokens) == pool.blocks[pool.hash_to_block[h]].token_ids
    engine.reset_prefix_cache()
    engine.add_request("x", SamplingParams(max_tokens=1))     # the next step carries the reset's events
    while engine.has_unfinished_requests():
        engine.step()
    batches = []
    while sub.poll(1000):
        batches.append(DECODER.decode(sub.recv_multipart()[2]))
    assert any(isinstance(e, AllBlocksCleared) for b in batches for e in b.events)
    llm.shutdown()
    sub.close()
