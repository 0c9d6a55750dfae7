"""Pretrained image tokenizers from local files, and the record of them that a DALLE export keeps.

    --taming --vqgan_model_path last.ckpt --vqgan_config_path model.yaml   taming's VQModel or GumbelVQ
    --openai_vae_path DIR        OpenAI's dVAE: encoder.pt + decoder.pt (state dicts) or encoder.pkl + decoder.pkl

The export of a DALLE trained on one of them does not copy the weights (a VQGAN is ~1 GB): it records the
kind, the architecture config, the image size, the paths and a fingerprint of the weights; `generate.py`
rebuilds the tokenizer from the record and the file, and refuses a file whose weights differ.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import fields

import torch

from .inert_pickle import load_untrusted, module_state_dict
from .openai_dvae import OpenAIDiscreteVAE, OpenAIDVAEConfig
from .vqgan import VQGANConfig, VQGanVAE

PRETRAINED_KINDS = ("vqgan", "gumbel_vqgan", "openai")
_TAMING_TARGETS = {  # model.target -> gumbel
    "taming.models.vqgan.VQModel": False,
    "taming.models.vqgan.VQNoDiscModel": False,
    "taming.models.vqgan.GumbelVQ": True,
}
_VQGAN_KEEP = ("encoder.", "decoder.", "quantize.", "quant_conv.", "post_quant_conv.")  # not loss.* (GAN, LPIPS)


def fingerprint(config: dict, weights: dict[str, torch.Tensor]) -> str:
    """A short hash of a tokenizer's config and weights (the same for a .ckpt, .pkl or .pt of one model)."""
    h = hashlib.sha1(json.dumps(config, sort_keys=True).encode())
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].detach().float().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ VQGAN


def read_vqgan_config(path: str) -> VQGANConfig:
    """The architecture in a taming config (`model.target`, `model.params.{ddconfig,n_embed,embed_dim}`)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"--vqgan_config_path {path} does not exist")
    try:
        import yaml
    except ImportError:
        raise ImportError("--vqgan_config_path needs PyYAML to read the config: run `make install`") from None
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except (yaml.YAMLError, UnicodeDecodeError):  # a checkpoint is not text
            data = None
    model = data.get("model", data) if isinstance(data, dict) else None
    if not isinstance(model, dict) or "params" not in model or "ddconfig" not in model.get("params", {}):
        raise ValueError(
            f"--vqgan_config_path {path} is not a taming config: expected model.params.ddconfig "
            "(did you swap --vqgan_model_path and --vqgan_config_path?)"
        )
    target = str(model.get("target", "taming.models.vqgan.VQModel"))
    if target not in _TAMING_TARGETS:
        raise ValueError(
            f"--vqgan_config_path {path}: model.target {target} is not supported; expected one of "
            f"{', '.join(_TAMING_TARGETS)}"
        )
    params = model["params"]
    if params.get("remap"):
        raise ValueError(f"--vqgan_config_path {path}: configs with index remapping (params.remap) are not supported")
    names = {f.name for f in fields(VQGANConfig)} - {"n_embed", "embed_dim", "gumbel", "extra"}
    dd = dict(params["ddconfig"])
    try:
        return VQGANConfig(
            **{k: v for k, v in dd.items() if k in names},
            n_embed=int(params["n_embed"]),
            embed_dim=int(params["embed_dim"]),
            gumbel=_TAMING_TARGETS[target],
            extra={k: v for k, v in dd.items() if k not in names},
        )
    except KeyError as e:
        raise ValueError(f"--vqgan_config_path {path}: model.params has no {e}") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"--vqgan_config_path {path}: {e}") from None


def vqgan_weights(path: str) -> dict[str, torch.Tensor]:
    """The autoencoder's weights from a Lightning checkpoint (its `state_dict`) or a plain state dict."""
    obj = load_untrusted(path, "--vqgan_model_path", "did you swap --vqgan_model_path and --vqgan_config_path?")
    sd = obj.get("state_dict", obj) if isinstance(obj, dict) else None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError(f"--vqgan_model_path {path} holds no state dict (a Lightning .ckpt or a state dict file)")
    return {k: v for k, v in sd.items() if k.startswith(_VQGAN_KEEP)}


def _load_into(model: torch.nn.Module, weights: dict, what: str) -> None:
    missing, unexpected = model.state_dict().keys() - weights.keys(), weights.keys() - model.state_dict().keys()
    if missing or unexpected:
        raise ValueError(
            f"{what} does not match its config: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}"
        )
    try:
        model.load_state_dict(weights)
    except RuntimeError as e:  # shapes
        raise ValueError(f"{what} does not match its config: {str(e).splitlines()[-1].strip()}") from None


def load_vqgan(model_path: str, config_path: str, image_size: int = 0) -> tuple[VQGanVAE, dict]:
    """(tokenizer, record) of a taming VQModel / GumbelVQ."""
    cfg = read_vqgan_config(config_path)
    weights = vqgan_weights(model_path)
    vae = VQGanVAE(cfg, image_size)
    _load_into(vae.model, weights, f"--vqgan_model_path {model_path}")
    paths = {"vqgan_model_path": os.path.abspath(model_path), "vqgan_config_path": os.path.abspath(config_path)}
    kind = "gumbel_vqgan" if cfg.gumbel else "vqgan"
    return vae.eval().requires_grad_(False), _record(kind, cfg.to_dict(), vae.image_size, paths, weights)


# ------------------------------------------------------------------------------------------- OpenAI dVAE


