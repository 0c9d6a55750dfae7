"""examples/kubernetes/ stays true to the code: the manifests parse, name the operator's fields the README
describes, and their commands' flags are the scripts' flags (parsed by the script's own parser, nothing run).
No Kubernetes cluster here: the pods' environment is tested in tests/launchers/test_kubeflow.py, Ray Train on a
real Ray cluster in tests/cluster/test_ray.py."""

import os
import shlex

import pytest
import yaml
from helpers import ROOT

import train_dalle

EXAMPLES = os.path.join(ROOT, "examples", "kubernetes")


def parsed(argv, monkeypatch):
    """The namespace train_dalle.py would train with."""
    seen = {}
    monkeypatch.setattr(train_dalle, "run_fit", lambda fit, ns, *configs: seen.setdefault("ns", ns))
    train_dalle.main(argv)
    return seen["ns"]


def test_the_pytorchjob(monkeypatch):
    job = yaml.safe_load(open(os.path.join(EXAMPLES, "pytorchjob.yaml")))
    assert job["kind"] == "PyTorchJob" and job["spec"]["nprocPerNode"]
    replicas = job["spec"]["pytorchReplicaSpecs"]
    for spec in replicas.values():
        assert spec["restartPolicy"] == "ExitCode"
        container = spec["template"]["spec"]["containers"][0]
        assert container["name"] == "pytorch"
        assert container["command"][1:3] == ["-m", "distributed.torchrun_agent"]
        shutdown = int(container["command"][container["command"].index("--shutdown_timeout") + 1])
        assert shutdown < spec["template"]["spec"]["terminationGracePeriodSeconds"]  # the ranks save within it
        assert os.path.exists(os.path.join(ROOT, "distributed", "torchrun_agent.py"))
        script, *flags = container["args"]
        assert script == "train_dalle.py"
        ns = parsed(flags, monkeypatch)
        assert ns.exit_code_on_stop >= 128 and ns.exit_code_on_hang >= 128 and ns.resume == "auto"
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert ns.output_dir in mounts  # the shared volume


def test_the_rayjob(monkeypatch):
    job = yaml.safe_load(open(os.path.join(EXAMPLES, "rayjob.yaml")))
    assert job["kind"] == "RayJob"
    python, script, *flags = shlex.split(job["spec"]["entrypoint"])
    assert script == "train_dalle.py"
    ns = parsed(flags, monkeypatch)
    lo, hi = (int(n) for n in ns.ray_workers.split(":"))
    group = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]
    assert group["minReplicas"] <= lo <= hi <= group["maxReplicas"]
    assert ns.global_batch_size and ns.resume == "auto" and ns.ray_max_failures == -1
    import ray

    assert job["spec"]["rayClusterSpec"]["rayVersion"] == ray.__version__


@pytest.mark.parametrize("name", ["pytorchjob.yaml", "rayjob.yaml"])
def test_the_manifests_say_what_to_change(name):
    text = open(os.path.join(EXAMPLES, name)).read()
    assert "What to change" in text and "ReadWriteMany" in text
