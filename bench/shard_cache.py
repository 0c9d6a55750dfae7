"""Shards from a distant store: the data-wait share of training steps, each DataLoader worker's memory, and the
requests of epoch 2, before the shard cache and after it, in one run.

    .venv/bin/python bench/shard_cache.py              # 8 shards of 500 256x256 JPEGs (~9 MB each), 2 epochs
    .venv/bin/python bench/shard_cache.py --before REV # the code before the cache: a git worktree of REV

The store: nginx on 127.0.0.1 behind a proxy that answers every request 200 ms late and sends each response at
--rate MB/s (tests/http_shards.py). The run: train_vae.py (--model small: 64x64, a step of ~0.13 s at one thread;
tiny: 32x32, ~0.03 s, as fast as the workers decode),
micro-batch 16, 2 DataLoader workers, 2 epochs, the shards counted beforehand (--shards_index), from each tree:
`before` (REV: each worker fetches a shard whole into memory when its stream reaches it), `after` with
--shuffle_block 1 (the same order, shards fetched ahead into --shard_cache), and `after` with the default shuffle
block (all 8 shards in one block: every worker's batches drawn across them), and the same files read from disk
(the wait that decoding alone leaves). Printed per run: the mean of the
loop's data_wait_share (the share of a step spent waiting for its batch), the wall time, the peak unique memory
(USS) and RSS of a DataLoader worker (sampled every 0.2 s), and the shard requests of the 2 epochs. The
data-wait share is the loop's data_wait_share of each logged window of 5 steps, weighted by the window's length
(the first window, with the workers' start, left out).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import psutil
from common import ROOT  # common puts the repository on sys.path
from stream_resume import cpu_model, make_shards

sys.path.insert(0, os.path.join(ROOT, "tests"))
from http_shards import CuttingProxy, Nginx  # noqa: E402

MODELS = {
    "small": ["--image_size", "64", "--num_tokens", "256", "--hidden_dim", "32", "--codebook_dim", "64",
              "--num_layers", "2"],  # a step of ~0.13 s at one thread: the data keeps up even before
    "tiny": ["--image_size", "32", "--num_tokens", "64", "--hidden_dim", "16", "--codebook_dim", "16",
             "--num_layers", "2"],  # ~0.03 s: the step a GPU would take, where the data must keep up
}  # fmt: skip


def peak_worker_memory(proc: subprocess.Popen, stop: threading.Event, out: dict) -> None:
    """The largest USS and RSS (MiB) of any child of `proc` (its DataLoader workers) while it runs."""
    parent = psutil.Process(proc.pid)
    while not stop.is_set():
        try:
            for child in parent.children():
                mem = child.memory_full_info()
                out["uss"] = max(out.get("uss", 0), mem.uss / 2**20)
                out["rss"] = max(out.get("rss", 0), mem.rss / 2**20)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
        time.sleep(0.2)


def run(tree: str, name: str, flags: list[str], pattern: str, index: str, out: str, proxy, model: str) -> dict:
    run_dir = os.path.join(out, name)
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [
        sys.executable, os.path.join(tree, "train_vae.py"), *MODELS[model], "--wds", "jpg", "--image_folder", pattern,
        "--shards_index", index, "--batch_size", "16", "--num_workers", "2", "--epochs", "2", "--threads", "1",
        "--log_every", "5", "--sample_every", "0", "--save_every_n_steps", "0", "--output_dir", run_dir, "--quiet",
        *flags,
    ]  # fmt: skip
    before = len(proxy.requests)
    stop, memory = threading.Event(), {}
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    watcher = threading.Thread(target=peak_worker_memory, args=(proc, stop, memory), daemon=True)
    watcher.start()
    _, err = proc.communicate()
    stop.set()
    watcher.join()
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{err[-3000:]}")
    wall = time.perf_counter() - t
    with open(os.path.join(run_dir, "vae", "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if '"data_wait_share"' in line]
    # each row's share is of its own window of steps: weighted by the window's length, the share of the whole run
    spans = [b["time"] - a["time"] for a, b in zip(rows, rows[1:])]
    wait = sum(r["data_wait_share"] * s for r, s in zip(rows[1:], spans)) / sum(spans)
    tars = [p for p, _ in proxy.requests[before:] if p.endswith(".tar")]
    return {"wait": wait, "wall": wall, **memory, "requests": len(tars)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="/tmp/shard-cache-bench")
    p.add_argument("--before", default="ea9c817", help="the commit before the shard cache")
    p.add_argument("--rate", type=float, default=10.0, help="MB/s per connection")
    p.add_argument("--latency", type=float, default=0.2)
    p.add_argument("--model", choices=sorted(MODELS), default="small")
    args = p.parse_args(argv)
    urls, _, mean_jpeg = make_shards(args.data, 4000, 500)
    shard_mb = os.path.getsize(urls[0]) / 1e6
    print(f"{cpu_model()}; 8 shards of 500 JPEGs ({shard_mb:.1f} MB each), {args.latency * 1000:.0f} ms latency, "
          f"{args.rate:g} MB/s per connection, the {args.model} dVAE")  # fmt: skip
    out = tempfile.mkdtemp(prefix="shard-cache-bench-")
    before_tree = os.path.join(out, "before")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "-q", "--detach", before_tree, args.before], check=True)
    try:
        folder = os.path.dirname(urls[0])
        with Nginx(folder) as nginx, CuttingProxy(nginx.address, cut_first_n=0, latency=args.latency,
                                                  rate=args.rate * 1e6) as proxy:  # fmt: skip
            names = [os.path.basename(u) for u in urls]
            index = os.path.join(out, "index.json")
            with open(index, "w") as f:
                json.dump({"version": 1, "samples": {proxy.url(n): 500 for n in names}}, f)
            pattern = proxy.url("{00000..00007}.tar").replace("%7B", "{").replace("%7D", "}")
            local = os.path.join(folder, "{00000..00007}.tar")
            runs = [
                ("local files (no store)", ROOT, ["--image_folder", local, "--shards_index", ""]),
                ("before", before_tree, []),
                ("after, --shuffle_block 1", ROOT, ["--shuffle_block", "1", "--shard_cache", os.path.join(out, "c1")]),
                ("after, default block", ROOT, ["--shard_cache", os.path.join(out, "c2")]),
            ]
            print(f"{'run':<26} {'data_wait_share':>15} {'wall s':>7} {'worker USS MiB':>14} {'worker RSS MiB':>14} "
                  f"{'shard requests':>14}")  # fmt: skip
            for name, tree, flags in runs:
                r = run(tree, name.split(",")[0] + str(len(flags)), flags, pattern, index, out, proxy, args.model)
                print(f"{name:<26} {r['wait']:>15.3f} {r['wall']:>7.1f} {r.get('uss', 0):>14.0f} "
                      f"{r.get('rss', 0):>14.0f} {r['requests']:>14}")  # fmt: skip
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", before_tree], check=False)
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    main()