def openai_weights(directory: str) -> tuple[dict, dict]:
    """(encoder, decoder) state dicts from DIR/encoder.pt + decoder.pt, or DIR/encoder.pkl + decoder.pkl."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--openai_vae_path {directory} is not a directory holding encoder.pkl and decoder.pkl")
    out = []
    for part in ("encoder", "decoder"):
        found = [os.path.join(directory, part + ext) for ext in (".pt", ".pth", ".pkl")]
        found = [p for p in found if os.path.exists(p)]
        if not found:
            raise FileNotFoundError(f"--openai_vae_path {directory} has no {part}.pkl (or {part}.pt state dict)")
        obj = load_untrusted(found[0], "--openai_vae_path")
        if isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
            out.append(dict(obj))
        else:
            out.append(module_state_dict(obj))
    return out[0], out[1]


def load_openai(directory: str, image_size: int = 0) -> tuple[OpenAIDiscreteVAE, dict]:
    enc, dec = openai_weights(directory)
    cfg = OpenAIDVAEConfig.from_state_dicts(enc, dec)
    vae = OpenAIDiscreteVAE(cfg, image_size or 256)
    what = f"--openai_vae_path {directory}"
    _load_into(vae.enc, enc, what + " (encoder)")
    _load_into(vae.dec, dec, what + " (decoder)")
    weights = {**{f"enc.{k}": v for k, v in enc.items()}, **{f"dec.{k}": v for k, v in dec.items()}}
    record = _record("openai", cfg.to_dict(), vae.image_size, {"openai_vae_path": os.path.abspath(directory)}, weights)
    return vae.eval().requires_grad_(False), record


# ---------------------------------------------------------------------------------------------- records


def _record(kind: str, config: dict, image_size: int, paths: dict, weights: dict) -> dict:
    return {
        "format_version": 1,
        "kind": kind,
        "config": config,
        "image_size": image_size,
        "paths": paths,
        "fingerprint": fingerprint({"kind": kind, **config}, weights),
    }


def tokenizer_from_record(record: dict, vqgan_model_path: str = "", openai_vae_path: str = ""):
    """Rebuild the pretrained tokenizer a DALLE export records; the paths override the recorded ones."""
    kind = record["kind"]
    if (vqgan_model_path and kind == "openai") or (openai_vae_path and kind != "openai"):
        wrong = "--vqgan_model_path" if vqgan_model_path and kind == "openai" else "--openai_vae_path"
        raise ValueError(f"this DALLE was trained with the {kind} tokenizer: {wrong} does not apply")
    if kind in ("vqgan", "gumbel_vqgan"):
        flag, path = "--vqgan_model_path", vqgan_model_path or record["paths"]["vqgan_model_path"]
    elif kind == "openai":
        flag, path = "--openai_vae_path", openai_vae_path or record["paths"]["openai_vae_path"]
    else:
        raise ValueError(f"unknown image tokenizer kind {kind!r} in the export: update the code")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"this DALLE was trained with the {kind} tokenizer at {path}, which does not exist here: "
            f"pass its new location with {flag}"
        )
    if kind == "openai":
        enc, dec = openai_weights(path)
        cfg = OpenAIDVAEConfig(**record["config"])
        vae = OpenAIDiscreteVAE(cfg, record["image_size"])
        weights = {**{f"enc.{k}": v for k, v in enc.items()}, **{f"dec.{k}": v for k, v in dec.items()}}
    else:
        cfg = VQGANConfig(**record["config"])
        vae = VQGanVAE(cfg, record["image_size"])
        weights = vqgan_weights(path)
    found = fingerprint({"kind": kind, **record["config"]}, weights)
    if found != record["fingerprint"]:
        raise ValueError(
            f"{flag} {path} holds other weights than the {kind} tokenizer this DALLE was trained with "
            f"(fingerprint {found}, the export recorded {record['fingerprint']}): pass the original file"
        )
    if kind == "openai":
        _load_into(vae.enc, enc, f"{flag} {path} (encoder)")
        _load_into(vae.dec, dec, f"{flag} {path} (decoder)")
    else:
        _load_into(vae.model, weights, f"{flag} {path}")
    return vae.eval().requires_grad_(False)


def load_image_tokenizer(
    vae_path: str = "",
    taming: bool = False,
    vqgan_model_path: str = "",
    vqgan_config_path: str = "",
    openai_vae_path: str = "",
    image_size: int = 0,
):
    """(tokenizer, export) from the flags that choose it: our VAE's export, or a pretrained one's record."""
    if (vqgan_model_path or vqgan_config_path) and not taming:
        raise ValueError("--vqgan_model_path and --vqgan_config_path are read with --taming: add --taming")
    chosen = [
        f for f, on in (("--vae_path", vae_path), ("--taming", taming), ("--openai_vae_path", openai_vae_path)) if on
    ]
    if len(chosen) > 1:
        raise ValueError(f"{' and '.join(chosen)} each choose the image tokenizer: pass only one of them")
    if not chosen:
        raise ValueError(
            "--vae_path is required: train a VAE first with `python train_vae.py` and pass its vae.pt, or use a "
            "pretrained tokenizer with --taming --vqgan_model_path M --vqgan_config_path C, or --openai_vae_path DIR"
        )
    if image_size and vae_path:
        raise ValueError("--pretrained_image_size is for --taming and --openai_vae_path; our VAE has its own size")
    if image_size < 0:
        raise ValueError(f"--pretrained_image_size must be positive, or 0 for the tokenizer's own (got {image_size})")
    if taming:
        if not (vqgan_model_path and vqgan_config_path):
            raise ValueError(
                "--taming needs --vqgan_model_path (.ckpt) and --vqgan_config_path (.yaml): nothing is downloaded"
            )
        return load_vqgan(vqgan_model_path, vqgan_config_path, image_size)
    if openai_vae_path:
        return load_openai(openai_vae_path, image_size)
    from .vae_task import load_vae

    return load_vae(vae_path)
