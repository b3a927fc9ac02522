r"""The KV connector API: how KV computed by one engine instance reaches another (vLLM v1's `KVConnectorBase_V1`,
`vllm/distributed/kv_transfer/kv_connector/v1/base.py`).

Prefill/decode disaggregation runs a prompt on a *producer* instance (kv_role "kv_producer"), which saves the prompt's
KV blocks, and streams the tokens from a *consumer* instance ("kv_consumer"), which loads those blocks instead of
computing them. "kv_both" does both: other instances' saved blocks act as a prefix cache shared between instances.
A connector has two sides, in vLLM's shape and names; each instance builds one of each (`make_kv_connectors`):

    scheduler side (core/scheduler.py)                       worker side (worker/model_runner.py)
    get_num_new_matched_tokens(req, n)  tokens loadable      start_load_kv(meta, kv_cache)  copy blocks in
      past the n computed locally (prefix cache hits)        wait_for_layer_load(layer)     (synchronous: no-op)
    update_state_after_alloc(req, n_ext) blocks to load      save_kv_layer(layer, k, v, meta) each layer's blocks
    build_connector_meta(sched) -> KVConnectorMetadata       wait_for_save()                 out to the store
    request_finished(req)                                      (the metadata travels in the step's ModelInput)

What moves: the prompt's tokens [0, P-1) in blocks, the last one possibly partial. The consumer computes token P-1
itself (it needs its logits to sample). Each block is named by a key, a SHA-256 chain over the model's identity and
the tokens of the block and of every block before it, so producer and consumer agree on names without talking, and
a block with other tokens, another model or another layout can never match:

    prompt  [ t0 .. t15 | t16 .. t31 | t32 .. t39 t40 ]        block_size 16, P = 41
    keys      k0          k1 = H(k0, t16..t31)   k2 = H(k1, t32..t39)    (t40: computed by the consumer)

A block travels as one frame (`encode_block`): a SHA-256 digest of the payload, then a JSON header (key, tokens,
dtype, shape) and the bytes of its K and V in every layer. The scheduler side reads and checks every block before it
promises it (`get_num_new_matched_tokens` counts only leading blocks whose digest, key and shape check out), and hands
the checked tensors to the worker in the metadata: a block that was half written, corrupted or lost is never loaded;
its tokens are computed instead, exactly as if they had never been sent.

With no connector (kv_transfer_config unset) the scheduler and the model runner never call any of this.
minivllm calls the worker side's layer hooks before and after the forward, not from inside each attention layer
as vLLM does: on a CPU there is no copy engine to overlap with the layers, and the model code stays free of transfer
code. Tensor and pipeline parallelism with a connector are not implemented (EngineConfig.validate says so).
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import struct
from dataclasses import dataclass, field

import torch

from minivllm.core.journal import Journaled
from minivllm.core.request import Request

logger = logging.getLogger(__name__)

MAGIC = b"MVKV1"


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


@dataclass
class BlockLoad:
    """Checked blocks to copy into this instance's pool: `blocks[i]` goes to block `block_ids[i]`."""
    request_id: str
    block_ids: list[int]
    blocks: list[torch.Tensor]             # each (2, num_layers, block_size, num_kv_heads, head_dim)


@dataclass
class BlockSave:
    """Blocks of a request to save after this step's forward has written them, under their keys."""
    request_id: str
    block_ids: list[int]
    keys: list[str]
    num_tokens: list[int]                  # tokens of each block that belong to the transferred prompt


@dataclass
class KVConnectorMetadata:
    """What the scheduler side tells the worker side for one step (vLLM's `KVConnectorMetadata`)."""
    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves)


def block_keys(token_ids: list[int], block_size: int, tag: str) -> list[tuple[str, int]]:
    """(key, number of tokens) of each block of `token_ids`, the last one possibly partial (see the docstring)."""
    keys, parent = [], hashlib.sha256(tag.encode()).hexdigest()
    for start in range(0, len(token_ids), block_size):
        chunk = token_ids[start:start + block_size]
        parent = hashlib.sha256(f"{parent}|{','.join(map(str, chunk))}".encode()).hexdigest()
        keys.append((parent, len(chunk)))
    return keys


