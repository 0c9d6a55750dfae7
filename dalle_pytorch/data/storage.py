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

import io
import os
import subprocess
import tempfile
import time

from webdataset.shardlists import expand_urls

from .http_get import Body, Final, Retry, http_get
from .http_get import why as http_why

RETRIES = 5  # consecutive failed attempts before a shard is given up (--shard_retries)
BACKOFF_S = 1.0  # the first wait; doubled after each failure, at most MAX_WAIT_S
MAX_WAIT_S = 30.0
MAX_ATTEMPTS = 100  # requests for one body at most, however each moved forward
CHUNK = 1 << 22


class ShardError(Exception):
    """Data that could not be read at all: `url` (its query and user part left out: a presigned URL's signature)
    and why, in one line."""

    def __init__(self, url: str, why: str):
        super().__init__(f"{redact(url)}: {why}")
        self.url, self.why = redact(url), why


def redact(url: str) -> str:
    """`url` without what may hold a secret: its query (?X-Amz-Signature=...) and user part (user:pass@)."""
    if "://" not in url or url.startswith("pipe:"):
        return url
    scheme_, rest = url.split("://", 1)
    host, sep, path = rest.partition("/")
    return f"{scheme_}://{host.rsplit('@', 1)[-1]}{sep}{path.split('?', 1)[0]}"


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


def shard_urls(urls: str) -> list[str]:
    """Brace patterns, URLs and `pipe:` commands as webdataset expands them; a folder: the shards under it,
    found recursively (as lucidrains' DALLE-pytorch took `--image_text_folder SHARD_FOLDER`), in an object store
    too (s3://bucket/shards/)."""
    if scheme(urls) == "fsspec" and urls.endswith("/"):
        found = list_shards(urls)
        if not found:
            raise FileNotFoundError(f"no WebDataset shards (.tar, .tar.gz) under {urls}")
        return found
    if os.path.isdir(urls):
        found = sorted(
            os.path.join(d, f)
            for d, _, files in os.walk(urls)
            for f in files
            if f.endswith((".tar", ".tar.gz", ".tgz"))
        )
        if not found:
            raise FileNotFoundError(f"no WebDataset shards (.tar, .tar.gz) under {urls}")
        return found
    return sorted(expand_urls(urls))


def list_shards(url: str) -> list[str]:
    """The .tar and .tar.gz files under an object store's prefix, as URLs, sorted."""
    try:
        fs, path = _fs(url)
        found = fs.find(path)
    except ShardError as e:
        raise FileNotFoundError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - one line: why the folder cannot be listed
        raise FileNotFoundError(f"{redact(url)}: {_fsspec_why(e)}") from None
    protocol = url.split("://", 1)[0]
    return sorted(f"{protocol}://{p}" for p in found if p.endswith((".tar", ".tar.gz", ".tgz")))


def exists(url: str) -> bool:
    kind = scheme(url)
    if kind == "local":
        return os.path.exists(local_path(url))
    if kind == "fsspec":
        fs, path = _fs(url)
        try:
            fs.info(path)
        except FileNotFoundError:
            return False
        except Exception as e:  # noqa: BLE001 - a store that cannot say is not a missing file
            raise ShardError(url, _fsspec_why(e)) from None
        return True
    try:
        read_bytes(url, retries=0)
    except ShardError as e:
        if e.why.startswith("HTTP 404") or e.why.startswith("HTTP 410") or kind == "pipe":
            return False
        raise
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
    body = Body(out)
    get = http_get if kind == "http" else _fsspec_get
    failures = attempts = 0
    while True:
        got = body.size
        attempts += 1
        try:
            get(url, body)
            return
        except Final as e:
            raise ShardError(url, str(e)) from None
        except ShardError:
            raise  # no filesystem for the URL: final
        except Retry as e:
            why = str(e)
        except Exception as e:  # noqa: BLE001 - any other failure of a transfer is retried, then one line
            why = http_why(e) if kind == "http" else _fsspec_why(e)
        failures = 0 if body.size > got else failures + 1  # a transfer that moved forward is not a failure
        if failures > retries or attempts > MAX_ATTEMPTS:
            where = f" (after {body.size} bytes)" if body.size else ""
            raise ShardError(url, f"{why}{where}, still failing after {attempts - 1} retries") from None
        time.sleep(min(backoff * 2 ** max(failures - 1, 0), MAX_WAIT_S))


def _run_pipe(url: str, out) -> None:
    with tempfile.TemporaryFile() as stderr:  # a file, not a pipe: a chatty command cannot block on it
        proc = subprocess.Popen(url[len("pipe:") :], shell=True, stdout=subprocess.PIPE, stderr=stderr)
        while chunk := proc.stdout.read(CHUNK):
            out.write(chunk)
        proc.wait()
        stderr.seek(0)
        err = stderr.read().decode(errors="replace").strip().splitlines()
    if proc.returncode != 0:
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


def _fsspec_get(url: str, body: Body) -> None:
    """One attempt at the rest of `url` from body.size on: a fresh handle, seeked to the byte reached."""
    fs, path = _fs(url)
    try:
        fs.invalidate_cache(path)  # a listing cached before a failure (or a restart of the store) is not trusted
        info = fs.info(path)
        validator = str(info.get("ETag") or info.get("etag") or info.get("mtime") or "") or None
        total = info.get("size")
        if body.size and (validator, total) != (body.validator, body.total):
            body.restart(total, validator)  # the object changed between attempts: from its start again
            raise Retry("the object changed while it was read")
        if not body.size:
            body.restart(total, validator)
        with fs.open(path, "rb", block_size=CHUNK) as f:
            f.seek(body.size)
            while chunk := f.read(CHUNK):
                body.append(chunk)
    except (FileNotFoundError, PermissionError, IsADirectoryError) as e:
        raise Final(_fsspec_why(e)) from None
    if body.total is not None and body.size < body.total:
        raise Retry(f"the read was cut at byte {body.size} of {body.total}")


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
