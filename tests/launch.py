"""The real scripts under the real launchers (torchrun, deepspeed, horovodrun) on 2 local ranks, and how
their results are compared: shared by the launcher tests and the model and compat tests that launch."""

import glob
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile

from helpers import ONE_THREAD, ROOT, TINY_DALLE_MODEL, TINY_VAE_MODEL

BIN = os.path.dirname(sys.executable)
PORTS = itertools.count(29700 + os.getpid() % 200)
# Tolerance: fp32 sums run in another order on 2 ranks, and Adam divides by sqrt(v), which turns a
# rounding difference in a near-zero gradient into a visible one in that weight. So, in every tensor:
# every weight within 1e-3 (a third of one step at the learning rate used, 3e-3) and at most 0.5% of its
# weights (at least one) beyond 1e-5. Per tensor, so that one wrong tensor cannot hide among the others.
# Adam is blind to a uniform gradient scale (a sum instead of a mean), so the gradient norm that each
# step logs, taken after synchronization and before clipping, must match too (relative 1e-4).
CLOSE, FAR, NORM_RTOL = 1e-5, 1e-3, 1e-4

TINY_VAE = [
    *TINY_VAE_MODEL,
    *ONE_THREAD,
    "--num_workers",
    "0",
    "--quiet",
    "--dataset_size",
    "200",
    "--log_every",
    "1",
    "--sample_every",
    "2",
]


def dalle_args(vae_path, out, batch, steps=3, extra=()):
    return [
        "--vae_path",
        vae_path,
        *TINY_DALLE_MODEL,
        *ONE_THREAD,
        "--batch_size",
        str(batch),
        "--num_workers",
        "0",
        "--quiet",
        "--dataset_size",
        "200",
        "--log_every",
        "1",
        "--steps",
        str(steps),
        "--output_dir",
        out,
        "--warmup_steps",
        "0",
        "--learning_rate",
        "3e-3",
        "--clip_grad_norm",
        "1.0",
        "--save_every_n_steps",
        "2",
        "--sample_every",
        "2",
        "--sample_captions",
        "a red circle",
        *extra,
    ]


def launch(kind: str, script: str, args: list[str], timeout: int = 300) -> str:
    port = str(next(PORTS))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    script = os.path.join(ROOT, script)
    if kind.startswith("torchrun"):
        cmd = [os.path.join(BIN, "torchrun"), "--nproc_per_node", "2", "--master_port", port, script, *args]
    elif kind == "deepspeed":
        cmd = [os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", port, script, *args]
    elif kind == "horovod":
        cmd = [
            os.path.join(BIN, "horovodrun"),
            "--gloo",
            "-np",
            "2",
            "-H",
            "localhost:2",
            sys.executable,
            script,
            *args,
        ]
    elif kind.startswith("ray"):  # Ray Train workers on a Ray of its own (--ray_address local), 1 CPU each
        cmd = [sys.executable, script, *args, "--ray_workers", "2", "--ray_address", "local"]
        env["RAY_TMPDIR"] = ray_tmp = tempfile.mkdtemp(prefix="ray")  # Ray's session files, removed below
    else:
        raise ValueError(kind)
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    finally:  # DeepSpeed's CPU allreduce segments (66 MB per rank, in RAM): our backend unlinks them
        leaked = glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")
        for path in leaked:
            os.remove(path)  # a failed run's too, so that failures do not fill the machine's memory
        if kind.startswith("ray"):
            shutil.rmtree(ray_tmp, ignore_errors=True)
    assert out.returncode == 0, f"{kind} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    assert not leaked, f"{kind} left shared memory behind: {leaked}"
    return out.stdout


def grad_norms(run_dir):
    return [json.loads(line)["grad_norm"] for line in open(os.path.join(run_dir, "metrics.jsonl"))]


def assert_same(a: dict, b: dict, far: float = FAR, beyond_close: float = 0.005):
    """Every tensor of `b` matches `a`: all of its elements within `far`, at most a fraction `beyond_close`
    of them (and at least one element, for a 32-element bias) beyond CLOSE."""
    assert a.keys() == b.keys(), f"different tensors: {sorted(a.keys() ^ b.keys())}"
    wrong = []
    for k in a:
        assert a[k].shape == b[k].shape, f"{k}: shape {tuple(a[k].shape)} != {tuple(b[k].shape)}"
        diff = (a[k].float() - b[k].float()).abs().flatten()
        if diff.numel() == 0:
            continue
        beyond, allowed = int((diff > CLOSE).sum()), max(1, int(beyond_close * diff.numel()))
        if diff.max() > far or beyond > allowed:
            wrong.append(
                f"{k} {tuple(a[k].shape)}: max difference {diff.max():.2e} (limit {far:.0e}), "
                f"{beyond} of {diff.numel()} elements beyond {CLOSE:.0e} (limit {allowed})"
            )
    assert not wrong, "tensors differ:\n" + "\n".join(wrong)


def restart_from_step_2(src, dst):
    """A copy of a finished 4-step run as if it had died right after its step-2 checkpoint."""
    shutil.copytree(src, dst)
    shutil.rmtree(dst / "checkpoints" / "step-00000004")
    for export in glob.glob(os.path.join(dst, "*.safetensors")):  # dalle.safetensors, vae.safetensors
        os.remove(export)
