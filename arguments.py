"""The training scripts' entry-point glue: command-line flags -> the typed run configs, and where the run goes.

The run configs live with the code that runs them (dalle_pytorch/training/configs.py); every run flag is a
dataclass field with a default and a help text, and `build_parser(description, *configs)` builds the parser from
the dataclasses (and adds each backend's own options and the Ray launcher's), so the flags, the defaults and
`config.json` cannot drift apart. `run_fit` runs a trainer in this process or on Ray Train workers. The process
topology itself is read in distributed/topology.py.
"""

from __future__ import annotations

import argparse
import sys

from dalle_pytorch.compat import flags as predecessor_flags
from dalle_pytorch.config import FileParser, add_flags, take
from dalle_pytorch.training.configs import LR_DECAYS, TrainConfig
from dalle_pytorch.training.run_dir import RunDir
from distributed import BACKEND_OPTIONS, Topology, topology_from_env
from distributed.ray_config import RayOptions


class Parser(FileParser):
    """A trainer's parser; with `predecessor` set (train_vae, train_dalle) it also reads that script's flags of
    lucidrains' DALLE-pytorch 1.6 and turns them into ours (dalle_pytorch/compat/flags.py)."""

    predecessor: str | None = None

    def parse_args(self, args=None, namespace=None):
        if self.predecessor is None:
            return super().parse_args(args, namespace)
        args = sys.argv[1:] if args is None else list(args)
        bare_lr_decay = LR_DECAYS if self.predecessor == "train_dalle" else ()  # its train_vae had no --lr_decay
        ns = super().parse_args(predecessor_flags.rewrite_argv(args, bare_lr_decay), namespace)
        topology = topology_from_env()
        say = print if topology.rank == 0 else (lambda *_: None)
        given = {a.split("=", 1)[0] for a in args if a.startswith("--")}
        try:
            predecessor_flags.apply(ns, self.predecessor, say, given, topology.world_size)
        except ValueError as e:  # before the scripts' user_errors: the same one line
            self.exit(2, f"error: {e}\n")
        return ns


def build_parser(description: str, *configs: tuple[type, str], extra=None, predecessor: str | None = None) -> Parser:
    parser = Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # deepspeed
    for cls, title in (*configs, *((cls, f"{name} backend") for name, cls in BACKEND_OPTIONS.items())):
        add_flags(parser, cls, title)
    add_flags(parser, RayOptions, "Ray Train launcher")
    if extra:
        extra(parser)
    if predecessor:
        parser.predecessor = predecessor
        predecessor_flags.add_flags(parser, predecessor)
    return parser


def take_backend_options(ns: argparse.Namespace) -> dict:
    """Each backend's own options from the parsed flags, by backend name (make_backend's keywords)."""
    return {name: take(ns, cls) for name, cls in BACKEND_OPTIONS.items()}


def run_fit(fit, ns: argparse.Namespace, *configs):
    """`fit(*configs, plan)` in this process (a launcher started it), or with --ray_workers on Ray Train workers
    (distributed/ray_launcher.py). The run's plan (training/plan.py: the flags validated, the topology, the
    backend, the accumulation) is made here, once, before the data and the models load. Returns the export's
    path."""
    from dalle_pytorch.training.plan import RunPlan
    from dalle_pytorch.training.session import RanksLost
    from dalle_pytorch.training.signals import Stopped

    cfg, backend_options, ray = take(ns, TrainConfig), take_backend_options(ns), take(ns, RayOptions)
    try:
        if not ray.ray_workers:
            return fit(*configs, RunPlan.make(cfg, backend_options))
        from distributed.ray_launcher import check_launch, run_on_ray

        lo, hi = check_launch(ray, cfg)  # what cannot run on Ray at all, first
        # planned as on the Ray workers (launcher 'ray'), at each number of workers they may have
        plan = RunPlan.make(cfg, backend_options, Topology("ray", world_size=lo))
        for n in range(lo + 1, hi + 1):
            plan.on(Topology("ray", world_size=n))  # says which --global_batch_size / --batch_size to change
        if cfg.mlflow:  # the workers run elsewhere: the tracking store this process would use
            from dalle_pytorch.training.trackers.mlflow_run import absolute_uri

            cfg.mlflow = absolute_uri(cfg.mlflow)
        return run_on_ray(fit, configs, plan, (lo, hi), ray, RunDir.path_of(cfg, fit.run_name))
    except Stopped as e:  # the loop said so: "SIGTERM: saved a checkpoint at step N; resume with --resume auto"
        if cfg.exit_code_on_stop:
            raise SystemExit(cfg.exit_code_on_stop) from None
        return e.export_path
    except RanksLost as e:  # rank 0 has named the ranks in train.log
        if ns.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(cfg.exit_code_on_hang) from None
