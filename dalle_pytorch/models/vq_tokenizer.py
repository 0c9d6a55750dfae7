"""A VQGAN to train (`train_vae.py --model vqgan`): images <-> a grid of codebook indices, trained with a
reconstruction loss, a perceptual loss and a patch discriminator.

After Esser et al. 2021 (taming-transformers, arXiv:2012.09841: the residual encoder/decoder with attention in the
middle, the PatchGAN discriminator with a hinge loss) and LlamaGen's tokenizer (Sun et al. 2024, arXiv:2406.06525,
after ViT-VQGAN, Yu et al. 2021): codes looked up in a low-dimensional space (8 by default) after l2-normalizing
both the encoder's vector and the codebook's, which keeps most of a large codebook in use without restarts, a
commitment loss, and an optional entropy term.

Its blocks sit in flat lists that forward calls one after another, so FSDP2 can shard each block on its own (the
backend makes every element of an nn.ModuleList a unit) and ZeRO-3 gathers each block's parameters by its own hooks.

`VQGANLoss` holds the tokenizer and the discriminator as one module with one loss, so that every backend trains
both with one optimizer and one backward:
- the generator's adversarial term reaches the tokenizer through the discriminator run with its weights
  detached (`frozen`): no gradient from it reaches the discriminator;
- the discriminator's hinge term sees the reconstructions detached: no gradient from it reaches the tokenizer.
Before `disc_start` both terms are computed and weighted by 0, so that every step's graph holds every parameter
(DDP, Horovod and ZeRO reduce a gradient for each).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .vae import ConfigSizes, check_images
from .vqgan_modules import AttnBlock, Downsample, ResnetBlock, Upsample


@dataclass
class VQTokenizerConfig:
    image_size: int = 32
    channels: int = 3
    num_tokens: int = 1024
    code_dim: int = 8  # the codebook's dimension (LlamaGen: 8)
    num_layers: int = 2  # downsamplings by 2: the token grid is image_size / 2**num_layers
    hidden_dim: int = 64  # channels at full resolution (x1, x2, x2, x4, x4 ... below)
    num_resnet_blocks: int = 1  # per resolution
    l2_norm: bool = True  # look codes up by cosine: encoder vectors and codebook l2-normalized
    commitment_weight: float = 0.25
    entropy_weight: float = 0.0  # LlamaGen's entropy term: confident codes, all of them used
    # LlamaGen's VQ (read from its checkpoints, not flags): its channel multipliers per resolution (num_layers + 1 of
    # them; empty: 1, 2, 2, 4, 4 ...), an encoder output of z_channels brought to code_dim by a 1x1 conv (0: the
    # encoder writes code_dim itself), and attention after every resnet block at the lowest resolution
    ch_mult: list = field(default_factory=list)
    z_channels: int = 0
    lowest_attn: bool = False

    def __post_init__(self):
        self.ch_mult = [int(m) for m in self.ch_mult]
        if self.ch_mult and len(self.ch_mult) != self.num_layers + 1:
            raise ValueError(f"ch_mult {self.ch_mult} needs num_layers + 1 = {self.num_layers + 1} entries")
        if self.image_size % (2**self.num_layers):
            raise ValueError(
                f"--image_size {self.image_size} is not a multiple of 2**--num_layers ({2**self.num_layers}): the "
                f"VQGAN's token grid must be whole"
            )
        if self.hidden_dim % 32:
            raise ValueError(
                f"--hidden_dim must be a multiple of 32 for the VQGAN (GroupNorm(32)), got {self.hidden_dim}"
            )
        if self.channels not in (3, 4):
            raise ValueError(f"--channels must be 3 (RGB) or 4 (RGBA) (got {self.channels})")
        if self.num_tokens < 2 or self.code_dim < 1:
            raise ValueError(f"--num_tokens must be at least 2 and --code_dim at least 1 ({self})")

    @property
    def fmap_size(self) -> int:
        return self.image_size >> self.num_layers

    @property
    def widths(self) -> list[int]:
        """Channels at each resolution, full first."""
        if self.ch_mult:
            return [self.hidden_dim * m for m in self.ch_mult]
        return [self.hidden_dim * (1, 2, 2, 4, 4, 4, 4, 4)[min(i, 7)] for i in range(self.num_layers + 1)]

    @property
    def latent_dim(self) -> int:
        """The channels between the encoder (decoder) and the codes: z_channels, or code_dim without them."""
        return self.z_channels or self.code_dim

    def to_dict(self) -> dict:
        return {"model": "vqgan", **asdict(self)}


class Head(nn.Sequential):
    """GroupNorm, swish, 3x3 conv: how taming's encoder and decoder end."""

    def __init__(self, channels: int, out: int):
        super().__init__(nn.GroupNorm(32, channels, eps=1e-6), nn.SiLU(), nn.Conv2d(channels, out, 3, padding=1))


