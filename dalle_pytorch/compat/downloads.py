"""The predecessor's default pretrained tokenizers, downloaded once per machine into a cache.

lucidrains' DALLE-pytorch 1.6.6 downloads OpenAI's dVAE when no VAE is given and taming's
vqgan_imagenet_f16_1024 for a bare `--taming` (its dalle_pytorch/vae.py, URLs and file names copied from
there). `fetch(name)` does the same here, into `$DALLE_CACHE/pretrained` (default ~/.cache/dalle-pytorch,
as scripts/install.sh uses it), with what the predecessor lacked:

- one download per machine: launchers start every local rank before any process group exists, so a file
  lock (flock on FILE.lock) makes the others wait while the first one downloads;
- resumable: bytes go to FILE.part, and a later try asks the server for the rest (HTTP Range);
- verified before the atomic rename to FILE. Neither OpenAI nor Heidelberg publishes sizes or hashes,
  so nothing is pinned: the size the server announces and the sha256 of the first complete download are
  recorded in FILE.download.json, and every later read (or download) must match them;
- no second download for the predecessor's users: its ~/.cache/dalle/FILE is copied, and verified alike.

`DALLE_PYTORCH_URL_BASE=URL` fetches every file from URL/FILENAME instead (a mirror, or the tests' server).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import urllib.error
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from http.client import HTTPException

from tqdm import tqdm

from ..files import atomic_write_json


@dataclass(frozen=True)
class Remote:
    url: str
    filename: str
    size: int | None = None  # bytes, where published
    sha256: str | None = None  # where published


# Neither host publishes sizes or hashes of these four, and no trustworthy copy of them was found in public code,
# issues or pages: none is pinned (see the docstring). Pin one here once it is published.
REGISTRY = {
    "openai_encoder": Remote("https://cdn.openai.com/dall-e/encoder.pkl", "encoder.pkl"),
    "openai_decoder": Remote("https://cdn.openai.com/dall-e/decoder.pkl", "decoder.pkl"),
    "vqgan_1024_model": Remote(
        "https://heibox.uni-heidelberg.de/f/140747ba53464f49b476/?dl=1", "vqgan.1024.model.ckpt"
    ),
    "vqgan_1024_config": Remote(
        "https://heibox.uni-heidelberg.de/f/6ecf2af6c658432c8298/?dl=1", "vqgan.1024.config.yml"
    ),
}
OPENAI_DEFAULT = ("openai_encoder", "openai_decoder")
VQGAN_DEFAULT = ("vqgan_1024_model", "vqgan_1024_config")
PREDECESSOR_CACHE = "~/.cache/dalle"  # where 1.6.6 kept the same files under the same names
TIMEOUT_S = 60  # per socket operation, not for the whole download
CHUNK = 1 << 20


def cache_root() -> str:
    """Where downloaded and converted files live: $DALLE_CACHE, else ~/.cache/dalle-pytorch (as make install)."""
    return os.environ.get("DALLE_CACHE") or os.path.expanduser("~/.cache/dalle-pytorch")


def cache_dir() -> str:
    return os.path.join(cache_root(), "pretrained")


def url_of(remote: Remote) -> str:
    base = os.environ.get("DALLE_PYTORCH_URL_BASE")
    return f"{base.rstrip('/')}/{remote.filename}" if base else remote.url


def default_openai_dir() -> str:
    """The cache folder holding OpenAI's encoder.pkl and decoder.pkl, fetched if missing."""
    return os.path.dirname([fetch(n) for n in OPENAI_DEFAULT][0])


def default_vqgan_paths() -> tuple[str, str]:
    """(model, config) of the predecessor's default VQGAN (vqgan_imagenet_f16_1024), fetched if missing."""
    config = fetch(VQGAN_DEFAULT[1])  # the small file first: an offline machine fails before the big one
    return fetch(VQGAN_DEFAULT[0]), config


def refetch_downloaded(record: dict) -> dict[str, str]:
    """{path flag: path} for the downloaded files a pretrained tokenizer's record names that are gone (another
    machine, a cleared cache): fetched again, so generate.py finds them. A path recorded for several files is
    their folder (OpenAI's dVAE)."""
    out = {}
    for key, names in record.get("downloaded", {}).items():
        recorded = record["paths"][key]
        wanted = [os.path.join(recorded, REGISTRY[n].filename) for n in names] if len(names) > 1 else [recorded]
        if not all(os.path.exists(p) for p in wanted):
            paths = [fetch(n) for n in names]
            out[key] = os.path.dirname(paths[0]) if len(names) > 1 else paths[0]
    return out


