"""The shard cache against a real nginx: a stream over HTTP reads the local files' batches, fetched once into
the cache (epoch 2 sends no request), a partial fetch is never taken for a shard, the least recently used shards
are evicted past the limit, and processes asking for one shard at once fetch it once."""

from __future__ import annotations

import multiprocessing
import os
from types import SimpleNamespace

import pytest
import torch
from helpers import read_batches
from http_shards import CuttingProxy, Nginx

from dalle_pytorch.data import storage
from dalle_pytorch.data.shapes_export import export_wds
from dalle_pytorch.data.shard_cache import ShardCache
from dalle_pytorch.data.shards import ShardError, open_shard
from dalle_pytorch.data.wds import StreamOptions, WebDatasetPairs
from dalle_pytorch.training.loop import Position

pytestmark = pytest.mark.skipif(not Nginx.available(), reason="needs Debian's nginx (make install-cluster)")


def _requests(nginx: Nginx) -> list[str]:
    with open(os.path.join(nginx.prefix, "access.log")) as f:
        return [line.split('"')[1].split()[1] for line in f if '"GET ' in line]


def _epochs(urls, cache: str, workers: int, steps: int):
    ds = WebDatasetPairs(urls, "png,txt", 16, resize_ratio=1.0, seed=1,
                         options=StreamOptions(shuffle_block=24, cache=cache, fetchers=2))  # fmt: skip
    ds.count(os.path.join(cache + "-index.json"))  # as a run keeps its shards.json
    cfg = SimpleNamespace(batch_size=4, num_workers=workers, seed=1)
    backend = SimpleNamespace(world_size=1, rank=0, device=torch.device("cpu"))
    run = read_batches(ds, cfg, backend, Position())
    return [next(run) for _ in range(steps)]


def test_a_stream_over_http_reads_the_local_batches_and_epoch_two_asks_for_nothing(tmp_path):
    export_wds(str(tmp_path / "shards"), 48, image_size=16, per_shard=8)  # 6 shards, blocks of 3
    names = sorted(os.listdir(tmp_path / "shards"))
    local = _epochs([str(tmp_path / "shards" / n) for n in names], str(tmp_path / "unused"), 2, 12)
    with Nginx(str(tmp_path / "shards")) as nginx:
        urls = [nginx.url(n) for n in names]
        cache = str(tmp_path / "cache")
        served = _epochs(urls, cache, 2, 12)  # the epoch's 12 batches: every shard fetched once
        fetched = _requests(nginx)
        again = _epochs(urls, cache, 2, 12)
        assert _requests(nginx) == fetched  # epoch 2 (a new stream, as a new run or epoch): from the cache
    tars = [r for r in fetched if r.endswith(".tar")]  # and each one's _stats.json asked for once: 404
    assert sorted(tars) == sorted(f"/{n}" for n in names)  # each shard once, counting and reading together
    for (img_a, cap_a), (img_b, cap_b), (img_c, cap_c) in zip(local, served, again, strict=True):
        assert cap_a == cap_b == cap_c and torch.equal(img_a, img_b) and torch.equal(img_a, img_c)
    assert not os.path.exists(tmp_path / "unused")  # local shards are read in place, never copied
    assert not os.listdir(os.path.join(cache, ".partial"))


def test_a_failed_fetch_leaves_no_shard_and_a_cut_one_is_resumed_whole(tmp_path, monkeypatch):
    export_wds(str(tmp_path), 8, image_size=16, per_shard=8)
    cache = ShardCache(str(tmp_path / "cache"), 1.0)
    with Nginx(str(tmp_path)) as nginx, CuttingProxy(nginx.address, fraction=0.4, cut_first_n=2) as proxy:
        url = proxy.url("shard-000000.tar")
        real = storage.copy

        def half_then_gone(url, out, *a):  # the store goes away after half of the shard reached the disk
            real(url, out, *a)
            out.truncate(out.tell() // 2)
            raise ShardError(url, "cannot connect (refused), still failing after 5 retries")

        monkeypatch.setattr(storage, "copy", half_then_gone)
        with pytest.raises(ShardError, match="refused"):
            open_shard(url, retries=1, backoff=0.01, cache=cache)
        assert not os.path.exists(cache.path_of(url)) and not os.listdir(cache.folder + "/.partial")
        monkeypatch.setattr(storage, "copy", real)
        shard = open_shard(url, retries=1, backoff=0.01, cache=cache)  # cut twice, resumed by ranges: whole
        assert len(shard) == 8 and shard.path == cache.path_of(url) and proxy.cuts["/shard-000000.tar"] == 2
        with open(cache.path_of(url), "rb") as f:
            assert f.read() == (tmp_path / "shard-000000.tar").read_bytes()
        shard.close()


def test_the_least_recently_used_shards_are_evicted_past_the_limit_but_never_one_being_read(tmp_path):
    export_wds(str(tmp_path), 48, image_size=16, per_shard=8)
    size = os.path.getsize(tmp_path / "shard-000000.tar")
    cache = ShardCache(str(tmp_path / "cache"), 2.5 * size / 2**30)
    with Nginx(str(tmp_path)) as nginx:
        urls = [nginx.url(f"shard-{i:06d}.tar") for i in range(6)]
        for url in urls[:2]:
            cache.get(url).file.close()
        os.utime(cache.path_of(urls[1]), (1, 1))  # shard 1 last used long ago; shard 0 just now
        for url in urls[2:4]:
            cache.get(url).file.close()
        assert sorted(u for u in urls if os.path.exists(cache.path_of(u))) == sorted(urls[2:4])  # 1, then 0, out
        held = [cache.get(url) for url in urls[4:6]]  # being read: 4 shards, 2 of them held
        os.utime(cache.path_of(urls[4]), (1, 1))  # the oldest, yet held: kept
        with pytest.warns(UserWarning, match="holds .* GB of shards in use, more than --shard_cache_gb"):
            held.append(cache.get(urls[0]))  # 3 held, more than the limit: said, and nothing held removed
        kept = sorted(u for u in urls if os.path.exists(cache.path_of(u)))
    assert kept == sorted([urls[0], urls[4], urls[5]])
    assert all(len(open_shard(u, cache=cache)) == 8 for u in kept)
    for cached in held:
        cached.file.close()


def _get(folder: str, url: str, out) -> None:
    cached = ShardCache(folder, 1.0).get(url)
    out.put(cached.file.read())


def test_processes_asking_for_one_shard_at_once_fetch_it_once(tmp_path):
    export_wds(str(tmp_path), 8, image_size=16, per_shard=8)
    with Nginx(str(tmp_path)) as nginx:
        url = nginx.url("shard-000000.tar")
        ctx = multiprocessing.get_context("fork")
        out = ctx.Queue()
        procs = [ctx.Process(target=_get, args=(str(tmp_path / "cache"), url, out)) for _ in range(4)]
        for p in procs:
            p.start()
        got = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(60)
        assert _requests(nginx) == ["/shard-000000.tar"]
    assert all(g == (tmp_path / "shard-000000.tar").read_bytes() for g in got)
