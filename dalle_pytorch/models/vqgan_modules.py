"""The config, encoder and decoder of taming-transformers' VQGAN, as taming/modules/diffusionmodules/model.py builds
them (same module and parameter names), without the timestep embedding the autoencoder does not use."""

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
    give_pre_end: bool = False  # true makes taming's decoder return features: refused
    tanh_out: bool = False  # later taming versions; False before the flag existed
    n_embed: int = 16384
    embed_dim: int = 256
    gumbel: bool = False  # GumbelVQ (quantize.proj + quantize.embed) instead of VQModel (quantize.embedding)
    extra: dict = field(default_factory=dict)  # ddconfig keys that do not change inference (dropout ...)

    def __post_init__(self):
        self.ch_mult, self.attn_resolutions = tuple(self.ch_mult), tuple(self.attn_resolutions)
        if self.ch % 32 or self.z_channels < 1 or not self.ch_mult:
            raise ValueError(f"ddconfig.ch must be a multiple of 32 (GroupNorm(32)) and ch_mult non-empty: {self}")
        if self.give_pre_end:
            raise ValueError("ddconfig.give_pre_end is true: its decoder returns features, not images; set it false")
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
        self.tanh_out = cfg.tanh_out
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
        h = self.conv_out(swish(self.norm_out(h)))
        return torch.tanh(h) if self.tanh_out else h
