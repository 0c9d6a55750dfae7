"""The discrete VAE of DALL-E: images <-> a grid of codebook indices.

After Ramesh et al. 2021 (arXiv:2102.12092) and lucidrains/DALLE-pytorch's DiscreteVAE: a conv encoder
with `num_layers` stride-2 downsamplings, logits over `num_tokens` codes, a Gumbel-softmax relaxation,
a KL term to the uniform prior, and a conv decoder.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import flag


@dataclass
class VAEConfig:
    image_size: int = flag(32, "image side in pixels (a power of 2)")
    num_tokens: int = flag(64, "codebook size: the image vocabulary of DALLE")
    codebook_dim: int = flag(64, "dimension of each codebook vector")
    num_layers: int = flag(2, "stride-2 downsamplings: the token grid is image_size / 2**num_layers")
    num_resnet_blocks: int = flag(1, "residual blocks in the encoder and in the decoder")
    hidden_dim: int = flag(64, "conv channels")
    channels: int = flag(3, "image channels: 3 (RGB) or 4 (RGBA)")
    temperature: float = flag(0.9, "Gumbel-softmax temperature when the loss is called without one")
    straight_through: bool = flag(False, "hard one-hot codes forward, soft gradients backward")
    kl_div_loss_weight: float = flag(1e-3, "weight of KL(q || uniform prior); keeps codebook usage up")
    smooth_l1_loss: bool = flag(False, "smooth-L1 reconstruction loss instead of MSE")
    # per-channel (mean, std) applied to inputs in [0, 1]; None means 0.5 and 0.5 for every channel
    normalization: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    # lucidrains' dalle-pytorch layout, set by `convert --from_reference`: without resnet blocks the decoder
    # starts with its first transposed conv on the codebook vectors (no 1x1 conv to hidden_dim before it)
    reference_layout: bool = False

    def __post_init__(self):
        if self.image_size < 2 or self.image_size & (self.image_size - 1):
            raise ValueError(f"--image_size must be a power of 2 (got {self.image_size})")
        if self.image_size >> self.num_layers < 1:
            raise ValueError(f"--num_layers {self.num_layers} downsamples --image_size {self.image_size} below 1 pixel")
        if self.channels not in (3, 4):
            raise ValueError(f"--channels must be 3 (RGB) or 4 (RGBA) (got {self.channels})")
        if self.num_tokens < 2:
            raise ValueError(f"--num_tokens must be at least 2 (got {self.num_tokens})")
        if self.normalization is None:
            self.normalization = ((0.5,) * self.channels, (0.5,) * self.channels)
        else:
            mean, std = (tuple(float(v) for v in t) for t in self.normalization)
            if len(mean) != self.channels or len(std) != self.channels:
                raise ValueError(f"normalization needs {self.channels} means and stds (got {self.normalization})")
            self.normalization = (mean, std)

    @property
    def fmap_size(self) -> int:
        return self.image_size >> self.num_layers

    def to_dict(self) -> dict:
        d = asdict(self)
        d["normalization"] = [list(t) for t in self.normalization]
        return d


class ResBlock(nn.Module):
    def __init__(self, chan: int):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(chan, chan, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(chan, chan, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(chan, chan, 1),
        )

    def forward(self, x):
        return self.net(x) + x


def check_images(images: torch.Tensor, channels: int, image_size: int) -> None:
    """Every image tokenizer's input check: (b, channels, image_size, image_size) in [0, 1]."""
    c, s = channels, image_size
    if images.dim() != 4 or tuple(images.shape[1:]) != (c, s, s):
        raise ValueError(f"expected images of shape (b, {c}, {s}, {s}) in [0, 1], got {tuple(images.shape)}")


class ConfigSizes:
    """The sizes of the tokenizer interface (shared with the pretrained adapters), read from `self.cfg`."""

    @property
    def num_tokens(self) -> int:
        return self.cfg.num_tokens

    @property
    def image_size(self) -> int:
        return self.cfg.image_size

    @property
    def fmap_size(self) -> int:
        return self.cfg.fmap_size

    @property
    def channels(self) -> int:
        return self.cfg.channels


