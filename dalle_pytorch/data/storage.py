"""Where data lives, chosen by URL scheme in this one place: local paths (and file://), `pipe:` commands, http(s),
and every other scheme through fsspec (s3://, gs://, az://, hf://: s3fs, gcsfs ... installed as extras).

Every remote read has the same guarantees: a failed or cut transfer is retried after a growing wait and resumed
at the byte reached (HTTP: a Range request checked against the first answer's ETag; fsspec: a seek on a fresh
handle, checked against the object's ETag or size), a final answer (missing, denied) is not retried, and every
failure is one line that names the URL, never a credential. fsspec takes credentials from where its backends
look (for S3: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE and ~/.aws, the instance's role; an
S3-compatible store's address from AWS_ENDPOINT_URL); nothing here reads, prints or records them.
"""

from __future__ import annotations

import http.client
import io
import os
import re
import subprocess
import time
import urllib.error
import urllib.request

RETRIES = 5  # consecutive failed attempts before a shard is given up (--shard_retries)
BACKOFF_S = 1.0  # the first wait; doubled after each failure, at most MAX_WAIT_S
MAX_WAIT_S = 30.0
TIMEOUT_S = 60.0  # a connection that sends nothing for this long is a failure
MAX_ATTEMPTS = 100  # requests for one body at most, however each moved forward
CHUNK = 1 << 22


class ShardError(Exception):
    """Data that could not be read at all: `url` and why, in one line."""

    def __init__(self, url: str, why: str):
        super().__init__(f"{url}: {why}")
        self.url, self.why = url, why


def scheme(url: str) -> str:
    """ "local", "pipe", "http" or "fsspec"."""
    if url.startswith("pipe:"):
        return "pipe"
    if url.startswith(("http://", "https://")):
        return "http"
    if "://" in url and not url.startswith("file://"):
        return "fsspec"
    return "local"


def local_path(url: str) -> str | None:
    return url.removeprefix("file://") if scheme(url) == "local" else None


def join(base: str, name: str) -> str:
    """`name` beside or under `base`, for paths and URLs alike."""
    return os.path.join(base, name) if scheme(base) == "local" else base.rstrip("/") + "/" + name


def dirname(url: str) -> str:
    return os.path.dirname(url) if scheme(url) == "local" else url.rsplit("/", 1)[0]


def list_shards(url: str) -> list[str]:
    """The .tar and .tar.gz files under an object store's prefix, as URLs, sorted."""
    fs, path = _fs(url)
    try:
        found = fs.find(path)
    except Exception as e:  # noqa: BLE001
        raise FileNotFoundError(f"{url}: {_fsspec_why(e)}") from None
    protocol = url.split("://", 1)[0]
    return sorted(f"{protocol}://{p}" for p in found if p.endswith((".tar", ".tar.gz", ".tgz")))


def exists(url: str) -> bool:
    kind = scheme(url)
    if kind == "local":
        return os.path.exists(local_path(url))
    if kind == "fsspec":
        fs, path = _fs(url)
        try:
            return fs.exists(path)
        except Exception:  # noqa: BLE001 - unreachable counts as absent here; reading it says why
            return False
    try:
        read_bytes(url, retries=0)
    except ShardError:
        return False
    return True


def read_bytes(url: str, retries: int = RETRIES, backoff: float = BACKOFF_S) -> bytes:
    """The whole of `url` in memory (small files: an index, a stats file, a run's metadata)."""
    out = io.BytesIO()
    copy(url, out, retries, backoff)
    return out.getvalue()


def write_bytes(url: str, data: bytes) -> None:
    """`data` as `url`, complete or not at all (a local file is renamed into place; an object store's put is)."""
    kind = scheme(url)
    if kind == "local":
        path = local_path(url)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    elif kind == "fsspec":
        fs, path = _fs(url)
        try:
            fs.pipe_file(path, data)
        except Exception as e:  # noqa: BLE001
            raise ShardError(url, _fsspec_why(e)) from None
    else:
        raise ShardError(url, "cannot be written: give a local path or an object store URL (s3://, gs://)")


