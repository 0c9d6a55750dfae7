"""Ray Train as a launcher: `python train_dalle.py --ray_workers N ...` runs the script's training on N Ray Train
workers (a TorchTrainer), one process each, with whichever backend the flags choose (DDP, FSDP, DeepSpeed).

Ray starts the workers, sets the torch.distributed variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, ...)
and joins them into a process group with --dist_timeout; each worker then runs the same fit function a launcher's
rank runs (topology: launcher 'ray'). Every other flag keeps its meaning: --output_dir must be on storage every
node sees, the checkpoints are the run's own (Ray keeps none), and after a failure (--ray_max_failures) or an
elastic resize (--ray_workers MIN:MAX) the new workers resume from the run's newest checkpoint, resharded to
their number, with --global_batch_size kept by the accumulation. Ray itself is imported only here, lazily."""

from __future__ import annotations

import contextlib
import io
import os
import secrets
import socket
import sys
import time

from .ray_config import RayOptions
from .topology import topology_from_env

CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the workers import the project from it


def check_launch(opts: RayOptions, cfg) -> tuple[int, int]:
    """The (min, max) workers, after refusing in one line what cannot run on Ray (before the run's plan is made
    for them: its flags, backend and accumulation at each number of workers)."""
    opts.validate()
    lo, hi = opts.worker_range()
    outer = topology_from_env().launcher
    if outer != "none":
        raise ValueError(
            f"--ray_workers starts the workers itself, but this process was started by {outer}: run "
            f"`python {os.path.basename(sys.argv[0]) or 'SCRIPT'} --ray_workers N ...` alone (or drop --ray_workers "
            "to use that launcher)"
        )
    if cfg.distributed_backend == "horovod":
        raise ValueError(
            "--distributed_backend horovod cannot run on --ray_workers (Ray Train 2.60 has no Horovod backend: "
            "its HorovodTrainer is deprecated and refuses to start): use horovodrun, or ddp, fsdp or deepspeed on Ray"
        )
    if cfg.distributed_backend == "single" and hi > 1:
        raise ValueError(f"--distributed_backend single runs one process, not --ray_workers {opts.ray_workers}")
    if lo != hi:
        if not cfg.global_batch_size:
            raise ValueError(
                f"--ray_workers {opts.ray_workers} lets the number of workers change: set --global_batch_size so "
                "that every optimizer step sees the same batch whatever the number (accumulation makes it up)"
            )
    return lo, hi


def run_on_ray(fit, configs: tuple, plan, workers: tuple[int, int], opts: RayOptions, run_dir: str):
    """Run `fit(*configs, plan)` on (min, max) `workers` Ray Train workers (check_launch's), each with the run's
    plan (dalle_pytorch/training/plan.py) moved to its own place in the job; returns what rank 0's returned (the
    export). `run_dir`: the run's directory (where the workers write), for Ray's own records beside the run's."""
    lo, hi = workers
    cfg = plan.cfg
    try:
        import ray
        from ray.train import FailureConfig, RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
        from ray.train.v2.api.exceptions import TrainingFailedError
    except ImportError as e:
        raise ImportError(f"--ray_workers needs Ray Train ({e}): run `make install`") from None

    connect(ray, opts.ray_address)
    gpus = wait_for_room(ray, opts, lo)
    # Ray Train's controller waits this long for a worker group to start (60 s by default) before counting a
    # failure and trying again with what it finds then: after a lost node, Ray still counts the node until its
    # heartbeats are missed, so the first restart may wait for it (Ray passes the variable on to its controller)
    os.environ.setdefault("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", str(opts.ray_wait))
    run_dir = os.path.abspath(run_dir)
    launch = secrets.token_hex(4)
    trainer = TorchTrainer(
        _worker,
        train_loop_config={
            "fit": fit,
            "configs": configs,
            "plan": plan,
            "started": os.path.join(run_dir, f".ray-{launch}"),
        },
        scaling_config=ScalingConfig(
            num_workers=lo if lo == hi else (lo, hi),
            use_gpu=gpus > 0,
            resources_per_worker={"CPU": opts.ray_cpus_per_worker, **({"GPU": 1} if gpus else {})},
            elastic_resize_monitor_interval_s=opts.ray_resize_every,
        ),
        torch_config=TorchConfig(timeout_s=int(max(cfg.dist_timeout, 1))),
        run_config=RunConfig(
            name=f"{os.path.basename(run_dir)}-{launch}",
            storage_path=os.path.join(run_dir, "ray"),
            failure_config=FailureConfig(max_failures=opts.ray_max_failures),
        ),
    )
    try:
        result = trainer.fit()
    except TrainingFailedError as e:  # what the workers said, in one line (their logs above hold the rest)
        print(f"error: the Ray workers failed: {_first_failure(e)}", file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        _remove(os.path.join(run_dir, f".ray-{launch}"))
    return (result.metrics or {}).get("export")


def connect(ray, address: str) -> None:
    """Join the cluster at `address` ('local': start one here), or stop in one line when there is none."""
    # the workers import the project from this checkout (at the same path on every node, like the other launchers)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH", "")]))}
    kwargs = {"runtime_env": {"env_vars": env}, "log_to_driver": True, "logging_level": "WARNING"}
    if address == "local":
        ray.init(**kwargs)
        return
    how = (
        "start one with `ray start --head` on the head node and `ray start --address HEAD:6379` on the others, "
        "pass its --ray_address HOST:PORT, or --ray_address local to start one here"
    )
    if address != "auto":  # Ray retries an address where nothing listens for minutes: ask it first, once
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=10).close()
        except ValueError:
            raise ValueError(f"--ray_address takes HOST:PORT, auto or local (got {address!r})") from None
        except OSError as e:
            raise ConnectionError(f"no Ray cluster at {address} ({e.strerror or e}): {how}") from None
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            ray.init(address=address, **kwargs)
    except (ConnectionError, RuntimeError):
        where = "running on this machine" if address == "auto" else f"at {address}"
        raise ConnectionError(f"no Ray cluster {where}: {how}") from None


