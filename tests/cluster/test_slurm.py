"""The sbatch files of examples/slurm/, as users submit them, on a real SLURM of 2 hosts: each trains on 2 ranks
(one per host), exports and writes its metrics; a job requeued while it runs resumes from its checkpoint."""

import json
import os
import re
import subprocess
import time

import pytest
from helpers import ROOT
from launch import dalle_args

from dalle_pytorch.training.checkpoints import step_dirs

EXAMPLES = os.path.join(ROOT, "examples", "slurm")


def sbatch(cluster, example, args, cwd, *more, from_checkout=False):
    """Submit examples/slurm/<example> with the script and flags as its arguments; returns the job id. With
    `from_checkout`, as `sbatch --chdir CWD examples/slurm/<example>` typed in the checkout (a relative path)."""
    os.makedirs(cwd, exist_ok=True)
    env = cluster.env(OMP_NUM_THREADS="1")
    path = os.path.relpath(os.path.join(EXAMPLES, example), ROOT) if from_checkout else os.path.join(EXAMPLES, example)
    cmd = ["sbatch", "--parsable", "--nodes=2", "--chdir", str(cwd), *more, path, *args]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30, cwd=ROOT if from_checkout else cwd)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def job(cluster, job_id) -> dict:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], env=cluster.env(), capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def wait(cluster, job_id, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        info = job(cluster, job_id)
        if info.get("JobState") in states:
            return info
        time.sleep(1)
    subprocess.run(["scancel", job_id], env=cluster.env())
    raise AssertionError(f"job {job_id} still {job(cluster, job_id).get('JobState')} after {timeout}s")


def output(cwd, job_id):
    [path] = [os.path.join(cwd, f) for f in os.listdir(cwd) if f.endswith(f"-{job_id}.out")]
    return open(path).read()


CASES = [("torchrun.sbatch", False), ("srun.sbatch", False), ("deepspeed.sbatch", False), ("horovod.sbatch", False),
         ("torchrun.sbatch", True)]  # fmt: skip


@pytest.mark.parametrize("example, from_checkout", CASES, ids=[e + ("-relative" if r else "") for e, r in CASES])
def test_sbatch_example_trains_on_two_hosts(cluster, vae_path, tmp_path, example, from_checkout):
    """Each file as users submit it; the last, by a relative path from the checkout with --chdir elsewhere
    (the file finds the checkout from SLURM_SUBMIT_DIR)."""
    args = dalle_args(vae_path, str(tmp_path / "runs"), 4)
    job_id = sbatch(cluster, example, ["train_dalle.py", *args], tmp_path, from_checkout=from_checkout)
    info = wait(cluster, job_id)
    log = output(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED", f"{info.get('JobState')} {info.get('ExitCode')}\n{log[-5000:]}"
    run = tmp_path / "runs" / "dalle"
    derived = json.load(open(run / "config.json"))["derived"]
    assert derived["world_size"] == 2, derived
    assert info["NodeList"] == "host[a-b]" or info["NodeList"] == "hosta,hostb", info["NodeList"]
    assert (run / "dalle.safetensors").exists()
    assert [json.loads(line)["step"] for line in open(run / "metrics.jsonl")] == [1, 2, 3]


@pytest.mark.slow  # 68 s; make test keeps test_preemption's requeues (SIGTERM, the limit's USR1), same weights
def test_requeued_job_resumes_from_its_checkpoint(cluster, vae_path, tmp_path):
    """`scontrol requeue` of a running job: SLURM stops it and starts it again, and the sbatch file's
    --resume auto continues from the last checkpoint instead of step 0."""
    args = dalle_args(vae_path, str(tmp_path / "runs"), 4, steps=60, extra=["--save_every_n_steps", "5"])
    job_id = sbatch(cluster, "torchrun.sbatch", ["train_dalle.py", *args], tmp_path)
    checkpoints = tmp_path / "runs" / "dalle" / "checkpoints"
    deadline = time.time() + 180
    while not any(d >= str(checkpoints / "step-00000010") for d in step_dirs(str(checkpoints))):
        assert time.time() < deadline, output(tmp_path, job_id)[-3000:]
        time.sleep(0.2)
    subprocess.run(["scontrol", "requeue", job_id], env=cluster.env(), check=True)
    info = wait(cluster, job_id, timeout=400)
    log = output(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED", log[-5000:]
    assert info["Restarts"] == "1", info
    assert "(restart 1)" in log
    assert "Traceback" not in log and "torchrun on host" in log and "SIGTERM, its ranks were told to save" in log
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    assert resumed and int(resumed.group(1)) >= 10, log[-3000:]
    metrics = [json.loads(line)["step"] for line in open(tmp_path / "runs" / "dalle" / "metrics.jsonl")]
    assert metrics[-1] == 60
