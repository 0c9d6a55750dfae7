"""Multi-process scaling on this machine: 2 ranks against 1, per backend, through the real launchers.

    .venv/bin/python bench/scaling.py [--steps 40]

Same per-rank batch and model (the train.py shape: 16x16 image tokens, text 32, dim 256, depth 4); the
1-process run uses all cores, each of the 2 ranks half of them (the scripts split cores among local
ranks). Image tokens are precomputed so that the model's step is what is measured. Prints images/s and
the ratio to 1 process (2.0 would be perfect scaling of throughput with twice the processes on the same
cores, so on one machine a ratio near 1.0 means communication costs little).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def images_per_s(run_dir: str) -> float:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    later = rows[1:] or rows  # the first window includes warm-up
    return sum(r["images_per_s"] for r in later) / len(later)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=8, help="per-rank batch")
    args = p.parse_args(argv)
    tmp = tempfile.mkdtemp(prefix="scaling-")
    env = {**os.environ, "PYTHONPATH": ROOT}
    vae = os.path.join(tmp, "vae", "vae.safetensors")
    subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "train_vae.py"),
            "--image_size",
            "64",
            "--num_layers",
            "2",
            "--num_tokens",
            "1024",
            "--steps",
            "1",
            "--batch_size",
            "4",
            "--output_dir",
            tmp,
            "--quiet",
            "--num_workers",
            "0",
            "--dataset_size",
            "64",
            "--sample_every",
            "0",
        ],
        check=True,
        env=env,
        capture_output=True,
    )
    common = [
        "--vae_path",
        vae,
        "--dim",
        "256",
        "--depth",
        "4",
        "--heads",
        "4",
        "--dim_head",
        "64",
        "--text_seq_len",
        "32",
        "--tokenizer",
        "byte",
        "--batch_size",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--log_every",
        "10",
        "--save_every_n_steps",
        "0",
        "--sample_every",
        "0",
        "--quiet",
        "--num_workers",
        "0",
        "--dataset_size",
        str(args.batch * 2 * args.steps),
        "--precompute_tokens",
        "--sample_captions",
        "x",
    ]
    script = os.path.join(ROOT, "train_dalle.py")
    launches = {
        "single (1 process)": [sys.executable, script],
        "ddp (torchrun, 2)": [
            os.path.join(BIN, "torchrun"),
            "--nproc_per_node",
            "2",
            "--master_port",
            "29561",
            script,
            "--distributed_backend",
            "ddp",
        ],
        "fsdp (torchrun, 2)": [
            os.path.join(BIN, "torchrun"),
            "--nproc_per_node",
            "2",
            "--master_port",
            "29562",
            script,
            "--distributed_backend",
            "fsdp",
        ],
        "deepspeed ZeRO-2 (2)": [
            os.path.join(BIN, "deepspeed"),
            "--num_gpus",
            "2",
            "--master_port",
            "29563",
            script,
            "--zero_stage",
            "2",
        ],
        "horovod (horovodrun, 2)": [
            os.path.join(BIN, "horovodrun"),
            "--gloo",
            "-np",
            "2",
            "-H",
            "localhost:2",
            sys.executable,
            script,
        ],
    }
    results = {}
    for name, cmd in launches.items():
        out = os.path.join(tmp, name.split()[0])
        done = subprocess.run([*cmd, *common, "--output_dir", out], env=env, capture_output=True, text=True)
        if done.returncode != 0:
            print(f"{name}: failed\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
            continue
        results[name] = images_per_s(os.path.join(out, "dalle"))
    base = results.get("single (1 process)")
    print(f"\nper-rank batch {args.batch}, {args.steps} steps, images/s over all ranks")
    for name, ips in results.items():
        ratio = f"{ips / base:.2f}x" if base else "-"
        print(f"{name:26} {ips:8.1f} images/s   {ratio} of 1 process")


if __name__ == "__main__":
    main()
