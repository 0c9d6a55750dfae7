"""Each launcher trains 2 ranks on 2 hosts (one rank per host, each host its own address and name) and equals
the 1-process run with the whole batch, as tests/launchers/test_launchers.py checks on loopback."""

import os
import sys

import pytest
from helpers import ROOT
from launch import NORM_RTOL, PORTS, assert_same, dalle_args, grad_norms

from dalle_pytorch.files import safe_load

PY = sys.executable
BIN = os.path.dirname(PY)
TRAIN = os.path.join(ROOT, "train_dalle.py")
MPIRUN = ["mpirun", "--allow-run-as-root", "-np", "2", "-H", "hosta:1,hostb:1"]
# the namespaces' only network is eth0; mpirun's own wiring would try every interface
MPIRUN += ["--mca", "btl_tcp_if_include", "eth0", "--mca", "oob_tcp_if_include", "eth0"]
MPIRUN += ["-x", "PATH", "-x", "PYTHONPATH", "-x", "OMP_NUM_THREADS"]


def env(cluster):
    return cluster.env(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def on_both(cluster, argv_of_host, timeout=300):
    """One process per host, started together; both must succeed. Returns their outputs."""
    procs = [
        cluster.popen(h, argv_of_host(i, h), env=env(cluster), stdout=-1, stderr=-2, text=True, cwd=ROOT)
        for i, h in enumerate(cluster.names)
    ]
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except Exception:
            for q in procs:
                q.kill()
            raise
    failed = "\n".join(f"--- {h}\n{o[-3000:]}" for h, o in zip(cluster.names, outs))
    assert all(p.returncode == 0 for p in procs), failed
    return outs


def on_first(cluster, argv, timeout=300):
    out = cluster.run(cluster.names[0], argv, env=env(cluster), timeout=timeout, cwd=ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out.stdout + out.stderr


def assert_equals_reference(run_dir, reference, launcher):
    ref_weights, ref_norms = reference[8]
    assert grad_norms(run_dir) == pytest.approx(ref_norms, rel=NORM_RTOL)
    assert_same(ref_weights, safe_load(os.path.join(run_dir, "dalle.safetensors"))["weights"])
    import json

    derived = json.load(open(os.path.join(run_dir, "config.json")))["derived"]
    assert derived["world_size"] == 2 and derived["launcher"] == launcher, derived


def test_torchrun_one_agent_per_host(cluster, vae_path, reference, tmp_path):
    port = next(PORTS)
    args = dalle_args(vae_path, str(tmp_path), 4)
    rdzv = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"hosta:{port}", "--rdzv_id", "cluster-test"]
    on_both(cluster, lambda i, h: [f"{BIN}/torchrun", "--nnodes", "2", "--nproc_per_node", "1", *rdzv, TRAIN, *args])
    assert_equals_reference(os.path.join(tmp_path, "dalle"), reference, "torchrun")


def test_deepspeed_launcher_per_node(cluster, vae_path, reference, tmp_path):
    """deepspeed's multi-node form with a hostfile, one launcher per host (--no_ssh, as under srun)."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("hosta slots=1\nhostb slots=1\n")
    port = str(next(PORTS))
    args = dalle_args(vae_path, str(tmp_path), 4, extra=["--zero_stage", "2"])
    ds = [f"{BIN}/deepspeed", "--hostfile", str(hostfile), "--master_addr", "hosta", "--master_port", port]
    on_both(cluster, lambda i, h: [*ds, "--no_ssh", "--node_rank", str(i), TRAIN, *args])
    assert_equals_reference(os.path.join(tmp_path, "dalle"), reference, "deepspeed")


def test_horovodrun_over_ssh(cluster, vae_path, reference, tmp_path):
    """horovodrun on the first host starts both ranks over ssh and wires Gloo across the hosts."""
    args = dalle_args(vae_path, str(tmp_path), 4)
    on_first(cluster, [f"{BIN}/horovodrun", "--gloo", "-np", "2", "-H", "hosta:1,hostb:1", PY, TRAIN, *args])
    assert_equals_reference(os.path.join(tmp_path, "dalle"), reference, "horovod")


@pytest.mark.parametrize("backend", ["auto", "deepspeed"])
def test_mpirun(cluster, vae_path, reference, tmp_path, backend):
    """mpirun across the hosts: the ranks meet on the first host's address (not 127.0.0.1); `auto` picks DDP,
    since this Horovod (Gloo only) cannot start under mpirun."""
    args = dalle_args(vae_path, str(tmp_path), 4, extra=["--distributed_backend", backend])
    out = on_first(cluster, [*MPIRUN, "-x", f"MASTER_PORT={next(PORTS)}", PY, TRAIN, *args])
    run = os.path.join(tmp_path, "dalle")
    assert_equals_reference(run, reference, "mpi")
    import json

    derived = json.load(open(os.path.join(run, "config.json")))["derived"]
    assert derived["backend"] == ("ddp" if backend == "auto" else "deepspeed"), (derived, out[-2000:])


def test_horovod_under_mpirun_is_refused_in_one_line(cluster, vae_path, tmp_path):
    args = dalle_args(vae_path, str(tmp_path), 4, extra=["--distributed_backend", "horovod"])
    out = cluster.run("hosta", [*MPIRUN, PY, TRAIN, *args], env=env(cluster), timeout=120, cwd=ROOT)
    assert out.returncode != 0
    assert "horovodrun --gloo" in out.stdout + out.stderr


def test_a_host_that_cannot_see_the_run_directory_stops_in_one_line(cluster, vae_path, tmp_path):
    """hostb gets its own private --output_dir (a tmpfs over it in a mount namespace of its own), as a node-local
    /tmp would be: both ranks stop at start, saying that --output_dir must be on storage every host sees."""
    port = next(PORTS)
    args = dalle_args(vae_path, str(tmp_path), 4)
    rdzv = ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"hosta:{port}", "--rdzv_id", "private-storage"]
    torchrun = [f"{BIN}/torchrun", "--nnodes", "2", "--nproc_per_node", "1", *rdzv, TRAIN, *args]
    private = ["unshare", "--mount", "sh", "-c", 'mount -t tmpfs private "$0" && exec "$@"', str(tmp_path)]
    procs = [
        cluster.popen(
            h, [*(private if h == "hostb" else []), *torchrun], env=env(cluster), stdout=-1, stderr=-2, text=True
        )
        for h in cluster.names
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode != 0 for p in procs), outs
    for out in outs:
        assert "error: rank 1 cannot see" in out and "must be on storage every host sees" in out, out[-3000:]
    assert not (tmp_path / "dalle" / "checkpoints").exists() or not any((tmp_path / "dalle" / "checkpoints").iterdir())
