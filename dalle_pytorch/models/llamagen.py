"""LlamaGen's published checkpoints (Sun et al. 2024, arXiv:2406.06525; FoundationVision/LlamaGen) read into the
project's own models, so that they train, sample, export and load wherever ours do:

- its VQ tokenizers (vq_ds16_t2i.pt, vq_ds16_c2i.pt, vq_ds8_c2i.pt) become a VQTokenizer with LlamaGen's channel
  multipliers, z_channels and attention at the lowest resolution (an export of kind "vae");
- its text-to-image GPTs (t2i_XL_stage1_256.pt ...) become a DALLE with LlamaGen's layout (models/dalle.py).

The architecture is read from the file's tensors, never from its name: widths, depths and codebook from their
shapes. The two things no tensor says are taken from LlamaGen's code: its VQ looks codes up l2-normalized (every
release), and a GPT's head count comes from LlamaGen's size table (head width 64 otherwise). Module names are mapped
one by one; a file whose tensors do not all map, or map to the wrong shapes, is refused in one line. No LlamaGen
code is imported or copied.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from .dalle import DALLEConfig
from .layers import swiglu_hidden
from .vq_tokenizer import VQTokenizerConfig

# LlamaGen's GPT sizes (gpt.py's GPT_models): (dim, layers) -> heads
GPT_HEADS = {
    (768, 12): 12,  # GPT-B
    (1024, 24): 16,  # GPT-L
    (1280, 36): 20,  # GPT-XL
    (1536, 48): 24,  # GPT-XXL
    (2560, 48): 40,  # GPT-XXXL
    (2048, 22): 32,  # GPT-1B
    (3200, 24): 32,  # GPT-3B
    (4096, 32): 32,  # GPT-7B
}
_VQ_MARK = ("encoder.conv_blocks.0.res.0.conv1.weight", "quantize.embedding.weight")
_GPT_MARK = ("tok_embeddings.weight", "layers.0.attention.wqkv.weight")
EXPECTED = (
    "LlamaGen's VQ (vq_ds16_t2i.pt, vq_ds16_c2i.pt, vq_ds8_c2i.pt) or text-to-image GPT (t2i_XL_stage1_256.pt, "
    "t2i_XL_stage2_512.pt) checkpoint"
)


def checkpoint_weights(obj) -> dict | None:
    """The state dict in a LlamaGen checkpoint (its `model`, as LlamaGen's training saves it; `module`, as
    DeepSpeed does; `state_dict`), or the object itself when it is one; None for anything else."""
    if isinstance(obj, dict):
        for key in ("model", "module", "state_dict"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if isinstance(obj, dict) and obj and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    return None


def kind_of(weights: dict | None) -> str:
    """ "vq", "t2i", "c2i" (a class-conditional GPT) or "" for a state dict that is none of LlamaGen's."""
    if not weights:
        return ""
    if all(k in weights for k in _VQ_MARK):
        return "vq"
    if all(k in weights for k in _GPT_MARK):
        return "t2i" if "cls_embedding.cap_proj.fc1.weight" in weights else "c2i"
    return ""


def _count(weights: dict, pattern: str) -> int:
    found = {m.group(1) for k in weights if (m := re.match(pattern, k))}
    return len(found)


def _shape(weights: dict, key: str, what: str) -> torch.Size:
    if key not in weights:
        raise ValueError(f"{what} is not {EXPECTED}: it has no {key}")
    return weights[key].shape


# ------------------------------------------------------------------------------------------------- VQ


