"""bench/gpu.sh --cpu: the GPU run's script, at tiny shapes on the CPU, stays green between GPU sessions."""

import os
import subprocess

import pytest
from helpers import ROOT


@pytest.mark.launcher
@pytest.mark.slow  # 110 s on 2 cores: out of `make test`'s 15-minute budget, in `make test-all`
def test_gpu_script_dry_run(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(["bash", "bench/gpu.sh", "--cpu"], cwd=ROOT, env=env, capture_output=True, text=True)
    table = (tmp_path / "gpu.txt").read_text() if (tmp_path / "gpu.txt").exists() else ""
    assert out.returncode == 0, f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    rows = table.strip().splitlines()[1:]
    assert len(rows) == 15 and all(" ok " in r for r in rows), table  # with the evaluation and the VQGAN rows
