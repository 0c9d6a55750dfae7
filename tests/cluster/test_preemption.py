"""Preempted or hung, on 2 hosts: a signalled SLURM job saves within one step whatever --log_every is, exits well
before SLURM's grace period (KillWait, 30 s here), requeues itself and resumes to the weights of the uninterrupted
run; a rank that stops answering (SIGSTOP) is named by the others within --dist_timeout, and torchrun's restart
resumes from the last checkpoint."""

import json
import os
import re
import signal
import subprocess
import time

from helpers import ROOT
from launch import PORTS, assert_same, dalle_args
from test_slurm import output, sbatch, wait

from dalle_pytorch.files import safe_load
from dalle_pytorch.training.checkpoints import step_dirs

BIN = os.path.dirname(__import__("sys").executable)
STEPS = 300


def long_run(vae_path, out):
    # log and save far apart: only the signal makes the job save mid-run
    args = dalle_args(vae_path, str(out), 4, steps=STEPS)
    return [*args, "--log_every", "1000", "--save_every_n_steps", "1000", "--sample_every", "0"]


def started(run_dir, timeout=120):
    """Wait until the run trains (its step-0 checkpoint exists)."""
    deadline = time.time() + timeout
    while not (run_dir / "checkpoints" / "step-00000000").exists():
        assert time.time() < deadline, "the job did not start training"
        time.sleep(0.2)
    time.sleep(0.5)  # a few steps in


def signalled_job(cluster, vae_path, tmp_path, send):
    """Submit srun.sbatch, signal it with `send(job_id)` once it trains, and follow it to the end."""
    out = tmp_path / "runs"
    job_id = sbatch(cluster, "srun.sbatch", ["train_dalle.py", *long_run(vae_path, out)], tmp_path)
    started(out / "dalle")
    t0 = time.time()
    send(job_id)
    wait(cluster, job_id, states=("PENDING", "REQUEUED", "COMPLETED", "FAILED"), timeout=60)
    stopped_after = time.time() - t0
    info = wait(cluster, job_id, timeout=300)
    log = output(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", (info, log[-4000:])
    saved = re.search(r"SIGTERM: saved a checkpoint at step (\d+)", log)
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    assert saved and resumed and saved.group(1) == resumed.group(1) and 0 < int(saved.group(1)) < STEPS, log[-4000:]
    assert stopped_after < 25, f"the job took {stopped_after:.0f} s to save and leave (KillWait is 30 s)"
    return safe_load(str(out / "dalle" / "dalle.safetensors"))["weights"]


def uninterrupted(cluster, vae_path, tmp_path):
    out = tmp_path / "runs"
    job_id = sbatch(cluster, "srun.sbatch", ["train_dalle.py", *long_run(vae_path, out)], tmp_path)
    info = wait(cluster, job_id)
    assert info["JobState"] == "COMPLETED", output(tmp_path, job_id)[-3000:]
    return safe_load(str(out / "dalle" / "dalle.safetensors"))["weights"]


def test_sigterm_saves_requeues_and_resumes_to_the_same_weights(cluster, vae_path, tmp_path):
    """SIGTERM to the batch script (`sbatch --signal=B:TERM@N`, or preemption): it passes SIGTERM to the tasks."""
    full = uninterrupted(cluster, vae_path, tmp_path / "a")

    def term(job_id):
        subprocess.run(["scancel", "--signal=TERM", "--batch", job_id], env=cluster.env(), check=True)

    assert_same(full, signalled_job(cluster, vae_path, tmp_path / "b", term))


def test_time_limit_signal_saves_requeues_and_resumes(cluster, vae_path, tmp_path):
    """The batch script alone gets USR1 (what `#SBATCH --signal=B:USR1@120` sends before the time limit) and
    passes SIGTERM to the tasks."""
    for name in ("torchrun", "srun", "deepspeed"):
        assert "#SBATCH --signal=B:USR1@" in open(os.path.join(ROOT, "examples", "slurm", f"{name}.sbatch")).read()

    def usr1(job_id):
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=cluster.env(), check=True)

    signalled_job(cluster, vae_path, tmp_path, usr1)


