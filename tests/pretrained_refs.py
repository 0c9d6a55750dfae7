"""The upstream reference tokenizers for tests/models/test_pretrained.py, and the random weights both sides load.

taming-transformers (`pip install --no-deps taming-transformers-rom1504==0.0.6`): its model classes import
`pytorch_lightning` and `taming.main` (which needs Lightning < 1.8 and omegaconf); neither is needed to
encode and decode, so `taming_vqgan` imports taming.models.vqgan behind two small stand-ins and removes them
again. OpenAI's DALL-E (`pip install --no-deps DALL-E==0.1` + attrs) imports as it is.
"""

from __future__ import annotations

import importlib
import math
import sys
import types

import torch

# small configs: seconds on a CPU; attention runs at the second level (attn_resolutions = resolution / 2)
VQGAN_DDCONFIG = dict(
    double_z=False,
    z_channels=32,
    resolution=32,
    in_channels=3,
    out_ch=3,
    ch=32,
    ch_mult=[1, 2],
    num_res_blocks=1,
    attn_resolutions=[16],
    dropout=0.0,
)
# the released models' shapes: vqgan_imagenet_f16_16384 and vqgan_gumbel_f8_8192 (built on the meta device)
F16_DDCONFIG = {**VQGAN_DDCONFIG, "z_channels": 256, "resolution": 256, "ch": 128, "ch_mult": [1, 1, 2, 2, 4]}
F16_DDCONFIG["num_res_blocks"], F16_DDCONFIG["attn_resolutions"] = 2, [16]
F8_DDCONFIG = {**F16_DDCONFIG, "ch_mult": [1, 1, 2, 4], "attn_resolutions": [32]}
FULL_SIZE = {"vqgan": (F16_DDCONFIG, 16384, 256), "gumbel_vqgan": (F8_DDCONFIG, 8192, 256)}
OPENAI_SIZES = dict(n_hid=64, n_blk_per_group=1, vocab_size=512, n_init=32)  # the package's minimum sizes


def integer_draws(shapes: dict[str, tuple], seed: int) -> dict[str, torch.Tensor]:
    """Integers behind `random_weights`: per name, the sum of 4 draws from [-64, 64] (an Irwin-Hall bell,
    std 74.5, |k| <= 256). torch's integer RNG does no float arithmetic, so these are the same on every CPU."""
    g = torch.Generator().manual_seed(seed)
    return {
        name: sum(torch.randint(-64, 65, tuple(shapes[name]), generator=g) for _ in range(4)) for name in sorted(shapes)
    }


def _power_of_two_scale(std: float) -> float:
    """The power of two nearest to std / 74.5 (the draws' std): multiplying by it is exact in float32."""
    return 2.0 ** round(math.log2(std / 74.5))


def random_weights(shapes: dict[str, tuple], seed: int) -> dict[str, torch.Tensor]:
    """Deterministic weights for the given names and shapes: fan-in scaled matrices, codebooks ~ unit scale,
    norm scales ~ 1 +- 0.1, biases ~ +- 0.1; codes come out varied instead of collapsed.

    Every value is exactly k * 2**-e for an integer draw k (`integer_draws`) and a power of two per kind of
    tensor, so the same seed gives the same bits on every CPU. Weights drawn with torch.randn and divided by a
    reduction did not: randn's vectorized log/cos and the order of a mean's sums differ between AVX2 and
    AVX-512 kernels, and a fixture hash recorded on one CPU failed on another.

    The dVAE's input convs (`blocks.input.w`) get zero-mean filters (their integer mean, rounded, subtracted):
    otherwise the mean brightness that every image shares dominates the encoder's features and 64 codes take
    about 5 distinct values."""
    out = {}
    for name, k in integer_draws(shapes, seed).items():
        shape = tuple(k.shape)
        fan_in = math.prod(shape[1:])
        if name.endswith("blocks.input.w"):
            k = k - torch.div(k.sum(dim=(1, 2, 3), keepdim=True), fan_in, rounding_mode="floor")
        if "embed" in name:
            out[name] = k.float() * _power_of_two_scale(1.0)
        elif len(shape) > 1:
            out[name] = k.float() * _power_of_two_scale(fan_in**-0.5)
        elif name.endswith("weight"):
            out[name] = 1 + k.float() * _power_of_two_scale(0.1)
        else:
            out[name] = k.float() * _power_of_two_scale(0.1)
    return out


def block_images(batch: int, size: int, seed: int) -> torch.Tensor:
    """(batch, 3, size, size) in [0, 1]: random 4x4 colour blocks, so that positions differ and codes vary."""
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.interpolate(torch.rand(batch, 3, 4, 4, generator=g), size=size)


def shapes_of(module: torch.nn.Module) -> dict[str, tuple]:
    return {k: tuple(v.shape) for k, v in module.state_dict().items()}