def fetch(name: str, quiet: bool = False) -> str:
    """The path of registry file `name` in the cache: downloaded by one process per machine, verified."""
    if name not in REGISTRY:
        raise ValueError(f"no downloadable file {name!r}: expected one of {', '.join(REGISTRY)}")
    remote = REGISTRY[name]
    root = cache_dir()
    try:
        os.makedirs(root, exist_ok=True)
    except OSError as e:
        raise PermissionError(
            f"cannot create the download cache {root} ({e}): set DALLE_CACHE to a writable folder"
        ) from None
    path = os.path.join(root, remote.filename)
    with _locked(path, quiet):
        if not os.path.exists(path):
            _download(remote, path, quiet)  # verified before it gets its name
            return path
    # the waiters verify outside the lock, all at once: the file is only ever replaced by a rename
    _verify(path, path, remote, "")
    return path


# ------------------------------------------------------------------------------------------ verification


def _sidecar(path: str) -> str:
    return path + ".download.json"


def _expected(path: str, remote: Remote) -> tuple[int | None, str | None]:
    """(size, sha256): published values win over the ones recorded at the first download."""
    recorded = {}
    if os.path.exists(_sidecar(path)):
        with open(_sidecar(path)) as f:
            recorded = json.load(f)
    return (remote.size if remote.size is not None else recorded.get("size")), remote.sha256 or recorded.get("sha256")


def _source(path: str, remote: Remote, field: str) -> str:
    if getattr(remote, field) is not None:
        return "pinned in dalle_pytorch/compat/downloads.py"
    return f"recorded in {_sidecar(path)} at its first download; delete that file if the server's changed on purpose"


def _record(path: str, remote: Remote, **values) -> None:
    """Keep what nothing publishes (size, sha256) beside the file, written atomically."""
    current = {}
    if os.path.exists(_sidecar(path)):
        with open(_sidecar(path)) as f:
            current = json.load(f)
    current.update(url=url_of(remote), **{k: v for k, v in values.items() if getattr(remote, k) is None})
    atomic_write_json(current, _sidecar(path))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def _verify(file: str, path: str, remote: Remote, what: str) -> None:
    """Check `file` (path itself, or its .part) against the expected size and sha256; delete it if it differs.
    With no sha256 known yet, this file's becomes the reference."""
    size, sha = _expected(path, remote)
    found_size = os.path.getsize(file)
    problem = ""
    if size is not None and found_size != size:
        problem = f"{found_size} bytes, expected {size} ({_source(path, remote, 'size')})"
    found_sha = _sha256(file) if not problem else ""
    if not problem and sha and found_sha != sha:
        problem = f"sha256 {found_sha}, expected {sha} ({_source(path, remote, 'sha256')})"
    if problem:
        try:
            os.remove(file)
        except FileNotFoundError:  # another rank found it first
            pass
        raise ValueError(
            f"{what or file} does not match {url_of(remote)}: {problem}; deleted it: run again to "
            f"download it anew, or place the right file at {path}"
        )
    if not sha:
        _record(path, remote, size=found_size, sha256=found_sha)


# -------------------------------------------------------------------------------------------- download