def vq_config(weights: dict, image_size: int, what: str) -> VQTokenizerConfig:
    """The VQTokenizer a LlamaGen VQ state dict fits, read from its shapes; `image_size` as given (its codes are
    those of any size divisible by its downsampling)."""
    ch, channels = _shape(weights, "encoder.conv_in.weight", what)[:2]
    levels = _count(weights, r"encoder\.conv_blocks\.(\d+)\.res\.0\.conv1\.weight")
    blocks = _count(weights, r"encoder\.conv_blocks\.0\.res\.(\d+)\.conv1\.weight")
    mult = [_shape(weights, f"encoder.conv_blocks.{i}.res.0.conv1.weight", what)[0] // ch for i in range(levels)]
    dec = [_shape(weights, f"decoder.conv_blocks.{levels - 1 - i}.res.0.conv1.weight", what)[0] for i in range(levels)]
    if dec != [ch * m for m in mult] or _count(weights, r"decoder\.conv_blocks\.0\.res\.(\d+)\.") != blocks + 1:
        raise ValueError(f"{what}: its decoder's channels or blocks are not its encoder's mirrored, as LlamaGen's are")
    return VQTokenizerConfig(
        image_size=image_size or 256,
        channels=int(channels),
        num_tokens=int(_shape(weights, "quantize.embedding.weight", what)[0]),
        code_dim=int(_shape(weights, "quant_conv.weight", what)[0]),
        num_layers=levels - 1,
        hidden_dim=int(ch),
        num_resnet_blocks=blocks,
        l2_norm=True,  # LlamaGen's codebook_l2_norm, on in every release
        ch_mult=mult,
        z_channels=int(_shape(weights, "encoder.conv_out.weight", what)[0]),
        lowest_attn=f"encoder.conv_blocks.{levels - 1}.attn.0.q.weight" in weights,
    )


def _vq_names(cfg: VQTokenizerConfig) -> dict[str, str]:
    """LlamaGen's module names -> ours (VQTokenizer's flat encoder and decoder lists, in forward order)."""
    last = cfg.num_layers
    enc = ["conv_in"]
    for i in range(last + 1):
        for j in range(cfg.num_resnet_blocks):
            enc.append(f"conv_blocks.{i}.res.{j}")
            if cfg.lowest_attn and i == last:
                enc.append(f"conv_blocks.{i}.attn.{j}")
        if i < last:
            enc.append(f"conv_blocks.{i}.downsample")
    dec = ["conv_in", "mid.0", "mid.1", "mid.2"]
    for i in range(last + 1):
        for j in range(cfg.num_resnet_blocks + 1):
            dec.append(f"conv_blocks.{i}.res.{j}")
            if cfg.lowest_attn and i == 0:
                dec.append(f"conv_blocks.{i}.attn.{j}")
        if i < last:
            dec.append(f"conv_blocks.{i}.upsample")
    enc += ["mid.0", "mid.1", "mid.2"]
    names = {"quant_conv": "quant_conv", "post_quant_conv": "post_quant_conv", "quantize.embedding": "codebook"}
    for side, order in (("encoder", enc), ("decoder", dec)):
        names.update({f"{side}.{theirs}": f"{side}.{i}" for i, theirs in enumerate(order)})
        names[f"{side}.norm_out"] = f"{side}.{len(order)}.0"  # our Head: GroupNorm, SiLU, conv
        names[f"{side}.conv_out"] = f"{side}.{len(order)}.2"
    return names


def _renamed(weights: dict, names: dict[str, str], skip: tuple, what: str) -> dict:
    prefixes = sorted(names, key=len, reverse=True)
    out = {}
    for key, value in weights.items():
        if key.startswith(skip):
            continue
        prefix = next((p for p in prefixes if key.startswith(p + ".")), None)
        if prefix is None:
            raise ValueError(f"{what} is not {EXPECTED}: it holds {key}, which LlamaGen's model has no place for")
        out[names[prefix] + key[len(prefix) :]] = value
    return out


def _fit(model: torch.nn.Module, weights: dict, what: str) -> dict:
    """`weights` checked against the model's own names and shapes (one line naming the first mismatch)."""
    ours = model.state_dict()
    missing, unexpected = sorted(ours.keys() - weights.keys()), sorted(weights.keys() - ours.keys())
    if missing or unexpected:
        raise ValueError(f"{what} is not {EXPECTED}: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for key, value in weights.items():
        if value.shape != ours[key].shape:
            raise ValueError(f"{what}: {key} is {tuple(value.shape)}, LlamaGen's layout says {tuple(ours[key].shape)}")
    return {k: v.to(ours[k].dtype).contiguous() for k, v in weights.items()}


def vq_export(weights: dict, image_size: int, what: str) -> dict:
    """The export (kind "vae") of a LlamaGen VQ state dict: its config read from the tensors, its weights renamed."""
    from .vq_tokenizer import VQTokenizer

    cfg = vq_config(weights, image_size, what)
    with torch.device("meta"):
        model = VQTokenizer(cfg)
    renamed = _fit(model, _renamed(weights, _vq_names(cfg), ("quantize.codebook_used",), what), what)
    return {"format_version": 1, "kind": "vae", "config": cfg.to_dict(), "weights": renamed}


# ------------------------------------------------------------------------------------------------ GPT


def gpt_config(weights: dict, image_fmap_size: int, what: str) -> DALLEConfig:
    """The DALLE a LlamaGen T2I GPT state dict fits (LlamaGen's layout), with the image grid of its VQ."""
    vocab, dim = _shape(weights, "tok_embeddings.weight", what)
    depth = _count(weights, r"layers\.(\d+)\.attention\.wqkv\.weight")
    heads = GPT_HEADS.get((dim, depth)) or dim // 64
    dim_head = dim // heads
    qkv = _shape(weights, "layers.0.attention.wqkv.weight", what)[0]
    kv_heads = (qkv // dim_head - heads) // 2
    hidden = _shape(weights, "layers.0.feed_forward.w1.weight", what)[0]
    if hidden != swiglu_hidden(dim, 4, 256):
        raise ValueError(
            f"{what}: its feed-forward is {hidden} wide, not LlamaGen's default {swiglu_hidden(dim, 4, 256)} "
            "(ffn_dim_multiplier): not supported"
        )
    text_seq_len, feature_dim = _shape(weights, "cls_embedding.uncond_embedding", what)
    return DALLEConfig(
        dim=int(dim), depth=depth, heads=heads, dim_head=dim_head, ff_mult=4, norm="rmsnorm", ff="swiglu",
        ff_multiple_of=256, kv_heads=0 if kv_heads == heads else int(kv_heads), text_seq_len=int(text_seq_len),
        rotary_emb=True, num_text_tokens=0, num_image_tokens=int(vocab),
        image_fmap_size=image_fmap_size, text_feature_dim=int(feature_dim), llamagen_layout=True,
    )  # fmt: skip


_GPT_NAMES = {
    "tok_embeddings": "image_emb",
    "cls_embedding.cap_proj.fc1": "caption_proj.0",
    "cls_embedding.cap_proj.fc2": "caption_proj.2",
    "norm": "norm",
    "output": "image_head",
}
_LAYER_NAMES = {
    "attention.wqkv": "attn.to_qkv",
    "attention.wo": "attn.to_out",
    "feed_forward.w1": "ff.w1",
    "feed_forward.w2": "ff.w2",
    "feed_forward.w3": "ff.w3",
    "attention_norm": "norm1",
    "ffn_norm": "norm2",
}


def gpt_weights(weights: dict, cfg: DALLEConfig, what: str) -> dict:
    """A LlamaGen T2I state dict as the DALLE's: renamed, zero biases where ours has them (the caption MLP, the
    attention's output), and the null caption projected from LlamaGen's (which lives in the encoder's space)."""
    from .dalle import DALLE

    names = dict(_GPT_NAMES)
    for i in range(cfg.depth):
        names.update(
            {f"layers.{i}.{theirs}": f"transformer.layers.{i}.{ours}" for theirs, ours in _LAYER_NAMES.items()}
        )
    uncond = weights.get("cls_embedding.uncond_embedding")
    out = _renamed(weights, names, ("cls_embedding.uncond_embedding", "freqs_cis"), what)
    fc1, fc2 = out.get("caption_proj.0.weight"), out.get("caption_proj.2.weight")
    if uncond is not None and fc1 is not None and fc2 is not None:
        out["null_caption"] = F.linear(F.gelu(F.linear(uncond.float(), fc1.float()), approximate="tanh"), fc2.float())
    for key in ["caption_proj.0.bias", "caption_proj.2.bias"] + [
        f"transformer.layers.{i}.attn.to_out.bias" for i in range(cfg.depth)
    ]:
        rows = out.get(key.replace(".bias", ".weight"))
        if rows is not None:
            out[key] = rows.new_zeros(rows.shape[0])
    with torch.device("meta"):
        model = DALLE(cfg)
    return _fit(model, out, what)
