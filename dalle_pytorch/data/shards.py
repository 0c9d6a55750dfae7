"""One WebDataset shard, read whole and indexed by sample: local tars, `pipe:` commands, and http(s) with retries.

A shard is opened once per pass over it: its tar headers are parsed into samples (the members sharing a key, as
webdataset groups them: `a/0001.jpg` + `a/0001.txt`), so any sample is read by its number without decoding the
others. Local tars are read in place; a URL is fetched whole, with retries and exponential backoff, and a
response cut mid-transfer is resumed with an HTTP Range request at the byte reached (ROOTS streamed its nodes'
shards so). Damage is said, not hidden: a truncated tar keeps the samples before the cut and records where it is.
"""

from __future__ import annotations

import gzip
import http.client
import os
import re
import subprocess
import time
import urllib.error
import urllib.request
import zlib
from dataclasses import dataclass, field

from .tar_members import members

RETRIES = 5  # consecutive failed attempts before a shard is given up (--shard_retries)
BACKOFF_S = 1.0  # the first wait; doubled after each failure, at most MAX_WAIT_S
MAX_WAIT_S = 30.0
TIMEOUT_S = 60.0  # a connection that sends nothing for this long is a failure
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset's base_plus_ext: the key, then every extension


class ShardError(Exception):
    """A shard that could not be read at all: `url` and why, in one line."""

    def __init__(self, url: str, why: str):
        super().__init__(f"{url}: {why}")
        self.url, self.why = url, why


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
        for ext, (offset, size) in self.samples[index].items():
            if self.data is not None:
                out[ext] = self.data[offset : offset + size]
            else:
                if self._file is None:
                    self._file = open(self.path, "rb")  # noqa: SIM115 - closed by close()
                out[ext] = os.pread(self._file.fileno(), size, offset)
        return out

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def open_shard(url: str, retries: int = RETRIES, backoff: float = BACKOFF_S) -> Shard:
    """Parse shard `url`; raises ShardError when it cannot be read at all (missing, refused after `retries`, or
    damaged in a way that raises): its callers, a counting collective among them, need catch nothing else."""
    try:
        return _open(url, retries, backoff)
    except ShardError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a damaged shard raises is one line about that shard
        raise ShardError(url, f"{type(e).__name__}: {e}") from None


def _open(url: str, retries: int, backoff: float) -> Shard:
    local = _local_path(url)
    if local is not None:
        if not os.path.exists(local):
            raise ShardError(url, "no such file")
        with open(local, "rb") as f:
            gzipped = f.read(2) == b"\x1f\x8b"
        if not gzipped:  # read in place: only the headers now, each sample's bytes when it is read
            with open(local, "rb") as f:
                samples, keys, cut = _parse(lambda offset, n: os.pread(f.fileno(), n, offset), os.path.getsize(local))
            return Shard(url, samples, keys, path=local, truncated_at=cut)
        with open(local, "rb") as f:
            data = f.read()
    elif url.startswith("pipe:"):
        data = _run_pipe(url)
    elif url.startswith(("http://", "https://")):
        data = fetch(url, retries, backoff)
    else:
        raise ShardError(url, "not a local path, http(s) URL or pipe: command")
    return shard_from_bytes(url, data)


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


def _local_path(url: str) -> str | None:
    if url.startswith("file://"):
        return url[len("file://") :]
    if "://" in url or url.startswith("pipe:"):
        return None
    return url


def _run_pipe(url: str) -> bytes:
    proc = subprocess.run(url[len("pipe:") :], shell=True, capture_output=True)
    if proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip().splitlines()
        raise ShardError(url, f"the command exited with {proc.returncode}: {err[-1] if err else 'no message'}")
    return proc.stdout


def fetch(url: str, retries: int = RETRIES, backoff: float = BACKOFF_S, timeout: float = TIMEOUT_S) -> bytes:
    """The whole body at `url`. A failed or cut transfer is retried after a growing wait; after a cut, the next
    request asks for the rest only (Range: bytes=N-, If-Range: the first answer's ETag or Last-Modified), so a
    flaky server costs the bytes lost, not the shard, and a file replaced meanwhile is read again from its start.
    4xx answers (but 408 and 429) are final: retrying a missing file does not make it appear."""
    body = _Body()
    failures = attempts = 0
    while True:
        got = len(body.buf)
        attempts += 1
        try:
            _get(url, body, timeout)
            return bytes(body.buf)
        except _Final as e:
            raise ShardError(url, str(e)) from None
        except (urllib.error.URLError, http.client.HTTPException, OSError, _Retry) as e:
            why = _why(e)
        failures = 0 if len(body.buf) > got else failures + 1  # a transfer that moved forward is not a failure
        if failures > retries or attempts > MAX_ATTEMPTS:
            where = f" (after {len(body.buf)} bytes)" if body.buf else ""
            raise ShardError(url, f"{why}{where}, still failing after {attempts - 1} retries") from None
        time.sleep(min(backoff * 2 ** max(failures - 1, 0), MAX_WAIT_S))


MAX_ATTEMPTS = 100  # requests for one body at most, however each moved forward


class _Body:
    """What the requests for one body have received: the bytes, its length, the validator of its version."""

    def __init__(self):
        self.buf = bytearray()
        self.total: int | None = None
        self.validator: str | None = None

    def restart(self, total: int | None, validator: str | None) -> None:
        del self.buf[:]
        self.total, self.validator = total, validator


class _Final(Exception):
    pass


class _Retry(Exception):
    pass


_CONTENT_RANGE = re.compile(r"bytes (\d+)-\d+/(\d+|\*)")


def _get(url: str, body: _Body, timeout: float) -> None:
    """One request for the bytes of `url` from len(body.buf) on, appended to it as they arrive."""
    start = len(body.buf)
    headers = {"Range": f"bytes={start}-"} if start else {}
    if start and body.validator:
        headers["If-Range"] = body.validator
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as e:
        if e.code == 416 and start and body.total in (None, start):  # nothing after the byte reached: the end
            return
        if 400 <= e.code < 500 and e.code not in (408, 429):
            raise _Final(f"HTTP {e.code} {e.reason}") from None
        raise _Retry(f"HTTP {e.code} {e.reason}") from None
    with response:
        length = response.headers.get("Content-Length")
        validator = response.headers.get("ETag") or response.headers.get("Last-Modified")
        if response.status == 206:
            match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
            total = int(match.group(2)) if match and match.group(2) != "*" else None
            if not match or int(match.group(1)) != start or (total is not None and total != body.total):
                body.restart(None, None)  # another part, or another version of the file: from the start again
                raise _Retry(f"the server answered the range from byte {start} with {match and match.group(0)}")
        else:  # the whole body: the first answer, or the server ignored the range (or the file changed)
            body.restart(int(length) if length is not None else None, validator)
        while True:
            chunk = response.read(1 << 20)
            if not chunk:
                break
            body.buf += chunk
    if body.total is not None and len(body.buf) < body.total:
        raise _Retry(f"the response was cut at byte {len(body.buf)} of {body.total}")


def _why(e: BaseException) -> str:
    if isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError):
        return f"cannot connect ({e.reason})"
    if isinstance(e, http.client.IncompleteRead):
        return "the response was cut mid-transfer"
    return str(e) or type(e).__name__
