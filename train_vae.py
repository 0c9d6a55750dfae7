"""Train the discrete VAE that turns images into tokens and back.

    python train_vae.py                                   # the built-in synthetic dataset
    python train_vae.py --image_folder DIR                # any folder of images, nested or flat
    torchrun --nproc_per_node 2 train_vae.py --image_folder DIR

Writes runs/vae/ (config.json, metrics.jsonl, train.log, samples/, checkpoints/) and the export vae.pt.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from arguments import TrainConfig, build_parser, take, take_backend_options
from dalle_pytorch.config import flag
from dalle_pytorch.errors import user_errors
from dalle_pytorch.models.vae import DiscreteVAE, VAEConfig


@dataclass
class VAERunConfig:
    image_folder: str = flag(
        "", "folder of images (searched recursively), or WebDataset shard URLs with --wds; empty: the built-in dataset"
    )
    wds: str = flag("", "image key of WebDataset shards (e.g. jpg): --image_folder then holds the shard URLs")
    resize_ratio: float = flag(1.0, "random resized crop keeps at least this fraction of the image (1: no crop)")
    starting_temp: float = flag(1.0, "Gumbel-softmax temperature at step 0")
    temp_min: float = flag(0.0625, "temperature floor reached after --anneal_steps")
    anneal_steps: int = flag(0, "steps over which the temperature anneals; 0: the whole run")
    temp_schedule: str = flag("cosine", "temperature anneal shape", choices=("cosine", "exponential", "linear"))
    vae_output: str = flag("", "path of the export (default: RUN_DIR/vae.pt)")


def _defaults(parser) -> None:
    parser.set_defaults(learning_rate=2e-3, batch_size=32, sample_every=100, name="vae", log_every=20)


def main(argv=None):
    parser = build_parser(
        __doc__,
        (VAEConfig, "model"),
        (VAERunConfig, "VAE training"),
        (TrainConfig, "training"),
        predecessor="train_vae",
    )
    _defaults(parser)
    ns = parser.parse_args(argv)
    with user_errors(ns.debug):
        return _train(take(ns, VAEConfig), take(ns, VAERunConfig), take(ns, TrainConfig), take_backend_options(ns))


def _train(model_cfg: VAEConfig, run_cfg: VAERunConfig, cfg: TrainConfig, backend_options: dict):
    from dalle_pytorch.training.loop import total_steps, train
    from dalle_pytorch.training.session import distributed_run, run_dataset
    from dalle_pytorch.training.vae_task import VAETask

    configs = {"model": model_cfg, "vae": run_cfg, "train": cfg}
    with distributed_run(cfg, "vae", configs, backend_options) as (backend, recovery, run):
        dataset = run_dataset(
            run_cfg.image_folder,
            run_cfg.wds,
            False,
            model_cfg.image_size,
            model_cfg.channels,
            run_cfg.resize_ratio,
            cfg,
            backend,
            run,
            "--image_folder",
        )
        # the temperature anneals over --anneal_steps, or over the whole run as the loop counts it
        anneal = run_cfg.anneal_steps or total_steps(cfg, dataset, backend.world_size)
        task = VAETask(
            DiscreteVAE(model_cfg),
            dataset,
            run_cfg.vae_output or os.path.join(run.path, "vae.pt"),
            (run_cfg.starting_temp, run_cfg.temp_min, anneal, run_cfg.temp_schedule),
        )
        pos = train(task, cfg, backend, recovery, run)
        skipped = getattr(dataset, "num_skipped", 0)
        if skipped:
            run.print(f"skipped {skipped} unreadable images")
        run.print(f"done at step {pos.step}: export {task.export_path}")
        return task.export_path


if __name__ == "__main__":
    main()
