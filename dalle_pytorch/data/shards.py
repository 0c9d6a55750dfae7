"""One WebDataset shard indexed by sample: its tar headers are parsed into samples (the members sharing a key, as
webdataset groups them: `a/0001.jpg` + `a/0001.txt`), so any sample is read by its number without decoding the
others. A local tar is read in place; a shard elsewhere (http(s), an object store, a `pipe:` command: storage.py)
is fetched whole with retries and resumed reads, into the shard cache (shard_cache.py) and read there by
offsets, or into memory without one. Damage is said, not hidden: a truncated tar keeps the samples before the cut
and records where it is.
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import zlib
from contextlib import nullcontext
from dataclasses import dataclass, field

from .storage import BACKOFF_S, RETRIES, ShardError, local_path, read_bytes  # noqa: F401 - RETRIES, ShardError: the shard's API
from .tar_members import members

_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext: the key, then every extension


@dataclass
class Shard:
    """A tar's samples, each {extension: (offset, size)}, read by number from `data` (fetched) or `path`."""

    url: str
    samples: list[dict[str, tuple[int, int]]]
    keys: list[str]
    data: bytes | None = None
    path: str | None = None
    truncated_at: int | None = None  # the byte where the tar breaks off, when it does
    _file: object = field(default=None, repr=False)

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, index: int) -> dict:
        """Sample `index`: {"__key__": key, extension: bytes, ...}."""
        out = {"__key__": self.keys[index]}
        if self.data is not None:
            for ext, (offset, size) in self.samples[index].items():
                out[ext] = self.data[offset : offset + size]
            return out
        with nullcontext(self._file) if self._file is not None else open(self.path, "rb") as f:
            for ext, (offset, size) in self.samples[index].items():
                out[ext] = os.pread(f.fileno(), size, offset)
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def open_shard(url: str, retries: int = RETRIES, backoff: float = BACKOFF_S, cache=None) -> Shard:
    """Parse shard `url`; raises ShardError when it cannot be read at all (missing, refused after `retries`, or
    damaged in a way that raises): its callers, a counting collective among them, need catch nothing else.
    `cache`: a ShardCache that holds shards fetched from elsewhere (read there by offsets), else memory."""
    try:
        return _open(url, retries, backoff, cache)
    except ShardError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a damaged shard raises is one line about that shard
        raise ShardError(url, f"{type(e).__name__}: {e}") from None


def _open(url: str, retries: int, backoff: float, cache) -> Shard:
    local = local_path(url)
    if local is not None:
        if not os.path.exists(local):
            raise ShardError(url, "no such file")
        with open(local, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
        if not gzipped:
            with open(local, "rb") as f:  # read in place: each sample's bytes when it is read
                return _in_place(url, local, f, keep=False)
    if cache is None:  # in memory (counting a shard, reading captions)
        return shard_from_bytes(url, read_bytes(url, retries, backoff))
    cached = cache.get(url, retries, backoff)  # whole, decompressed, held open until this shard is closed
    try:
        shard = _in_place(url, cached.path, cached.file, keep=True)
    except BaseException:
        cached.file.close()
        cache.discard(url)  # damaged as fetched: fetched again next time
        raise
    if shard.truncated_at is not None:
        cache.discard(url)  # its complete samples are read now; the next use fetches it again
    return shard


def _in_place(url: str, path: str, file, keep: bool) -> Shard:
    """A tar on this machine read where it is: only the headers now, each sample's bytes when it is read, from
    `file` when `keep` (a cached shard: held against eviction), else from `path` opened for each read (a block of
    many local shards holds no file descriptors)."""
    samples, keys, cut = _parse(lambda offset, n: os.pread(file.fileno(), n, offset), os.fstat(file.fileno()).st_size)
    return Shard(url, samples, keys, path=path, truncated_at=cut, _file=file if keep else None)


def gunzip_into(src, dest) -> None:
    """A gzipped file object's content into `dest`, streamed (a shard's .tar.gz is kept decompressed)."""
    src.seek(0)
    with gzip.GzipFile(fileobj=src) as z:
        shutil.copyfileobj(z, dest, 1 << 22)


def shard_from_bytes(url: str, data: bytes) -> Shard:
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise ShardError(url, f"not a readable gzip file ({e})") from None
    samples, keys, cut = _parse(lambda offset, n: data[offset : offset + n], len(data))
    return Shard(url, samples, keys, data=data, truncated_at=cut)


def _parse(read_at, size: int):
    """(samples, keys, truncated_at) of the tar of `size` bytes that `read_at(offset, n)` reads."""
    samples: list[dict] = []
    keys: list[str] = []
    found, cut = members(read_at, size)
    for name, offset, n in found:
        match = _KEY.match(name)
        if not match or os.path.basename(name).startswith("__"):
            continue
        key, ext = match.group(1), match.group(2).lower()
        if not keys or keys[-1] != key:
            keys.append(key)
            samples.append({})
        samples[-1][ext] = (offset, n)
    if cut is not None and samples:
        # the last sample before the cut may have lost members that followed it: drop it, it is incomplete
        samples.pop()
        keys.pop()
    return samples, keys, cut


fetch = read_bytes  # the whole of a URL in memory, retried and resumed (storage.py)
