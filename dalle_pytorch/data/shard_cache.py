"""Shards from elsewhere (http(s), object stores, `pipe:`) kept on local disk: fetched ahead of use by a few
concurrent fetches, read by their samples' offsets, the least recently used evicted past a size limit.

One cache folder serves every DataLoader worker and rank of a host: a shard is fetched by one of them (a lock
file per shard), written under .partial/ and renamed into place when whole, so a partial file is never read as a
shard; the others wait for it and open the same file. Using a shard marks it (its mtime), eviction (under one
lock for the folder) removes the least recently used until the total fits. An evicted shard that a reader still
holds open stays readable (Linux frees it when the last handle closes): the stream keeps its block's shards open.
Epoch 2 finds the shards of epoch 1 on disk when the limit holds them, and asks the store for nothing. A shard is
known by its URL, as the shard index knows its count: a shard rewritten under the same URL needs its cached file
(and its index entry) deleted.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import tempfile
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

from . import storage
from .shards import gunzip_into

RECENT_S = 60.0  # a shard used this recently and evicted: the limit is below what the streams hold at once


def default_folder() -> str:
    """$DALLE_SHARD_CACHE, else dalle-shards-UID under the system's temporary folder."""
    return os.environ.get("DALLE_SHARD_CACHE") or os.path.join(tempfile.gettempdir(), f"dalle-shards-{os.getuid()}")


@dataclass
class Cached:
    path: str
    file: object  # open for reading: the bytes stay reachable while the stream reads them, evicted or not


class ShardCache:
    def __init__(self, folder: str, limit_gb: float):
        self.folder, self.limit = folder, int(limit_gb * 2**30)
        for sub in ("", ".partial", ".locks"):
            os.makedirs(os.path.join(folder, sub), exist_ok=True)
        self._warned = False

    def path_of(self, url: str) -> str:
        name = hashlib.sha1(url.encode()).hexdigest()[:24]
        return os.path.join(self.folder, f"{name}.tar")

    def get(self, url: str, retries: int = storage.RETRIES, backoff: float = storage.BACKOFF_S) -> Cached:
        """Shard `url` on disk, whole and decompressed, opened: from the cache, else fetched into it now."""
        path = self.path_of(url)
        while True:
            try:
                file = open(path, "rb")  # noqa: SIM115 - the caller's Shard closes it
            except FileNotFoundError:
                pass
            else:
                os.utime(path)  # used now: the last to be evicted
                return Cached(path, file)
            with _locked(os.path.join(self.folder, ".locks", os.path.basename(path) + ".lock")):
                if not os.path.exists(path):  # else another worker or rank fetched it while this one waited
                    self._fetch(url, path, retries, backoff)
            self._evict(keep=path)

    def _fetch(self, url: str, path: str, retries: int, backoff: float) -> None:
        name = f"{os.path.basename(path)}.{os.getpid()}.{threading.get_ident()}"
        partial = os.path.join(self.folder, ".partial", name)
        try:
            with open(partial, "wb+") as f:
                storage.copy(url, f, retries, backoff)
                f.seek(0)
                if f.read(2) == b"\x1f\x8b":  # a .tar.gz: kept decompressed, so samples are read by offset
                    with open(partial + ".tar", "wb") as out:
                        gunzip_into(f, out)
                    os.replace(partial + ".tar", partial)
            os.replace(partial, path)
        except BaseException:
            for leftover in (partial, partial + ".tar"):
                if os.path.exists(leftover):
                    os.remove(leftover)
            raise

    def _evict(self, keep: str) -> None:
        with _locked(os.path.join(self.folder, ".locks", "evict.lock")):
            entries = []
            for entry in os.scandir(self.folder):
                if entry.name.endswith(".tar") and entry.is_file():
                    st = entry.stat()
                    entries.append((st.st_mtime, st.st_size, entry.path))
            total = sum(size for _, size, _ in entries)
            now = time.time()
            for mtime, size, path in sorted(entries):
                if total <= self.limit:
                    break
                if path == keep:
                    continue
                os.remove(path)
                total -= size
                if now - mtime < RECENT_S and not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"the shard cache {self.folder} ({self.limit / 2**30:g} GB) evicts shards in use: it holds "
                        "less than the shuffle blocks being read and fetched ahead; raise --shard_cache_gb or lower "
                        "--shuffle_block",
                        stacklevel=3,
                    )


@contextmanager
def _locked(path: str):
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Prefetcher:
    """Fetches a stream's shards ahead of use into the cache: the shards of the block being read and of the next
    one, by `fetchers` concurrent fetches. `get` answers like ShardCache.get (a fetch that failed raises its
    ShardError there, when the stream reaches the shard)."""

    def __init__(self, cache: ShardCache, blocks: list[list[str]], fetchers: int = 4, retries: int = storage.RETRIES):
        self.cache, self.blocks, self.retries = cache, blocks, retries
        self.pool = ThreadPoolExecutor(max(fetchers, 1), thread_name_prefix="shard-fetch")
        self.futures: dict[str, Future] = {}
        self.submitted = -1

    def enter(self, k: int) -> None:
        """The stream starts its k-th block: this block's shards and the next block's are fetched (or queued)."""
        for b in range(self.submitted + 1, min(k + 2, len(self.blocks))):
            for url in self.blocks[b]:
                if url not in self.futures:
                    self.futures[url] = self.pool.submit(self.cache.get, url, self.retries)
            self.submitted = b

    def get(self, url: str, retries: int = storage.RETRIES, backoff: float = storage.BACKOFF_S) -> Cached:
        future = self.futures.pop(url, None)
        return future.result() if future is not None else self.cache.get(url, retries, backoff)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for future in self.futures.values():  # fetched for a block the stream did not reach: close the handles
            if future.done() and not future.cancelled() and future.exception() is None:
                future.result().file.close()
        self.futures.clear()
