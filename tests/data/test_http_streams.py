"""Shards over HTTP from a real nginx, through a proxy that cuts responses mid-transfer, and across a restart of the
server: every sample arrives once, and training ends with the weights it gets from the same files on disk."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from http_shards import CuttingProxy, Nginx

from dalle_pytorch.data.shapes_export import export_wds
from dalle_pytorch.data.shard_index import write_index
from dalle_pytorch.data.shards import ShardError, fetch, open_shard

pytestmark = pytest.mark.skipif(not Nginx.available(), reason="needs Debian's nginx (make install-cluster)")


def test_a_cut_response_is_resumed_with_a_range_request(tmp_path):
    export_wds(str(tmp_path), 20, image_size=16, per_shard=20)
    path = tmp_path / "shard-000000.tar"
    with Nginx(str(tmp_path)) as nginx, CuttingProxy(nginx.address, fraction=0.4, cut_first_n=2) as proxy:
        data = fetch(proxy.url("shard-000000.tar"), retries=3, backoff=0.05)
        assert data == path.read_bytes()
        assert proxy.cuts["/shard-000000.tar"] == 2
        ranges = [r for p, r in proxy.requests if p == "/shard-000000.tar"]
        assert ranges[0] is None and all(r and r.startswith("bytes=") for r in ranges[1:])
        assert len(open_shard(proxy.url("shard-000000.tar"))) == 20


def test_missing_and_gone_shards_are_final_and_named(tmp_path):
    with Nginx(str(tmp_path)) as nginx:
        t = time.perf_counter()
        with pytest.raises(ShardError, match=r"missing.tar: HTTP 404 Not Found"):
            fetch(nginx.url("missing.tar"), retries=5, backoff=1.0)
        assert time.perf_counter() - t < 1.0  # a 404 is not retried
        url = nginx.url("gone.tar")
    with pytest.raises(ShardError, match=r"gone.tar: cannot connect .*still failing after 1 retries"):
        fetch(url, retries=1, backoff=0.05)


def _weights(path):
    from dalle_pytorch.files import safe_load

    return safe_load(path)["weights"]


@pytest.mark.e2e
def test_training_over_a_flaky_server_ends_with_the_local_files_weights(tmp_path):
    """Every shard's first response is cut at 40%, and nginx restarts while the run reads (the shards counted
    beforehand, in --shards_index): the export equals the one trained from the same shards on disk."""
    from helpers import ONE_THREAD, TINY_VAE_MODEL

    import train_vae

    export_wds(str(tmp_path / "shards"), 48, image_size=16, per_shard=8)
    common = [
        *TINY_VAE_MODEL, *ONE_THREAD, "--wds", "png", "--batch_size", "4", "--num_workers", "0", "--steps", "12",
        "--quiet", "--sample_every", "0", "--save_every_n_steps", "0", "--resize_ratio", "0.8",
    ]  # fmt: skip
    local = train_vae.main([*common, "--image_folder", str(tmp_path / "shards"), "--output_dir", str(tmp_path / "a")])
    with Nginx(str(tmp_path / "shards")) as nginx, CuttingProxy(nginx.address, 0.4, cut_first_n=1) as proxy:
        restarted = []

        def restart_when_training():  # once the first shard was read: away for 1.5 s
            while len(proxy.requests) < 3:
                time.sleep(0.005)
            nginx.stop()
            time.sleep(1.5)
            nginx.start()
            restarted.append(time.perf_counter())

        restarter = threading.Thread(target=restart_when_training, daemon=True)
        restarter.start()
        urls = [proxy.url(f"shard-{i:06d}.tar") for i in range(6)]
        write_index(str(tmp_path / "index.json"), {u: 8 for u in urls})
        pattern = proxy.url("shard-{000000..000005}.tar").replace("%7B", "{").replace("%7D", "}")
        remote = train_vae.main(
            [*common, "--image_folder", pattern, "--shards_index", str(tmp_path / "index.json"),
             "--output_dir", str(tmp_path / "b")]
        )  # fmt: skip
        ended = time.perf_counter()
        restarter.join(timeout=10)
    assert restarted and restarted[0] < ended  # the run waited for the server to come back
    assert sum(proxy.cuts.values()) == 6  # each cut transfer went on with a Range request
    assert sum(1 for _, r in proxy.requests if r) >= 6
    a, b = _weights(local), _weights(remote)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.e2e
def test_unreadable_shards_past_the_limit_stop_the_run_in_one_line(tmp_path, capsys):
    from helpers import ONE_THREAD, TINY_VAE_MODEL

    import train_vae

    export_wds(str(tmp_path / "shards"), 24, image_size=16, per_shard=8)  # 3 shards; the test asks for 4
    with Nginx(str(tmp_path / "shards")) as nginx:
        urls = nginx.url("shard-{000000..000003}.tar").replace("%7B", "{").replace("%7D", "}")
        args = [
            *TINY_VAE_MODEL, *ONE_THREAD, "--wds", "png", "--image_folder", urls, "--batch_size", "4", "--steps", "2",
            "--num_workers", "0", "--quiet", "--sample_every", "0", "--save_every_n_steps", "0",
        ]  # fmt: skip
        with pytest.raises(SystemExit):
            train_vae.main([*args, "--output_dir", str(tmp_path / "a")])
        err = capsys.readouterr()
        assert "shard-000003.tar is unreadable: HTTP 404 Not Found; it is left out" in err.out
        assert "error: 1 of 4 shards could not be read, more than --max_bad_shards 0" in err.err
        train_vae.main([*args, "--output_dir", str(tmp_path / "b"), "--max_bad_shards", "1", "--log_every", "1"])
    with open(tmp_path / "b" / "vae" / "metrics.jsonl") as f:
        assert json.loads(f.readlines()[-1])["bad_shards"] == 1  # allowed, trained, and counted