def _encoder(cfg: VQTokenizerConfig) -> nn.ModuleList:
    w = cfg.widths
    blocks: list[nn.Module] = [nn.Conv2d(cfg.channels, w[0], 3, padding=1)]
    width = w[0]
    for i, out in enumerate(w):
        for _ in range(cfg.num_resnet_blocks):
            blocks.append(ResnetBlock(width, out))
            width = out
            if cfg.lowest_attn and i == cfg.num_layers:
                blocks.append(AttnBlock(width))
        if i < cfg.num_layers:
            blocks.append(Downsample(width, True))
    blocks += [ResnetBlock(width, width), AttnBlock(width), ResnetBlock(width, width), Head(width, cfg.latent_dim)]
    return nn.ModuleList(blocks)


def _decoder(cfg: VQTokenizerConfig) -> nn.ModuleList:
    w = cfg.widths[::-1]
    width = w[0]
    blocks: list[nn.Module] = [nn.Conv2d(cfg.latent_dim, width, 3, padding=1)]
    blocks += [ResnetBlock(width, width), AttnBlock(width), ResnetBlock(width, width)]
    for i, out in enumerate(w):
        for _ in range(cfg.num_resnet_blocks + 1):
            blocks.append(ResnetBlock(width, out))
            width = out
            if cfg.lowest_attn and i == 0:
                blocks.append(AttnBlock(width))
        if i < cfg.num_layers:
            blocks.append(Upsample(width, True))
    blocks.append(Head(width, cfg.channels))
    return nn.ModuleList(blocks)


