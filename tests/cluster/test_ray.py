"""Ray Train as the launcher on a real 2-node Ray cluster: `ray start --head` on hosta, `ray start --address` on
hostb (one CPU each, so each worker lands on its own host), stopped by pid (`ray stop` would end every Ray on the
machine). Two workers equal the 1-process run; an elastic run (--ray_workers 1:2) that loses hostb goes on alone
from its checkpoint with the same global batch, takes hostb in again when it is back, and ends with the weights
of the uninterrupted run; a cluster too small for the workers is one line."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from cluster_hosts import INSTANCE
from helpers import ROOT
from launch import assert_same, dalle_args
from test_across_hosts import assert_equals_reference

from dalle_pytorch.files import safe_load

PY = sys.executable
RAY = os.path.join(os.path.dirname(PY), "ray")
TRAIN = os.path.join(ROOT, "train_dalle.py")
PORT = 6379


class RayCluster:
    """A Ray head on the first host and a node on the second; every process each started is found in its
    host's network namespace (whatever was there before is the host's own: sshd, slurmd)."""

    def __init__(self, cluster):
        self.cluster, self.head = cluster, cluster.names[0]
        self.address = f"{cluster.addr[self.head]}:{PORT}"
        self.token = os.path.join(cluster.root, "ray_token")
        with open(self.token, "w") as f:
            f.write(os.urandom(32).hex())
        # Ray's token authentication, as a cluster of real hosts would have it: one token file every node reads
        self.env = cluster.env(
            OMP_NUM_THREADS="1", PYTHONPATH=ROOT, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=self.token
        )
        self.own = {h: cluster.processes(h) for h in cluster.names}

    def start(self, host):
        # a temporary folder per node (both hosts share this machine's /tmp), short: Ray's socket paths must fit
        argv = [RAY, "start", "--num-cpus", "1", "--disable-usage-stats", "--temp-dir", f"/tmp/ray{INSTANCE}-{host}"]
        argv += ["--node-ip-address", self.cluster.addr[host]]
        argv += ["--head", "--port", str(PORT)] if host == self.head else ["--address", self.address]
        out = self.cluster.run(host, argv, env=self.env, timeout=120)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]

    def wait_nodes(self, n, timeout=60):
        probe = f"import ray; ray.init(address={self.address!r}); print(len([x for x in ray.nodes() if x['Alive']]))"
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = self.cluster.run(self.head, [PY, "-c", probe], env=self.env, timeout=60)
            if out.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            time.sleep(2)
        raise AssertionError(f"the Ray cluster did not reach {n} nodes: {out.stdout[-500:]} {out.stderr[-1500:]}")

    def stop(self, host):
        """The host's Ray (raylet, its workers, the head's services) killed at once, as when the host dies."""
        for pid in self.cluster.processes(host) - self.own[host]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def down(self):
        for host in self.cluster.names:
            self.stop(host)
            shutil.rmtree(f"/tmp/ray{INSTANCE}-{host}", ignore_errors=True)


@pytest.fixture(scope="module")
def ray_cluster(cluster):
    ray = RayCluster(cluster)
    try:
        for host in cluster.names:
            ray.start(host)
        ray.wait_nodes(2)
        yield ray
    finally:
        ray.down()


def driver(ray, args, log):
    """The script with --ray_workers on the head's host; its output (Ray forwards every worker's) into `log`."""
    with open(log, "w") as f:
        proc = ray.cluster.popen(
            ray.head, [PY, TRAIN, *args, "--ray_address", ray.address], env=ray.env, cwd=ROOT, stdout=f, stderr=-2
        )
    proc.log = log
    return proc


def output(proc) -> str:
    return open(proc.log).read()


def finish(proc, timeout=300, status=0):
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise AssertionError(f"the driver did not finish within {timeout} s:\n{output(proc)[-6000:]}") from None
    assert proc.returncode == status, output(proc)[-6000:]
    return output(proc)


def test_two_workers_on_two_hosts_equal_one_process(ray_cluster, vae_path, reference, tmp_path):
    args = dalle_args(vae_path, str(tmp_path), 4, extra=["--distributed_backend", "fsdp", "--ray_workers", "2"])
    out = finish(driver(ray_cluster, args, tmp_path / "driver.log"))
    assert "ip=198.18." in out  # the workers' lines, as Ray forwards them from the hosts
    assert_equals_reference(os.path.join(tmp_path, "dalle"), reference, "ray")


SLOW_HOOK = """
import os, time
from dalle_pytorch.training.hooks import Hooks

