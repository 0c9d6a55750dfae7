"""Pretrained image tokenizers from local files, and the record of them that a DALLE export keeps.

    --taming --vqgan_model_path last.ckpt --vqgan_config_path model.yaml   taming's VQModel or GumbelVQ
    --openai_vae_path DIR        OpenAI's dVAE: encoder.pt + decoder.pt (state dicts) or encoder.pkl + decoder.pkl

The export of a DALLE trained on one of them does not copy the weights (a VQGAN is ~1 GB): it records the
kind, the architecture config, the image size, the paths and a fingerprint of the weights; `generate.py`
rebuilds the tokenizer from the record and the file, and refuses a file whose weights differ.
"""

from __future__ import annotations

import os
from dataclasses import fields

import torch

from ..files import fingerprint
from .inert_pickle import load_untrusted, module_state_dict
from .openai_dvae import OpenAIDiscreteVAE, OpenAIDVAEConfig
from .vqgan import VQGANConfig, VQGanVAE

_TAMING_TARGETS = {  # model.target -> gumbel
    "taming.models.vqgan.VQModel": False,
    "taming.models.vqgan.VQNoDiscModel": False,
    "taming.models.vqgan.GumbelVQ": True,
}
_VQGAN_KEEP = ("encoder.", "decoder.", "quantize.", "quant_conv.", "post_quant_conv.")  # not loss.* (GAN, LPIPS)
# kind -> the flag that gives its file, also the key of the path in its record
_FLAGS = {"vqgan": "vqgan_model_path", "gumbel_vqgan": "vqgan_model_path", "openai": "openai_vae_path"}


# ------------------------------------------------------------------------------------------ reading files


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


def openai_weights(directory: str) -> dict[str, torch.Tensor]:
    """The weights of OpenAIDiscreteVAE (`enc.*`, `dec.*`) from DIR/encoder.pt + decoder.pt (state dicts) or
    DIR/encoder.pkl + decoder.pkl (pickled modules, as OpenAI released them)."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--openai_vae_path {directory} is not a directory holding encoder.pkl and decoder.pkl")
    out = {}
    for part, prefix in (("encoder", "enc."), ("decoder", "dec.")):
        path = openai_file(directory, part)
        if not path:
            raise FileNotFoundError(f"--openai_vae_path {directory} has no {part}.pkl (or {part}.pt state dict)")
        obj = load_untrusted(path, "--openai_vae_path")
        is_state_dict = isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values())
        out.update({prefix + k: v for k, v in (obj if is_state_dict else module_state_dict(obj)).items()})
    return out


def openai_file(directory: str, part: str) -> str:
    """DIR/encoder.safetensors, .pt, .pth or .pkl (the first that exists; `part` "decoder" likewise), or ""."""
    found = [os.path.join(directory, part + ext) for ext in (".safetensors", ".pt", ".pth", ".pkl")]
    return next((p for p in found if os.path.exists(p)), "")


def _read_weights(kind: str, path: str) -> dict[str, torch.Tensor]:
    return openai_weights(path) if kind == "openai" else vqgan_weights(path)


# ------------------------------------------------------------------------------- tokenizers and records


def _build(kind: str, config: dict, image_size: int, weights: dict, what: str):
    """The frozen tokenizer of `kind` with `weights` loaded; `what` names the file in errors."""
    if kind == "openai":
        vae = OpenAIDiscreteVAE(OpenAIDVAEConfig(**config), image_size or 256)
        target = vae
    elif kind in ("vqgan", "gumbel_vqgan"):
        vae = VQGanVAE(VQGANConfig(**config), image_size)
        target = vae.model
    else:
        raise ValueError(f"unknown image tokenizer kind {kind!r}: update the code")
    missing, unexpected = target.state_dict().keys() - weights.keys(), weights.keys() - target.state_dict().keys()
    if missing or unexpected:
        raise ValueError(
            f"{what} does not match its config: missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}"
        )
    try:
        target.load_state_dict(weights)
    except RuntimeError as e:  # shapes
        raise ValueError(f"{what} does not match its config: {str(e).splitlines()[-1].strip()}") from None
    return vae.eval().requires_grad_(False)


def _with_record(kind: str, config: dict, image_size: int, path_key: str, path: str, weights: dict):
    """(tokenizer, record): what a DALLE export keeps of a pretrained tokenizer instead of its weights."""
    vae = _build(kind, config, image_size, weights, f"--{path_key} {path}")
    record = {
        "format_version": 1,
        "kind": kind,
        "config": config,
        "image_size": vae.image_size,
        "paths": {path_key: os.path.abspath(path)},
        "fingerprint": fingerprint({"kind": kind, **config}, weights),
    }
    return vae, record


def load_vqgan(model_path: str, config_path: str, image_size: int = 0):
    """(tokenizer, record) of a taming VQModel / GumbelVQ."""
    cfg = read_vqgan_config(config_path)
    kind = "gumbel_vqgan" if cfg.gumbel else "vqgan"
    vae, record = _with_record(
        kind, cfg.to_dict(), image_size, "vqgan_model_path", model_path, vqgan_weights(model_path)
    )
    record["paths"]["vqgan_config_path"] = os.path.abspath(config_path)
    return vae, record


def load_openai(directory: str, image_size: int = 0):
    """(tokenizer, record) of OpenAI's dVAE; its sizes are read from the weights."""
    weights = openai_weights(directory)
    config = OpenAIDVAEConfig.from_state_dict(weights).to_dict()
    return _with_record("openai", config, image_size, "openai_vae_path", directory, weights)


def tokenizer_from_record(record: dict, vqgan_model_path: str = "", openai_vae_path: str = ""):
    """Rebuild the pretrained tokenizer a DALLE export records; the paths override the recorded ones."""
    kind = record["kind"]
    if kind not in _FLAGS:
        raise ValueError(f"unknown image tokenizer kind {kind!r} in the export: update the code")
    overrides = {"vqgan_model_path": vqgan_model_path, "openai_vae_path": openai_vae_path}
    for key, value in overrides.items():
        if value and key != _FLAGS[kind]:
            raise ValueError(f"this DALLE was trained with the {kind} tokenizer: --{key} does not apply")
    key = _FLAGS[kind]
    path = overrides[key] or record["paths"][key]
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"this DALLE was trained with the {kind} tokenizer at {path}, which does not exist here: "
            f"pass its new location with --{key}"
        )
    weights = _read_weights(kind, path)
    found = fingerprint({"kind": kind, **record["config"]}, weights)
    if found != record["fingerprint"]:
        raise ValueError(
            f"--{key} {path} holds other weights than the {kind} tokenizer this DALLE was trained with "
            f"(fingerprint {found}, the export recorded {record['fingerprint']}): pass the original file"
        )
    return _build(kind, record["config"], record["image_size"], weights, f"--{key} {path}")
