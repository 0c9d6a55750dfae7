"""The run directory: where it is, its record (config.json, and config.yaml: the flags, for --config), what it
logs (metrics.jsonl, train.log, and to the trackers: TensorBoard, wandb, MLflow), samples/, checkpoints/.

Only rank 0 writes; the other ranks get an object whose methods do nothing, so callers never branch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time

import torch


class RunDir:
    def __init__(self, path: str, is_main: bool, trackers=None, resumed: bool = False):
        """`trackers(path, continue_run, say)`: the run's trackers (trackers.open_trackers), started on rank 0;
        `resumed`: the tracked runs go on (as they do on a worker that an elastic run makes rank 0 later)."""
        self.path = path
        self.is_main = False
        self.samples = os.path.join(path, "samples")
        self.checkpoints = os.path.join(path, "checkpoints")
        self._open_trackers, self._resumed = trackers, resumed
        self._trackers: list = []
        self._log = None
        self._started = False  # becoming rank 0 after this: an elastic takeover
        self.config: dict = {}
        if is_main:
            self.become_main()
        self._started = True

    def become_main(self) -> None:
        """Start writing the run's files: at startup on rank 0, or later on the worker that an elastic run
        made rank 0 when the previous one was lost."""
        if self.is_main:
            return
        self.is_main = True
        os.makedirs(self.samples, exist_ok=True)
        os.makedirs(self.checkpoints, exist_ok=True)
        self._log = open(os.path.join(self.path, "train.log"), "a", buffering=1)
        if self._open_trackers is not None:
            # a resumed run, or an elastic run's new rank 0, goes on in the same tracked run
            self._trackers = self._open_trackers(self.path, self._resumed or self._started, self.print)
            for tracker in self._trackers:
                if self.config:
                    tracker.set_config(self.config)

    def print(self, *parts, console: bool = True) -> None:
        """Print on rank 0 (unless not `console`: --quiet) and append to train.log."""
        if not self.is_main:
            return
        line = " ".join(str(p) for p in parts)
        if console:
            print(line, flush=True)
        self._log.write(line + "\n")

    @staticmethod
    def path_of(cfg, default_name: str) -> str:
        """Where a run goes: --output_dir/--name, the trainer's name (vae, dalle, clip) without --name."""
        return os.path.join(cfg.output_dir, cfg.name or default_name)

    @staticmethod
    def recorded(path: str) -> dict | None:
        """The record (config.json) of the run in the directory `path`, or None before its first start."""
        try:
            with open(os.path.join(path, "config.json")) as f:
                return json.load(f)
        except FileNotFoundError:
            return None

    def record(self, configs: dict, backend_options: dict, derived: dict) -> None:
        """What the run is: config.json (the resolved configs, the options of the backend that runs, `derived`:
        backend, launcher, world size, accumulation, global batch) and config.yaml (its flags by section, which
        `--config` reads back to relaunch it)."""
        resolved = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in configs.items()}
        resolved.update({k: dataclasses.asdict(v) for k, v in backend_options.items()})
        self.write_config({**resolved, "derived": derived})
        if self.is_main:
            import yaml

            with open(os.path.join(self.path, "config.yaml"), "w") as f:
                f.write("# this run's flags: relaunch it with  --config THIS_FILE --resume auto\n")
                yaml.safe_dump(flag_sections({**configs, **backend_options}), f, sort_keys=False)

    def write_config(self, config: dict) -> None:
        self.config = config
        for tracker in self._trackers:
            tracker.set_config(config)
        if self.is_main:
            with open(os.path.join(self.path, "config.json"), "w") as f:
                json.dump(config, f, indent=2, sort_keys=True, default=str)

    def update_config(self, section: str, value) -> None:
        """Rewrite one section once it is known (DALLE's vocabulary sizes come from the tokenizer and VAE)."""
        value = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        self.write_config({**self.config, section: value})

    def log_metrics(self, step: int, metrics: dict) -> None:
        if not self.is_main:
            return
        row = {"step": step, "time": round(time.time(), 3), **{k: _plain(v) for k, v in metrics.items()}}
        with open(os.path.join(self.path, "metrics.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        for tracker in self._trackers:
            tracker.log_metrics(step, row)

    def log_image(self, step: int, key: str, path: str) -> None:
        """A sample grid written to `path`, to the trackers that take images (wandb, MLflow under samples/)."""
        for tracker in self._trackers:
            tracker.log_image(step, key, path)

    def log_artifact(self, path: str) -> None:
        """The export, to the trackers that keep it (a wandb model artifact; MLflow's export/ when the run ends)."""
        for tracker in self._trackers:
            tracker.log_artifact(path)

    def close(self, status: str = "FINISHED") -> None:
        """`status`: how the run ended, for the trackers: FINISHED, FAILED, or KILLED (stopped by SIGTERM)."""
        for tracker in self._trackers:
            tracker.close(status)  # each says its failures in train.log, before that closes
        if self._log is not None:
            self._log.close()


def flag_sections(configs: dict) -> dict:
    """The flags of a run, by section: what `--config runs/NAME/config.yaml` reads back to relaunch it."""
    return {
        title: {f.name: _listed(getattr(obj, f.name)) for f in dataclasses.fields(obj) if "help" in f.metadata}
        for title, obj in configs.items()
        if dataclasses.is_dataclass(obj)
    }


def _listed(value):
    return list(value) if isinstance(value, tuple) else value


def _plain(v):
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float):
        return round(v, 6) if math.isfinite(v) else str(v)
    return v


def progress(total: int, initial: int, enabled: bool):
    """A tqdm bar on rank 0 when stderr is a terminal; None otherwise."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, dynamic_ncols=True, unit="step")