def import_taming_vqgan():
    """taming.models.vqgan with stand-ins for pytorch_lightning and taming.main while it imports."""
    try:
        return importlib.import_module("taming.models.vqgan")
    except ImportError:
        pass
    importlib.import_module("taming.modules.diffusionmodules.model")  # ImportError: taming is not installed
    pl = types.ModuleType("pytorch_lightning")
    pl.LightningModule = torch.nn.Module
    main = types.ModuleType("taming.main")

    def instantiate_from_config(config):  # taming/main.py's, verbatim in substance
        module, cls = config["target"].rsplit(".", 1)
        return getattr(importlib.import_module(module), cls)(**config.get("params", {}))

    main.instantiate_from_config = instantiate_from_config
    saved = {k: sys.modules.get(k) for k in ("pytorch_lightning", "taming.main")}
    sys.modules.update({"pytorch_lightning": pl, "taming.main": main})
    try:
        return importlib.import_module("taming.models.vqgan")
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


def taming_model(gumbel: bool, n_embed: int = 64, embed_dim: int = 32, ddconfig=VQGAN_DDCONFIG):
    """taming's VQModel or GumbelVQ, no loss (torch.nn.Identity stands for the LPIPS + discriminator)."""
    vqgan = import_taming_vqgan()
    identity = {"target": "torch.nn.Identity"}
    if gumbel:
        model = vqgan.GumbelVQ(dict(ddconfig), identity, n_embed, embed_dim, temperature_scheduler_config=identity)
    else:
        model = vqgan.VQModel(dict(ddconfig), identity, n_embed, embed_dim)
    return model.eval()


@torch.no_grad()
def taming_tokenize(model, images01: torch.Tensor, gumbel: bool):
    """Reference codes (b, h*w) and decoded images in [0, 1] the way DALLE-pytorch's VQGanVAE uses taming;
    Gumbel-VQ codes are the argmax of its logits (taming samples them with noise)."""
    x = images01 * 2 - 1
    if gumbel:
        h = model.encode_to_prequant(x)
        _, _, _, logits = model.quantize(h, return_logits=True)
        codes = logits.argmax(dim=1)
    else:
        quant, _, (_, _, ind) = model.encode(x)
        codes = ind.view(quant.shape[0], quant.shape[2], quant.shape[3])
    b, h, w = codes.shape
    dim = (model.quantize.embed if gumbel else model.quantize.embedding).weight.shape[1]
    z = model.quantize.get_codebook_entry(codes.reshape(-1), (b, h, w, dim))
    decoded = model.decode(z)
    return codes.reshape(b, -1), (decoded.clamp(-1, 1) + 1) * 0.5


def top2_margin(scores: torch.Tensor, dim: int) -> torch.Tensor:
    """How far the chosen code's score is ahead of the runner-up's, per position (b, h*w): where it is small, a
    CPU whose kernels sum in another order may pick the other code, and a comparison of codes across machines
    must not count that position. `scores` has the codes along `dim`; the result has that dimension removed."""
    top2 = scores.topk(2, dim=dim).values
    return (top2.narrow(dim, 0, 1) - top2.narrow(dim, 1, 1)).squeeze(dim)


@torch.no_grad()
def taming_margins(model, images01: torch.Tensor, gumbel: bool) -> torch.Tensor:
    """The margin of each position's code in taming's own scores: Gumbel-VQ logits, or minus the squared
    distances that VectorQuantizer2 takes its argmin of."""
    h = model.quant_conv(model.encoder(images01 * 2 - 1))  # (b, c, h, w): both classes' encode_to_prequant
    if gumbel:
        return top2_margin(model.quantize.proj(h), dim=1).flatten(1)
    b, c, hh, ww = h.shape
    z = h.permute(0, 2, 3, 1).reshape(-1, c)
    e = model.quantize.embedding.weight
    d = z.pow(2).sum(1, keepdim=True) + e.pow(2).sum(1) - 2 * z @ e.t()  # (b*h*w, n_embed)
    return top2_margin(-d, dim=1).reshape(b, hh * ww)


@torch.no_grad()
def dall_e_margins(enc, images01: torch.Tensor) -> torch.Tensor:
    from dall_e import map_pixels

    return top2_margin(enc(map_pixels(images01)), dim=1).flatten(1)


def dall_e_models(**sizes):
    from dall_e import Decoder, Encoder

    s = {**OPENAI_SIZES, **sizes}
    enc = Encoder(n_hid=s["n_hid"], n_blk_per_group=s["n_blk_per_group"], vocab_size=s["vocab_size"])
    dec = Decoder(
        n_init=s["n_init"], n_hid=s["n_hid"], n_blk_per_group=s["n_blk_per_group"], vocab_size=s["vocab_size"]
    )
    return enc.eval(), dec.eval()


@torch.no_grad()
def dall_e_tokenize(enc, dec, images01: torch.Tensor):
    """Reference codes and images, as in the DALL-E package's usage notebook."""
    import torch.nn.functional as F
    from dall_e import map_pixels, unmap_pixels

    codes = enc(map_pixels(images01)).argmax(dim=1)  # (b, h, w)
    one_hot = F.one_hot(codes, num_classes=enc.vocab_size).permute(0, 3, 1, 2).float()
    images = unmap_pixels(torch.sigmoid(dec(one_hot)[:, :3]))
    return codes.flatten(1), images
