"""Crashes and preemption: SIGTERM saves and exits cleanly; torchrun --max-restarts resumes by itself;
Horovod elastic loses a worker and takes a new one without stopping."""

import os
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from helpers import ROOT, TINY_DALLE_MODEL, TINY_VAE_MODEL

import train_vae
from dalle_pytorch.files import safe_load
from dalle_pytorch.training.checkpoints import step_dirs

BIN = os.path.dirname(sys.executable)


@pytest.fixture(scope="module")
def vae_path(tmp_path_factory):
    return train_vae.main(
        [
            *TINY_VAE_MODEL,
            "--batch_size",
            "8",
            "--num_workers",
            "0",
            "--quiet",
            "--dataset_size",
            "100",
            "--steps",
            "2",
            "--output_dir",
            str(tmp_path_factory.mktemp("vae")),
        ]
    )


def dalle(vae_path, out, steps, save_every):
    return [
        os.path.join(ROOT, "train_dalle.py"),
        "--vae_path",
        vae_path,
        *TINY_DALLE_MODEL,
        "--batch_size",
        "4",
        "--num_workers",
        "0",
        "--quiet",
        "--dataset_size",
        "400",
        "--log_every",
        "1",
        "--steps",
        str(steps),
        "--output_dir",
        out,
        "--save_every_n_steps",
        str(save_every),
        "--keep_n_checkpoints",
        "3",
        "--sample_every",
        "0",
        "--resume",
        "auto",
    ]


def wait_for(predicate, timeout=120):
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        time.sleep(0.2)
    raise TimeoutError("condition not reached")


def metric_rows(run):
    path = os.path.join(run, "metrics.jsonl")
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def test_sigterm_saves_and_resume_continues(vae_path, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, *dalle(vae_path, str(tmp_path), 2000, 0)],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = os.path.join(tmp_path, "dalle")
    wait_for(lambda: metric_rows(run) >= 3)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM: saved a checkpoint at step" in out
    newest = step_dirs(os.path.join(run, "checkpoints"))[0]
    stopped = int(newest.rsplit("-", 1)[1])
    assert 3 <= stopped < 2000
    out = subprocess.run(
        [sys.executable, *dalle(vae_path, str(tmp_path), stopped + 2, 0)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert f"resumed from {newest} at step {stopped}" in out


def test_torchrun_restarts_after_a_killed_rank(vae_path, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    port = str(29900 + os.getpid() % 90)
    proc = subprocess.Popen(
        [
            os.path.join(BIN, "torchrun"),
            "--nproc_per_node",
            "2",
            "--max-restarts",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            *dalle(vae_path, str(tmp_path), 300, 20),
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    ckpts = os.path.join(tmp_path, "dalle", "checkpoints")
    wait_for(lambda: any(d.endswith("step-00000020") for d in step_dirs(ckpts)))
    workers = [
        p for p in psutil.Process(proc.pid).children(recursive=True) if "train_dalle.py" in " ".join(p.cmdline())
    ]
    assert len(workers) == 2
    workers[1].send_signal(signal.SIGKILL)  # a rank dies mid-run
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-4000:]
    log = open(os.path.join(tmp_path, "dalle", "train.log")).read()
    assert "resumed from" in log and "done at step 300" in log


@pytest.mark.launchers
@pytest.mark.slow  # 80 s: make test-launchers and make test-all; make test keeps the torchrun and Ray elastic runs
def test_horovod_elastic_loses_a_worker_then_takes_a_new_one(vae_path, tmp_path):
    """horovodrun --min-np 1 --max-np 2 on two "hosts" (localhost and 127.0.0.1, both this machine): rank 0
    is killed, the other worker rolls back to its last commit, becomes rank 0 (and the run's writer) and
    goes on alone; then a third host (this machine's name) appears in discovery, its worker joins at a
    commit, takes rank 0's state (the sync checks that both hold the same weights) and both finish."""
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:1\n127.0.0.1:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(0o755)
    args = dalle(vae_path, str(tmp_path), 240, 100)
    args += ["--commit_every", "5", "--tokenizer", "yttm"]  # yttm: a startup barrier the joining worker must skip
    args += ["--ema", "0.99"]  # rolled back with the weights, handed to the joiner (the sync checks both hold it)
    proc = subprocess.Popen(
        [
            os.path.join(BIN, "horovodrun"),
            "--gloo",
            "--network-interface",
            "lo",
            "-np",
            "2",
            "--min-np",
            "1",
            "--max-np",
            "2",
            "--host-discovery-script",
            str(discover),
            sys.executable,
            *args,
        ],
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    run = os.path.join(tmp_path, "dalle")
    try:
        wait_for(lambda: metric_rows(run) >= 30)
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.cmdline()[1:2] == [args[0]]]
        assert len(workers) == 2
        victim = next(p for p in workers if p.environ()["HOROVOD_RANK"] == "0")  # the one writing the run's files
        survivor = next(p for p in workers if p is not victim).environ()["HOROVOD_HOSTNAME"]
        victim.send_signal(signal.SIGKILL)
        log = os.path.join(run, "train.log")
        wait_for(lambda: "x 1 ranks" in open(log).read())  # the survivor goes on alone
        rows = metric_rows(run)
        wait_for(lambda: metric_rows(run) >= rows + 20)
        hosts.write_text(f"{survivor}:1\n{socket.gethostname()}:1\n")
        wait_for(lambda: open(log).read().count("x 2 ranks") == 2)  # the first start, then the join
        out = proc.communicate(timeout=300)[0]
    except TimeoutError:
        proc.kill()
        raise AssertionError("stalled:\n" + proc.communicate()[0][-6000:]) from None
    finally:
        proc.kill()
    assert proc.returncode == 0, out[-4000:]
    assert "continuing on 1 workers" in out and "continuing on 2 workers" in out
    assert "done at step 240" in open(log).read()
    assert safe_load(os.path.join(run, "dalle.safetensors"))["ema"]["decay"] == 0.99
