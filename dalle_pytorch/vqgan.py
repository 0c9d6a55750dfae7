"""VQGAN and Gumbel-VQ from taming-transformers as an image tokenizer: only what encodes and decodes.

Re-implemented after CompVis/taming-transformers (Esser et al. 2021, arXiv:2012.09841):
taming/modules/diffusionmodules/model.py (Encoder, Decoder, ResnetBlock, AttnBlock), taming/modules/vqvae/
quantize.py (VectorQuantizer2, GumbelQuantize) and taming/models/vqgan.py (VQModel, GumbelVQ), with the same
parameter names, so a checkpoint's state dict loads unchanged. Left out: the discriminator and the LPIPS
loss (`loss.*` keys), the timestep embedding (unused by the autoencoder), index remapping, training code.
The taming package itself is not imported: its import chain needs an old PyTorch Lightning.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class VQGANConfig:
    """`model.params.ddconfig` of a taming config, plus n_embed, embed_dim and which quantizer."""

    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] = (16,)
    resolution: int = 256
    in_channels: int = 3
    out_ch: int = 3
    z_channels: int = 256
    double_z: bool = False
    resamp_with_conv: bool = True
    give_pre_end: bool = False
    tanh_out: bool = False  # later taming versions; False before the flag existed
    n_embed: int = 16384
    embed_dim: int = 256
    gumbel: bool = False  # GumbelVQ (quantize.proj + quantize.embed) instead of VQModel (quantize.embedding)
    extra: dict = field(default_factory=dict)  # ddconfig keys that do not change inference (dropout ...)

    def __post_init__(self):
        self.ch_mult, self.attn_resolutions = tuple(self.ch_mult), tuple(self.attn_resolutions)
        if self.ch % 32 or self.z_channels < 1 or not self.ch_mult:
            raise ValueError(f"ddconfig.ch must be a multiple of 32 (GroupNorm(32)) and ch_mult non-empty: {self}")
        if self.gumbel and self.embed_dim != self.z_channels:
            raise ValueError(f"a GumbelVQ needs embed_dim == z_channels (got {self.embed_dim}, {self.z_channels})")

    @property
    def downsample_factor(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    @property
    def fmap_size(self) -> int:
        return self.resolution // self.downsample_factor

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ch_mult"], d["attn_resolutions"] = list(self.ch_mult), list(self.attn_resolutions)
        return d


def swish(x):
    return x * torch.sigmoid(x)


def normalize(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class Upsample(nn.Module):
    def __init__(self, channels: int, with_conv: bool):
        super().__init__()
        self.with_conv = with_conv
        if with_conv:
            self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        x = F.interpolate(x, scale_factor=2.0, mode="nearest")
        return self.conv(x) if self.with_conv else x


class Downsample(nn.Module):
    def __init__(self, channels: int, with_conv: bool):
        super().__init__()
        self.with_conv = with_conv
        if with_conv:
            self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x):
        if self.with_conv:  # asymmetric padding (right and bottom only), as taming does
            return self.conv(F.pad(x, (0, 1, 0, 1)))
        return F.avg_pool2d(x, kernel_size=2, stride=2)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1 = normalize(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = normalize(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        # taming's default shortcut is the 1x1 `nin_shortcut` (conv_shortcut=False everywhere in its models)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x):
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))  # dropout is the identity at inference
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the h*w positions, 1x1 convs for q, k, v and the output."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = normalize(channels)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(channels, channels, 1) for _ in range(4))

    def forward(self, x):
        h_ = self.norm(x)
        b, c, h, w = x.shape
        q, k, v = (t.reshape(b, 1, c, h * w).transpose(2, 3) for t in (self.q(h_), self.k(h_), self.v(h_)))
        out = F.scaled_dot_product_attention(q, k, v)  # (b, 1, hw, c), softmax(q k^T / sqrt(c)) v
        return x + self.proj_out(out.transpose(2, 3).reshape(b, c, h, w))


def _level(block_in: int, block_out: int, n_blocks: int, attn: bool) -> tuple[nn.Module, int]:
    level = nn.Module()
    level.block = nn.ModuleList()
    level.attn = nn.ModuleList()
    for _ in range(n_blocks):
        level.block.append(ResnetBlock(block_in, block_out))
        block_in = block_out
        if attn:
            level.attn.append(AttnBlock(block_in))
    return level, block_in


def _run_level(level: nn.Module, h: torch.Tensor) -> torch.Tensor:
    for i, block in enumerate(level.block):
        h = block(h)
        if len(level.attn):
            h = level.attn[i](h)
    return h


def _middle(channels: int) -> nn.Module:
    mid = nn.Module()
    mid.block_1, mid.attn_1, mid.block_2 = (
        ResnetBlock(channels, channels),
        AttnBlock(channels),
        ResnetBlock(channels, channels),
    )
    return mid


class Encoder(nn.Module):
    def __init__(self, cfg: VQGANConfig):
        super().__init__()
        self.conv_in = nn.Conv2d(cfg.in_channels, cfg.ch, 3, padding=1)
        in_ch_mult = (1, *cfg.ch_mult)
        res = cfg.resolution
        self.down = nn.ModuleList()
        for i, mult in enumerate(cfg.ch_mult):
            level, block_in = _level(
                cfg.ch * in_ch_mult[i], cfg.ch * mult, cfg.num_res_blocks, res in cfg.attn_resolutions
            )
            if i != len(cfg.ch_mult) - 1:
                level.downsample = Downsample(block_in, cfg.resamp_with_conv)
                res //= 2
            self.down.append(level)
        self.mid = _middle(block_in)
        self.norm_out = normalize(block_in)
        self.conv_out = nn.Conv2d(block_in, 2 * cfg.z_channels if cfg.double_z else cfg.z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for i, level in enumerate(self.down):
            h = _run_level(level, h)
            if i != len(self.down) - 1:
                h = level.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(swish(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, cfg: VQGANConfig):
        super().__init__()
        self.cfg = cfg
        block_in = cfg.ch * cfg.ch_mult[-1]
        res = cfg.resolution // cfg.downsample_factor
        self.conv_in = nn.Conv2d(cfg.z_channels, block_in, 3, padding=1)
        self.mid = _middle(block_in)
        self.up = nn.ModuleList()
        for i in reversed(range(len(cfg.ch_mult))):
            attn = res in cfg.attn_resolutions
            level, block_in = _level(block_in, cfg.ch * cfg.ch_mult[i], cfg.num_res_blocks + 1, attn)
            if i != 0:
                level.upsample = Upsample(block_in, cfg.resamp_with_conv)
                res *= 2
            self.up.insert(0, level)  # up[0] is the full-resolution level, as in taming
        self.norm_out = normalize(block_in)
        self.conv_out = nn.Conv2d(block_in, cfg.out_ch, 3, padding=1)

    def forward(self, z):
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(self.conv_in(z))))
        for i in reversed(range(len(self.up))):
            h = _run_level(self.up[i], h)
            if i != 0:
                h = self.up[i].upsample(h)
        if self.cfg.give_pre_end:
            return h
        h = self.conv_out(swish(self.norm_out(h)))
        return torch.tanh(h) if self.cfg.tanh_out else h


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

    def _check_images(self, images: torch.Tensor) -> None:
        c, s = self.channels, self.image_size
        if images.dim() != 4 or tuple(images.shape[1:]) != (c, s, s):
            raise ValueError(f"expected images of shape (b, {c}, {s}, {s}) in [0, 1], got {tuple(images.shape)}")

    @torch.no_grad()
    def get_codebook_indices(self, images: torch.Tensor) -> torch.Tensor:
        """(b, c, s, s) in [0, 1] -> (b, f*f) long."""
        self._check_images(images)
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
