"""The samples in each shard, counted once and kept in a JSON index (the run directory's shards.json, or the
file --shards_index names, shared between runs), so that positions in a stream are arithmetic.

A shard is counted from img2dataset's `NAME_stats.json` beside `NAME.tar` when there is one ("successes": a few
bytes to fetch instead of the shard), else by reading its tar headers (a URL: the shard, fetched once). The ranks
count their share of the missing shards, in threads, and add the counts up; a shard that cannot be read counts
-1: named in one line, left out of the epoch, and not written into the index, so that the next run tries it again.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from . import storage
from .shards import ShardError, open_shard

UNREADABLE = -1
_MISSING = -2  # not in the index yet
VERSION = 1


def read_index(path: str) -> dict[str, int]:
    """The index at `path` (a file or an object store URL); {} where there is none yet."""
    try:
        if not path or not storage.exists(path):
            return {}
        index = json.loads(storage.read_bytes(path))
        return {str(k): int(v) for k, v in index["samples"].items()}
    except ShardError as e:
        raise ValueError(f"the shard index {path} cannot be read: {e.why}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{path} is not a shard index ({type(e).__name__}: {e}): delete it to count again") from None


def write_index(path: str, counts: dict[str, int]) -> None:
    if storage.scheme(path) == "local":
        os.makedirs(os.path.dirname(os.path.abspath(storage.local_path(path))), exist_ok=True)
    data = json.dumps({"version": VERSION, "samples": counts}, indent=0, sort_keys=True).encode()
    try:
        storage.write_bytes(path, data)
    except ShardError as e:
        raise ValueError(f"the shard index cannot be written to {path}: {e.why}") from None


def count_shards(
    urls: list[str],
    index_path: str,
    rank: int,
    world_size: int,
    add_up: Callable[[list[int]], list[int]] | None,
    retries: int,
    say: Callable[[str], None],
    threads: int = 8,
    cache=None,
    why: dict[str, str] | None = None,
) -> list[int]:
    """Samples per shard of `urls` (UNREADABLE where it could not be read), the same on every rank.

    `add_up`: the sum of a list of ints over the ranks (a collective: every rank calls this function as often as
    the others); without it, this process counts every shard itself. Only rank 0 reads and writes the index.
    `why`: filled with the reason of each shard this process found unreadable."""
    known = read_index(index_path) if rank == 0 or add_up is None else {}
    counts = [known.get(u, _MISSING) for u in urls]
    if add_up is not None:  # rank 0's reading of the index, on every rank
        counts = add_up(counts if rank == 0 else [0] * len(urls))
    missing = [i for i, n in enumerate(counts) if n == _MISSING]
    if not missing:
        return counts
    mine = missing[rank::world_size] if add_up is not None else missing
    counted, truncated = [0] * len(urls), [0] * len(urls)
    if mine:
        with ThreadPoolExecutor(min(threads, len(mine))) as pool:
            for i, (n, cut) in zip(mine, pool.map(lambda i: _count(urls[i], retries, say, cache, why), mine)):
                counted[i], truncated[i] = n, int(cut)
    if add_up is not None:
        both = add_up(counted + truncated)
        counted, truncated = both[: len(urls)], both[len(urls) :]
    counts = [counted[i] if n == _MISSING else n for i, n in enumerate(counts)]
    if rank == 0 and index_path:
        # an unreadable or truncated shard is not kept: the next run counts it again (a transfer cut short, a
        # shard being written, repaired since)
        known.update({urls[i]: counts[i] for i in missing if counts[i] >= 0 and not truncated[i]})
        write_index(index_path, known)
        say(f"counted the samples of {len(missing)} shards: {index_path}")
    return counts


def _count(url: str, retries: int, say: Callable[[str], None], cache=None, why=None) -> tuple[int, bool]:
    """(samples, whether the shard is truncated); UNREADABLE samples for a shard that cannot be read at all."""
    stats = _stats_count(url)
    if stats is not None:
        return stats, False
    try:
        shard = open_shard(url, retries, cache=cache)  # fetched into the cache: the first epoch reads it there
    except ShardError as e:  # whatever the damage: this rank must still reach the collective
        say(f"warning: shard {e.url} is unreadable: {e.why}; it is left out")
        if why is not None:
            why[url] = e.why
        return UNREADABLE, False
    shard.close()
    if shard.truncated_at is not None:
        say(f"warning: shard {url} is truncated at byte {shard.truncated_at}: {len(shard)} complete samples before it")
    elif len(shard) == 0:
        say(f"warning: shard {url} holds no samples (an empty tar)")
    return len(shard), shard.truncated_at is not None


def _stats_count(url: str) -> int | None:
    """img2dataset's count of the samples it wrote into the shard, from NAME_stats.json beside NAME.tar."""
    if not url.endswith(".tar") or storage.scheme(url) == "pipe":
        return None
    stats_url = url[: -len(".tar")] + "_stats.json"
    try:
        if storage.scheme(stats_url) == "local" and not storage.exists(stats_url):
            return None
        n = json.loads(storage.read_bytes(stats_url, retries=1, backoff=0.2))["successes"]
    except (ShardError, ValueError, KeyError, TypeError):
        return None
    return n if isinstance(n, int) and n >= 0 else None