class DiscreteVAE(ConfigSizes, nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_dim
        enc: list[nn.Module] = []
        dec: list[nn.Module] = []
        chans = cfg.channels
        for _ in range(cfg.num_layers):
            enc += [nn.Conv2d(chans, h, 4, stride=2, padding=1), nn.ReLU()]
            chans = h
        enc += [ResBlock(h) for _ in range(cfg.num_resnet_blocks)]
        enc.append(nn.Conv2d(h, cfg.num_tokens, 1))

        chans = cfg.codebook_dim
        if cfg.num_resnet_blocks or not cfg.reference_layout:
            dec.append(nn.Conv2d(chans, h, 1))
            chans = h
        dec += [ResBlock(h) for _ in range(cfg.num_resnet_blocks)]
        for _ in range(cfg.num_layers):
            dec += [nn.ConvTranspose2d(chans, h, 4, stride=2, padding=1), nn.ReLU()]
            chans = h
        dec.append(nn.Conv2d(h, cfg.channels, 1))

        self.encoder = nn.Sequential(*enc)
        self.decoder = nn.Sequential(*dec)
        self.codebook = nn.Embedding(cfg.num_tokens, cfg.codebook_dim)
        mean, std = cfg.normalization
        self.register_buffer("mean", torch.tensor(mean).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, -1, 1, 1), persistent=False)

    def logits(self, images: torch.Tensor) -> torch.Tensor:
        """(b, c, s, s) in [0, 1] -> (b, num_tokens, f, f)."""
        check_images(images, self.cfg.channels, self.cfg.image_size)
        return self.encoder((images - self.mean) / self.std)

    @torch.no_grad()
    def get_codebook_indices(self, images: torch.Tensor) -> torch.Tensor:
        """(b, c, s, s) in [0, 1] -> (b, f*f) long, row-major over the token grid."""
        return self.logits(images).argmax(dim=1).flatten(1)

    def _to_unit(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.std + self.mean).clamp(0, 1)

    @torch.no_grad()
    def decode(self, indices: torch.Tensor) -> torch.Tensor:
        """(b, f*f) long -> images (b, c, s, s) in [0, 1]."""
        f = self.cfg.fmap_size
        if indices.dim() != 2 or indices.shape[1] != f * f:
            raise ValueError(f"expected indices of shape (b, {f * f}), got {tuple(indices.shape)}")
        emb = self.codebook(indices).view(indices.shape[0], f, f, -1).permute(0, 3, 1, 2)  # (b, d, f, f)
        return self._to_unit(self.decoder(emb))

    def forward(self, images: torch.Tensor, temperature: float | None = None) -> tuple[torch.Tensor, dict]:
        """The training loss, as `loss`: wrappers (DDP, FSDP, DeepSpeed) hook `forward`, not named methods."""
        return self.loss(images, temperature)

    def loss(self, images: torch.Tensor, temperature: float | None = None) -> tuple[torch.Tensor, dict]:
        """Reconstruction + weighted KL to the uniform prior, and metrics (detached tensors, no host sync)."""
        logits = self.logits(images)  # (b, n, f, f)
        tau = self.cfg.temperature if temperature is None else temperature
        soft_one_hot = F.gumbel_softmax(logits, tau=tau, dim=1, hard=self.cfg.straight_through)
        sampled = torch.einsum("b n h w, n d -> b d h w", soft_one_hot, self.codebook.weight)
        out = self.decoder(sampled)
        target = (images - self.mean) / self.std
        recon = F.smooth_l1_loss(out, target) if self.cfg.smooth_l1_loss else F.mse_loss(out, target)

        # KL(q || uniform) per position = sum q log q + log n; averaged over the batch and the grid
        log_qy = F.log_softmax(logits.float(), dim=1)
        kl = (log_qy.exp() * log_qy).sum(dim=1).mean() + math.log(self.cfg.num_tokens)
        loss = recon + self.cfg.kl_div_loss_weight * kl
        with torch.no_grad():
            mse01 = F.mse_loss(self._to_unit(out.float()), images.float())
            metrics = {
                "recon": recon.detach(),
                "kl": kl.detach(),
                "psnr": -10 * torch.log10(mse01.clamp_min(1e-10)),
                "indices": logits.argmax(dim=1).flatten(1),  # for codebook usage, counted by the caller
            }
        return loss, metrics

    def reconstruct(self, images: torch.Tensor) -> torch.Tensor:
        """Hard reconstruction through the codebook, in [0, 1]: decode(get_codebook_indices(images))."""
        return self.decode(self.get_codebook_indices(images))

    @torch.no_grad()
    def reconstruct_soft(self, images: torch.Tensor, temperature: float) -> torch.Tensor:
        """Reconstruction through the relaxed (softmax) codes the training loss sees, in [0, 1]."""
        soft = F.softmax(self.logits(images) / temperature, dim=1)
        return self._to_unit(self.decoder(torch.einsum("b n h w, n d -> b d h w", soft, self.codebook.weight)))


def codebook_stats(indices: torch.Tensor, num_tokens: int) -> dict[str, torch.Tensor]:
    """Fraction of the codebook used and the perplexity of code usage over `indices` (any shape)."""
    counts = torch.bincount(indices.flatten(), minlength=num_tokens).float()
    p = counts / counts.sum().clamp_min(1)
    entropy = -(p * p.clamp_min(1e-12).log()).sum()
    return {"codebook_usage": (counts > 0).float().mean(), "codebook_perplexity": entropy.exp()}
