"""TCPConnector: KV blocks pushed over a TCP connection, producer to consumer (minivllm's network connector; vLLM's
P2pNcclConnector and NixlConnector move the same blocks over NCCL or RDMA).

The consumer listens on kv_ip:kv_port (port 0: any free port, read back from `connector.store.port`) and keeps the
blocks it receives in memory, at most kv_buffer_size bytes, the least recently used dropped first. The producer
connects to the consumer's kv_ip:kv_port and sends each block as it is saved:

    producer -> consumer   8-byte length, then the frame (base.py encode_block)
    consumer -> producer   1 byte: 1 stored, 0 refused (digest does not check out)

A frame is stored only once all of it has arrived and its digest checks out, so a connection that breaks mid-frame
leaves nothing behind, and the consumer computes those tokens itself. A producer that cannot reach the consumer
logs it once and goes on serving (its own requests do not depend on the transfer); it tries again for later blocks.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import socket
import struct
import threading

from minivllm.kv_transfer.base import MAGIC, BlockStore, KVConnectorBase_V1

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = 1 << 30


def frame_key(frame: bytes) -> str | None:
    """The key of an intact frame (digest checked), or None."""
    head = len(MAGIC) + 32
    if len(frame) < head + 4 or not frame.startswith(MAGIC):
        return None
    if hashlib.sha256(frame[head:]).digest() != frame[len(MAGIC):head]:
        return None
    (n,) = struct.unpack("<I", frame[head:head + 4])
    return json.loads(frame[head + 4:head + 4 + n]).get("key")


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            return None                        # the peer closed: whatever came of this frame is dropped
        buf += chunk
    return bytes(buf)


class ReceivingBlockStore(BlockStore):
    """The consumer's side: a TCP server thread filling an LRU map of key -> frame."""

    def __init__(self, host: str, port: int, capacity_bytes: int):
        self.capacity, self.size = capacity_bytes, 0
        self.frames: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self.lock = threading.Lock()
        self.num_refused = 0
        self.server = socket.create_server((host, port), reuse_port=False)
        self.port = self.server.getsockname()[1]
        self._stopped = False
        threading.Thread(target=self._serve, name="kv-transfer-server", daemon=True).start()

    def _serve(self) -> None:
        while not self._stopped:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return                          # closed
            threading.Thread(target=self._receive, args=(conn,), daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        with conn:
            while True:
                head = _recv_exactly(conn, 8)
                if head is None:
                    return
                (n,) = struct.unpack(">Q", head)
                frame = _recv_exactly(conn, n) if n <= MAX_FRAME_BYTES else None
                if frame is None:
                    return
                key = frame_key(frame)
                if key is None:
                    self.num_refused += 1
                else:
                    self._store(key, frame)
                try:
                    conn.sendall(b"\x01" if key is not None else b"\x00")
                except OSError:
                    return

    def _store(self, key: str, frame: bytes) -> None:
        with self.lock:
            if key in self.frames:
                self.frames.move_to_end(key)
                return
            self.frames[key] = frame
            self.size += len(frame)
            while self.size > self.capacity and len(self.frames) > 1:
                _, old = self.frames.popitem(last=False)
                self.size -= len(old)

    def contains(self, key: str) -> bool:
        with self.lock:
            return key in self.frames

    def get(self, key: str) -> bytes | None:
        with self.lock:
            frame = self.frames.get(key)
            if frame is not None:
                self.frames.move_to_end(key)
            return frame

    def put(self, key: str, frame: bytes) -> bool:
        raise RuntimeError("a kv_consumer receives blocks; it does not send them")

    def close(self) -> None:
        self._stopped = True
        self.server.close()


class SendingBlockStore(BlockStore):
    """The producer's side: one connection to the consumer, opened when the first block is sent."""

    def __init__(self, host: str, port: int, timeout: float = 10.0):
        self.address, self.timeout = (host, port), timeout
        self.sock: socket.socket | None = None
        self.sent: collections.OrderedDict[str, None] = collections.OrderedDict()   # keys acknowledged (bounded)
        self.num_failed = 0
        self._warned = False

    def contains(self, key: str) -> bool:
        return key in self.sent

    def get(self, key: str) -> bytes | None:
        return None

    def put(self, key: str, frame: bytes) -> bool:
        try:
            if self.sock is None:
                self.sock = socket.create_connection(self.address, timeout=self.timeout)
            self.sock.sendall(struct.pack(">Q", len(frame)) + frame)
            ok = self.sock.recv(1) == b"\x01"
        except OSError as e:
            self.num_failed += 1
            if not self._warned:
                logger.warning("KV transfer to %s:%d failed (%s): the consumer computes those tokens itself",
                               *self.address, e)
                self._warned = True
            self.close()
            return False
        if ok:
            self.sent[key] = None
            if len(self.sent) > 1 << 16:
                self.sent.popitem(last=False)
        return ok

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


class TCPConnector(KVConnectorBase_V1):
    """kv_producer sends, kv_consumer receives; kv_both is the shared-storage connector's (it needs one store)."""

    @staticmethod
    def make_store(transfer, is_scheduler_side: bool) -> BlockStore:
        if transfer.kv_role == "kv_consumer":
            return ReceivingBlockStore(transfer.kv_ip, transfer.kv_port, transfer.kv_buffer_size)
        return SendingBlockStore(transfer.kv_ip, transfer.kv_port)
