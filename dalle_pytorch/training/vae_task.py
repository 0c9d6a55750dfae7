"""Training an image tokenizer as a loop task: DALL-E's discrete VAE (its loss with the annealed temperature) or a
VQGAN (VQGANTask: with its discriminator and perceptual loss); codebook health, samples, the export."""

from __future__ import annotations

import itertools
from collections import deque

import torch
from torchvision.utils import save_image

from ..data.stream import is_stream
from ..inference.export import save_export
from ..models.vae import DiscreteVAE, codebook_stats
from ..models.vq_tokenizer import VQGANLoss
from .schedules import gumbel_temperature


class VAETask:
    name = "vae"

    def __init__(
        self,
        vae: DiscreteVAE,
        dataset,
        export_path: str,
        temperature: tuple[float, float, int, str] | None,
        usage_window: int = 20,
        num_sample_images: int = 8,
        val_dataset=None,
    ):
        self.model = vae
        self.dataset = dataset
        self.val_dataset = val_dataset  # held-out images, or None: no validation
        self.export_path = export_path
        self.tokens_per_sample = vae.fmap_size**2  # image tokens per image, for tokens/s
        if temperature is not None:  # the dVAE's Gumbel-softmax anneal (start, end, steps, shape)
            self.temp_start, self.temp_end, self.anneal_steps, self.temp_kind = temperature
            self._last_tau = self.temp_start
        self._codes = deque(maxlen=usage_window)  # hard codes of the last N micro-batches
        if is_stream(dataset):
            readable = (item for item in dataset if isinstance(item, tuple))  # not a skipped sample's None
            first = [image for image, _ in itertools.islice(readable, num_sample_images)]
        else:
            first = [dataset[i][0] for i in range(min(num_sample_images, len(dataset)))]
        if not first:
            raise ValueError("the data yielded no batch: check the dataset and --batch_size (no image could be read)")
        self._fixed = torch.stack(first)  # the same images in every grid

    def temperature(self, step: int) -> float:
        return gumbel_temperature(step, self.temp_start, self.temp_end, self.anneal_steps, self.temp_kind)

    def prepare_batch(self, batch, device):
        images = batch[0] if isinstance(batch, (list, tuple)) else batch
        return images.to(device, non_blocking=True)

    def loss(self, model, images, step):
        self._last_tau = self.temperature(step)
        loss, metrics = model(images, self._last_tau)
        self._codes.append(metrics.pop("indices").detach())
        return loss, metrics

    def window_metrics(self) -> dict:
        stats = codebook_stats(torch.cat([c.flatten() for c in self._codes]), self.model.num_tokens)
        return {"temperature": self._last_tau, **{k: v.item() for k, v in stats.items()}}

    def val_scores(self, whole_model, rank, world_size) -> dict:
        return {}

    def fid_reference(self, indices):
        return torch.stack([_image(self.val_dataset[i]) for i in indices])

    @torch.no_grad()
    def fid_images(self, whole_model, indices, seed):
        with whole_model() as model:  # every rank enters it, one with no share too (more ranks than images)
            if not indices:
                return torch.zeros(0)
            images = self.fid_reference(indices)
            recon = model.reconstruct(images.to(next(model.parameters()).device))
        return recon.float().clamp(0, 1).cpu()

    @torch.no_grad()
    def write_samples(self, model, step, path):
        """Originals | hard reconstructions | soft reconstructions, one row each."""
        images = self._fixed.to(next(model.parameters()).device)
        grid = torch.cat([images, model.reconstruct(images), model.reconstruct_soft(images, self._last_tau)])
        if path is not None:
            save_image(grid.float().cpu(), path, nrow=len(images), padding=1)  # RGBA keeps its alpha

    def activation_bytes(self, batch_size: int) -> float:
        return 0.0  # convolutional and small: the parameters decide the ZeRO stage

    def export(self, weights, ema=None):
        save_export(self.export_path, "vae", self.model.cfg.to_dict(), weights, ema=ema)


def _image(item) -> torch.Tensor:
    return item[0] if isinstance(item, (list, tuple)) else item


class VQGANTask(VAETask):
    """`model`: a VQGANLoss (the tokenizer with its discriminator, one module, one loss); `perceptual`: the frozen
    LPIPS outside the trained module (no backend wraps or shards it), or None."""

    def __init__(self, model: VQGANLoss, dataset, export_path: str, perceptual=None, val_dataset=None):
        super().__init__(model, dataset, export_path, None, val_dataset=val_dataset)
        self.perceptual = perceptual

    def loss(self, model, images, step):
        loss, metrics = model(images, step, self.perceptual)
        self._codes.append(metrics.pop("indices").detach())
        return loss, metrics

    def window_metrics(self) -> dict:
        stats = codebook_stats(torch.cat([c.flatten() for c in self._codes]), self.model.num_tokens)
        return {k: v.item() for k, v in stats.items()}

    @torch.no_grad()
    def write_samples(self, model, step, path):
        """Originals | reconstructions through the codebook, one row each."""
        images = self._fixed.to(next(model.parameters()).device)
        grid = torch.cat([images, model.reconstruct(images)])
        if path is not None:
            save_image(grid.float().cpu(), path, nrow=len(images), padding=1)

    def export(self, weights, ema=None):
        """The tokenizer alone (the discriminator stays in the checkpoints)."""

        def own(state):
            return {k[len("tokenizer.") :]: v for k, v in state.items() if k.startswith("tokenizer.")}

        ema = None if ema is None else {**ema, "weights": own(ema["weights"])}
        save_export(self.export_path, "vae", self.model.tokenizer.cfg.to_dict(), own(weights), ema=ema)
