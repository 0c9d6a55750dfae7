"""The topology as real cluster launchers describe it: SLURM nodelists and task counts, mpirun across hosts, and
the backend 'auto' picks (one that can start). No processes but scontrol."""

import importlib.util
import shutil
import subprocess
import sys
import types

import pytest

from distributed import topology
from distributed.topology import Topology, resolve_backend, slurm_hostnames, topology_from_env

NODELISTS = {
    "node[1-4]-ib": ["node1-ib", "node2-ib", "node3-ib", "node4-ib"],
    "gpu[07-08,10]": ["gpu07", "gpu08", "gpu10"],
    "a1,b[2-3]": ["a1", "b2", "b3"],
}


@pytest.fixture
def slurm_conf(tmp_path, monkeypatch):
    """The least config scontrol reads: `show hostnames` needs one, but no running slurmctld."""
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=test\nSlurmctldHost=localhost\n")
    monkeypatch.setenv("SLURM_CONF", str(conf))


@pytest.mark.parametrize("nodelist,hosts", NODELISTS.items())
def test_slurm_hostnames_with_scontrol(nodelist, hosts, slurm_conf):
    assert slurm_hostnames(nodelist) == hosts


@pytest.mark.parametrize("nodelist,hosts", NODELISTS.items())
def test_slurm_hostnames_without_scontrol(nodelist, hosts, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert slurm_hostnames(nodelist) == hosts


def test_slurm_hostnames_when_scontrol_has_no_config(tmp_path, monkeypatch):
    if shutil.which("scontrol") is None:
        pytest.skip("scontrol is not installed")
    (tmp_path / "slurm.conf").write_text("")  # no ClusterName: scontrol exits 1 at once, python-hostlist reads it
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    assert slurm_hostnames("gpu[07-08,10]") == ["gpu07", "gpu08", "gpu10"]


@pytest.mark.parametrize("nodelist", ["gpu[07-08,10]", "a1,b[2-3]", "a[1-2]b[3-4]", "gpu[10,07]", "x"])
def test_scontrol_and_python_hostlist_agree(nodelist, slurm_conf):
    import hostlist

    # 'node[1-4]-ib' is left out: SLURM 22.05's scontrol rejects a suffix after a range, so it never writes one
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    assert out.stdout.split() == hostlist.expand_hostlist(nodelist)


def test_a_bad_nodelist_names_the_fix(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="set MASTER_ADDR"):
        slurm_hostnames("gpu[3-2]")


@pytest.mark.parametrize("spec,counts", [("4", [4]), ("2(x3),1", [2, 2, 2, 1]), ("2(x2),1", [2, 2, 1]), ("", [])])
def test_slurm_task_counts(spec, counts):
    assert topology._slurm_counts(spec) == counts


def test_a_bad_slurm_task_count_names_the_fix():
    with pytest.raises(ValueError, match="is not a SLURM task count list"):
        topology._slurm_counts("2(x")


SRUN = {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_JOB_NODELIST": "node[1-4]-ib"}


@pytest.mark.parametrize(
    "more,node,local_world",
    [
        ({"SLURM_TASKS_PER_NODE": "2(x2),1"}, "2", 1),
        ({"SLURM_TASKS_PER_NODE": "2(x2),1"}, "1", 2),
        ({"SLURM_STEP_TASKS_PER_NODE": "1(x2),3", "SLURM_TASKS_PER_NODE": "2(x2),1"}, "2", 3),  # the step wins
        ({"SLURM_NTASKS_PER_NODE": "2"}, "3", 2),  # one number for every node
        ({"SLURM_NNODES": "2"}, "1", 2),  # no counts: 5 tasks // 2 nodes
        ({}, "0", 1),
    ],
)
def test_srun_local_world_size(more, node, local_world, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    t = topology_from_env({**SRUN, **more, "SLURM_NODEID": node})
    assert (t.launcher, t.rank, t.world_size, t.node_rank) == ("slurm", 4, 5, int(node))
    assert t.local_world_size == local_world and t.master_addr == "node1-ib"


def test_srun_master_is_the_steps_first_node(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    t = topology_from_env({**SRUN, "SLURM_STEP_NODELIST": "node[3-4]-ib"})
    assert t.master_addr == "node3-ib"
    assert topology_from_env({**SRUN, "MASTER_ADDR": "10.0.0.1"}).master_addr == "10.0.0.1"


def _ompi(rank, world, local_world, **more):
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": str(world),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % local_world),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_world),
        "OMPI_COMM_WORLD_NODE_RANK": str(rank % local_world),  # what Open MPI sets: not the node's index
        **more,
    }


@pytest.fixture
def mpi4py(monkeypatch):
    """A stand-in mpi4py whose broadcast answers rank 0's host name; None in sys.modules: not installed."""
    calls = []
    comm = types.SimpleNamespace(bcast=lambda obj, root: calls.append(root) or "hostA")
    mpi = types.ModuleType("mpi4py.MPI")
    mpi.COMM_WORLD = comm
    package = types.ModuleType("mpi4py")
    package.MPI = mpi
    monkeypatch.setitem(sys.modules, "mpi4py", package)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", mpi)
    topology._mpi_master_addr.cache_clear()
    yield calls
    topology._mpi_master_addr.cache_clear()


def test_mpirun_across_hosts_asks_rank_0(mpi4py):
    t = topology_from_env(_ompi(3, 4, 2))
    assert (t.launcher, t.rank, t.world_size, t.local_rank, t.local_world_size, t.node_rank) == ("mpi", 3, 4, 1, 2, 1)
    assert t.master_addr == "hostA" and mpi4py == [0]
    topology_from_env(_ompi(3, 4, 2))
    assert mpi4py == [0]  # the broadcast is a collective: once per process, however often the topology is read


def test_mpirun_uses_master_addr_or_localhost_on_one_host(mpi4py):
    assert topology_from_env(_ompi(3, 4, 2, MASTER_ADDR="10.0.0.1")).master_addr == "10.0.0.1"
    assert topology_from_env(_ompi(1, 2, 2)).master_addr == "127.0.0.1"
    assert mpi4py == []


def test_mpirun_across_hosts_without_mpi4py_says_what_to_pass(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)
    topology._mpi_master_addr.cache_clear()
    with pytest.raises(ValueError, match=r"mpirun -x MASTER_ADDR=<first host> -x MASTER_PORT=29500"):
        topology_from_env(_ompi(0, 4, 2))
    assert topology_from_env(_ompi(0, 2, 2)).master_addr == "127.0.0.1"  # one host needs nothing


@pytest.mark.parametrize("has_mpi,backend", [(True, "horovod"), (False, "ddp")])
def test_auto_under_mpirun_picks_a_backend_that_starts(has_mpi, backend, monkeypatch):
    monkeypatch.setattr(topology, "_horovod_has_mpi", lambda: has_mpi)
    assert resolve_backend("auto", Topology("mpi", world_size=4)) == backend
    assert resolve_backend("auto", Topology("slurm", world_size=4)) == "ddp"


def test_horovod_without_mpi_under_mpirun_is_refused(monkeypatch):
    if importlib.util.find_spec("horovod") is None:
        pytest.skip("horovod is not installed")
    monkeypatch.setattr(topology, "_horovod_has_mpi", lambda: False)
    with pytest.raises(ValueError, match=r"built with Gloo only.*horovodrun --gloo.*--distributed_backend ddp"):
        resolve_backend("horovod", Topology("mpi", world_size=4))
    assert resolve_backend("horovod", Topology("horovod", world_size=4)) == "horovod"  # horovodrun --gloo
    monkeypatch.setattr(topology, "_horovod_has_mpi", lambda: True)
    assert resolve_backend("horovod", Topology("mpi", world_size=4)) == "horovod"


def test_without_horovod_auto_is_ddp_and_the_backend_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "horovod", None)
    monkeypatch.setitem(sys.modules, "horovod.torch", None)
    assert not topology._horovod_has_mpi()
    assert resolve_backend("auto", Topology("mpi", world_size=4)) == "ddp"
    assert resolve_backend("horovod", Topology("mpi", world_size=4)) == "horovod"  # make_backend's ImportError


def test_this_machines_horovod(monkeypatch):
    """The real horovod, unpatched: auto under mpirun is horovod only where it has MPI."""
    if importlib.util.find_spec("horovod") is None:
        pytest.skip("horovod is not installed")
    import horovod.torch as hvd

    assert resolve_backend("auto", Topology("mpi", world_size=4)) == ("horovod" if hvd.mpi_built() else "ddp")


# What Kubeflow's operators set in each pod (Trainer's TrainJob, and PyTorchJob with numProcPerNode): torchrun's
# own defaults, PET_*, which torchrun reads when the pod's command is `torchrun SCRIPT` with no topology flags
KUBEFLOW = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_MASTER_ADDR": "job-node-0-0.job"}
KUBEFLOW["PET_MASTER_PORT"] = "29400"


def test_a_kubeflow_pod_running_the_script_itself_is_one_rank():
    t = topology_from_env({**KUBEFLOW, "PET_NODE_RANK": "1"})
    assert t == Topology("kubeflow", 1, 2, 0, 1, 1, "job-node-0-0.job", 29400)
    assert resolve_backend("auto", t) == "ddp"


@pytest.mark.parametrize("more", [{"PET_NPROC_PER_NODE": "4"}, {"PET_NNODES": "1:2"}, {"PET_NPROC_PER_NODE": "cpu"}])
def test_a_kubeflow_pod_asked_for_more_than_python_can_be_says_torchrun(more):
    with pytest.raises(ValueError, match=r"start the script with torchrun, which reads them"):
        topology_from_env({**KUBEFLOW, "PET_NODE_RANK": "0", **more})


def test_torchrun_in_a_kubeflow_pod_is_torchrun():
    """torchrun sets RANK, WORLD_SIZE, ... for its ranks: those win over the pod's PET_* (the agent's input)."""
    env = {**KUBEFLOW, "PET_NODE_RANK": "1", "TORCHELASTIC_RUN_ID": "x", "RANK": "3", "WORLD_SIZE": "4"}
    env.update(LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", GROUP_RANK="1", MASTER_ADDR="10.0.0.1", MASTER_PORT="29400")
    assert topology_from_env(env) == Topology("torchrun", 3, 4, 1, 2, 1, "10.0.0.1", 29400)


def test_a_ray_train_worker():
    env = {"DALLE_LAUNCHER": "ray", "RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    env.update(NODE_RANK="2", MASTER_ADDR="10.0.0.2", MASTER_PORT="41000")
    t = topology_from_env(env)
    assert t == Topology("ray", 2, 3, 0, 1, 2, "10.0.0.2", 41000)
    assert resolve_backend("auto", t) == "ddp"


def test_torchrun_agent_passes_on_a_retryable_status():
    from distributed.torchrun_agent import retryable_status

    assert retryable_status([1, 143]) == 143  # a rank's --exit_code_on_stop
    assert retryable_status([-9, 1]) == 137  # killed: 128 + 9
    assert retryable_status([2, 1]) == 1  # a bad flag: torchrun's own 1, not retried
