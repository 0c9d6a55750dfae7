"""serve.py under load: images per second and p50/p99 latency for 1, 4 and 16 concurrent clients, batched
(--max_batch 16) against one request at a time (--max_batch 1), and against `python generate.py` run once per
request (the model loaded every time). Target: at 16 clients, batching serves at least 3x the images per second
of one-at-a-time.

    .venv/bin/python bench/serve.py             # the demo's shape (scripts/demo.py: dim 192, depth 4, 8x8 tokens)
    .venv/bin/python bench/serve.py --quick     # fewer requests

The model is trained for one step first by the real scripts (random weights otherwise): the speed of sampling
does not depend on what the weights learned. Every client asks for 1 image per request, with its own seed."""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
QUIET = ["--num_workers", "0", "--quiet", "--sample_every", "0", "--dataset_size", "64", "--steps", "1"]


def exports(out: str) -> str:
    """A DALLE export at the demo's shape (train_vae.py's defaults, scripts/demo.py's DALLE flags)."""
    vae = os.path.join(out, "vae", "vae.safetensors")
    subprocess.run([PY, "train_vae.py", *QUIET, "--output_dir", out, "--batch_size", "8"], cwd=ROOT, check=True)
    shape = ["--dim", "192", "--depth", "4", "--heads", "4", "--dim_head", "48", "--text_seq_len", "16"]
    argv = [PY, "train_dalle.py", *QUIET, *shape, "--vae_path", vae, "--output_dir", out, "--batch_size", "8"]
    subprocess.run([*argv, "--tokenizer", "byte"], cwd=ROOT, check=True)
    return os.path.join(out, "dalle", "dalle.safetensors")


class Server:
    def __init__(self, dalle: str, *flags: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        argv = [PY, os.path.join(ROOT, "serve.py"), "--dalle_path", dalle, "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5).read()
                return
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("serve.py did not start") from None
                time.sleep(0.3)

    def ask(self, seed: int) -> float:
        body = json.dumps({"text": "a small red circle above a large blue square", "num_images": 1, "seed": seed})
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/generate", data=body.encode())
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=600) as r:
            assert r.status == 200
            r.read()
        return time.perf_counter() - t0

    def stop(self):
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=30)


def load(server: Server, clients: int, per_client: int) -> tuple[float, float, float]:
    """(images/s, p50 s, p99 s) of `clients` clients each sending `per_client` requests back to back."""
    server.ask(10**6)  # warm: the first batch of each size allocates
    with ThreadPoolExecutor(clients) as pool:
        t0 = time.perf_counter()
        waits = list(pool.map(lambda c: [server.ask(c * 1000 + i) for i in range(per_client)], range(clients)))
        wall = time.perf_counter() - t0
    latencies = sorted(t for client in waits for t in client)
    p99 = latencies[min(len(latencies) - 1, round(0.99 * (len(latencies) - 1)))]
    return len(latencies) / wall, statistics.median(latencies), p99


def per_request_script(dalle: str, runs: int, out: str) -> float:
    """Images per second of `python generate.py` once per request (the model loaded each time)."""
    t0 = time.perf_counter()
    for i in range(runs):
        subprocess.run(
            [PY, "generate.py", "--dalle_path", dalle, "--text", "a small red circle above a large blue square",
             "--num_images", "1", "--seed", str(i), "--outputs_dir", out, "--quiet"],
            cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
    return runs / (time.perf_counter() - t0)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="fewer requests per client")
    args = p.parse_args(argv)
    per = {1: 8, 4: 6, 16: 4} if args.quick else {1: 16, 4: 12, 16: 8}
    with tempfile.TemporaryDirectory() as out:
        dalle = exports(out)
        print(f"model: {dalle} (the demo's shape), 1 image per request, CPU threads: {os.cpu_count()}")
        rows = {}
        for name, flags in (
            ("batched", ["--max_batch", "16", "--max_wait", "0.05"]),
            ("one-at-a-time", ["--max_batch", "1", "--max_wait", "0"]),
        ):
            server = Server(dalle, *flags)
            try:
                for clients, n in per.items():
                    rows[name, clients] = load(server, clients, n)
                    ips, p50, p99 = rows[name, clients]
                    times = f"p50 {p50 * 1000:7.0f} ms   p99 {p99 * 1000:7.0f} ms"
                    print(f"{name:14s} {clients:2d} clients: {ips:6.2f} images/s   {times}")
            finally:
                server.stop()
        script = per_request_script(dalle, 3, os.path.join(out, "outputs"))
        print(f"generate.py per request:  {script:6.2f} images/s (the model loaded for every request)")
    for clients in per:
        ratio = rows["batched", clients][0] / rows["one-at-a-time", clients][0]
        vs_script = rows["batched", clients][0] / script
        print(f"{clients:2d} clients: batched {ratio:.2f}x one-at-a-time, {vs_script:.1f}x generate.py per request")
    ratio = rows["batched", 16][0] / rows["one-at-a-time", 16][0]
    print(f"target at 16 clients: >= 3x one-at-a-time: {'met' if ratio >= 3 else 'NOT met'} ({ratio:.2f}x)")


if __name__ == "__main__":
    main()