def _run(blocks: nn.ModuleList, x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def _entropy_loss(logits: torch.Tensor) -> torch.Tensor:
    """LlamaGen's (after MaskGIT): mean per-position entropy of the code distribution (each position confident)
    minus the entropy of the batch's mean distribution (all codes used)."""
    p = F.softmax(logits.float(), dim=-1)
    per_sample = -(p * F.log_softmax(logits.float(), dim=-1)).sum(-1).mean()
    mean = p.mean(0)
    return per_sample + (mean * mean.clamp_min(1e-12).log()).sum()


class VQTokenizer(ConfigSizes, nn.Module):
    """Encoder, quantizer, decoder. The tokenizer interface of DiscreteVAE: images in [0, 1], codes row-major."""

    def __init__(self, cfg: VQTokenizerConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = _encoder(cfg)
        self.decoder = _decoder(cfg)
        if cfg.z_channels:  # LlamaGen's: 1x1 convs between the encoder's (decoder's) width and the codes'
            self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.code_dim, 1)
            self.post_quant_conv = nn.Conv2d(cfg.code_dim, cfg.z_channels, 1)
        self.codebook = nn.Embedding(cfg.num_tokens, cfg.code_dim)
        nn.init.uniform_(self.codebook.weight, -1 / cfg.num_tokens, 1 / cfg.num_tokens)

    def _codebook(self) -> torch.Tensor:
        e = self.codebook.weight
        return F.normalize(e, dim=-1) if self.cfg.l2_norm else e

    def encode(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(b, c, s, s) in [0, 1] -> (z (b, f, f, d) as looked up, -squared distances to every code (b, f, f, n))."""
        check_images(images, self.cfg.channels, self.cfg.image_size)
        z = _run(self.encoder, images * 2 - 1)
        if self.cfg.z_channels:
            z = self.quant_conv(z)
        z = z.permute(0, 2, 3, 1).float()
        if self.cfg.l2_norm:
            z = F.normalize(z, dim=-1)
        e = self._codebook().float()
        neg_dist = 2 * z @ e.t() - z.pow(2).sum(-1, keepdim=True) - e.pow(2).sum(-1)
        return z, neg_dist

    def decode_vectors(self, zq: torch.Tensor) -> torch.Tensor:
        """(b, f, f, d) code vectors -> (b, c, s, s) nominally in [-1, 1]."""
        z = zq.permute(0, 3, 1, 2)
        return _run(self.decoder, self.post_quant_conv(z) if self.cfg.z_channels else z)

    @torch.no_grad()
    def get_codebook_indices(self, images: torch.Tensor) -> torch.Tensor:
        """(b, c, s, s) in [0, 1] -> (b, f*f) long."""
        return self.encode(images)[1].argmax(-1).flatten(1)

    @torch.no_grad()
    def decode(self, indices: torch.Tensor) -> torch.Tensor:
        """(b, f*f) long -> images (b, c, s, s) in [0, 1]."""
        f = self.cfg.fmap_size
        if indices.dim() != 2 or indices.shape[1] != f * f:
            raise ValueError(f"expected indices of shape (b, {f * f}), got {tuple(indices.shape)}")
        zq = F.embedding(indices.view(-1, f, f), self._codebook())
        return (self.decode_vectors(zq).float().clamp(-1, 1) + 1) / 2

    def reconstruct(self, images: torch.Tensor) -> torch.Tensor:
        return self.decode(self.get_codebook_indices(images))

    def quantized(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Training: (reconstruction in [-1, 1], codebook + commitment (+ entropy) loss, metrics with `indices`)."""
        z, neg_dist = self.encode(images)
        indices = neg_dist.argmax(-1)
        zq = F.embedding(indices, self._codebook().float())
        codebook_loss = F.mse_loss(zq, z.detach())
        commitment = F.mse_loss(z, zq.detach())
        loss = codebook_loss + self.cfg.commitment_weight * commitment
        metrics = {"codebook_loss": codebook_loss.detach(), "commitment": commitment.detach()}
        if self.cfg.entropy_weight:
            entropy = _entropy_loss(neg_dist.flatten(0, 2))
            loss = loss + self.cfg.entropy_weight * entropy
            metrics["entropy"] = entropy.detach()
        zq = z + (zq - z).detach()  # straight-through: the decoder's gradient reaches the encoder
        metrics["indices"] = indices.flatten(1)
        return self.decode_vectors(zq.to(z.dtype)), loss, metrics


def _weights(module: nn.Module, frozen: bool):
    w, b = module.weight, module.bias
    return (w.detach(), None if b is None else b.detach()) if frozen else (w, b)


class FrozenableConv(nn.Conv2d):
    def forward(self, x, frozen: bool = False):
        return self._conv_forward(x, *_weights(self, frozen))


class FrozenableNorm(nn.GroupNorm):
    def forward(self, x, frozen: bool = False):
        return F.group_norm(x, self.num_groups, *_weights(self, frozen), self.eps)


class PatchDiscriminator(nn.Module):
    """pix2pix's PatchGAN as taming builds it (NLayerDiscriminator: 4x4 convs, LeakyReLU 0.2, one logit per
    patch), with GroupNorm in place of BatchNorm (no running statistics to keep equal across ranks), and a `frozen`
    forward that uses its weights detached."""

    def __init__(self, channels: int = 3, hidden_dim: int = 64, num_layers: int = 3):
        super().__init__()
        layers: list[nn.Module] = [FrozenableConv(channels, hidden_dim, 4, 2, 1), nn.LeakyReLU(0.2)]
        width = hidden_dim
        for n in range(1, num_layers + 1):
            out = hidden_dim * min(2**n, 8)
            layers += [
                FrozenableConv(width, out, 4, 2 if n < num_layers else 1, 1, bias=False),
                FrozenableNorm(min(32, out // 4), out),
                nn.LeakyReLU(0.2),
            ]
            width = out
        layers.append(FrozenableConv(width, 1, 4, 1, 1))
        self.layers = nn.Sequential(*layers)  # one FSDP unit with its owner: the frozen pass must see whole weights

    def forward(self, x: torch.Tensor, frozen: bool = False) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, frozen) if isinstance(layer, (FrozenableConv, FrozenableNorm)) else layer(x)
        return x


@dataclass
class VQGANLossConfig:
    perceptual_weight: float = 1.0
    disc_weight: float = 0.5  # the generator's adversarial term (LlamaGen's; no adaptive weight)
    disc_start: int = 0
    disc_hidden_dim: int = 64
    disc_layers: int = 3


class VQGANLoss(ConfigSizes, nn.Module):
    """The tokenizer and its discriminator, trained together by one loss (see the module's docstring); the
    tokenizer's sizes (`cfg` is its config)."""

    def __init__(self, cfg: VQTokenizerConfig, loss: VQGANLossConfig):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = VQTokenizer(cfg)
        self.discriminator = PatchDiscriminator(cfg.channels, loss.disc_hidden_dim, loss.disc_layers)
        self.loss_cfg = loss

    def reconstruct(self, images: torch.Tensor) -> torch.Tensor:
        return self.tokenizer.reconstruct(images)

    def forward(self, images: torch.Tensor, step: int, perceptual=None) -> tuple[torch.Tensor, dict]:
        """`perceptual`: a frozen LPIPS (images in [-1, 1] -> (b, 1, 1, 1)), or None."""
        c = self.loss_cfg
        target = images * 2 - 1
        recon, vq_loss, metrics = self.tokenizer.quantized(images)
        rec = F.l1_loss(recon.float(), target.float())
        loss = rec + vq_loss
        if perceptual is not None and c.perceptual_weight:
            p = perceptual(recon, target).mean()
            loss = loss + c.perceptual_weight * p
            metrics["perceptual"] = p.detach()
        on = 1.0 if step >= c.disc_start else 0.0
        g_loss = -self.discriminator(recon, frozen=True).float().mean()
        logits = self.discriminator(torch.cat([target, recon.detach()])).float()
        real, fake = logits.chunk(2)
        d_loss = 0.5 * (F.relu(1 - real).mean() + F.relu(1 + fake).mean())
        loss = loss + on * (c.disc_weight * g_loss + d_loss)
        with torch.no_grad():
            mse01 = F.mse_loss((recon.float().clamp(-1, 1) + 1) / 2, images.float())
            metrics.update(
                recon=rec.detach(),
                psnr=-10 * torch.log10(mse01.clamp_min(1e-10)),
                g_loss=g_loss.detach(),
                d_loss=d_loss.detach(),
                d_real_accuracy=(real > 0).float().mean(),
                d_fake_accuracy=(fake < 0).float().mean(),
            )
        return loss, metrics
