"""Files in LlamaGen's layouts with fixed random values, and the inputs its figures were recorded on
(tests/fixtures/llamagen.json, written by scripts/record_llamagen.py with LlamaGen's own code at the commit it
names). The same seed gives the same values on any CPU: every value is drawn by torch's CPU generator, in a fixed
order of the sorted parameter names.

Sizes: "small" (quick, the default tier) and "real" (LlamaGen's VQ-16 widths and GPT-XL, the slow tier)."""

from __future__ import annotations

import hashlib

import torch

from dalle_pytorch.models import llamagen
from dalle_pytorch.models.layers import swiglu_hidden

# LlamaGen's ModelArgs for each size: the VQ's (ch, ch_mult, z_channels, code_dim, codebook) and an image side,
# the GPT's (dim, layers, caption width, caption positions: 120, as CaptionEmbedder fixes them) over the codes
VQ = {
    "small": dict(ch=32, ch_mult=[1, 1, 2], z_channels=32, code_dim=8, codes=64, image=16),
    "real": dict(ch=128, ch_mult=[1, 1, 2, 2, 4], z_channels=256, code_dim=8, codes=16384, image=32),
    # for the launchers (tests/launchers/test_vqgan_ranks.py): 64 channels, as that test's docstring says why
    "launcher": dict(ch=64, ch_mult=[1, 1], z_channels=64, code_dim=8, codes=16, image=16),
}
GPT = {
    "small": dict(dim=128, layers=2, caption_dim=32, caption_len=120, fmap=4),
    "real": dict(dim=1280, layers=36, caption_dim=2048, caption_len=120, fmap=16),
}
CAPTION_LENGTHS = {"small": [3, 120], "real": [7, 120]}  # real tokens per row: a short caption and a full one


def layout_hash(state_dict: dict) -> str:
    """The names and shapes of a state dict: the layout a file must have to load."""
    text = "\n".join(f"{k}:{tuple(v.shape)}" for k, v in sorted(state_dict.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _values(shapes: dict[str, tuple], seed: int) -> dict[str, torch.Tensor]:
    """Fixed random values for every name: weights scaled by 1/sqrt(fan-in), norms near 1, biases small."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        x = torch.randn(shape, generator=g)
        if name.endswith("bias"):
            x = x * 0.1
        elif len(shape) == 1:  # a norm's scale
            x = 1 + 0.1 * x
        elif "embedding" not in name and "embeddings" not in name:
            x = x / (torch.tensor(shape[1:]).prod().float().sqrt())
        out[name] = x
    return out


def _theirs(ours: dict[str, torch.Size], names: dict[str, str]) -> dict[str, tuple]:
    """Our names and shapes under LlamaGen's names (names: theirs -> ours)."""
    back = {v: k for k, v in names.items()}
    prefixes = sorted(back, key=len, reverse=True)
    out = {}
    for key, shape in ours.items():
        prefix = next((p for p in prefixes if key == p or key.startswith(p + ".")), None)
        if prefix is not None:
            out[back[prefix] + key[len(prefix) :]] = tuple(shape)
    return out


def vq_state_dict(size: str = "small", seed: int = 0) -> dict[str, torch.Tensor]:
    """A LlamaGen VQ state dict (VQModel's names, codebook_used included) of the given size."""
    from dalle_pytorch.models.vq_tokenizer import VQTokenizer, VQTokenizerConfig

    s = VQ[size]
    cfg = VQTokenizerConfig(
        image_size=s["image"], num_tokens=s["codes"], code_dim=s["code_dim"], num_layers=len(s["ch_mult"]) - 1,
        hidden_dim=s["ch"], num_resnet_blocks=2, ch_mult=s["ch_mult"], z_channels=s["z_channels"], lowest_attn=True,
    )  # fmt: skip
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in VQTokenizer(cfg).state_dict().items()}
    sd = _values(_theirs(shapes, llamagen._vq_names(cfg)), seed)
    sd["quantize.codebook_used"] = torch.zeros(65536)
    return sd


def gpt_state_dict(size: str = "small", seed: int = 1) -> dict[str, torch.Tensor]:
    """A LlamaGen T2I GPT state dict (Transformer's names) over the same-size VQ's codebook."""
    from dalle_pytorch.models.dalle import DALLE

    s = GPT[size]
    d, t, f = s["dim"], s["caption_len"], s["caption_dim"]
    shapes = {
        "tok_embeddings.weight": (VQ[size]["codes"], d),
        "cls_embedding.cap_proj.fc1.weight": (d, f),
        "cls_embedding.cap_proj.fc2.weight": (d, d),
        "cls_embedding.uncond_embedding": (t, f),
        "norm.weight": (d,),
        "output.weight": (VQ[size]["codes"], d),
    }
    spec = {k: torch.zeros(v) for k, v in shapes.items()}  # what gpt_config reads, for the blocks' shapes
    spec["layers.0.attention.wqkv.weight"] = torch.zeros(3 * d, d)
    spec["layers.0.feed_forward.w1.weight"] = torch.zeros(swiglu_hidden(d, 4, 256), d)
    cfg = llamagen.gpt_config(spec, s["fmap"], "spec")
    cfg.depth = s["layers"]
    with torch.device("meta"):
        ours = {k: v.shape for k, v in DALLE(cfg).state_dict().items() if k.startswith("transformer.layers.")}
    names = {}
    for i in range(s["layers"]):
        names.update({f"layers.{i}.{a}": f"transformer.layers.{i}.{b}" for a, b in llamagen._LAYER_NAMES.items()})
    shapes.update({k: v for k, v in _theirs(ours, names).items() if not k.endswith("wo.bias")})
    return _values(shapes, seed)


def images(size: str = "small", seed: int = 2) -> torch.Tensor:
    """Two images in [-1, 1] (LlamaGen's input range) of the size's side."""
    side = VQ[size]["image"]
    return torch.rand((2, 3, side, side), generator=torch.Generator().manual_seed(seed)) * 2 - 1


def captions(size: str = "small", seed: int = 3) -> torch.Tensor:
    """Two captions' features (2, caption_len, caption_dim), real tokens first, zero vectors after."""
    s = GPT[size]
    x = torch.randn((2, s["caption_len"], s["caption_dim"]), generator=torch.Generator().manual_seed(seed))
    for row, n in enumerate(CAPTION_LENGTHS[size]):
        x[row, n:] = 0
    return x


def image_tokens(size: str = "small", seed: int = 4) -> torch.Tensor:
    """Two rows of image token ids over the whole grid."""
    n = GPT[size]["fmap"] ** 2
    return torch.randint(0, VQ[size]["codes"], (2, n), generator=torch.Generator().manual_seed(seed))
