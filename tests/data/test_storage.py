"""The storage layer's choices that need no server: the scheme, URLs redacted in errors, a `pipe:` command that
talks a lot on stderr, a local .tar.gz read through the cache (decompressed on disk, not held in memory)."""

from __future__ import annotations

import gzip
import sys

import pytest

from dalle_pytorch.data import storage
from dalle_pytorch.data.shapes_export import export_wds
from dalle_pytorch.data.shard_cache import ShardCache
from dalle_pytorch.data.shards import open_shard


def test_the_scheme_chooses_the_reader():
    assert [storage.scheme(u) for u in ("a.tar", "file:///a.tar", "pipe:cat a", "https://h/a", "s3://b/a")] == [
        "local", "local", "pipe", "http", "fsspec",
    ]  # fmt: skip


def test_errors_name_the_url_without_its_secrets():
    url = "https://user:pass@host/shards/a.tar?X-Amz-Signature=abc&X-Amz-Credential=key"
    assert storage.redact(url) == "https://host/shards/a.tar"
    e = storage.ShardError(url, "HTTP 403 Forbidden")
    assert str(e) == "https://host/shards/a.tar: HTTP 403 Forbidden" and "pass" not in str(e)


def test_a_pipe_that_writes_much_to_stderr_does_not_block(tmp_path):
    export_wds(str(tmp_path), 8, image_size=16, per_shard=8)
    code = "import sys; sys.stderr.write('x' * 300_000); sys.stdout.buffer.write(open(sys.argv[1], 'rb').read())"
    url = f'pipe:{sys.executable} -c "{code}" {tmp_path / "shard-000000.tar"}'
    assert storage.read_bytes(url) == (tmp_path / "shard-000000.tar").read_bytes()
    with pytest.raises(storage.ShardError, match="the command exited with 3: gone"):
        storage.read_bytes(f"pipe:{sys.executable} -c \"import sys; sys.stderr.write('gone'); sys.exit(3)\"")


def test_a_local_tar_gz_is_read_from_the_cache_decompressed(tmp_path):
    export_wds(str(tmp_path), 8, image_size=16, per_shard=8)
    tar = (tmp_path / "shard-000000.tar").read_bytes()
    (tmp_path / "a.tar.gz").write_bytes(gzip.compress(tar))
    cache = ShardCache(str(tmp_path / "cache"), 1.0)
    shard = open_shard(str(tmp_path / "a.tar.gz"), cache=cache)
    assert len(shard) == 8 and shard.data is None and shard.path == cache.path_of(str(tmp_path / "a.tar.gz"))
    with open(shard.path, "rb") as f:
        assert f.read() == tar
    assert shard.read(3) == open_shard(str(tmp_path / "shard-000000.tar")).read(3)
    shard.close()
