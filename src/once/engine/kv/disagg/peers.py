"""A decode engine's readers of prefill engines' transfer stores (kv/disagg/transfer.py).

Each peer has the store's read side of SharedTier's interface (`get`, `num_errors`) and
`release`, which tells the prefill engine this side is done with a request's blocks.
Every failure is a miss: the decode engine computes what it could not read.
"""

import logging
import mmap
import os
import socket
import threading
from collections import OrderedDict
from pathlib import Path

from once.engine.kv.disagg.transfer import (
    BLOCK_HASH,
    OP_GET,
    OP_RELEASE,
    RELEASED,
    REPLY_LENGTH,
    block_file_name,
    hold_key,
)

logger = logging.getLogger(__name__)


class ShmPeer:
    """A decode engine's reader of a prefill engine's tmpfs folder on the same host."""

    def __init__(self, folder: str):
        self.folder = Path(folder)
        self.num_errors = 0

    def get(self, block_hash: int):
        try:
            with open(self.folder / block_file_name(block_hash), "rb") as file:
                # Copy-on-write: writable for torch.frombuffer, nothing copied until written.
                return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):  # missing, or empty (ValueError from mmap)
            return None

    def release(self, request_id: str) -> None:
        try:
            (self.folder / RELEASED / hold_key(request_id)).touch()
        except OSError:
            pass  # the prefill engine is gone, and its holds with it

    def close(self) -> None:
        return None


class TcpPeer:
    """A decode engine's client of a prefill engine's served store: one connection,
    reopened after any failure; every failure is a miss."""

    def __init__(self, host: str, port: int, timeout_s: float = 2.0):
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self.num_errors = 0
        self._socket: socket.socket | None = None
        self._lock = threading.Lock()

    def get(self, block_hash: int) -> bytearray | None:
        return self._ask(OP_GET + BLOCK_HASH.pack(block_hash & (2**64 - 1)))

    def release(self, request_id: str) -> None:
        self._ask(OP_RELEASE + hold_key(request_id).encode("ascii"))

    def _ask(self, message: bytes) -> bytearray | None:
        with self._lock:
            try:
                if self._socket is None:
                    self._socket = socket.create_connection((self.host, self.port),
                                                            self.timeout_s)  # fmt: skip
                    self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._socket.sendall(message)
                (length,) = REPLY_LENGTH.unpack(self._read(REPLY_LENGTH.size))
                return self._read(length) if length else None
            except OSError as exc:
                self.num_errors += 1
                logger.warning("KV transfer peer %s:%d: %s", self.host, self.port, exc)
                self.close()
                return None

    def _read(self, num_bytes: int) -> bytearray:
        assert self._socket is not None
        buffer = bytearray(num_bytes)
        view, received = memoryview(buffer), 0
        while received < num_bytes:
            count = self._socket.recv_into(view[received:])
            if count == 0:
                raise ConnectionError("the prefill engine closed the connection")
            received += count
        return buffer  # writable: decoded in place

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def open_peer(address: str) -> ShmPeer | TcpPeer:
    """A reader for a store's `address`: "shm:/dev/shm/once-kv-..." or "tcp://host:port"."""
    if address.startswith("shm:"):
        folder = address[len("shm:") :]
        if not os.path.isdir(folder):
            raise ValueError(f"no KV transfer folder at {folder!r}")
        return ShmPeer(folder)
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://") :].rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"bad KV transfer address {address!r}: want tcp://host:port")
        return TcpPeer(host, int(port))
    raise ValueError(f"bad KV transfer address {address!r}: want shm:<folder> or tcp://host:port")


class PeerSet:
    """The prefill engines a decode engine has heard of (from requests or its flags),
    most recent first; a block is looked for in each until one has it."""

    name = "transfer"

    def __init__(self, max_peers: int = 16):
        self.max_peers = max_peers
        self._peers: OrderedDict[str, ShmPeer | TcpPeer] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, address: str) -> None:
        with self._lock:
            if address in self._peers:
                self._peers.move_to_end(address, last=False)
                return
        peer = open_peer(address)  # raises ValueError for a bad address
        with self._lock:
            self._peers[address] = peer
            self._peers.move_to_end(address, last=False)
            while len(self._peers) > self.max_peers:
                self._peers.popitem()[1].close()

    def __bool__(self) -> bool:
        return bool(self._peers)

    @property
    def num_errors(self) -> int:
        return sum(peer.num_errors for peer in list(self._peers.values()))

    def get(self, block_hash: int):
        with self._lock:
            peers = list(self._peers.values())
        for peer in peers:
            data = peer.get(block_hash)
            if data is not None:
                return data
        return None

    def release(self, address: str, request_id: str) -> None:
        """Tell the prefill engine at `address` that this side is done with the blocks of
        its request `request_id`."""
        with self._lock:
            peer = self._peers.get(address)
        if peer is not None:
            peer.release(request_id)
            return
        try:  # dropped from the set since: a peer of its own for the one message
            peer = open_peer(address)
        except ValueError:
            return  # the folder is gone, or the address is bad: nothing is held there
        peer.release(request_id)
        peer.close()

    def put(self, block_hash: int, data: bytes) -> bool:
        return False  # a decode engine reads from its peers, never writes to them

    def discard(self, block_hash: int) -> None:
        return None  # a corrupt block is the prefill side's to replace

    def close(self) -> None:
        with self._lock:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()
