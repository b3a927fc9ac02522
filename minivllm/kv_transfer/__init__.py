"""KV transfer between engine instances: the connector API (base.py) and two connectors, files on one machine
(shared_storage_connector.py) and TCP (tcp_connector.py). vLLM keeps these under `vllm/distributed/kv_transfer/`."""

from __future__ import annotations

import hashlib
from pathlib import Path

from minivllm.kv_transfer.base import (BlockLoad, BlockSave, KVConnectorBase_V1, KVConnectorMetadata,
                                       KVConnectorRole, block_keys, decode_block, encode_block)
from minivllm.kv_transfer.shared_storage_connector import SharedStorageConnector
from minivllm.kv_transfer.tcp_connector import TCPConnector

CONNECTORS = {"SharedStorageConnector": SharedStorageConnector, "TCPConnector": TCPConnector}

__all__ = ["BlockLoad", "BlockSave", "CONNECTORS", "KVConnectorBase_V1", "KVConnectorMetadata", "KVConnectorRole",
           "block_keys", "decode_block", "encode_block", "make_kv_connectors", "model_tag"]


def model_tag(model_path, runner) -> str:
    """What must match for a block to be reusable: the checkpoint (its config and weight files' names and sizes)
    and the cache layout (dtype, block size, layers, KV heads, head size)."""
    path = Path(model_path)
    h = hashlib.sha256((path / "config.json").read_bytes())
    for f in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.gguf")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    shape = tuple(runner.kv_cache.shape)           # (2, layers, blocks, block_size, kv_heads, head_dim)
    return f"{h.hexdigest()[:16]}|{runner.kv_cache_dtype}|{shape[1]}x{shape[3]}x{shape[4]}x{shape[5]}"


def make_kv_connectors(transfer, model_path, runner, journal) -> tuple[KVConnectorBase_V1, KVConnectorBase_V1]:
    """The scheduler side and the worker side of the connector `transfer` (a KVTransferConfig) names, sharing one
    store, for a single-rank engine whose runner has allocated its KV cache; the scheduler side's counters go in
    the core's `journal`."""
    cls = CONNECTORS[transfer.kv_connector]
    store = cls.make_store(transfer, True)
    shape = tuple(runner.kv_cache.shape)
    block_shape = (2, shape[1]) + shape[3:]
    tag = model_tag(model_path, runner)
    scheduler_side, worker_side = (cls(role, transfer.kv_role, store, runner.block_size, tag, block_shape,
                                       runner.kv_cache_dtype)
                                   for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER))
    scheduler_side.journal = journal
    return scheduler_side, worker_side
