"""FID, KID, Inception Score and precision/recall of a folder of generated images against a folder of reference
images, computed by torch-fidelity (its feature extractors, their TensorFlow-compatible resizing, its estimators),
never by hand: a figure here equals what `fidelity --input1 GENERATED --input2 REFERENCE` prints with the same
weights files (tests/eval/test_fidelity.py checks it).

As torch-fidelity does by default and the papers did: IS, FID and KID on Inception v3 features (torch-fidelity's
weights, converted from TensorFlow's 2015-12-05 graph as in the FID paper's code), precision and recall
(Kynkäänniemi et al. 2019, k = 3) on VGG-16 features (torchvision's ImageNet weights). Each file is downloaded once
into torch's hub cache on a machine with internet; elsewhere `--inception_weights PATH` and `--vgg16_weights PATH`,
or the file put where the error says. DINOv2 features (`--feature_extractor
dinov2-vit-b-14`, as "Exposing flaws of generative model evaluation metrics", Stein et al. 2023, advises) come
through torch.hub and need internet; they give FID, KID and precision/recall, and no Inception Score.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..config import flag

INCEPTION = "inception-v3-compat"
EXTRACTORS = (INCEPTION, "dinov2-vit-s-14", "dinov2-vit-b-14", "dinov2-vit-l-14")
MIN_IMAGES = 10  # the Inception Score's 10 splits; KID's subsets need a few too
# torch-fidelity's names -> ours (results.json)
NAMES = {
    "frechet_inception_distance": "fid",
    "kernel_inception_distance_mean": "kid",
    "kernel_inception_distance_std": "kid_std",
    "inception_score_mean": "inception_score",
    "inception_score_std": "inception_score_std",
    "precision": "precision",
    "recall": "recall",
    "f_score": "f_score",
}


@dataclass
class FidelityConfig:
    """The feature extractor behind FID, KID, IS and precision/recall."""

    feature_extractor: str = flag(INCEPTION, "features for FID/KID/precision/recall", choices=EXTRACTORS)
    inception_weights: str = flag(
        "",
        "torch-fidelity's Inception weights file (weights-inception-2015-12-05-6726825d.pth) for FID, KID and IS; "
        "default: downloaded once into torch's hub cache",
    )
    vgg16_weights: str = flag(
        "",
        "torchvision's VGG-16 ImageNet weights file (vgg16-397923af.pth) for precision/recall; default: downloaded "
        "once into torch's hub cache",
    )
    fidelity_batch_size: int = flag(32, "images per batch through the feature extractor")
    precision_recall: bool = flag(
        True,
        "also precision and recall (on VGG-16 features: about two thirds of the scoring time on a CPU); "
        "--no-precision_recall skips them",
    )


def inception_url() -> str:
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    return URL_INCEPTION_V3


def vgg16_url() -> str:
    from torchvision.models import VGG16_Weights

    return VGG16_Weights.IMAGENET1K_V1.url


def weights_file(url: str, path: str, flag_name: str, what: str) -> str:
    """The weights file: `path`, else torch's hub cache, downloaded there from `url` the first time. One line that
    says which file to put where when neither is possible."""
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{flag_name} {path}: no such file")
        return path
    import torch

    cached = os.path.join(torch.hub.get_dir(), "checkpoints", os.path.basename(url))
    if not os.path.isfile(cached):
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        try:
            torch.hub.download_url_to_file(url, cached, progress=False)  # a partial download is never left there
        except Exception as e:  # noqa: BLE001 - no network, a proxy, a firewall: all say the same to the user
            raise ConnectionError(
                f"{what} needs {os.path.basename(url)} and it could not be downloaded ({type(e).__name__}): "
                f"put {url} at {cached}, or pass {flag_name} PATH"
            ) from None
    return cached


def image_count(folder: str) -> int:
    return sum(1 for f in os.listdir(folder) if f.endswith(".png"))


def fidelity_metrics(
    generated: str,
    reference: str,
    cfg: FidelityConfig,
    device: str = "cpu",
    precision_recall: bool = True,
    reference_cache: str = "",
) -> dict:
    """FID, KID (mean and std over subsets), Inception Score (of `generated`; Inception features only) and
    precision/recall (Kynkäänniemi et al. 2019, k = 3) of the PNGs in `generated` against those in `reference`.
    `reference_cache`: a folder where torch-fidelity keeps the reference's features (named after the reference
    folder), computed the first time and read afterwards."""
    n = min(image_count(generated), image_count(reference))
    if n < MIN_IMAGES:
        raise ValueError(f"FID and its friends need at least {MIN_IMAGES} images on each side (got {n})")
    common = dict(
        input1=generated,
        input2=reference,
        cuda=device.startswith("cuda"),
        batch_size=cfg.fidelity_batch_size,
        kid_subset_size=min(1000, n),  # torch-fidelity's default, or all the images where there are fewer
        samples_find_ext="png",
        cache=bool(reference_cache),
        verbose=False,
        # on the CPU no loader workers: the feature extractor wants every core, and PNG decoding is cheap beside it
        save_cpu_ram=not device.startswith("cuda"),
    )
    if reference_cache:
        common.update(cache_root=reference_cache, input2_cache_name=os.path.basename(os.path.normpath(reference)))
    prc = precision_recall and cfg.precision_recall
    if cfg.feature_extractor != INCEPTION:  # DINOv2 for all three (torch.hub); no Inception Score
        return _calculate(common, cfg.feature_extractor, None, "", fid=True, kid=True, prc=prc)
    inception = weights_file(inception_url(), cfg.inception_weights, "--inception_weights", "FID")
    out = _calculate(common, INCEPTION, inception, "--inception_weights", isc=True, fid=True, kid=True)
    if prc:  # VGG-16 at 224 x 224: about twice as long as the rest
        vgg16 = weights_file(vgg16_url(), cfg.vgg16_weights, "--vgg16_weights", "precision/recall")
        out.update(_calculate(common, "vgg16", vgg16, "--vgg16_weights", prc=True))
    return out


def _calculate(common: dict, extractor: str, weights: str | None, flag_name: str, **metrics) -> dict:
    import torch_fidelity

    try:
        raw = torch_fidelity.calculate_metrics(
            **common, **metrics, feature_extractor=extractor, feature_extractor_weights_path=weights
        )
    except RuntimeError as e:
        if "state_dict" in str(e):  # load_state_dict: missing or unexpected keys, shapes that differ
            raise ValueError(f"{flag_name} {weights}: not the {extractor} network ({str(e).splitlines()[0]})") from None
        raise
    except NotImplementedError:  # torch-fidelity's DINOv2 takes no weights file
        raise ValueError(f"--feature_extractor {extractor} loads through torch.hub only") from None
    return {NAMES[k]: float(v) for k, v in raw.items() if k in NAMES}


def settings(cfg: FidelityConfig) -> dict:
    """What the figures were computed with (results.json)."""
    import torch_fidelity

    return {
        "library": f"torch-fidelity {torch_fidelity.__version__}",
        "feature_extractor": cfg.feature_extractor,
        "weights": [
            os.path.basename(cfg.inception_weights or inception_url()),
            os.path.basename(cfg.vgg16_weights or vgg16_url()),
        ]
        if cfg.feature_extractor == INCEPTION
        else "torch.hub",
        "precision_recall_features": (
            "none"
            if not cfg.precision_recall
            else "vgg16"
            if cfg.feature_extractor == INCEPTION
            else cfg.feature_extractor
        ),
        "kid_subset_size": "min(1000, images)",
        "prc_neighborhood": 3,
    }
