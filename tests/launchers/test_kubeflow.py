"""Two pods as Kubeflow's operator starts them, on loopback: each process gets only what the operator sets
(PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT) and runs the command of
examples/kubernetes/pytorchjob.yaml: torchrun through distributed/torchrun_agent.py with no topology flags, or
the script itself. Both equal the 1-process run; a SIGTERM to one pod (the kubelet's, on preemption) makes both
save and exit 143, which the operator's ExitCode restart policy retries, and the restarted pods resume and finish
with 0; a pod whose peer died exits --exit_code_on_hang."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT
from launch import PORTS, assert_same, dalle_args

from dalle_pytorch.files import safe_load

TRAIN = os.path.join(ROOT, "train_dalle.py")
AGENT = [sys.executable, "-m", "distributed.torchrun_agent"]


def pods(command, args, tmp_path, name):
    port = str(next(PORTS))
    procs = []
    for rank in range(2):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "RANK", "WORLD_SIZE", "MASTER_"))}
        env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, PET_NNODES="2", PET_NPROC_PER_NODE="1")
        env.update(PET_NODE_RANK=str(rank), PET_MASTER_ADDR="127.0.0.1", PET_MASTER_PORT=port)
        log = open(tmp_path / f"{name}-pod{rank}.log", "w")
        procs.append(
            subprocess.Popen([*command, TRAIN, *args], env=env, cwd=ROOT, stdout=log, stderr=-2, start_new_session=True)
        )
        procs[-1].log = log.name
    return procs


def wait(procs, timeout=300):
    try:
        for p in procs:
            p.wait(timeout=timeout)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [p.returncode for p in procs], "\n".join(f"--- {p.log}\n" + open(p.log).read()[-3000:] for p in procs)


@pytest.mark.parametrize("command", [AGENT, [sys.executable]], ids=["torchrun", "python"])
def test_two_pods_equal_one_process(command, vae_path, reference, tmp_path):
    codes, logs = wait(pods(command, dalle_args(vae_path, str(tmp_path), 4), tmp_path, "run"))
    assert codes == [0, 0], logs
    ref_weights, _ = reference[8]
    assert_same(ref_weights, safe_load(str(tmp_path / "dalle" / "dalle.safetensors"))["weights"])
    derived = json.load(open(tmp_path / "dalle" / "config.json"))["derived"]
    assert derived["world_size"] == 2 and derived["launcher"] == ("torchrun" if command == AGENT else "kubeflow")


def test_preempted_pods_exit_143_and_resume_when_restarted(vae_path, tmp_path):
    args = dalle_args(vae_path, str(tmp_path), 4, steps=300)
    args += ["--log_every", "1000", "--save_every_n_steps", "1000", "--sample_every", "0", "--resume", "auto"]
    args += ["--exit_code_on_stop", "143"]
    procs = pods(AGENT, args, tmp_path, "first")
    first = tmp_path / "dalle" / "checkpoints" / "step-00000000"
    deadline = time.time() + 120
    while not first.exists():
        assert time.time() < deadline and all(p.poll() is None for p in procs), wait(procs, 1)[1]
        time.sleep(0.2)
    time.sleep(1)
    procs[0].send_signal(signal.SIGTERM)  # the kubelet's SIGTERM to pod 0's command
    codes, logs = wait(procs, timeout=60)
    assert codes == [143, 143], logs  # both pods: the operator retries both
    text = open(tmp_path / "dalle" / "train.log").read()
    assert "SIGTERM: saved a checkpoint at step" in text, text[-2000:]
    codes, logs = wait(pods(AGENT, args, tmp_path, "again"))
    assert codes == [0, 0], logs
    text = open(tmp_path / "dalle" / "train.log").read()
    assert "resumed from" in text and "done at step 300" in text, text[-2000:]


def test_a_pod_whose_peer_died_exits_the_hang_status(vae_path, tmp_path):
    args = dalle_args(vae_path, str(tmp_path), 4, steps=300)
    args += ["--log_every", "1000", "--save_every_n_steps", "1000", "--sample_every", "0"]
    args += ["--dist_timeout", "10", "--exit_code_on_hang", "142"]
    procs = pods([sys.executable], args, tmp_path, "hang")
    first = tmp_path / "dalle" / "checkpoints" / "step-00000000"
    deadline = time.time() + 120
    while not first.exists():
        assert time.time() < deadline and all(p.poll() is None for p in procs), wait(procs, 1)[1]
        time.sleep(0.2)
    os.killpg(procs[1].pid, signal.SIGKILL)  # pod 1's node is gone
    codes, logs = wait(procs, timeout=60)
    assert codes[0] == 142, logs
    assert "error: rank 1 on" in logs and "did not answer" in logs, logs