def wait_for_room(ray, opts: RayOptions, workers: int) -> int:
    """Wait up to --ray_wait seconds until the cluster has the CPUs (and GPUs, where it has any) for `workers`
    workers; returns the GPUs per node found (0: CPU workers). Ray itself would wait forever, silently."""
    need = workers * opts.ray_cpus_per_worker
    deadline = time.monotonic() + opts.ray_wait
    while True:
        total = ray.cluster_resources()
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
        room = cpus >= need and (not gpus or gpus >= workers)
        if room or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    if not room:
        what = f"{need:g} CPUs ({opts.ray_cpus_per_worker:g} per worker)"
        if gpus:
            what += f" and {workers} GPUs"
        raise TimeoutError(
            f"--ray_workers {opts.ray_workers} needs {what}, but after {opts.ray_wait:g} s the Ray cluster has "
            f"{cpus:g} CPUs and {gpus:g} GPUs on {len(nodes)} node(s): add nodes (`ray start --address ...`), or "
            "ask for fewer workers or --ray_cpus_per_worker"
        )
    return int(gpus)


def _worker(config: dict) -> None:
    """One Ray Train worker: the rank a launcher would have started, running the script's fit function."""
    import ray.train

    os.environ["DALLE_LAUNCHER"] = "ray"  # topology_from_env: RANK, WORLD_SIZE, ... are Ray's
    plan = config["plan"]
    # a restart after a failure or a resize goes on from the run's newest checkpoint
    resume = "auto" if _restarted(config["started"]) else plan.cfg.resume
    export = config["fit"](*config["configs"], plan.on(topology_from_env(), resume=resume))
    ray.train.report({"export": export or ""})


def _restarted(marker: str) -> bool:
    """Whether an earlier worker group of this launch has started (so this one is a restart). Rank 0 leaves
    a marker in the run directory and tells the others through the store of Ray's process group (a store, not a
    collective: under NCCL a collective needs CUDA tensors; each worker group has a store of its own)."""
    import torch.distributed as dist

    seen = False
    if int(os.environ.get("RANK", 0)) == 0:
        os.makedirs(os.path.dirname(marker), exist_ok=True)
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            seen = True
    if not dist.is_initialized():
        return seen
    store = dist.distributed_c10d._get_default_store()
    if int(os.environ.get("RANK", 0)) == 0:
        store.set("dalle/ray_restarted", "1" if seen else "0")
    return store.get("dalle/ray_restarted") == b"1"


def _first_failure(error) -> str:
    """The first worker's error in one line (what it said, not Ray's wrapping)."""
    failures = getattr(error, "worker_failures", None) or {}
    for _, exc in sorted(failures.items()):
        cause = getattr(exc, "cause", None) or exc
        lines = [ln for ln in str(cause).strip().splitlines() if ln.strip()]
        return f"rank {_}: {type(cause).__name__}: {lines[-1] if lines else ''}"
    return str(error).strip().splitlines()[-1]


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
