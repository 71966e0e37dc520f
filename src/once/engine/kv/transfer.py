"""KV transfer between a prefill engine and a decode engine: the store and its peers.

    prefill engine                                    decode engine
    block fills --save--> writer thread --put-->  store  <--get-- loader thread (a peer)
    (chunk k+1 computes while chunk k is written)     |           checks, stages in host
                                                      |           memory, then the device
    shm: a folder of block files on /dev/shm ---------+
    tcp: the same store served on a TCP port ---------+

A prefill engine (`--role prefill`) writes every block it fills into its transfer store as
the block fills, on the tier writer thread (TieredConnector.save): the blocks of one
prefill chunk are written while the next chunk computes. A decode engine reads them as
one more tier below its host memory, through the peer named in the request's
`kv_transfer_params`: the request waits aside while the loader thread pulls the run, checks
each block (block_codec: layout, hash, CRC-32) and stages it in host memory; it then joins
the batch with its prompt cached. A peer that is gone, a block evicted meanwhile, a torn or
corrupt block: the run ends there and the decode engine computes the rest. The decode
engine asks only for what its own prefix cache lacks (lookups start past its match).

Both transports have SharedTier's interface (`put`, `get`, `discard`, `num_errors`):
- shm, for one host: one file per block in a folder on /dev/shm (tmpfs, i.e. shared
  memory). The reader maps the file copy-on-write and decodes straight from the mapping,
  so the bytes are copied once, into the staging block. Files are written under a
  temporary name and renamed, so a reader never sees half a block.
- tcp, across hosts: the store is served on a TCP port; one round trip per block.

A store is bounded (`capacity_blocks`, oldest write out first): a prefill engine keeps a
block until it is that far behind, long after a decode side in step has fetched it.
"""

import logging
import mmap
import os
import shutil
import socket
import socketserver
import struct
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path

logger = logging.getLogger(__name__)

TRANSPORTS = ("shm", "tcp")
_HASH = struct.Struct("<Q")
_LENGTH = struct.Struct("<Q")
_GET = b"G"


def _name(block_hash: int) -> str:
    return f"{block_hash & (2**64 - 1):016x}"


class TransferStore:
    """The prefill side: encoded blocks by hash, in a tmpfs folder, bounded, thread-safe."""

    name = "transfer"

    def __init__(self, capacity_blocks: int, root: str | None = None):
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        base = root or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.folder = Path(tempfile.mkdtemp(prefix="once-kv-", dir=base))
        self.capacity_blocks = capacity_blocks
        self.num_errors = 0
        self.num_evictions = 0
        self._names: OrderedDict[str, int] = OrderedDict()  # file name -> bytes
        self._lock = threading.Lock()
        self._server: _TcpServer | None = None

    @property
    def address(self) -> str:
        """Where a decode engine finds this store: tcp://host:port when served, else shm:."""
        if self._server is not None:
            host, port = self._server.socket.getsockname()[:2]
            return f"tcp://{host}:{port}"
        return f"shm:{self.folder}"

    def put(self, block_hash: int, data: bytes) -> bool:
        name = _name(block_hash)
        temporary = self.folder / f".{name}.{threading.get_ident()}"
        try:
            temporary.write_bytes(data)
            os.replace(temporary, self.folder / name)
        except OSError as exc:
            self.num_errors += 1
            logger.warning("KV transfer store: write failed: %s", exc)
            return False
        with self._lock:
            self._names[name] = len(data)
            self._names.move_to_end(name)
            victims = []
            while len(self._names) > self.capacity_blocks:
                victims.append(self._names.popitem(last=False)[0])
                self.num_evictions += 1
        for victim in victims:
            (self.folder / victim).unlink(missing_ok=True)
        return True

    def get(self, block_hash: int) -> bytes | None:
        try:
            return (self.folder / _name(block_hash)).read_bytes()
        except OSError:
            return None

    def discard(self, block_hash: int) -> None:
        with self._lock:
            self._names.pop(_name(block_hash), None)
        (self.folder / _name(block_hash)).unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, block_hash: int) -> bool:
        return _name(block_hash) in self._names

    def serve_tcp(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve this store on a TCP port (0: any free one); returns the address."""
        self._server = _TcpServer((host, port), _BlockRequestHandler)
        self._server.store = self
        threading.Thread(target=self._server.serve_forever, name="once-kv-transfer",
                         daemon=True).start()  # fmt: skip
        return self.address

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        shutil.rmtree(self.folder, ignore_errors=True)


class _TcpServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    store: TransferStore


class _BlockRequestHandler(socketserver.StreamRequestHandler):
    # Requests: b"G" + block hash (u64). Reply: length (u64; 0 = missing) + the block.
    def handle(self) -> None:
        store = self.server.store  # type: ignore[attr-defined]
        while True:
            request = self.rfile.read(1 + _HASH.size)
            if len(request) < 1 + _HASH.size or request[:1] != _GET:
                return
            data = store.get(_HASH.unpack_from(request, 1)[0]) or b""
            self.wfile.write(_LENGTH.pack(len(data)) + data)
            self.wfile.flush()


class ShmPeer:
    """A decode engine's reader of a prefill engine's tmpfs folder on the same host."""

    def __init__(self, folder: str):
        self.folder = Path(folder)
        self.num_errors = 0

    def get(self, block_hash: int):
        try:
            with open(self.folder / _name(block_hash), "rb") as file:
                # Copy-on-write: writable for torch.frombuffer, nothing copied until written.
                return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)
        except (OSError, ValueError):  # missing, or empty (ValueError from mmap)
            return None

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
        with self._lock:
            try:
                if self._socket is None:
                    self._socket = socket.create_connection((self.host, self.port),
                                                            self.timeout_s)  # fmt: skip
                    self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._socket.sendall(_GET + _HASH.pack(block_hash & (2**64 - 1)))
                (length,) = _LENGTH.unpack(self._read(_LENGTH.size))
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

    def put(self, block_hash: int, data: bytes) -> bool:
        return False  # a decode engine reads from its peers, never writes to them

    def discard(self, block_hash: int) -> None:
        return None  # a corrupt block is the prefill side's to replace

    def close(self) -> None:
        with self._lock:
            for peer in self._peers.values():
                peer.close()
            self._peers.clear()
