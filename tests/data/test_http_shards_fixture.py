"""The HTTP shard helpers themselves (tests/http_shards.py): nginx serves whole files and ranges and survives a
restart on its port; the proxy cuts the first response of a path mid-body and lets a ranged retry through."""

import http.client
import os
import urllib.request

import pytest
from http_shards import CuttingProxy, Nginx

if not Nginx.available():
    pytest.skip("needs nginx: run `apt-get install nginx` (scripts/install_cluster.sh does)", allow_module_level=True)

# No proxy from the environment between urllib and 127.0.0.1
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def get(url: str, range_start: int | None = None):
    headers = {} if range_start is None else {"Range": f"bytes={range_start}-"}
    return OPENER.open(urllib.request.Request(url, headers=headers), timeout=10)


@pytest.fixture
def shard(tmp_path):
    data = os.urandom(300_000)  # several TCP segments: a cut at 40% falls mid-transfer
    (tmp_path / "shard-000000.tar").write_bytes(data)
    return data


def test_nginx_serves_whole_files_and_ranges(tmp_path, shard):
    with Nginx(str(tmp_path)) as nginx:
        with get(nginx.url("shard-000000.tar")) as resp:
            assert resp.status == 200
            assert int(resp.headers["Content-Length"]) == len(shard)
            assert resp.read() == shard
        with get(nginx.url("shard-000000.tar"), range_start=1000) as resp:
            assert resp.status == 206
            assert resp.headers["Content-Range"] == f"bytes 1000-{len(shard) - 1}/{len(shard)}"
            assert resp.read() == shard[1000:]


def test_proxy_cuts_the_first_response_and_a_ranged_retry_completes(tmp_path, shard):
    with Nginx(str(tmp_path)) as nginx, CuttingProxy(nginx.address, fraction=0.4) as proxy:
        with get(proxy.url("shard-000000.tar")) as resp:
            assert int(resp.headers["Content-Length"]) == len(shard)
            with pytest.raises(http.client.IncompleteRead) as cut:
                resp.read()
        received = cut.value.partial
        assert 0 < len(received) < len(shard) and received == shard[: len(received)]
        with get(proxy.url("shard-000000.tar"), range_start=len(received)) as resp:
            assert resp.status == 206
            assert received + resp.read() == shard
        assert proxy.cuts == {"/shard-000000.tar": 1}
        assert proxy.requests == [("/shard-000000.tar", None), ("/shard-000000.tar", f"bytes={len(received)}-")]


def test_nginx_restart_keeps_its_port(tmp_path, shard):
    with Nginx(str(tmp_path)) as nginx:
        port, pid = nginx.port, nginx.proc.pid
        nginx.restart()
        assert nginx.port == port and nginx.proc.pid != pid
        with get(nginx.url("shard-000000.tar")) as resp:
            assert resp.read() == shard
    assert nginx.proc is None
