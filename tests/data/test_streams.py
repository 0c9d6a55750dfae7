"""Streamed shards: the epoch's plan, exact resumes at the same layout, every sample once at another, shards
skipped without reading them, and bad shards said and counted."""

from __future__ import annotations

import io
import random
import tarfile
from types import SimpleNamespace

import pytest
import torch
from helpers import read_batches
from PIL import Image

from dalle_pytorch.data import shard_plan, wds
from dalle_pytorch.data.wds import StreamOptions, WebDatasetPairs
from dalle_pytorch.training.loop import Position


def write_shards(folder, shards: int, per_shard, size: int = 8, ext: str = "png") -> list[str]:
    """Shards of samples whose caption is their key (so the tests can count samples by caption)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(shards):
        n = per_shard[s] if isinstance(per_shard, list) else per_shard
        path = folder / f"shard-{s:04d}.tar"
        with tarfile.open(path, "w") as tar:
            for i in range(n):
                key = f"s{s}-{i}"
                buf = io.BytesIO()
                Image.new("RGB", (size, size), ((s * 37) % 256, (i * 53) % 256, 90)).save(buf, format=ext.upper())
                _add(tar, f"{key}.{ext}", buf.getvalue())
                _add(tar, f"{key}.txt", key.encode())
        paths.append(str(path))
    return paths


def _add(tar, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _setup(ranks: int, rank: int, workers: int, batch: int = 2):
    cfg = SimpleNamespace(batch_size=batch, num_workers=workers, seed=3)
    backend = SimpleNamespace(world_size=ranks, rank=rank, device=torch.device("cpu"))
    return cfg, backend


def _dataset(paths, rank=0, ranks=1, resize_ratio=1.0, block=wds.SHUFFLE_BLOCK):
    options = StreamOptions(shuffle_block=block)
    ds = WebDatasetPairs(paths, "png,txt", 8, resize_ratio=resize_ratio, rank=rank, world_size=ranks, seed=3,
                         options=options)  # fmt: skip
    ds.count()
    return ds


def _copy(pos: Position) -> Position:
    return Position(pos.step, pos.epoch, pos.samples_in_epoch, {k: v for k, v in pos.stream.items()})


def test_remaining_and_consumed_make_the_plan_exactly():
    """For any layout and position, what the streams gave plus what remains is every item of the plan once."""
    rng = random.Random(0)
    for _ in range(300):
        total = rng.randrange(4, 400)
        ranges = shard_plan.merge([(0, total)])
        if rng.random() < 0.5:  # a plan left by an earlier resume: a few ranges
            cuts = sorted(rng.sample(range(total + 1), 4))
            ranges = [(cuts[0], cuts[1]), (cuts[2], cuts[3])]
        ranks, workers, batch = rng.randrange(1, 4), rng.randrange(1, 4), rng.randrange(1, 5)
        streams = ranks * workers
        per_stream = shard_plan.stream_length(ranges, streams, batch)
        consumed = rng.randrange(0, per_stream // batch * workers + 1) if per_stream else 0
        given = []
        for s in range(streams):
            mine = shard_plan.stream_ranges(ranges, s, streams, batch)
            assert shard_plan.length(mine) == per_stream
            k = shard_plan.worker_batches(consumed, s % workers, workers) * batch
            given += [i for a, b in shard_plan.cut(mine, 0, k) for i in range(a, b)]
        left = [i for a, b in shard_plan.remaining(ranges, ranks, workers, batch, consumed) for i in range(a, b)]
        assert sorted(given + left) == [i for a, b in ranges for i in range(a, b)]


@pytest.mark.parametrize("block", [1, 6, 1000])
def test_epoch_order_is_a_permutation_that_changes_with_the_epoch(block):
    counts = [5, 0, 3, 7]
    orders = []
    for epoch in (0, 1):
        order = shard_plan.EpochOrder(counts, seed=1, epoch=epoch, block=block)
        items = list(order.items([(0, order.total)]))
        assert sorted(items) == sorted((s, j) for s, n in enumerate(counts) for j in range(n))
        orders.append(items)
    assert orders[0] != orders[1]
    assert list(shard_plan.EpochOrder(counts, 1, 0, block).items([(0, 15)])) == orders[0]  # a pure function
    pieces = list(shard_plan.EpochOrder(counts, 1, 0, block).items([(0, 4), (4, 9), (9, 15)]))
    assert pieces == orders[0]  # read in pieces: the same items


def test_shuffle_blocks_hold_whole_shards_and_mix_them():
    """Over random layouts: every block is whole shards of at least `block` samples (but the last), every item
    once; with a block of all the shards, a run of items is drawn across them."""
    rng = random.Random(0)
    for _ in range(200):
        counts = [rng.randrange(0, 30) for _ in range(rng.randrange(1, 12))]
        block = rng.choice([1, 2, 10, 50, 10_000])
        order = shard_plan.EpochOrder(counts, rng.randrange(9), rng.randrange(3), block)
        assert sorted(i for b in order.blocks for i in b) == [i for i, n in enumerate(counts) if n]
        sizes = [sum(counts[i] for i in b) for b in order.blocks]
        assert all(n >= block for n in sizes[:-1]) and all(
            n - counts[b[-1]] < block for n, b in zip(sizes, order.blocks)
        )
        cuts = sorted(rng.sample(range(order.total + 1), min(4, order.total + 1)))
        ranges = list(zip(cuts[:-1], cuts[1:]))
        assert len(list(order.items(ranges))) == shard_plan.length(ranges)
        assert sorted(order.items([(0, order.total)])) == sorted((s, j) for s, n in enumerate(counts) for j in range(n))
    order = shard_plan.EpochOrder([100] * 10, 0, 0, block=1000)
    first = [s for s, _ in order.items([(0, 20)])]
    assert len(set(first)) >= 6  # 20 items from 10 shards of 100: one shard at a time would give 1


@pytest.mark.parametrize("workers, block", [(0, wds.SHUFFLE_BLOCK), (2, wds.SHUFFLE_BLOCK), (2, 1), (2, 13)])
def test_resume_at_the_same_layout_gives_the_uninterrupted_batches(tmp_path, workers, block):
    """Stopped after an odd number of batches (mid-epoch, mid-shard, on a worker's turn), a new process's batches
    are the uninterrupted run's, random crops included, into the next epoch."""
    paths = write_shards(tmp_path, 5, [7, 6, 9, 5, 8], size=12)
    cfg, backend = _setup(1, 0, workers, batch=3)
    pos = Position()
    run = read_batches(_dataset(paths, resize_ratio=0.6, block=block), cfg, backend, pos)
    for _ in range(5):
        next(run)
    saved = _copy(pos)
    rest = [next(run) for _ in range(10)]  # 10 or 11 batches an epoch: into epoch 1
    resumed = read_batches(_dataset(paths, resize_ratio=0.6, block=block), cfg, backend, saved)
    for (img_a, cap_a), (img_b, cap_b) in zip(rest, (next(resumed) for _ in range(10)), strict=True):
        assert cap_a == cap_b
        assert torch.equal(img_a, img_b)
    assert saved.epoch == pos.epoch == 1


def _captions(ds, cfg, backend, pos, steps: int) -> list[str]:
    run = read_batches(ds, cfg, backend, pos)
    return [c for _ in range(steps) for c in next(run)[1]]


@pytest.mark.parametrize("block", [1, 20, wds.SHUFFLE_BLOCK])
def test_resume_on_another_world_size_sees_every_sample_once(tmp_path, block):
    """2 ranks x 2 workers stop mid-epoch; 1 rank with 1 worker finishes the epoch: none twice, none lost."""
    paths = write_shards(tmp_path, 6, [10, 12, 8, 9, 11, 14])  # 64 samples: 4 streams of 16 (batch 2)
    seen, saved = [], None
    for rank in range(2):
        cfg, backend = _setup(2, rank, 2)
        pos = Position()
        seen += _captions(_dataset(paths, rank, 2, block=block), cfg, backend, pos, 5)  # 5 of each rank's 16
        saved = saved or _copy(pos)
        assert pos.samples_in_epoch == saved.samples_in_epoch == 5 * 2 * 2
    cfg, backend = _setup(1, 0, 0)
    pos = _copy(saved)
    ds = _dataset(paths, block=block)
    left = 64 - len(seen)
    seen += _captions(ds, cfg, backend, pos, left // 2)
    assert pos.epoch == 0 and pos.stream["ranks"] == 1
    keys = [f"s{s}-{i}" for s, n in enumerate([10, 12, 8, 9, 11, 14]) for i in range(n)]
    assert sorted(seen) == sorted(keys)
    assert next(read_batches(ds, cfg, backend, pos)) and pos.epoch == 1  # the next epoch starts on the new layout


@pytest.mark.parametrize("block, shards", [(1, 1), (12, 2)])
def test_a_resume_opens_only_the_shards_it_reads(tmp_path, monkeypatch, block, shards):
    """The samples before the position are skipped by arithmetic: the shards that hold them are never opened,
    only those of the shuffle block the position is in (blocks of 2 shards of 6 samples: 2)."""
    paths = write_shards(tmp_path, 10, 6)
    cfg, backend = _setup(1, 0, 0)
    pos = Position()
    run = read_batches(_dataset(paths, block=block), cfg, backend, pos)
    for _ in range(26):  # 52 of 60 samples
        next(run)
    opened = []
    real = wds.open_shard
    monkeypatch.setattr(wds, "open_shard", lambda url, *a, **k: opened.append(url) or real(url, *a, **k))
    next(read_batches(_dataset(paths, block=block), cfg, backend, _copy(pos)))
    assert len(opened) == shards


def test_bad_shards_are_named_counted_and_stop_the_run_past_the_limit(tmp_path):
    paths = write_shards(tmp_path, 4, 4)
    data = open(paths[1], "rb").read()
    open(paths[1], "wb").write(data[: len(data) // 2])  # truncated mid-member
    open(paths[2], "wb").close()  # an empty file
    ds = WebDatasetPairs(paths, "png,txt", 8, resize_ratio=1.0, options=StreamOptions(max_bad_shards=0))
    said = []
    ds.count(str(tmp_path / "index.json"), say=said.append)
    assert any("shard-0001.tar is truncated at byte" in s for s in said)
    assert any("shard-0002.tar holds no samples" in s for s in said)
    assert ds.num_samples == 8 + ds.counts[1]
    missing = WebDatasetPairs(
        [*paths, str(tmp_path / "gone.tar")], "png,txt", 8, options=StreamOptions(max_bad_shards=0)
    )
    with pytest.raises(wds.DataError, match=r"1 of 5 shards could not be read, more than --max_bad_shards 0"):
        missing.count(say=said.append)
    assert any("gone.tar is unreadable: no such file" in s for s in said)


@pytest.mark.parametrize(
    "case, reason, said",
    [
        ("wrong_key", "missing_key", "no png, the keys seen were jpg, txt: name them with --wds"),
        ("not_utf8", "bad_caption", "caption is not UTF-8"),
        ("bad_image", "bad_image", "UnidentifiedImageError"),
    ],
)
def test_every_bad_sample_is_said_and_counted_and_no_batch_is_the_last_line(tmp_path, case, reason, said):
    paths = write_shards(tmp_path, 2, 4, ext="jpeg" if case == "wrong_key" else "png")
    if case == "wrong_key":  # --wds png,txt on shards of .jpg
        for p in paths:
            _rename_members(p, ".jpeg", ".jpg")
    if case in ("not_utf8", "bad_image"):
        for p in paths:
            _replace_members(p, ".txt" if case == "not_utf8" else ".png", b"\xff\xfe caption \xff")
    ds = WebDatasetPairs(paths, "png,txt", 8)
    ds.count()
    cfg, backend = _setup(1, 0, 0)
    with pytest.warns(UserWarning, match=said), pytest.raises(ValueError, match="the data yielded no batch"):
        next(read_batches(ds, cfg, backend, Position()))
    assert ds.skip_counts()[reason] == 8


def _rewrite(path: str, change) -> None:
    with tarfile.open(path) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            _add(tar, *change(name, data))


def _rename_members(path: str, old: str, new: str) -> None:
    _rewrite(path, lambda name, data: (name.replace(old, new), data))


def _replace_members(path: str, ext: str, data: bytes) -> None:
    _rewrite(path, lambda name, old: (name, data if name.endswith(ext) else old))


def test_a_shard_that_changed_since_it_was_counted_is_said_and_counts_as_bad(tmp_path):
    paths = write_shards(tmp_path, 3, 4)
    ds = WebDatasetPairs(paths, "png,txt", 8, resize_ratio=1.0, options=StreamOptions(max_bad_shards=1))
    ds.count(str(tmp_path / "index.json"))
    write_shards(tmp_path, 1, [2])  # shard 0 rewritten with 2 samples
    cfg, backend = _setup(1, 0, 0)
    with pytest.warns(UserWarning, match=r"shard-0000.tar holds 2 samples, its index 4: it changed since it was"):
        run = read_batches(ds, cfg, backend, Position())
        got = [c for _ in range(6) for c in next(run)[1]]  # the epoch's 6 batches, 2 samples of shard 0 missing
    assert len(got) == 12 and len(set(got)) == 10 and ds.skip_counts()["missing_from_shard"] == 2
    strict = WebDatasetPairs(paths, "png,txt", 8, options=StreamOptions(max_bad_shards=0))
    strict.count(str(tmp_path / "index.json"))  # the old counts, from the index
    with pytest.raises(wds.DataError, match=r"1 of 3 shards could not be read, more than --max_bad_shards 0"):
        run = read_batches(strict, cfg, backend, Position())
        for _ in range(6):  # the epoch's batches: shard 0 is among them
            next(run)


def test_a_batch_of_skipped_samples_still_takes_its_step(tmp_path):
    """Every sample of some batches unreadable: the rank gives a batch for each anyway (the last good one), so its
    position and steps stay those of ranks whose batches were whole."""
    paths = write_shards(tmp_path, 3, 4)
    _replace_members(paths[1], ".png", b"not a png")
    ds = _dataset(paths)
    cfg, backend = _setup(1, 0, 0)
    pos = Position()
    run = read_batches(ds, cfg, backend, pos)
    with pytest.warns(UserWarning, match="skipping an unreadable"):
        for step in range(1, 7):  # the epoch's 6 batches of 2
            assert len(next(run)[1]) == 2 and pos.samples_in_epoch == 2 * step and pos.epoch == 0
    assert ds.skip_counts()["bad_image"] == 4
