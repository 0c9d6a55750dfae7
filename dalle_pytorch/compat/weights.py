"""Checkpoints written by lucidrains' dalle-pytorch 1.6 (`{'hparams', 'weights', ...}` from its train_vae.py,
`{'hparams', 'vae_params', 'vae_class_name', 'weights', ...}` from its train_dalle.py) as our models.

Read with the weights-only loader: no code from the file runs. The mapping is exact (tests/compat/test_reference.py
compares codes and logits with the real package): its LayerScale, which it always applies, is folded into the
branch's last linear layer (or the sandwich norm's affine); its logits layer is split into our text and image
heads; its padding tokens, one per text position, and its token shift are our `reference_layout`.
"""

from __future__ import annotations

import os
import re

import torch

from ..files import atomic_save, fingerprint
from ..models.dalle import DALLEConfig
from ..models.vae import DiscreteVAE, VAEConfig
from .downloads import cache_root

_VAE_ARGS = {"image_size", "num_layers", "num_tokens", "codebook_dim", "hidden_dim", "num_resnet_blocks", "channels"}
_VAE_TRAINING_ARGS = {"smooth_l1_loss", "temperature", "straight_through", "kl_div_loss_weight", "reinmax"}
# the predecessor's DiscreteVAE default normalization, cut to the channels (alpha: mean 0, std 1)
_NORMALIZATION = ((0.5, 0.5, 0.5, 0.0), (0.5, 0.5, 0.5, 1.0))
IMAGE_SIZE = 256  # its VQGanVAE and OpenAIDiscreteVAE took 256-pixel images, whatever their config said
_BLOCK = re.compile(r"^transformer\.layers\.layers\.(\d+)\.([01])\.(.*)$")


def is_predecessor(obj) -> bool:
    """A file the predecessor wrote: hparams and weights, and none of our exports' format_version."""
    return isinstance(obj, dict) and "hparams" in obj and "weights" in obj and "format_version" not in obj


def _refuse(what: str, option: str, why: str) -> None:
    raise ValueError(f"{what}: the predecessor's option {option} is not supported here ({why})")


def predecessor_vae(hparams: dict, weights: dict[str, torch.Tensor], what: str) -> tuple[VAEConfig, dict]:
    """(config, state dict) of our DiscreteVAE from the predecessor's DiscreteVAE arguments and weights."""
    unknown = set(hparams) - _VAE_ARGS - _VAE_TRAINING_ARGS - {"normalization"}
    if unknown:
        _refuse(what, ", ".join(sorted(unknown)), "unknown DiscreteVAE argument")
    channels = hparams.get("channels", 3)
    norm = hparams.get("normalization", _NORMALIZATION)
    if norm is None:  # an explicit None meant no normalization there
        norm = ((0.0,) * channels, (1.0,) * channels)
    cfg = VAEConfig(
        **{k: hparams[k] for k in _VAE_ARGS & set(hparams)},
        normalization=tuple(tuple(t[:channels]) for t in norm),
        smooth_l1_loss=bool(hparams.get("smooth_l1_loss", False)),
        straight_through=bool(hparams.get("straight_through", False)),
        temperature=float(hparams.get("temperature", 0.9)),
        kl_div_loss_weight=float(hparams.get("kl_div_loss_weight", 0.0)),
        reference_layout=True,
    )
    # both build the encoder and the decoder layer by layer in the same order; ours only flattens the
    # (conv, relu) pairs, so within each part the tensors correspond one to one in order (names and shapes
    # then confirm it)
    ours = DiscreteVAE(cfg).state_dict()
    out = {}
    for part in ("codebook.", "encoder.", "decoder."):
        mine = [k for k in ours if k.startswith(part)]
        theirs = [k for k in weights if k.startswith(part)]
        if len(mine) != len(theirs):
            raise ValueError(f"{what}: {len(theirs)} {part[:-1]} tensors, expected {len(mine)} for hparams {hparams}")
        for name, their_name in zip(mine, theirs):
            tensor = weights[their_name]
            if name[-4:] != their_name[-4:] or ours[name].shape != tensor.shape:
                raise ValueError(f"{what}: VAE tensor {their_name} {tuple(tensor.shape)} does not fit {name}")
            out[name] = tensor
    return cfg, out


def _prefixed(weights: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)}


