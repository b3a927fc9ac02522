"""Prefill/decode disaggregation through both KV connectors (minivllm/kv_transfer/): a producer instance computes
the prompts (max_tokens 1, as vLLM's disaggregation proxy asks it), a consumer instance loads their KV and streams
the tokens. The oracle is Hugging Face's greedy output; the proof that the transfer fired is the consumer's own
prefill counter, which stays at the one token per request it must compute to sample (the last prompt token)."""

from __future__ import annotations

import socket
import struct

import pytest
import torch

from minivllm import LLM, SamplingParams
from minivllm.config import EngineConfig, KVTransferConfig
from minivllm.kv_transfer import block_keys, decode_block, encode_block
from tests.oracle import PROMPTS, hf_greedy

NUM_TOKENS = 8
ENGINE = dict(dtype="float32", device="cpu", num_kv_blocks=96)


def _greedy(n=NUM_TOKENS):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(hf_model, tokenizer):
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    return ids, [hf_greedy(hf_model, p, NUM_TOKENS) for p in ids]


def _storage(path, role):
    return {"kv_connector": "SharedStorageConnector", "kv_role": role,
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kv")


@pytest.fixture(scope="module")
def file_pair(model_dir, shared_dir):
    producer = LLM(str(model_dir), kv_transfer_config=_storage(shared_dir, "kv_producer"), **ENGINE)
    consumer = LLM(str(model_dir), kv_transfer_config=_storage(shared_dir, "kv_consumer"), **ENGINE)
    yield producer, consumer
    producer.llm_engine.shutdown()
    consumer.llm_engine.shutdown()


@pytest.fixture(scope="module")
def tcp_pair(model_dir):
    consumer = LLM(str(model_dir), kv_transfer_config={"kv_connector": "TCPConnector", "kv_role": "kv_consumer",
                                                       "kv_port": 0}, **ENGINE)
    port = consumer.llm_engine.scheduler.connector.store.port
    producer = LLM(str(model_dir), kv_transfer_config={"kv_connector": "TCPConnector", "kv_role": "kv_producer",
                                                       "kv_port": port}, **ENGINE)
    yield producer, consumer
    producer.llm_engine.shutdown()
    consumer.llm_engine.shutdown()


def _decode(consumer, ids):
    """Run the prompts on the consumer from a cold local cache; (tokens, prompt tokens it computed, loaded)."""
    engine = consumer.llm_engine
    engine.reset_prefix_cache()
    computed, loaded = engine.num_prompt_tokens_computed, engine.scheduler.connector.num_loaded_tokens
    outs = consumer.generate([{"prompt_token_ids": p} for p in ids], _greedy(), use_tqdm=False)
    engine.check_integrity()
    assert engine.get_stats().num_free_blocks == engine.get_stats().num_kv_blocks, "a block leaked"
    return ([list(o.outputs[0].token_ids) for o in outs], engine.num_prompt_tokens_computed - computed,
            engine.scheduler.connector.num_loaded_tokens - loaded)


@pytest.mark.slow
@pytest.mark.parametrize("pair", ["file_pair", "tcp_pair"])
def test_the_consumer_streams_the_hf_tokens_computing_one_prompt_token_per_request(pair, request, expected):
    producer, consumer = request.getfixturevalue(pair)
    ids, want = expected
    producer.generate([{"prompt_token_ids": p} for p in ids], SamplingParams(temperature=0, max_tokens=1),
                      use_tqdm=False)
    assert producer.llm_engine.scheduler.connector.num_saved_blocks > 0
    got, computed, loaded = _decode(consumer, ids)
    assert got == want
    assert computed == len(ids)                               # the last prompt token of each request, nothing more
    assert loaded == sum(len(p) - 1 for p in ids)


@pytest.mark.slow
def test_a_corrupt_or_missing_block_is_computed_instead(file_pair, shared_dir, expected):
    producer, consumer = file_pair
    ids, want = expected
    long = ids[-1]                                            # 33 tokens: blocks 0 and 1 move, 1 token not
    producer.generate([{"prompt_token_ids": long}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    tag = consumer.llm_engine.scheduler.connector.tag
    keys = [k for k, _ in block_keys(long[:-1], 16, tag)]
    files = {k: next(shared_dir.rglob(f"{k}.kv")) for k in keys}
    data = bytearray(files[keys[1]].read_bytes())
    data[-5] ^= 0xFF                                          # one flipped byte in block 1's V
    files[keys[1]].write_bytes(bytes(data))
    (shared_dir / keys[1][:2] / f".{keys[1][:12]}.x.tmp").write_bytes(b"half a block")   # a killed writer's leftover
    got, computed, loaded = _decode(consumer, [long])
    assert got == [want[-1]] and loaded == 16 and computed == len(long) - 16
    files[keys[0]].unlink()                                   # lost: nothing can be loaded before it either
    got, computed, loaded = _decode(consumer, [long])
    assert got == [want[-1]] and loaded == 0 and computed == len(long)


def _frame_to(port, payload: bytes, length: int | None = None) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(struct.pack(">Q", len(payload) if length is None else length) + payload)
        if length is not None:
            return b""                                        # closed mid-frame
        return s.recv(1)


@pytest.mark.slow
def test_a_broken_or_corrupt_transfer_stores_nothing_and_the_consumer_recomputes(tcp_pair, expected):
    _, consumer = tcp_pair
    ids, want = expected
    connector = consumer.llm_engine.scheduler.connector
    store = connector.store
    prompt = ids[3]                                           # 16 tokens: 15 move, in one partial block
    (key, n), = block_keys(prompt[:-1], 16, connector.tag)
    frame = encode_block(key, n, torch.ones(connector.block_shape))
    with store.lock:
        store.frames.pop(key, None)                           # what an earlier test's producer sent
    before, refused = dict(store.frames), store.num_refused
    _frame_to(store.port, frame[:len(frame) // 2], length=len(frame))    # the sender dies mid-frame
    bad = bytearray(frame)
    bad[-1] ^= 1
    assert _frame_to(store.port, bytes(bad)) == b"\x00"
    assert store.frames == before and store.num_refused == refused + 1
    got, computed, loaded = _decode(consumer, [prompt])
    assert got == [want[3]] and loaded == 0 and computed == len(prompt)


@pytest.mark.slow
def test_a_producer_that_cannot_reach_its_consumer_still_answers(model_dir, expected):
    with socket.socket() as s:                                # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    producer = LLM(str(model_dir), kv_transfer_config={"kv_connector": "TCPConnector", "kv_role": "kv_producer",
                                                       "kv_port": port}, **ENGINE)
    try:
        ids, want = expected
        out = producer.generate([{"prompt_token_ids": ids[0]}], _greedy(), use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == want[0]
        assert producer.llm_engine.scheduler.connector.store.num_failed >= 1
    finally:
        producer.llm_engine.shutdown()


@pytest.mark.slow
def test_a_failed_step_on_the_consumer_moves_nothing_and_the_retry_loads(file_pair, expected, monkeypatch):
    producer, consumer = file_pair
    ids, want = expected
    producer.generate([{"prompt_token_ids": ids[2]}], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    engine = consumer.llm_engine
    engine.reset_prefix_cache()
    runner = engine.model_runner
    forward = runner.forward
    calls = []

    def failing_forward(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected failure after the KV was loaded")
        return forward(*args)
    monkeypatch.setattr(runner, "forward", failing_forward)
    engine.add_request({"prompt_token_ids": ids[2]}, _greedy(), request_id="pd-fail")
    loaded = engine.scheduler.connector.num_loaded_tokens
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert engine.scheduler.connector.num_loaded_tokens == loaded       # journaled with the core
    engine.check_integrity()
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = list(out.outputs[0].token_ids)
    assert tokens == want[2]
    assert engine.scheduler.connector.num_loaded_tokens == loaded + len(ids[2]) - 1


def test_block_keys_chain_the_tokens_and_the_model():
    a = block_keys(list(range(40)), 16, "m")
    assert [n for _, n in a] == [16, 16, 8]
    assert block_keys(list(range(33)), 16, "m")[:2] == a[:2]            # a block's key depends on what precedes
    assert block_keys([99] + list(range(1, 40)), 16, "m")[1][0] != a[1][0]
    assert block_keys(list(range(40)), 16, "other model")[0][0] != a[0][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_block_frame_round_trips_and_refuses_another_key_shape_or_dtype(dtype):
    block = torch.randn(2, 3, 4, 2, 8).to(dtype)
    frame = encode_block("k", 3, block)
    assert torch.equal(decode_block(frame, "k", block.shape, dtype).view(torch.uint8), block.view(torch.uint8))
    assert decode_block(frame, "other", block.shape, dtype) is None
    assert decode_block(frame, "k", (2, 3, 4, 2, 4), dtype) is None
    assert decode_block(frame[:-1], "k", block.shape, dtype) is None


@pytest.mark.parametrize("config, message", [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_both"}, "kv_connector is 'NixlConnector'; choose one of"),
    ({"kv_connector": "TCPConnector", "kv_role": "kv_both"}, "TCPConnector takes kv_producer, kv_consumer"),
    ({"kv_connector": "SharedStorageConnector", "kv_role": "kv_both"}, "needs kv_connector_extra_config"),
    ({"kv_connector": "TCPConnector", "kv_role": "kv_consumer", "kv_port": 70000}, "kv_port is 70000"),
    ({"kv_connector": "TCPConnector", "kv_role": "kv_consumer", "port": 1}, r"unknown key\(s\) \['port'\]"),
])
def test_a_wrong_kv_transfer_config_is_refused_naming_the_value(config, message):
    with pytest.raises(ValueError, match=message):
        KVTransferConfig.from_dict(config)
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(kv_transfer_config=config)


def test_kv_transfer_with_more_than_one_rank_is_refused():
    with pytest.raises(ValueError, match="tensor_parallel_size or pipeline_parallel_size > 1 is not implemented"):
        EngineConfig.from_kwargs(tensor_parallel_size=2, kv_transfer_config={
            "kv_connector": "TCPConnector", "kv_role": "kv_consumer"})


@pytest.mark.slow
def test_async_scheduling_and_chunked_prefill_save_and_load_the_same_blocks(model_dir, tmp_path, expected):
    """The connector's hooks under the batch queue (AsyncScheduler): a producer that prefills in chunks of 8 saves
    each block in the step that completes it; an async consumer loads them all."""
    ids, want = expected
    engines = []
    try:
        for role, extra in (("kv_producer", {"long_prefill_token_threshold": 8}), ("kv_consumer", {})):
            engines.append(LLM(str(model_dir), async_scheduling=True, kv_transfer_config=_storage(tmp_path, role),
                               **ENGINE, **extra))
        producer, consumer = engines
        assert producer.llm_engine.async_scheduling and consumer.llm_engine.async_scheduling
        out = producer.generate([{"prompt_token_ids": p} for p in ids], _greedy(), use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in out] == want
        got, computed, loaded = _decode(consumer, ids)
        assert got == want and computed == len(ids) and loaded == sum(len(p) - 1 for p in ids)
    finally:
        for engine in engines:
            engine.llm_engine.shutdown()