def worker_pid(cluster, host):
    """The training process (not its launcher) running on `host`."""
    for pid in cluster.processes(host):
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().split("\0")
        except OSError:
            continue
        if any(c.endswith("train_dalle.py") for c in cmd) and not any(
            "torchrun" in c or "distributed.run" in c for c in cmd
        ):
            return int(pid)
    return None


def test_a_stopped_rank_is_named_and_the_restart_resumes(cluster, vae_path, tmp_path):
    """SIGSTOP rank 1 (on hostb) mid-run: rank 0 stops within --dist_timeout plus the diagnosis, naming rank 1 and
    its host; torchrun --max-restarts starts both again, and they resume from the last checkpoint."""
    port = next(PORTS)
    args = dalle_args(vae_path, str(tmp_path), 4, steps=150)
    args += ["--log_every", "1000", "--save_every_n_steps", "10", "--sample_every", "0", "--dist_timeout", "10"]
    args += ["--resume", "auto"]  # what torchrun's restart needs to continue (nothing to resume at the start)
    rdzv = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"hosta:{port}", "--rdzv_id", "hang"]
    torchrun = [f"{BIN}/torchrun", "--nnodes", "2", "--nproc_per_node", "1", "--max-restarts", "1", *rdzv]
    env = cluster.env(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    procs = [
        cluster.popen(
            h, [*torchrun, os.path.join(ROOT, "train_dalle.py"), *args], env=env, stdout=-1, stderr=-2, text=True
        )
        for h in cluster.names
    ]
    checkpoints = tmp_path / "dalle" / "checkpoints"
    deadline = time.time() + 120
    while not any(d >= str(checkpoints / "step-00000020") for d in step_dirs(str(checkpoints))):
        assert time.time() < deadline and all(p.poll() is None for p in procs), "the run did not reach step 20"
        time.sleep(0.2)
    stopped = worker_pid(cluster, "hostb")
    os.kill(stopped, signal.SIGSTOP)
    t0 = time.time()
    log = tmp_path / "dalle" / "train.log"
    while "did not answer" not in log.read_text():
        assert time.time() - t0 < 60, log.read_text()[-3000:]
        time.sleep(0.2)
    named_after = time.time() - t0
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
        try:
            os.kill(stopped, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = log.read_text()
    assert "error: rank 1 on hostb did not answer within --dist_timeout 10 s" in text, text[-3000:]
    assert named_after < 10 + 20, f"named after {named_after:.0f} s"
    resumed = re.search(r"resumed from \S+ at step (\d+)", text)
    assert resumed and int(resumed.group(1)) >= 20, (text[-3000:], outs[0][-3000:])
    assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
    assert "done at step 150" in text


def test_a_lost_host_resumes_on_the_one_left(cluster, vae_path, tmp_path):
    """hostb dies mid-run (its slurmd and every process on it killed): rank 0 stops at once, naming it; SLURM
    ends the job. Submitted again on the one host left (`sbatch -N 1`, as the README says), the run resumes from
    its last checkpoint on 1 rank instead of 2, with the same global batch (accumulation 2 instead of 1)."""
    out = tmp_path / "runs"
    args = dalle_args(vae_path, str(out), 4, steps=STEPS, extra=["--global_batch_size", "8"])
    args += ["--log_every", "1000", "--save_every_n_steps", "20", "--sample_every", "0", "--dist_timeout", "20"]
    job_id = sbatch(cluster, "srun.sbatch", ["train_dalle.py", *args], tmp_path)
    checkpoints = out / "dalle" / "checkpoints"
    deadline = time.time() + 120
    while not any(d >= str(checkpoints / "step-00000040") for d in step_dirs(str(checkpoints))):
        assert time.time() < deadline, output(tmp_path, job_id)[-3000:]
        time.sleep(0.2)
    try:
        cluster.kill_host("hostb")
        # SLURM requeues a job that lost a node (--requeue); it would wait for 2 hosts: cancel it
        first = wait(cluster, job_id, states=("PENDING", "REQUEUED", "FAILED", "NODE_FAIL", "COMPLETED"), timeout=120)
        subprocess.run(["scancel", job_id], env=cluster.env())
        again = sbatch(cluster, "srun.sbatch", ["train_dalle.py", *args], tmp_path, "--nodes=1")
        info = wait(cluster, again, timeout=300)
    finally:
        cluster.revive_host("hostb")
    first_log, log = output(tmp_path, job_id), output(tmp_path, again)
    assert first["JobState"] != "COMPLETED", first_log[-4000:]
    assert "rank 1 on hostb did not answer" in first_log, first_log[-4000:]
    assert info["JobState"] == "COMPLETED" and info["NodeList"] == "hosta", (info, log[-4000:])
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    assert resumed and int(resumed.group(1)) >= 40, log[-4000:]
    assert "global batch 8 = 4 per rank x 1 ranks x 2 accumulation" in log, log[-4000:]
    assert f"done at step {STEPS}" in log


def test_elastic_torchrun_goes_on_alone_when_a_host_dies(cluster, vae_path, tmp_path):
    """torchrun --nnodes 1:2 --max-restarts 3, one agent per host: hostb dies mid-run; hosta's agent restarts its
    worker, rendezvouses again alone and the run finishes from its last checkpoint on 1 rank with the same
    global batch (accumulation 2), nobody resubmitting. Prints the time from the kill to the first step after."""
    port, steps = next(PORTS), 120
    args = dalle_args(vae_path, str(tmp_path), 4, steps=steps, extra=["--global_batch_size", "8"])
    args += ["--log_every", "2", "--save_every_n_steps", "10", "--sample_every", "0", "--dist_timeout", "20"]
    args += ["--resume", "auto"]  # what a restart needs to continue (nothing to resume at the start)
    rdzv = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"hosta:{port}", "--rdzv_id", "elastic"]
    torchrun = [f"{BIN}/torchrun", "--nnodes", "1:2", "--nproc_per_node", "1", "--max-restarts", "3", *rdzv]
    env = cluster.env(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    train = os.path.join(ROOT, "train_dalle.py")
    logs = [open(tmp_path / f"{h}.log", "w") for h in cluster.names]
    procs = [
        cluster.popen(h, [*torchrun, train, *args], env=env, stdout=f, stderr=-2) for h, f in zip(cluster.names, logs)
    ]
    checkpoints = tmp_path / "dalle" / "checkpoints"
    try:
        deadline = time.time() + 180
        while not any(d >= str(checkpoints / "step-00000020") for d in step_dirs(str(checkpoints))):
            assert time.time() < deadline and procs[0].poll() is None, (tmp_path / "hosta.log").read_text()[-3000:]
            time.sleep(0.2)
        lost = time.time()
        cluster.kill_host("hostb")
        procs[0].wait(timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        cluster.revive_host("hostb")
    text, agent = (tmp_path / "dalle" / "train.log").read_text(), (tmp_path / "hosta.log").read_text()
    assert procs[0].returncode == 0, agent[-4000:] + text[-3000:]
    resumed = re.search(r"resumed from \S+ at step (\d+)", text)
    assert resumed and int(resumed.group(1)) >= 20, text[-3000:]
    assert "global batch 8 = 4 per rank x 1 ranks x 2 accumulation" in text, text[-3000:]
    assert f"done at step {steps}" in text
    rows = [json.loads(r) for r in (tmp_path / "dalle" / "metrics.jsonl").read_text().splitlines()]
    after = [r["time"] for r in rows if r.get("time", 0) > lost and "loss" in r]
    print(f"torchrun --nnodes 1:2: hostb lost, first step after recovery {after[0] - lost:.1f} s after the kill")
