"""OpenAI's discrete VAE of DALL-E (Ramesh et al. 2021) as an image tokenizer.

Re-implemented after openai/DALL-E (dall_e/encoder.py, decoder.py, utils.py) with the same parameter names
(`blocks.group_1.block_1.res_path.conv_1.w` ...), so the released weights load unchanged. Differences: the
convs always run in the input's dtype (the original casts most of them to fp16 on CUDA), and the sizes are
read from the weights instead of attrs fields.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .vae import check_images

LOGIT_LAPLACE_EPS = 0.1  # dall_e/utils.py: pixels live in [eps, 1 - eps] for the logit-Laplace likelihood


def map_pixels(x: torch.Tensor) -> torch.Tensor:
    return (1 - 2 * LOGIT_LAPLACE_EPS) * x + LOGIT_LAPLACE_EPS


def unmap_pixels(x: torch.Tensor) -> torch.Tensor:
    return ((x - LOGIT_LAPLACE_EPS) / (1 - 2 * LOGIT_LAPLACE_EPS)).clamp(0, 1)


@dataclass
class OpenAIDVAEConfig:
    n_hid: int = 256
    n_blk_per_group: int = 2
    vocab_size: int = 8192
    input_channels: int = 3
    output_channels: int = 3
    n_init: int = 128
    group_count: int = 4  # fixed in the original: three 2x poolings, a grid of image_size / 8

    @property
    def downsample_factor(self) -> int:
        return 2 ** (self.group_count - 1)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, weights: dict) -> OpenAIDVAEConfig:
        """The sizes, read from the shapes of the weights (`enc.*` and `dec.*`, as OpenAIDiscreteVAE names them)."""
        try:
            n_hid, input_channels = weights["enc.blocks.input.w"].shape[:2]
            vocab_size = weights["enc.blocks.output.conv.w"].shape[0]
            n_init = weights["dec.blocks.input.w"].shape[0]
            output_channels = weights["dec.blocks.output.conv.w"].shape[0] // 2
        except KeyError as e:
            raise ValueError(f"not an OpenAI dVAE state dict: no {e.args[0]}") from None
        n_blk = sum(1 for k in weights if k.startswith("enc.blocks.group_1.block_") and k.endswith("res_path.conv_1.w"))
        return cls(n_hid, n_blk, vocab_size, input_channels, output_channels, n_init)


class Conv2d(nn.Module):
    """A 'same'-padded conv with parameters named `w` and `b`, as in dall_e/utils.py."""

    def __init__(self, n_in: int, n_out: int, kw: int):
        super().__init__()
        self.w = nn.Parameter(torch.randn(n_out, n_in, kw, kw) / math.sqrt(n_in * kw**2))
        self.b = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return F.conv2d(x, self.w, self.b, padding=(self.w.shape[-1] - 1) // 2)


class _Block(nn.Module):
    """Encoder and decoder blocks: identity (or 1x1) path + post_gain x a 4-conv residual path."""

    def __init__(self, n_in: int, n_out: int, n_layers: int, kernels: tuple[int, int, int, int]):
        super().__init__()
        n_hid = n_out // 4
        self.post_gain = 1 / n_layers**2
        self.id_path = Conv2d(n_in, n_out, 1) if n_in != n_out else nn.Identity()
        chans = (n_in, n_hid, n_hid, n_hid, n_out)
        layers = []
        for i, kw in enumerate(kernels):
            layers += [(f"relu_{i + 1}", nn.ReLU()), (f"conv_{i + 1}", Conv2d(chans[i], chans[i + 1], kw))]
        self.res_path = nn.Sequential(OrderedDict(layers))

    def forward(self, x):
        return self.id_path(x) + self.post_gain * self.res_path(x)


def _group(widths: list[tuple[int, int]], n_layers: int, kernels, resample: tuple[str, nn.Module] | None):
    blocks = [(f"block_{i + 1}", _Block(n_in, n_out, n_layers, kernels)) for i, (n_in, n_out) in enumerate(widths)]
    return nn.Sequential(OrderedDict(blocks + ([resample] if resample else [])))


def _widths(first_in: int, out: int, n: int) -> list[tuple[int, int]]:
    return [(first_in if i == 0 else out, out) for i in range(n)]


class Encoder(nn.Module):
    def __init__(self, cfg: OpenAIDVAEConfig):
        super().__init__()
        h, n, n_layers = cfg.n_hid, cfg.n_blk_per_group, cfg.group_count * cfg.n_blk_per_group
        k = (3, 3, 3, 1)
        pool = ("pool", nn.MaxPool2d(kernel_size=2))
        self.blocks = nn.Sequential(
            OrderedDict(
                [
                    ("input", Conv2d(cfg.input_channels, h, 7)),
                    ("group_1", _group(_widths(h, h, n), n_layers, k, pool)),
                    ("group_2", _group(_widths(h, 2 * h, n), n_layers, k, pool)),
                    ("group_3", _group(_widths(2 * h, 4 * h, n), n_layers, k, pool)),
                    ("group_4", _group(_widths(4 * h, 8 * h, n), n_layers, k, None)),
                    (
                        "output",
                        nn.Sequential(OrderedDict([("relu", nn.ReLU()), ("conv", Conv2d(8 * h, cfg.vocab_size, 1))])),
                    ),
                ]
            )
        )

    def forward(self, x):
        return self.blocks(x)  # (b, vocab, s/8, s/8) logits


class Decoder(nn.Module):
    def __init__(self, cfg: OpenAIDVAEConfig):
        super().__init__()
        h, n, n_layers = cfg.n_hid, cfg.n_blk_per_group, cfg.group_count * cfg.n_blk_per_group
        k = (1, 3, 3, 3)
        up = ("upsample", nn.Upsample(scale_factor=2, mode="nearest"))
        self.blocks = nn.Sequential(
            OrderedDict(
                [
                    ("input", Conv2d(cfg.vocab_size, cfg.n_init, 1)),
                    ("group_1", _group(_widths(cfg.n_init, 8 * h, n), n_layers, k, up)),
                    ("group_2", _group(_widths(8 * h, 4 * h, n), n_layers, k, up)),
                    ("group_3", _group(_widths(4 * h, 2 * h, n), n_layers, k, up)),
                    ("group_4", _group(_widths(2 * h, h, n), n_layers, k, None)),
                    (
                        "output",
                        nn.Sequential(
                            OrderedDict([("relu", nn.ReLU()), ("conv", Conv2d(h, 2 * cfg.output_channels, 1))])
                        ),
                    ),
                ]
            )
        )

    def forward(self, x):
        return self.blocks(x)  # (b, 2 * channels, s, s): logit-Laplace location and log-scale per channel


class OpenAIDiscreteVAE(nn.Module):
    """OpenAI's dVAE behind the tokenizer interface of DiscreteVAE: images in [0, 1]."""

    def __init__(self, cfg: OpenAIDVAEConfig, image_size: int = 256):
        super().__init__()
        self.cfg = cfg
        self.enc = Encoder(cfg)
        self.dec = Decoder(cfg)
        if image_size % cfg.downsample_factor:
            raise ValueError(f"--pretrained_image_size {image_size} is not a multiple of {cfg.downsample_factor}")
        self.image_size = image_size  # fully convolutional; trained by OpenAI at 256
        self.fmap_size = image_size // cfg.downsample_factor
        self.num_tokens = cfg.vocab_size
        self.channels = cfg.input_channels

    @torch.no_grad()
    def get_codebook_indices(self, images: torch.Tensor) -> torch.Tensor:
        """(b, c, s, s) in [0, 1] -> (b, f*f) long."""
        check_images(images, self.channels, self.image_size)
        return self.enc(map_pixels(images)).argmax(dim=1).flatten(1)

    @torch.no_grad()
    def decode(self, indices: torch.Tensor) -> torch.Tensor:
        """(b, f*f) long -> images (b, c, s, s) in [0, 1]: the sigmoid of the predicted location, unmapped."""
        f = self.fmap_size
        if indices.dim() != 2 or indices.shape[1] != f * f:
            raise ValueError(f"expected indices of shape (b, {f * f}), got {tuple(indices.shape)}")
        one_hot = F.one_hot(indices.view(-1, f, f), self.num_tokens).permute(0, 3, 1, 2)  # (b, vocab, f, f)
        x = self.dec(one_hot.to(self.dec.blocks.input.w.dtype))
        return unmap_pixels(torch.sigmoid(x[:, : self.cfg.output_channels]))

    def reconstruct(self, images: torch.Tensor) -> torch.Tensor:
        return self.decode(self.get_codebook_indices(images))