def copy(url: str, out, retries: int = RETRIES, backoff: float = BACKOFF_S) -> None:
    """Every byte of `url` into the binary file `out` (at its start; what it held is replaced)."""
    kind = scheme(url)
    if kind == "local":
        path = local_path(url)
        if not os.path.exists(path):
            raise ShardError(url, "no such file")
        with open(path, "rb") as f:
            while chunk := f.read(CHUNK):
                out.write(chunk)
        return
    if kind == "pipe":
        return _run_pipe(url, out)
    body = _Body(out)
    get = _http_get if kind == "http" else _fsspec_get
    failures = attempts = 0
    while True:
        got = body.size
        attempts += 1
        try:
            get(url, body)
            return
        except _Final as e:
            raise ShardError(url, str(e)) from None
        except _Retry as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - any other failure of a transfer is retried, then one line
            why = _why(e) if kind == "http" else _fsspec_why(e)
        failures = 0 if body.size > got else failures + 1  # a transfer that moved forward is not a failure
        if failures > retries or attempts > MAX_ATTEMPTS:
            where = f" (after {body.size} bytes)" if body.size else ""
            raise ShardError(url, f"{why}{where}, still failing after {attempts - 1} retries") from None
        time.sleep(min(backoff * 2 ** max(failures - 1, 0), MAX_WAIT_S))


class _Body:
    """What the requests for one body have received (written to `out`), its length, its version's validator."""

    def __init__(self, out):
        self.out, self.size = out, 0
        self.total: int | None = None
        self.validator: str | None = None

    def append(self, chunk: bytes) -> None:
        self.out.write(chunk)
        self.size += len(chunk)

    def restart(self, total: int | None, validator: str | None) -> None:
        self.out.seek(0)
        self.out.truncate()
        self.size, self.total, self.validator = 0, total, validator


class _Final(Exception):
    pass


class _Retry(Exception):
    pass


def _run_pipe(url: str, out) -> None:
    proc = subprocess.Popen(url[len("pipe:") :], shell=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while chunk := proc.stdout.read(CHUNK):
        out.write(chunk)
    err = proc.stderr.read().decode(errors="replace").strip().splitlines()
    if proc.wait() != 0:
        raise ShardError(url, f"the command exited with {proc.returncode}: {err[-1] if err else 'no message'}")


# ---------------------------------------------------------------------------------------------------- fsspec
def _fs(url: str):
    try:
        import fsspec
    except ImportError:
        raise ShardError(url, "object store URLs need fsspec: run `make install`") from None
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as e:
        extra = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs"}.get(url.split(":")[0])
        hint = f": pip install {extra}" if extra else ""
        raise ShardError(url, f"no filesystem for this URL ({e}){hint}") from None


def _fsspec_get(url: str, body: _Body) -> None:
    """One attempt at the rest of `url` from body.size on: a fresh handle, seeked to the byte reached."""
    fs, path = _fs(url)
    try:
        fs.invalidate_cache(path)  # a listing cached before a failure (or a restart of the store) is not trusted
        info = fs.info(path)
        validator = str(info.get("ETag") or info.get("etag") or info.get("mtime") or "") or None
        total = info.get("size")
        if body.size and (validator, total) != (body.validator, body.total):
            body.restart(total, validator)  # the object changed between attempts: from its start again
            raise _Retry("the object changed while it was read")
        if not body.size:
            body.restart(total, validator)
        with fs.open(path, "rb", block_size=CHUNK) as f:
            f.seek(body.size)
            while chunk := f.read(CHUNK):
                body.append(chunk)
    except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
        raise _Final(_fsspec_why(e)) from None
    if body.total is not None and body.size < body.total:
        raise _Retry(f"the read was cut at byte {body.size} of {body.total}")


def _fsspec_why(e: BaseException) -> str:
    if isinstance(e, FileNotFoundError):
        return f"no such object or bucket ({_first_line(e)}): check the bucket's and the object's names"
    if isinstance(e, PermissionError):
        return (
            f"access denied ({_first_line(e)}): check the credentials (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
            "AWS_PROFILE, or the store's own) and that they may read this bucket"
        )
    if isinstance(e, IsADirectoryError):
        return "a folder, not a file"
    return f"{type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return lines[0] if lines else type(e).__name__


# ---------------------------------------------------------------------------------------------------- http(s)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-\d+/(\d+|\*)")


def _http_get(url: str, body: _Body) -> None:
    """One request for the bytes of `url` from body.size on, appended as they arrive. After a cut the request
    asks for the rest only (Range: bytes=N-, If-Range: the first answer's ETag or Last-Modified), so a flaky
    server costs the bytes lost, and a file replaced meanwhile is read again from its start. 4xx answers (but 408
    and 429) are final: retrying a missing file does not make it appear."""
    start = body.size
    headers = {"Range": f"bytes={start}-"} if start else {}
    if start and body.validator:
        headers["If-Range"] = body.validator
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S)
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
        while chunk := response.read(1 << 20):
            body.append(chunk)
    if body.total is not None and body.size < body.total:
        raise _Retry(f"the response was cut at byte {body.size} of {body.total}")


def _why(e: BaseException) -> str:
    if isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError):
        return f"cannot connect ({e.reason})"
    if isinstance(e, http.client.IncompleteRead):
        return "the response was cut mid-transfer"
    return str(e) or type(e).__name__
