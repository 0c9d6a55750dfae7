"""One transfer's state and one HTTP request of it (storage.py retries them): the bytes received so far go to a
file, and a request after a cut asks for the rest only."""

from __future__ import annotations

import http.client
import re
import urllib.error
import urllib.request

TIMEOUT_S = 60.0  # a connection that sends nothing for this long is a failure


class Body:
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


class Final(Exception):
    pass


class Retry(Exception):
    pass


_CONTENT_RANGE = re.compile(r"bytes (\d+)-\d+/(\d+|\*)")


def http_get(url: str, body: Body) -> None:
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
            raise Final(f"HTTP {e.code} {e.reason}") from None
        raise Retry(f"HTTP {e.code} {e.reason}") from None
    with response:
        length = response.headers.get("Content-Length")
        validator = response.headers.get("ETag") or response.headers.get("Last-Modified")
        if response.status == 206:
            match = _CONTENT_RANGE.match(response.headers.get("Content-Range", ""))
            total = int(match.group(2)) if match and match.group(2) != "*" else None
            if not match or int(match.group(1)) != start or (total is not None and total != body.total):
                body.restart(None, None)  # another part, or another version of the file: from the start again
                raise Retry(f"the server answered the range from byte {start} with {match and match.group(0)}")
        else:  # the whole body: the first answer, or the server ignored the range (or the file changed)
            body.restart(int(length) if length is not None else None, validator)
        while chunk := response.read(1 << 20):
            body.append(chunk)
    if body.total is not None and body.size < body.total:
        raise Retry(f"the response was cut at byte {body.size} of {body.total}")


def why(e: BaseException) -> str:
    if isinstance(e, urllib.error.URLError) and not isinstance(e, urllib.error.HTTPError):
        return f"cannot connect ({e.reason})"
    if isinstance(e, http.client.IncompleteRead):
        return "the response was cut mid-transfer"
    return str(e) or type(e).__name__
