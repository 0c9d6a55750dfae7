"""VQGAN and Gumbel-VQ from taming-transformers as an image tokenizer: only what encodes and decodes.

Re-implemented after CompVis/taming-transformers (Esser et al. 2021, arXiv:2012.09841):
taming/modules/diffusionmodules/model.py (Encoder, Decoder, ResnetBlock, AttnBlock; in vqgan_modules.py),
taming/modules/vqvae/quantize.py (VectorQuantizer2, GumbelQuantize) and taming/models/vqgan.py (VQModel,
GumbelVQ), with the same parameter names, so a checkpoint's state dict loads unchanged. Left out: the
discriminator and the LPIPS loss (`loss.*` keys), the timestep embedding (unused by the autoencoder), index
remapping, training code.
The taming package itself is not imported: its import chain needs an old PyTorch Lightning.
"""

from __future__ import annotations

import torch
from torch import nn

from .vae import check_images
from .vqgan_modules import Decoder, Encoder, VQGANConfig


class VectorQuantizer(nn.Module):
    """taming's VectorQuantizer2 at inference: the nearest codebook vector (the legacy beta only weighs the
    training loss, which is not built here)."""

    def __init__(self, n_embed: int, embed_dim: int):
        super().__init__()
        self.embedding = nn.Embedding(n_embed, embed_dim)

    def codes(self, z: torch.Tensor) -> torch.Tensor:
        """(b, d, h, w) -> (b, h, w) long: argmin of ||z - e||^2 = z^2 + e^2 - 2 z.e, as taming computes it."""
        b, d, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, d)
        e = self.embedding.weight
        dist = flat.pow(2).sum(1, keepdim=True) + e.pow(2).sum(1) - 2 * flat @ e.t()
        return dist.argmin(dim=1).view(b, h, w)

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """(b, h, w) long -> (b, d, h, w)."""
        return self.embedding(codes).permute(0, 3, 1, 2)


class GumbelQuantize(nn.Module):
    """taming's GumbelQuantize at inference. taming samples codes with Gumbel noise even in eval mode; a
    tokenizer must be deterministic, so the code is the argmax of the logits (the mode of that sample)."""

    def __init__(self, num_hiddens: int, n_embed: int, embed_dim: int):
        super().__init__()
        self.proj = nn.Conv2d(num_hiddens, n_embed, 1)
        self.embed = nn.Embedding(n_embed, embed_dim)

    def codes(self, z: torch.Tensor) -> torch.Tensor:
        return self.proj(z).argmax(dim=1)  # (b, h, w)

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        return self.embed(codes).permute(0, 3, 1, 2)


class VQGAN(nn.Module):
    """VQModel / GumbelVQ without losses: images in [-1, 1] <-> (b, h, w) code grids."""

    def __init__(self, cfg: VQGANConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        if cfg.gumbel:
            self.quantize = GumbelQuantize(cfg.z_channels, cfg.n_embed, cfg.embed_dim)
        else:
            self.quantize = VectorQuantizer(cfg.n_embed, cfg.embed_dim)
        self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.embed_dim, cfg.z_channels, 1)

    def encode_codes(self, x: torch.Tensor) -> torch.Tensor:
        """(b, c, s, s) in [-1, 1] -> (b, s/f, s/f) long."""
        return self.quantize.codes(self.quant_conv(self.encoder(x)))

    def decode_codes(self, codes: torch.Tensor) -> torch.Tensor:
        """(b, h, w) long -> (b, out_ch, h*f, w*f), nominally in [-1, 1] (not clamped)."""
        return self.decoder(self.post_quant_conv(self.quantize.lookup(codes)))


class VQGanVAE(nn.Module):
    """A VQGAN behind the tokenizer interface of DiscreteVAE: images in [0, 1], codes flattened row-major."""

    def __init__(self, cfg: VQGANConfig, image_size: int = 0):
        super().__init__()
        self.model = VQGAN(cfg)
        self.image_size = image_size or cfg.resolution
        if self.image_size % cfg.downsample_factor:
            raise ValueError(
                f"--pretrained_image_size {self.image_size} is not a multiple of the VQGAN's downsampling "
                f"factor {cfg.downsample_factor}"
            )
        self.fmap_size = self.image_size // cfg.downsample_factor
        self.num_tokens = cfg.n_embed
        self.channels = cfg.in_channels

    @torch.no_grad()
    def get_codebook_indices(self, images: torch.Tensor) -> torch.Tensor:
        """(b, c, s, s) in [0, 1] -> (b, f*f) long."""
        check_images(images, self.channels, self.image_size)
        return self.model.encode_codes(images * 2 - 1).flatten(1)

    @torch.no_grad()
    def decode(self, indices: torch.Tensor) -> torch.Tensor:
        """(b, f*f) long -> images (b, c, s, s) in [0, 1]."""
        f = self.fmap_size
        if indices.dim() != 2 or indices.shape[1] != f * f:
            raise ValueError(f"expected indices of shape (b, {f * f}), got {tuple(indices.shape)}")
        out = self.model.decode_codes(indices.view(-1, f, f))
        return (out.clamp(-1, 1) + 1) * 0.5

    def reconstruct(self, images: torch.Tensor) -> torch.Tensor:
        return self.decode(self.get_codebook_indices(images))