def encode_block(key: str, num_tokens: int, block: torch.Tensor) -> bytes:
    """One block as a frame: MAGIC, SHA-256 of the payload, payload = header length, JSON header, raw bytes."""
    block = block.contiguous()
    header = json.dumps({"key": key, "num_tokens": num_tokens, "dtype": str(block.dtype).removeprefix("torch."),
                         "shape": list(block.shape)}).encode()
    payload = struct.pack("<I", len(header)) + header + block.reshape(-1).view(torch.uint8).numpy().tobytes()
    return MAGIC + hashlib.sha256(payload).digest() + payload


def decode_block(frame: bytes, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """The block a frame holds, or None when it is not a whole, intact block of this key, shape and dtype."""
    if len(frame) < len(MAGIC) + 36 or not frame.startswith(MAGIC):
        return None
    digest, payload = frame[len(MAGIC):len(MAGIC) + 32], frame[len(MAGIC) + 32:]
    if hashlib.sha256(payload).digest() != digest:
        return None
    (n,) = struct.unpack("<I", payload[:4])
    header = json.loads(payload[4:4 + n])
    if (header["key"] != key or tuple(header["shape"]) != tuple(shape)
            or header["dtype"] != str(dtype).removeprefix("torch.")):
        return None
    data = bytearray(payload[4 + n:])
    if len(data) != dtype.itemsize * torch.Size(shape).numel():
        return None
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(shape)


class BlockStore:
    """Where blocks live between instances: a key -> frame map. `get` returns None for a key it lacks."""

    def contains(self, key: str) -> bool:
        raise NotImplementedError

    def get(self, key: str) -> bytes | None:
        raise NotImplementedError

    def put(self, key: str, frame: bytes) -> bool:
        """Store (or send) one frame; False when it did not get there (the other side will compute it)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class KVConnectorBase_V1(Journaled):
    """Both sides of a connector over a BlockStore; subclasses choose the store (shared_storage_connector.py,
    tcp_connector.py). The scheduler side's counters are journaled with the core: a failed step moves none."""
    JOURNALED = frozenset({"num_loaded_tokens", "num_saved_blocks"})

    def __init__(self, role: KVConnectorRole, kv_role: str, store: BlockStore, block_size: int, tag: str,
                 block_shape: tuple[int, ...], dtype: torch.dtype):
        self.role, self.kv_role, self.store = role, kv_role, store
        self.block_size, self.tag, self.block_shape, self.dtype = block_size, tag, block_shape, dtype
        self.is_producer = kv_role in ("kv_producer", "kv_both")
        self.is_consumer = kv_role in ("kv_consumer", "kv_both")
        self.num_loaded_tokens = 0             # prompt tokens this instance loaded instead of computing
        self.num_saved_blocks = 0              # blocks this instance's scheduler asked its worker to save
        self._staged: dict[str, list[torch.Tensor]] = {}    # open step: request -> checked blocks to load
        self._loads: list[BlockLoad] = []
        self._meta: KVConnectorMetadata | None = None       # worker side: the step being run
        self._layers: list[torch.Tensor] = []                # worker side: each layer's copy of the saved blocks

    def _prompt_keys(self, req: Request) -> list[tuple[str, int]]:
        return block_keys(req.prompt_token_ids[:req.num_prompt_tokens - 1], self.block_size, self.tag)

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, req: Request, num_computed_tokens: int) -> int:
        """Prompt tokens past `num_computed_tokens` (local prefix-cache hits, whole blocks) whose KV can be loaded:
        the leading blocks that are in the store and check out. Stages those blocks for `update_state_after_alloc`.
        0 for a producer, or a request with prompt_logprobs (loaded tokens have no logits to score them with)."""
        if not self.is_consumer or req.sampling_params.prompt_logprobs is not None:
            return 0
        keys = self._prompt_keys(req)[num_computed_tokens // self.block_size:]
        blocks, num_tokens = [], 0
        for key, n in keys:
            frame = self.store.get(key)
            block = None if frame is None else decode_block(frame, key, self.block_shape, self.dtype)
            if block is None:
                if frame is not None:
                    logger.warning("KV block %s… of request %s does not check out: its tokens are computed",
                                   key[:12], req.request_id)
                break
            blocks.append(block)
            num_tokens += n
        if blocks:
            self._staged[req.request_id] = blocks
        return num_tokens

    def update_state_after_alloc(self, req: Request, num_external_tokens: int) -> None:
        """The scheduler admitted `req` with `num_external_tokens` to load, its blocks allocated: plan the load."""
        blocks = self._staged.pop(req.request_id, [])
        if num_external_tokens == 0 or not blocks:
            return
        first = (req.num_computed_tokens - num_external_tokens) // self.block_size
        self._loads.append(BlockLoad(req.request_id, req.block_table[first:first + len(blocks)], blocks))
        self.num_loaded_tokens += num_external_tokens

    def build_connector_meta(self, sched) -> KVConnectorMetadata:
        """This step's loads (planned above) and saves: a producer saves each prompt block in the step that
        computes its last token (and, in a request's first step, the blocks it got from the prefix cache that the
        store lacks). Ends the step's scheduler-side state."""
        saves, picked_keys = [], set()
        if self.is_producer:
            for req in sched.scheduled:
                start = req.num_computed_tokens + sched.num_computed_ahead.get(req.request_id, 0)
                end = start + sched.num_scheduled_tokens[req.request_id]
                first_step = req.request_id in sched.newly_admitted
                picked = [(i, key, n) for i, (key, n) in enumerate(self._prompt_keys(req)) if key not in picked_keys
                          and (start < i * self.block_size + n <= end
                               or (first_step and i * self.block_size + n <= start and not self.store.contains(key)))]
                picked_keys.update(key for _, key, _ in picked)     # a block shared in this step is saved once
                if picked:
                    saves.append(BlockSave(req.request_id, [req.block_table[i] for i, _, _ in picked],
                                           [k for _, k, _ in picked], [n for _, _, n in picked]))
                    self.num_saved_blocks += len(picked)
        meta = KVConnectorMetadata(self._loads, saves)
        self._loads, self._staged = [], {}
        return meta

    def request_finished(self, req: Request) -> tuple[bool, dict | None]:
        """vLLM's hook as a request ends: (free its blocks later?, kv_transfer_params for the client). Both
        connectors here move blocks within the step that computed them, so a request's blocks are free at once."""
        return False, None

    # ------------------------------------------------------------------ worker side
    def start_load_kv(self, meta: KVConnectorMetadata | None, kv_cache: torch.Tensor) -> None:
        """Before the forward: copy this step's checked blocks into their blocks of the pool
        (kv_cache: (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim))."""
        self._meta = meta
        if meta is None:
            return
        cache = kv_cache.view(torch.uint8)        # bytes: fp8 has no indexed copy on a CPU
        for load in meta.loads:
            blocks = torch.stack([b.view(torch.uint8) for b in load.blocks], dim=2)
            cache[:, :, load.block_ids] = blocks.to(cache.device)

    def wait_for_layer_load(self, layer: int) -> None:
        """Loads here are synchronous (done by start_load_kv): nothing to wait for."""

    def save_kv_layer(self, layer: int, key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
        """After the forward wrote layer `layer`: keep a copy of its K and V in the blocks this step saves."""
        if self._meta is None or not self._meta.saves:
            return
        ids = [b for s in self._meta.saves for b in s.block_ids]
        self._layers.append(torch.stack([key_cache[ids], value_cache[ids]]).cpu())   # (2, blocks, bs, H, D)

    def wait_for_save(self) -> None:
        """After the last layer: write (or send) each saved block as one frame, then end the step."""
        meta, self._meta = self._meta, None
        layers, self._layers = self._layers, []
        if meta is None or not meta.saves or not layers:
            return
        stacked = torch.stack(layers, dim=1)                        # (2, num_layers, blocks, bs, H, D)
        i = 0
        for save in meta.saves:
            for key, n in zip(save.keys, save.num_tokens):
                if not self.store.contains(key):
                    self.store.put(key, encode_block(key, n, stacked[:, :, i]))
                i += 1

    def close(self) -> None:
        self.store.close()