@contextmanager
def _locked(path: str, quiet: bool):
    with open(path + ".lock", "a") as f:  # "a": created if missing, never truncated under another holder
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not quiet:
                print(f"waiting for another process to download {path}", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:  # also released if this process dies: a download that crashed is resumed by the next one
            fcntl.flock(f, fcntl.LOCK_UN)


def _offline(remote: Remote, path: str, reason: str) -> FileNotFoundError:
    sha = _expected(path, remote)[1]
    part = path + ".part"
    have = os.path.getsize(part) if os.path.exists(part) else 0
    resume = f"; or run again to resume from the {have} bytes in {part}" if have else ""
    sha = f"sha256 {sha}" if sha else "no published sha256: it is recorded when first used"
    reason = " ".join(str(reason).split())
    return FileNotFoundError(
        f"could not download {url_of(remote)} ({reason}): place the file at {path} ({sha}){resume}"
    )


def _adopt_predecessor(remote: Remote, path: str, quiet: bool) -> bool:
    """Users of the predecessor have the files already: copy them instead of downloading again."""
    old = os.path.join(os.path.expanduser(PREDECESSOR_CACHE), remote.filename)
    if os.path.exists(path + ".part") or not os.path.isfile(old):
        return False
    if not quiet:
        print(f"copying the predecessor's download {old} to {path}", flush=True)
    shutil.copyfile(old, path + ".part")
    return True


def _download(remote: Remote, path: str, quiet: bool) -> None:
    part = path + ".part"
    if _adopt_predecessor(remote, path, quiet):
        try:
            _verify(part, path, remote, f"the predecessor's {remote.filename}")
            os.replace(part, path)
            return
        except ValueError as e:  # deleted: download it instead
            print(e, flush=True)
    for attempt in range(2):  # the second from byte 0, after a server answered a Range request badly
        if _download_once(remote, path, quiet, resume=attempt == 0):
            break
    _verify(part, path, remote, f"the download of {remote.filename}")
    os.replace(part, path)


def _download_once(remote: Remote, path: str, quiet: bool, resume: bool) -> bool:
    """Fetch the rest of FILE.part (all of it without `resume`); False when the server refused the Range and
    the .part was discarded, to start again."""
    part, url = path + ".part", url_of(remote)
    have = os.path.getsize(part) if resume and os.path.exists(part) else 0
    size, sha = _expected(path, remote)
    if size is not None and have >= size:
        if have == size:
            return True  # complete: a run stopped between the last byte and the rename
        have = 0
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        if e.code == 416 and have:  # Range Not Satisfiable: the .part is not a prefix of this file
            os.remove(part)
            return False
        raise _offline(remote, path, f"HTTP {e.code} {e.reason}") from None
    except (urllib.error.URLError, OSError, HTTPException) as e:  # no route, DNS, refused, timeout
        raise _offline(remote, path, getattr(e, "reason", None) or e) from None
    with response:
        total = _announced_total(response, have)
        if response.status == 206 and not _range_starts_at(response, have):
            os.remove(part)
            return False
        if have and response.status != 206:
            if not quiet:
                print(f"{url} ignores HTTP Range: downloading it from the start", flush=True)
            have = 0
        if size is not None and total is not None and total != size:
            if sha or remote.size is not None:  # the file is known: this is another one
                raise ValueError(
                    f"{url} announces {total} bytes, expected {size} ({_source(path, remote, 'size')}): not the "
                    f"file this was meant to download; place the right file at {path}"
                )
            size = None  # it changed between two tries of the first download: the .part is stale
            if have:
                _record(path, remote, size=total)
                os.remove(part)
                return False
        if total is not None and size is None:
            _record(path, remote, size=total)
        if not quiet:
            print(f"downloading {url} to {path}", flush=True)
        try:
            _stream(response, part, have, total, remote.filename, quiet)
        except (OSError, HTTPException) as e:  # the connection dropped: what arrived is kept for the next try
            if isinstance(e, OSError) and e.errno == 28:
                raise
            raise _offline(remote, path, f"{type(e).__name__}: {e}") from None
    got = os.path.getsize(part)
    if total is not None and got < total:  # http.client ends a short body quietly: kept for the next try
        raise _offline(remote, path, f"the connection closed after {got} of {total} bytes")
    return True


def _announced_total(response, have: int) -> int | None:
    """The whole file's size as the server announces it (Content-Range of a 206, Content-Length of a 200)."""
    m = re.search(r"/(\d+)\s*$", response.headers.get("Content-Range", ""))
    if response.status == 206 and m:
        return int(m.group(1))
    length = response.headers.get("Content-Length")
    return (have if response.status == 206 else 0) + int(length) if length else None


def _range_starts_at(response, have: int) -> bool:
    m = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", ""))
    return bool(m) and int(m.group(1)) == have


def _stream(response, part: str, have: int, total: int | None, label: str, quiet: bool) -> None:
    bar = tqdm(total=total, initial=have, unit="B", unit_scale=True, desc=label, disable=quiet)
    with open(part, "ab" if have else "wb") as f, bar:
        while block := response.read(CHUNK):
            f.write(block)
            bar.update(len(block))
        f.flush()
        os.fsync(f.fileno())
