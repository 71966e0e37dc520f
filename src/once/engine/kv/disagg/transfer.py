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

The peers are in kv/disagg/peers.py. Both transports have SharedTier's interface (`put`,
`get`, `discard`, `num_errors`):
- shm, for one host: one file per block in a folder on /dev/shm (tmpfs, i.e. shared
  memory). The reader maps the file copy-on-write and decodes straight from the mapping,
  so the bytes are copied once, into the staging block. Files are written under a
  temporary name and renamed, so a reader never sees half a block.
- tcp, across hosts: the store is served on a TCP port; one round trip per block.

A store is bounded (`capacity_blocks`, oldest write out first), and a finished prefill leg
holds its blocks (`hold`) until the decode side says it has them (`release_key`, by the
request id the params carry) or `hold_s` passes, as vLLM's NIXL connector keeps a prefill's
blocks until the decode instance has read them or a timeout ends the wait. A held block is
never evicted and does not count against the capacity; held blocks are bounded by the
capacity on their own (the oldest holds end first). The decode side releases through its
peer: over shm it drops an empty file named for the request into the store's `released/`
folder, which the store reads on its next write; over TCP it sends the request's key.
"""

import hashlib
import logging
import os
import shutil
import socketserver
import struct
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

TRANSPORTS = ("shm", "tcp")
BLOCK_HASH = struct.Struct("<Q")
REPLY_LENGTH = struct.Struct("<Q")
OP_GET = b"G"
OP_RELEASE = b"R"  # + a hold key (HOLD_KEY_CHARS ASCII)
RELEASED = "released"  # the shm store's folder of release notes
# How long a prefill engine keeps a finished request's blocks for a decode side that never
# says it has them (gone, or the request aborted there): chosen; a decode side in step
# releases within its load, milliseconds to seconds.
DEFAULT_HOLD_S = 120.0
HOLD_KEY_CHARS = 32


def block_file_name(block_hash: int) -> str:
    return f"{block_hash & (2**64 - 1):016x}"


def hold_key(request_id: str) -> str:
    """A request id as a fixed-length file name: ids are client-chosen strings."""
    return hashlib.blake2b(request_id.encode(), digest_size=HOLD_KEY_CHARS // 2).hexdigest()


class TransferStore:
    """The prefill side: encoded blocks by hash, in a tmpfs folder, bounded, thread-safe."""

    name = "transfer"

    def __init__(
        self,
        capacity_blocks: int,
        root: str | None = None,
        hold_s: float = DEFAULT_HOLD_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if capacity_blocks < 1 or not hold_s > 0:
            raise ValueError("capacity_blocks must be >= 1 and hold_s > 0")
        base = root or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
        self.folder = Path(tempfile.mkdtemp(prefix="once-kv-", dir=base))
        (self.folder / RELEASED).mkdir()
        self.capacity_blocks = capacity_blocks
        self.hold_s = hold_s
        self.clock = clock
        self.num_errors = 0
        self.num_evictions = 0
        self.num_released = 0  # holds the decode side ended
        self.num_expired = 0  # holds that ran out of time, or of room (below)
        self._names: OrderedDict[str, int] = OrderedDict()  # file name -> bytes
        self._held: Counter[str] = Counter()  # file name -> holds on it
        self._holds: OrderedDict[str, tuple[list[str], float]] = OrderedDict()  # by deadline
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
        name = block_file_name(block_hash)
        temporary = self.folder / f".{name}.{threading.get_ident()}"
        try:
            temporary.write_bytes(data)
            os.replace(temporary, self.folder / name)
        except OSError as exc:
            self.num_errors += 1
            logger.warning("KV transfer store: write failed: %s", exc)
            return False
        self.collect_releases()
        with self._lock:
            self._names[name] = len(data)
            self._names.move_to_end(name)
            victims = []
            # Held blocks do not count against the capacity: the oldest unheld go first,
            # a held one moves to the back on the way (it is in use).
            while len(self._names) - len(self._held) > self.capacity_blocks:
                oldest = next(iter(self._names))
                if self._held[oldest]:
                    self._names.move_to_end(oldest)
                    continue
                del self._names[oldest]
                victims.append(oldest)
                self.num_evictions += 1
        for victim in victims:
            (self.folder / victim).unlink(missing_ok=True)
        return True

    def hold(self, request_id: str, block_hashes: list[int]) -> None:
        """Keep `block_hashes` (those stored) until `release(request_id)` or `hold_s`.
        Held blocks are bounded too, by the capacity: past it the oldest holds end first
        (a decode side that has not released by then is slow or gone)."""
        key = hold_key(request_id)
        with self._lock:
            self._end_hold(key)
            names = [name for name in map(block_file_name, block_hashes) if name in self._names]
            self._held.update(names)
            self._holds[key] = (names, self.clock() + self.hold_s)
            while len(self._held) > self.capacity_blocks and len(self._holds) > 1:
                self._end_hold(next(iter(self._holds)))
                self.num_expired += 1

    def release_key(self, key: str) -> None:
        """End the hold a decode side names by `hold_key(request_id)`."""
        with self._lock:
            if self._end_hold(key):
                self.num_released += 1

    def _end_hold(self, key: str) -> bool:
        # Under the lock.
        entry = self._holds.pop(key, None)
        if entry is None:
            return False
        for name in entry[0]:
            self._held[name] -= 1
            if self._held[name] <= 0:
                del self._held[name]
        return True

    def collect_releases(self) -> None:
        """Read the decode sides' release notes (shm) and end the holds that ran out."""
        try:
            notes = os.listdir(self.folder / RELEASED)
        except OSError:
            notes = []
        for note in notes:
            self.release_key(note)
            (self.folder / RELEASED / note).unlink(missing_ok=True)
        now = self.clock()
        with self._lock:
            while self._holds:
                key, (_, deadline) = next(iter(self._holds.items()))
                if deadline > now:
                    break
                self._end_hold(key)
                self.num_expired += 1

    @property
    def num_held_blocks(self) -> int:
        return len(self._held)

    @property
    def num_holds(self) -> int:
        return len(self._holds)

    def get(self, block_hash: int) -> bytes | None:
        try:
            return (self.folder / block_file_name(block_hash)).read_bytes()
        except OSError:
            return None

    def discard(self, block_hash: int) -> None:
        with self._lock:
            self._names.pop(block_file_name(block_hash), None)  # its holds end as they would
        (self.folder / block_file_name(block_hash)).unlink(missing_ok=True)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, block_hash: int) -> bool:
        return block_file_name(block_hash) in self._names

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
    # Requests: b"G" + block hash (u64), replied with length (u64; 0 = missing) + the
    # block; b"R" + a hold key, replied with length 0.
    def handle(self) -> None:
        store = self.server.store  # type: ignore[attr-defined]
        while True:
            op = self.rfile.read(1)
            if op == OP_GET:
                request = self.rfile.read(BLOCK_HASH.size)
                if len(request) < BLOCK_HASH.size:
                    return
                data = store.get(BLOCK_HASH.unpack(request)[0]) or b""
            elif op == OP_RELEASE:
                key = self.rfile.read(HOLD_KEY_CHARS)
                if len(key) < HOLD_KEY_CHARS:
                    return
                store.release_key(key.decode("ascii", "replace"))
                data = b""
            else:
                return
            self.wfile.write(REPLY_LENGTH.pack(len(data)) + data)
            self.wfile.flush()
