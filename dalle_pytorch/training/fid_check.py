"""--val_fid_every N --val_fid_samples K: FID and KID of the model's images against K validation images, every N
steps, logged to every tracker as val_fid / val_kid (a DALLE's images for the validation captions; a VAE's
reconstructions: its rFID), and with --val_clip_path a DALLE's val_clip_score (its CLIP's score of each image with
its caption, averaged). Computed by torch-fidelity (dalle_pytorch/eval/fidelity.py); precision/recall and the
Inception Score are left to `python -m dalle_pytorch.eval`, which has the time for them.

The reference images are written once into the run directory, under a name made from their pixels
(RUN/fid/reference-<digest>/), and torch-fidelity keeps their features beside them (RUN/fid/cache/): a resumed run,
or a later check, reads them instead of computing them again; other validation images make another name.
Every rank generates its share of the K images (sharded parameters need every rank); rank 0 scores them.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import torch
from torchvision.utils import save_image

from ..eval.fidelity import MIN_IMAGES, FidelityConfig, fidelity_metrics
from ..eval.on_data import Folders


class FidCheck:
    def __init__(self, task, cfg, backend, run, say=print):
        if not hasattr(task, "fid_images"):
            raise ValueError(f"--val_fid_every: the {task.name} model makes no images to measure")
        if task.val_dataset is None:
            raise ValueError(
                "--val_fid_every measures against validation images: set --val_every and a validation folder "
                "(--val_image_text_folder / --val_image_folder) or --val_fraction"
            )
        k = cfg.val_fid_samples
        if not MIN_IMAGES <= k <= len(task.val_dataset):
            raise ValueError(
                f"--val_fid_samples must be between {MIN_IMAGES} and the {len(task.val_dataset)} validation samples "
                f"(got {k})"
            )
        self.task, self.backend, self.seed = task, backend, cfg.seed
        self.fidelity = FidelityConfig(inception_weights=cfg.inception_weights)
        self.indices = list(range(k))
        self.root = os.path.join(run.path, "fid")
        reference = None
        if backend.is_main:
            images = task.fid_reference(self.indices)
            digest = hashlib.sha256(images.numpy().tobytes()).hexdigest()[:16]
            reference = os.path.join(self.root, f"reference-{digest}")
            if os.path.isdir(reference):
                say(f"--val_fid_every: reusing the reference images and their statistics in {reference}")
            else:
                name = os.path.basename(reference)
                folders = Folders(self.root, name)  # made whole in a temporary folder beside it, then moved in
                folders.write(name, images, 0)
                folders.keep()
        self.reference = reference

    def __call__(self, model, step: int) -> dict:
        """{"val_fid", "val_kid"} at `step`, the same on every rank (collective)."""
        from .validation import whole_model

        b = self.backend
        share = self.indices[b.rank :: b.world_size]
        images = self.task.fid_images(lambda: whole_model(b, model), share, self.seed)
        folder = os.path.join(self.root, f"step-{step:08d}")
        if b.is_main:
            shutil.rmtree(folder, ignore_errors=True)
            os.makedirs(folder)
        b.barrier()
        for i, image in zip(share, images):
            save_image(image, os.path.join(folder, f"{i:06d}.png"))
        b.barrier()
        sums = self.task.fid_scores(share, images) if hasattr(self.task, "fid_scores") else {}
        figures = torch.tensor([0.0, 0.0, *sums.values()], dtype=torch.float64, device=b.device)
        if b.is_main:
            cache = os.path.join(self.root, "cache")
            found = fidelity_metrics(folder, self.reference, self.fidelity, b.device.type, False, cache)
            figures[:2] += torch.tensor([found["fid"], found["kid"]], dtype=torch.float64, device=b.device)
            shutil.rmtree(folder)
        fid, kid, *rest = b.all_reduce(figures, op="sum").tolist()
        return {"val_fid": fid, "val_kid": kid, **{name: total / len(self.indices) for name, total in zip(sums, rest)}}