class Slow(Hooks):  # 0.4 s a step, time to kill a host mid-run; alone, it waits at step 12 for the host to come back
    def after_step(self, ctx, step):
        if not os.path.exists({go!r}):
            time.sleep(0.4)
        while ctx.world_size == 1 and step >= 12 and not os.path.exists({go!r}):
            time.sleep(0.2)
"""


def test_elastic_run_survives_a_lost_host_and_takes_it_back(ray_cluster, vae_path, tmp_path):
    """--ray_workers 1:2: hostb's Ray is killed after the first checkpoint; the run goes on with 1 worker and
    accumulation 2 from that checkpoint, grows to 2 again once hostb's Ray is back, and ends with the weights of
    the uninterrupted 1-process run (every step done once in the end, the global batch 8 throughout)."""
    import train_dalle

    steps, go = 24, str(tmp_path / "go")
    (tmp_path / "slow.py").write_text(SLOW_HOOK.format(go=go))
    ref = safe_load(train_dalle.main(dalle_args(vae_path, str(tmp_path / "ref"), 8, steps=steps)))["weights"]

    elastic = ["--global_batch_size", "8", "--ray_max_failures", "3", "--ray_resize_every", "5", "--ray_wait", "20"]
    args = dalle_args(vae_path, str(tmp_path / "el"), 4, steps=steps, extra=["--save_every_n_steps", "4"])
    args += ["--ray_workers", "1:2", *elastic, "--hooks", f"{tmp_path / 'slow.py'}:Slow", "--dist_timeout", "30"]
    run = tmp_path / "el" / "dalle"
    proc = driver(ray_cluster, args, tmp_path / "driver.log")
    try:
        wait_for(lambda: os.path.isdir(run / "checkpoints" / "step-00000004"), proc, "the first checkpoint")
        lost = time.time()
        ray_cluster.stop("hostb")
        wait_for(lambda: rows(run, after=lost), proc, "a step after hostb was lost")
        recovered = rows(run, after=lost)[0]["time"] - lost
        ray_cluster.start("hostb")
        wait_for(lambda: worlds(run)[-1:] == [2] and len(worlds(run)) >= 3, proc, "the run growing back to 2")
        open(go, "w").close()
        out = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    print(f"hostb lost: first step after recovery {recovered:.1f} s after the kill")
    assert worlds(run)[:2] == [2, 1], worlds(run)  # 2 workers, then 1 (accumulation 2), then 2 again
    log = open(run / "train.log").read()
    assert "4 per rank x 1 ranks x 2 accumulation" in log and log.count("resumed from") >= 2, log[-3000:]
    assert json.load(open(run / "config.json"))["derived"]["global_batch_size"] == 8
    assert_same(ref, safe_load(str(run / "dalle.safetensors"))["weights"])
    assert "A worker health check failed" in out  # Ray's account of the lost worker


def test_more_workers_than_the_cluster_can_place_is_one_line(ray_cluster, vae_path, tmp_path):
    args = dalle_args(vae_path, str(tmp_path), 4, extra=["--ray_workers", "3", "--ray_wait", "5"])
    out = finish(driver(ray_cluster, args, tmp_path / "driver.log"), timeout=120, status=2)
    last = out.strip().splitlines()[-1]
    assert last.startswith("error: --ray_workers 3 needs 3 CPUs") and "2 CPUs and 0 GPUs on 2 node(s)" in last, out


def rows(run, after):
    path = run / "metrics.jsonl"
    lines = open(path).read().splitlines() if path.exists() else []
    return [r for r in map(json.loads, lines) if r.get("time", 0) > after and "loss" in r]


def worlds(run):
    """The world size of each start of the run, from its train.log ("... x N ranks x ...")."""
    path = run / "train.log"
    text = open(path).read() if path.exists() else ""
    return [int(line.split(" ranks x ")[0].split()[-1]) for line in text.splitlines() if " ranks x " in line]


def wait_for(ready, proc, what, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if ready():
            return
        if proc.poll() is not None:
            raise AssertionError(f"the driver ended before {what}:\n{output(proc)[-6000:]}")
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout} s")
