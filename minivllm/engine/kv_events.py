"""KV cache events: the prefix cache's changes, published for a router to follow (vLLM's `kv_events.py`).

Owns: `kv_events_config` (vLLM's JSON: {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint":
"tcp://*:5557", "topic": ""}) and the ZMQ publisher. The block pool records each change as it happens
(core/block_pool.py, `BlockEvents.kv_cache`); a rolled-back step's records are dropped with it, so only committed
steps publish. The publisher is a step-trace listener: after every step that changed the cache it sends one batch,
in vLLM's wire format, so vLLM's own subscriber (examples/online_serving/kv_events_subscriber.py) reads it:

    ZMQ PUB multipart:  [topic, sequence number (8 bytes, big-endian), msgpack payload]
    payload:            [timestamp, [event, ...]]                          (vLLM's EventBatch, array-like)
    events:             ["BlockStored", [hash], parent hash | None, token ids, block_size, None, "GPU"]
                        ["BlockRemoved", [hash], "GPU"]
                        ["AllBlocksCleared"]

A hash enters the stream when a full, computed block first caches its prefix and leaves it when no block caches
it any more (evicted, distrusted after a failed step, or forgotten by reset_prefix_cache). Hashes are minivllm's
own (Python's hash of (parent hash, block key)): stable across processes, comparable within one deployment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

DEFAULT_ENDPOINT = "tcp://*:5557"        # vLLM's default


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = DEFAULT_ENDPOINT
    topic: str = ""

    @classmethod
    def from_dict(cls, d) -> "KVEventsConfig":
        if not isinstance(d, dict):
            raise ValueError(f"kv_events_config is {d!r}; it must be a dict (vLLM's JSON), e.g. "
                             '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}.')
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"kv_events_config has unknown key(s) {unknown}; known ones are "
                             f"{sorted(cls.__dataclass_fields__)}.")
        cfg = cls(**d)
        if not isinstance(cfg.enable_kv_cache_events, bool):
            raise ValueError(f"kv_events_config enable_kv_cache_events is {cfg.enable_kv_cache_events!r}; "
                             "it must be true or false.")
        if cfg.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config publisher is {cfg.publisher!r}; choose 'zmq' or 'null'.")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(cfg, name), str):
                raise ValueError(f"kv_events_config {name} is {getattr(cfg, name)!r}; it must be a string.")
        return cfg


def encode_events(events: tuple[tuple, ...], block_size: int) -> list:
    """BlockEvents.kv_cache records as vLLM's tagged, array-like events."""
    out = []
    for e in events:
        if e[0] == "BlockStored":
            _, block_hash, parent, token_ids = e
            out.append(["BlockStored", [block_hash], parent, list(token_ids), block_size, None, "GPU"])
        elif e[0] == "BlockRemoved":
            out.append(["BlockRemoved", [e[1]], "GPU"])
        else:
            out.append(["AllBlocksCleared"])
    return out


class ZmqEventPublisher:
    """A step-trace listener (LLMEngine.add_trace_listener) that sends each step's KV cache events as one batch."""

    def __init__(self, endpoint: str, topic: str, block_size: int):
        import msgpack
        import zmq

        self._packb = msgpack.packb
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)      # the bound port, for tcp://*:0
        self.topic, self.block_size = topic.encode(), block_size
        self.seq = 0

    def __call__(self, trace) -> None:
        if trace.kv_cache_events:
            payload = self._packb([time.time(), encode_events(trace.kv_cache_events, self.block_size)])
            self._socket.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
            self.seq += 1

    def close(self) -> None:
        self._socket.close()


def make_kv_event_publisher(kv_events_config: dict | None, block_size: int) -> ZmqEventPublisher | None:
    """The publisher kv_events_config asks for, or None (events off, or the null publisher)."""
    if kv_events_config is None:
        return None
    cfg = KVEventsConfig.from_dict(kv_events_config)
    if not cfg.enable_kv_cache_events or cfg.publisher == "null":
        return None
    return ZmqEventPublisher(cfg.endpoint, cfg.topic, block_size)