def predecessor_dalle_config(hparams: dict, num_image_tokens: int, fmap: int, what: str) -> DALLEConfig:
    """Our DALLEConfig for the predecessor's DALLE arguments; what has no exact equivalent is refused."""
    if hparams.get("reversible"):
        _refuse(what, "reversible", "reversible layers compute another function; retrain with --checkpoint_activations")
    if hparams.get("sparse_attn"):
        _refuse(what, "sparse_attn", "DeepSpeed's block-sparse attention")
    if hparams.get("rotary_emb"):
        _refuse(what, "rotary_emb", "its rotary layout (also applied to values) differs from ours")
    if hparams.get("stable"):
        _refuse(what, "stable (--stable_softmax)", "it divides by the max before the final norm; ours after")
    attn_types = list(hparams.get("attn_types") or ("full",))
    if set(attn_types) != {"full"}:
        _refuse(what, f"attn_types {','.join(attn_types)}", "its sparse patterns group keys differently from ours")
    text_seq_len = int(hparams.get("text_seq_len", 256))
    return DALLEConfig(
        dim=int(hparams["dim"]),
        depth=int(hparams["depth"]),
        heads=int(hparams.get("heads", 8)),
        dim_head=int(hparams.get("dim_head", 64)),
        ff_mult=4,
        attn_dropout=float(hparams.get("attn_dropout", 0.0)),
        ff_dropout=float(hparams.get("ff_dropout", 0.0)),
        attn_types=["full"],
        text_seq_len=text_seq_len,
        loss_img_weight=float(hparams.get("loss_img_weight", 7)),
        shift_tokens=bool(hparams.get("shift_tokens", True)),  # the DALLE class's default
        rotary_emb=False,
        share_input_output_emb=bool(hparams.get("share_input_output_emb", False)),
        sandwich_norm=bool(hparams.get("sandwich_norm", False)),
        num_text_tokens=int(hparams.get("num_text_tokens", 10000)) + text_seq_len,  # + a padding id per position
        num_image_tokens=num_image_tokens,
        image_fmap_size=fmap,
        reference_layout=True,
    )


