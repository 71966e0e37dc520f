"""L3: KV blocks as files on local disk, bounded by size, kept across engine restarts.

One file per block, `<folder>/<layout fingerprint>/<block hash>.kv`, in block_codec's
format. A write goes to a temporary name and is renamed into place, so a reader sees a
whole file or none; a crash mid-write leaves a stray `.tmp` that the next start removes.
No fsync: a block lost or torn by a power cut fails its checksum and is recomputed, which
is cheaper than syncing every block.

At start the index is rebuilt from the folder, oldest modification first, and the size
bound is enforced at once; from then on the index is LRU (a read touches the file's
mtime, so the order survives a restart too).
"""

import logging
import os
import threading
from collections import OrderedDict
from pathlib import Path

logger = logging.getLogger(__name__)

SUFFIX = ".kv"


class DiskTier:
    name = "disk"

    def __init__(self, folder: str | os.PathLike, max_bytes: int, fingerprint: bytes):
        if max_bytes < 1:
            raise ValueError("the disk KV tier needs a size bound of at least one byte")
        self.folder = Path(folder) / fingerprint.hex()
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.lock = threading.Lock()
        self.size_of: OrderedDict[int, int] = OrderedDict()  # hash -> file bytes, LRU first
        self.num_bytes = 0
        self.num_evictions = 0
        self._rebuild_index()

    def _path(self, block_hash: int) -> Path:
        return self.folder / f"{block_hash & (2**64 - 1):016x}{SUFFIX}"

    def _rebuild_index(self) -> None:
        found = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(".tmp"):
                Path(entry.path).unlink(missing_ok=True)
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            try:
                block_hash = int(entry.name[: -len(SUFFIX)], 16)
                stat = entry.stat()
            except (ValueError, OSError):
                continue
            found.append((stat.st_mtime_ns, block_hash, stat.st_size))
        for _, block_hash, size in sorted(found):
            self.size_of[block_hash] = size
            self.num_bytes += size
        with self.lock:
            self._evict_to(self.max_bytes)

    def __len__(self) -> int:
        return len(self.size_of)

    def __contains__(self, block_hash: object) -> bool:
        if not isinstance(block_hash, int):
            return False
        return (block_hash & (2**64 - 1)) in self.size_of

    def put(self, block_hash: int, data: bytes) -> bool:
        block_hash &= 2**64 - 1
        if len(data) > self.max_bytes:
            return False
        path = self._path(block_hash)
        temporary = path.with_name(f"{path.name}.{threading.get_ident()}.tmp")
        try:
            temporary.write_bytes(data)
            os.replace(temporary, path)
        except OSError as exc:  # a full or read-only disk: the block is simply not kept
            logger.warning("disk KV tier: could not write %s: %s", path.name, exc)
            temporary.unlink(missing_ok=True)
            return False
        with self.lock:
            self.num_bytes += len(data) - self.size_of.pop(block_hash, 0)
            self.size_of[block_hash] = len(data)
            self._evict_to(self.max_bytes)
        return True

    def get(self, block_hash: int) -> bytes | None:
        block_hash &= 2**64 - 1
        if block_hash not in self.size_of:
            return None
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
            os.utime(path)
        except OSError:
            self.discard(block_hash)
            return None
        with self.lock:
            if block_hash in self.size_of:
                self.size_of.move_to_end(block_hash)
        return data

    def discard(self, block_hash: int) -> None:
        """Forget a block (missing, or failed its checks) and remove its file."""
        block_hash &= 2**64 - 1
        with self.lock:
            self.num_bytes -= self.size_of.pop(block_hash, 0)
        self._path(block_hash).unlink(missing_ok=True)

    def _evict_to(self, max_bytes: int) -> None:
        while self.num_bytes > max_bytes and self.size_of:
            block_hash, size = self.size_of.popitem(last=False)
            self.num_bytes -= size
            self.num_evictions += 1
            self._path(block_hash).unlink(missing_ok=True)
