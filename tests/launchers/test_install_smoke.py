"""A broken install is caught here, not by users: deepspeed imports, horovod runs a Gloo allreduce."""

import os
import subprocess
import sys

VENV_BIN = os.path.dirname(sys.executable)


def test_deepspeed_imports_with_cpu_accelerator():
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            "import deepspeed; from deepspeed.accelerator import get_accelerator; "
            "print(deepspeed.__version__, get_accelerator().communication_backend_name())",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] in ("gloo", "nccl", "ccl")


def test_horovod_gloo_allreduce_on_two_ranks():
    code = (
        "import torch, horovod.torch as hvd; hvd.init(); "
        "t = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum); "
        "print('RESULT', hvd.rank(), hvd.size(), t.item())"
    )
    out = subprocess.run(
        [os.path.join(VENV_BIN, "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    results = sorted(line.split("RESULT")[1].split() for line in out.stdout.splitlines() if "RESULT" in line)
    assert results == [["0", "2", "3.0"], ["1", "2", "3.0"]]
