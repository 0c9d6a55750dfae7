"""Shards from elsewhere (http(s), object stores, `pipe:`, local .tar.gz) kept on local disk: fetched ahead of use
by a few concurrent fetches, read by their samples' offsets, the least recently used evicted past a size limit.

One cache folder serves every DataLoader worker and rank of a host: a shard is fetched by one of them (a lock
file per shard), written under .partial/ and renamed into place when whole, so a partial file is never read as a
shard; the others wait for it and open the same file. A reader holds a shared lock on the shard's file while it
reads it, and eviction (under one lock for the folder) removes the least recently used files that no reader
holds until the total fits; when the shards in use alone exceed the limit, a warning says so once. Partial files
of a process that died are removed by the next eviction. Epoch 2 finds the shards of epoch 1 on disk when the
limit holds them, and asks the store for nothing. A shard is known by its URL, as the shard index knows its count:
a shard rewritten under the same URL needs its cached file (and its index entry) deleted.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import queue
import resource
import tempfile
import threading
import warnings
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass

from . import storage
from .shards import gunzip_into


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
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft < hard:  # a stream holds its block's cached shards open (two blocks with the ones fetched ahead)
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        for sub in ("", ".partial", ".locks"):
            os.makedirs(os.path.join(folder, sub), exist_ok=True)
        self._warned = False

    def path_of(self, url: str) -> str:
        name = hashlib.sha1(url.encode()).hexdigest()[:24]
        return os.path.join(self.folder, f"{name}.tar")

    def get(self, url: str, retries: int = storage.RETRIES, backoff: float = storage.BACKOFF_S) -> Cached:
        """Shard `url` on disk, whole and decompressed, opened (and held: eviction passes it by until its file is
        closed): from the cache, else fetched into it now."""
        path = self.path_of(url)
        cached = _open_held(path)
        if cached is None:
            with _locked(os.path.join(self.folder, ".locks", os.path.basename(path) + ".lock")):
                cached = _open_held(path)  # another worker or rank may have fetched it while this one waited
                if cached is None:
                    self._fetch(url, path, retries, backoff)
                    cached = _open_held(path)  # held before the lock goes: no eviction can take it now
            self._evict()
        return cached

    def discard(self, url: str) -> None:
        """Forget a cached shard found damaged (truncated, unparsable): the next use fetches it again."""
        try:
            os.remove(self.path_of(url))
        except FileNotFoundError:
            pass

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

    def _evict(self) -> None:
        with _locked(os.path.join(self.folder, ".locks", "evict.lock")):
            self._remove_dead_partials()
            entries = []
            for entry in os.scandir(self.folder):
                if entry.name.endswith(".tar") and entry.is_file():
                    st = entry.stat()
                    entries.append((st.st_mtime, st.st_size, entry.path))
            total = sum(size for _, size, _ in entries)
            for _, size, path in sorted(entries):
                if total <= self.limit:
                    return
                if _remove_unheld(path):
                    total -= size
            if total > self.limit and not self._warned:
                self._warned = True
                warnings.warn(
                    f"the shard cache {self.folder} holds {total / 2**30:.1f} GB of shards in use, more than "
                    f"--shard_cache_gb {self.limit / 2**30:g}: raise it (to about two shuffle blocks of shards per "
                    "host), or lower --shuffle_block",
                    stacklevel=3,
                )

    def _remove_dead_partials(self) -> None:
        for entry in os.scandir(os.path.join(self.folder, ".partial")):
            pid = entry.name.split(".")[-2] if entry.name.count(".") >= 3 else ""
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    os.remove(entry.path)
                except FileNotFoundError:
                    pass


def _open_held(path: str) -> Cached | None:
    """The cached file opened with a shared lock (a reader), marked used now; None when it is not there."""
    try:
        file = open(path, "rb")  # noqa: SIM115 - the caller's Shard closes it
    except FileNotFoundError:
        return None
    fcntl.flock(file, fcntl.LOCK_SH)
    os.utime(file.fileno())  # used now: the last to be evicted
    return Cached(path, file)


def _remove_unheld(path: str) -> bool:
    """Remove `path` unless a reader holds it (a shared lock); whether it was removed."""
    try:
        with open(path, "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            os.remove(path)
            return True
    except FileNotFoundError:
        return False


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
    one, by `fetchers` concurrent fetches (daemon threads: a DataLoader worker told to stop does not wait for a
    download). `get` answers like ShardCache.get; a fetch that failed ahead is tried once more there, when the
    stream reaches the shard (a store away for a minute costs waits, not shards)."""

    def __init__(self, cache: ShardCache, blocks: list[list[str]], fetchers: int = 4, retries: int = storage.RETRIES):
        self.cache, self.blocks, self.retries = cache, blocks, retries
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.futures: dict[str, Future] = {}
        self.submitted = -1
        self.threads = max(fetchers, 1)
        for _ in range(self.threads):
            threading.Thread(target=self._work, daemon=True, name="shard-fetch").start()

    def _work(self) -> None:
        while (job := self.queue.get()) is not None:
            url, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self.cache.get(url, self.retries))
                except BaseException as e:  # noqa: BLE001 - given to the stream when it reaches the shard
                    future.set_exception(e)

    def enter(self, k: int) -> None:
        """The stream starts its k-th block: this block's shards and the next block's are fetched (or queued); the
        handles of the block before, fetched but not read, are let go."""
        if k >= 1:
            for url in self.blocks[k - 1]:
                _release(self.futures.pop(url, None))
        for b in range(self.submitted + 1, min(k + 2, len(self.blocks))):
            for url in self.blocks[b]:
                if url not in self.futures:
                    self.futures[url] = Future()
                    self.queue.put((url, self.futures[url]))
            self.submitted = b

    def get(self, url: str, retries: int = storage.RETRIES, backoff: float = storage.BACKOFF_S) -> Cached:
        future = self.futures.pop(url, None)
        if future is not None:
            try:
                return future.result()
            except storage.ShardError:
                pass  # tried again now, in the stream's own time
        return self.cache.get(url, retries, backoff)

    def close(self) -> None:
        for future in self.futures.values():
            future.cancel()
            _release(future)
        self.futures.clear()
        for _ in range(self.threads):  # each thread ends once its download does
            self.queue.put(None)


def _release(future: Future | None) -> None:
    """Close the handle a finished fetch holds (queued and running ones: cancelled, or left to finish)."""
    if future is not None and future.done() and not future.cancelled() and future.exception() is None:
        future.result().file.close()
