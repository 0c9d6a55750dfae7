"""The S3 server helper itself (tests/s3_server.py): a real SeaweedFS on 127.0.0.1 keeps its objects across a
SIGKILL and a restart on the same endpoint; the read-only identity reads its bucket and nothing else, and writes
nowhere; env() alone points a subprocess's fsspec at the server."""

import os
import subprocess
import sys

import botocore.exceptions
import fsspec
import pytest
from s3_server import READER, READER_BUCKET, s3_server  # noqa: F401  (the fixture)

pytestmark = pytest.mark.slow  # a server start, ~12 s: what tests/data/test_s3_streams.py uses of it is tested there


def test_objects_survive_a_kill_and_a_restart(s3_server):  # noqa: F811
    data = os.urandom(300_000)
    [url] = s3_server.put("shards", {"shard-000000.tar": data})
    opts = s3_server.storage_options()
    with fsspec.open(url, "rb", **opts) as f:
        assert f.read() == data
    info = s3_server.fs().info(url)
    assert info["size"] == len(data) and info["ETag"]

    endpoint = s3_server.endpoint
    s3_server.kill()
    with pytest.raises(botocore.exceptions.EndpointConnectionError):  # not an OSError: s3fs passes it through
        s3_server.fs().cat_file(url)
    s3_server.start()
    assert s3_server.endpoint == endpoint
    fs = s3_server.fs()
    assert fs.cat_file(url) == data
    assert fs.info(url)["ETag"] == info["ETag"]
    with fs.open(url, "rb") as f:  # ranged reads: a cut read resumes from where it stopped
        f.seek(123_456)
        assert f.read(1000) == data[123_456:124_456]


def test_the_reader_reads_its_bucket_only_and_env_points_a_subprocess_at_the_server(s3_server):  # noqa: F811
    s3_server.put("private", {"a.txt": b"secret"})
    s3_server.put(READER_BUCKET, {"a.txt": b"public"})
    reader = s3_server.fs(READER)
    assert reader.cat_file(f"{READER_BUCKET}/a.txt") == b"public"
    with pytest.raises(PermissionError):
        reader.pipe_file(f"{READER_BUCKET}/b.txt", b"x")
    with pytest.raises(PermissionError):
        reader.cat_file("private/a.txt")

    code = "import fsspec, sys; sys.stdout.write(fsspec.open(sys.argv[1], 'rb').open().read().decode())"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FSSPEC_"))}
    out = subprocess.run(
        [sys.executable, "-c", code, "s3://private/a.txt"],
        env={**env, **s3_server.env()},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout == "secret", out.stderr[-2000:]