def predecessor_dalle_weights(cfg: DALLEConfig, weights: dict[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
    """Our DALLE state dict from the predecessor's (without its `vae.*` tensors)."""
    w = {k: v for k, v in weights.items() if not k.startswith("vae.")}
    n_text = cfg.num_text_tokens
    try:
        logits_w, logits_b = w["to_logits.1.weight"], w["to_logits.1.bias"]
        out = {
            "text_pos.weight": w["text_pos_emb.weight"],
            "norm.weight": w["to_logits.0.weight"],
            "norm.bias": w["to_logits.0.bias"],
            "text_head.weight": logits_w[:n_text],
            "text_head.bias": logits_b[:n_text],
            "image_head.weight": logits_w[n_text:],
            "image_head.bias": logits_b[n_text:],
        }
        if cfg.share_input_output_emb:  # its SharedEmbedding reads rows of the logits layer
            text_emb, image_emb = logits_w[:n_text], logits_w[n_text:]
        else:
            text_emb, image_emb = w["text_emb.weight"], w["image_emb.weight"]
        out["text_emb.weight"], out["image_emb.weight"] = text_emb, image_emb
        out["bos"] = text_emb[0].clone()  # <bos> is text token 0 there (padding having moved to its own ids)
        # AxialPositionalEmbedding: summed row (1, f, 1, d) and column (1, 1, f, d) embeddings
        rows = w.get("image_pos_emb.weights_0", w.get("image_pos_emb.weights.0"))
        cols = w.get("image_pos_emb.weights_1", w.get("image_pos_emb.weights.1"))
        out["image_row.weight"] = rows.reshape(cfg.image_fmap_size, cfg.dim)
        out["image_col.weight"] = cols.reshape(cfg.image_fmap_size, cfg.dim)
    except (KeyError, AttributeError) as e:
        raise ValueError(f"{what}: not a DALLE state dict of dalle-pytorch 1.6 (no {e})") from None
    out.update(_blocks(cfg, w, what))
    return out


def _blocks(cfg: DALLEConfig, w: dict, what: str) -> dict[str, torch.Tensor]:
    """Each LayerScale(PreNorm(branch)) -> our block's norm, branch and (sandwich) post-norm, scale folded.
    Layers that shared a branch there (shared_attn_ids) get their own copy here: each folds its own scale."""
    branches: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for name, tensor in w.items():
        m = _BLOCK.match(name)
        if m:  # wrappers (CachedAs, PreShiftToken, NonCached) only add `fn.` levels: drop them
            core = re.sub(r"^(fn\.)+", "", m.group(3))
            branches.setdefault((int(m.group(1)), int(m.group(2))), {})[core] = tensor
    out = {}
    for i in range(cfg.depth):
        for j, (norm, post, last) in enumerate((("norm1", "post1", "attn.to_out"), ("norm2", "post2", "ff.proj_out"))):
            b = branches.get((i, j))
            if b is None:
                raise ValueError(f"{what}: no transformer layer {i} (the checkpoint's depth differs from its hparams)")
            scale = b["scale"].reshape(-1)
            out[f"transformer.layers.{i}.{norm}.weight"] = b["norm.weight"]
            out[f"transformer.layers.{i}.{norm}.bias"] = b["norm.bias"]
            if j == 0:
                out[f"transformer.layers.{i}.attn.to_qkv.weight"] = b["to_qkv.weight"]
                lw, lb = b["to_out.0.weight"], b["to_out.0.bias"]
            else:
                out[f"transformer.layers.{i}.ff.proj_in.weight"] = b["net.0.weight"]
                out[f"transformer.layers.{i}.ff.proj_in.bias"] = b["net.0.bias"]
                lw, lb = b["net.3.weight"], b["net.3.bias"]
            if cfg.sandwich_norm:  # scale * norm_out(y): fold into the norm's affine
                out[f"transformer.layers.{i}.{post}.weight"] = b["norm_out.weight"] * scale
                out[f"transformer.layers.{i}.{post}.bias"] = b["norm_out.bias"] * scale
                out[f"transformer.layers.{i}.{last}.weight"], out[f"transformer.layers.{i}.{last}.bias"] = lw, lb
            else:  # scale * (W x + b) = (scale W) x + scale b
                out[f"transformer.layers.{i}.{last}.weight"] = lw * scale[:, None]
                out[f"transformer.layers.{i}.{last}.bias"] = lb * scale
    return out


def image_tokenizer_weights(obj: dict) -> tuple[str, dict[str, torch.Tensor]]:
    """(kind, weights) of the image tokenizer a predecessor DALLE checkpoint holds in its `vae.*` tensors:
    'vae' (its DiscreteVAE, with `vae_params`), 'openai' (`enc.*`, `dec.*`) or 'vqgan' (taming's model)."""
    weights = obj["weights"]
    if obj.get("vae_params") is not None:
        return "vae", _prefixed(weights, "vae.")
    name = obj.get("vae_class_name", "")
    if name == "OpenAIDiscreteVAE" or any(k.startswith("vae.enc.") for k in weights):
        return "openai", _prefixed(weights, "vae.")
    if name == "VQGanVAE" or any(k.startswith("vae.model.") for k in weights):
        return "vqgan", _prefixed(weights, "vae.model.")
    raise ValueError(f"unknown image tokenizer {name!r} in a dalle-pytorch checkpoint")


# ------------------------------------------------------------------------------------------ whole files


def vae_parts(obj: dict, what: str) -> tuple[dict, dict]:
    """(config dict, weights) of our VAE export from the predecessor's vae.pt."""
    cfg, weights = predecessor_vae(obj["hparams"], obj["weights"], what)
    return cfg.to_dict(), weights


def dalle_parts(obj: dict, what: str, text_tokenizer, files_dir: str, vqgan_config_path: str = "") -> dict:
    """Our DALLE export's fields (config, weights, vae, tokenizer) from the predecessor's dalle.pt.

    Its image tokenizer is in its `vae.*` tensors: its own DiscreteVAE becomes our VAE export inside the
    DALLE export; OpenAI's dVAE or a VQGAN is written to `files_dir` as safetensors (encoder + decoder,
    or vqgan.safetensors) and recorded like any pretrained tokenizer (a VQGAN also needs its config)."""
    from ..models.pretrained import load_openai, load_vqgan

    hparams = obj["hparams"]
    vocab = int(hparams.get("num_text_tokens", 10000))
    if text_tokenizer.vocab_size != vocab:
        raise ValueError(
            f"{what} was trained with a text vocabulary of {vocab} tokens; the tokenizer given has "
            f"{text_tokenizer.vocab_size}: pass the one it was trained with (--bpe_path FILE [--hug], or --chinese; "
            "the default is the CLIP BPE, 49408 tokens)"
        )
    kind, weights = image_tokenizer_weights(obj)
    os.makedirs(files_dir, exist_ok=True)
    if kind == "vae":
        vae_cfg, vae_weights = predecessor_vae(obj["vae_params"], weights, what)
        vae = {"format_version": 1, "kind": "vae", "config": vae_cfg.to_dict(), "weights": vae_weights}
        num_tokens, fmap = vae_cfg.num_tokens, vae_cfg.fmap_size
    elif kind == "openai":
        for part in ("enc", "dec"):
            name = "encoder.safetensors" if part == "enc" else "decoder.safetensors"  # no pickle
            _save_once(_prefixed(weights, f"{part}."), os.path.join(files_dir, name))
        tokenizer, vae = load_openai(files_dir, IMAGE_SIZE)
        num_tokens, fmap = tokenizer.num_tokens, tokenizer.fmap_size
    else:
        if not vqgan_config_path:  # its default VQGAN's config (vqgan_imagenet_f16_1024), which it downloaded too
            from .downloads import fetch

            vqgan_config_path = fetch("vqgan_1024_config")
        model_path = os.path.join(files_dir, "vqgan.safetensors")
        _save_once(weights, model_path)
        tokenizer, vae = load_vqgan(model_path, vqgan_config_path, IMAGE_SIZE)
        num_tokens, fmap = tokenizer.num_tokens, tokenizer.fmap_size
    cfg = predecessor_dalle_config(hparams, num_tokens, fmap, what)
    return {
        "config": cfg.to_dict(),
        "weights": predecessor_dalle_weights(cfg, obj["weights"], what),
        "vae": vae,
        "tokenizer": text_tokenizer.to_dict(),
    }


def _save_once(weights: dict, path: str) -> None:
    """Write a converted tokenizer's weights unless this file already holds them (generate.py converts on
    every call: a dVAE is hundreds of MB)."""
    if os.path.exists(path):
        from ..files import safe_load

        old = safe_load(path)
        if old.keys() == weights.keys() and all(torch.equal(old[k], weights[k]) for k in weights):
            return
    atomic_save(weights, path)


def predecessor_text_tokenizer(bpe_path: str = "", hug: bool = False, chinese: bool = False):
    """The text tokenizer the predecessor's flags chose, with its ids: --bpe_path (YouTokenToMe, not
    lowercased; or a tokenizers JSON with --hug, ids not shifted), --chinese, or by default the CLIP BPE."""
    from ..data.build import pretrained_text_tokenizer
    from ..data.tokenizer import HugTokenizer, YttmTokenizer

    if chinese:  # --bpe_path, if given, is its vocab.txt (as for --tokenizer chinese)
        return pretrained_text_tokenizer("chinese", bpe_path)
    if bpe_path:  # it neither lowercased captions for YouTokenToMe nor kept id 0 free in a tokenizers JSON
        return HugTokenizer.from_file(bpe_path, offset=0) if hug else YttmTokenizer.from_file(bpe_path, lowercase=False)
    return pretrained_text_tokenizer("clip")


def predecessor_export(
    obj: dict, path: str, kind: str, bpe_path: str = "", hug: bool = False, chinese: bool = False,
    vqgan_config_path: str = "", files_dir: str = "",
) -> dict:  # fmt: skip
    """Our export's kind, config and weights (and a DALLE's vae and tokenizer) from a checkpoint the predecessor
    wrote. A pretrained image tokenizer inside its DALLE is written as state dicts to `files_dir` (default: a
    cache folder per file)."""
    if not isinstance(obj["weights"], dict):  # its DeepSpeed runs' auxiliary.pt holds a note instead
        raise ValueError(
            f"{path} holds no weights (a DeepSpeed checkpoint's auxiliary file): consolidate the DeepSpeed "
            "checkpoint into one dalle.pt first, as dalle-pytorch's wiki 'DeepSpeed-Checkpoints' describes"
        )
    if "vae_params" not in obj:  # its train_vae.py's vae.pt
        if kind != "vae":
            raise ValueError(f"{path} is a dalle-pytorch VAE checkpoint, expected a DALLE: pass it as --vae_path")
        config, weights = vae_parts(obj, path)
        return {"kind": "vae", "config": config, "weights": weights}
    if kind != "dalle":
        raise ValueError(f"{path} is a dalle-pytorch DALLE checkpoint, expected a {kind}: pass it as --dalle_path")
    if not files_dir:  # named by its image tokenizer's weights: the same tokenizer is written once
        vae_weights = {k: v for k, v in obj["weights"].items() if k.startswith("vae.")}
        files_dir = os.path.join(cache_root(), "converted", fingerprint({}, vae_weights))
    text_tokenizer = predecessor_text_tokenizer(bpe_path, hug, chinese)
    parts = dalle_parts(obj, path, text_tokenizer, files_dir, vqgan_config_path)
    return {"kind": "dalle", **parts}
