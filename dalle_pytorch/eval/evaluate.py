"""Image quality, on your data (on_data.py) or on the built-in dataset, read back from pixels by `parse.py`.

    python -m dalle_pytorch.eval --dalle_path RUN/dalle.safetensors --image_text_folder VAL [--wds jpg,txt]
        --num_images N [--clip_path clip.safetensors] --out DIR
    python -m dalle_pytorch.eval --vae_path vae.safetensors --image_text_folder VAL --num_images N --out DIR
    python -m dalle_pytorch.eval --vae_path vae.safetensors [--dalle_path dalle.safetensors [--clip_path clip...]]

On your data: FID, KID, Inception Score, precision/recall (torch-fidelity) and the CLIP score of a DALLE's images
for VAL's captions; a tokenizer's rFID, PSNR, SSIM and codebook usage on VAL's images.
On the built-in dataset:
VAE: PSNR and the parser's accuracy on reconstructions (the ceiling for any generator), codebook usage.
DALLE: bits per image token on validation data, and the fraction of generated images whose parsed objects
match the caption, fully and per attribute, on seen captions and on held-out colour-shape combinations,
with bootstrap 95% confidence intervals, plus a grid of generated images beside their captions. With a
CLIP: the same rates after CLIP keeps the best of several samples per caption, and CLIP's own retrieval
accuracy on held-out validation pairs.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from ..config import FileParser, add_flags, flag, take
from ..inference.pipeline import RerankConfig, SamplingConfig
from .fidelity import FidelityConfig
from .summary import table


@dataclass
class EvalConfig:
    """What to evaluate and where the results go."""

    vae_path: str = flag("", "VAE export (default: the one recorded in --dalle_path)")
    image_text_folder: str = flag(
        "",
        "validation data: a folder of images with captions beside them, or with --wds the shard URLs; "
        "default: the built-in dataset",
    )
    wds: str = flag("", "the WebDataset keys of image and caption in --image_text_folder's shards, e.g. jpg,txt")
    taming: bool = flag(
        False,
        "on your data: evaluate a taming-transformers VQGAN as the tokenizer: with --vqgan_model_path and "
        "--vqgan_config_path, or alone for the predecessor's default VQGAN (downloaded once)",
    )
    vqgan_model_path: str = flag("", "--taming: the VQGAN's Lightning checkpoint (.ckpt) or state dict")
    vqgan_config_path: str = flag("", "--taming: the VQGAN's config (.yaml)")
    openai_vae_path: str = flag(
        "",
        "on your data: evaluate OpenAI's dVAE, a folder with encoder.pkl and decoder.pkl (an empty folder: "
        "downloaded into it once)",
    )
    pretrained_image_size: int = flag(0, "the pretrained tokenizer's image size (default: its training resolution)")
    dalle_path: str = flag("", "DALLE export to evaluate by generation")
    num_images: int = flag(200, "captions per split (seen, held-out); on your data: validation pairs scored")
    candidates: int = flag(16, "with --clip_path: samples per caption (on your data: CLIP keeps the best)")
    fid: bool = flag(
        False,
        "on the built-in dataset: also FID, KID, IS and precision/recall of each split's images (a VAE's "
        "reconstructions: rFID) against the dataset's own images, beside the parser's rates (on your data: always)",
    )
    out: str = flag("eval", "folder for results.json, results.txt and the grids")
    seed: int = flag(0, "random seed of the sampling")


def build_parser() -> argparse.ArgumentParser:
    p = FileParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, EvalConfig, "evaluation")
    add_flags(p, SamplingConfig, "sampling")
    add_flags(p, RerankConfig, "reranking with CLIP")
    add_flags(p, FidelityConfig, "FID and friends (on your data)")
    p.set_defaults(keep=1)  # the reranked rates are over the best sample per caption
    return p


def main(argv=None):
    from ..errors import user_errors

    p = build_parser()
    ns = p.parse_args(argv)
    with user_errors(False):
        configs = take(ns, EvalConfig), take(ns, SamplingConfig), take(ns, RerankConfig), take(ns, FidelityConfig)
        return evaluate(*configs)


def evaluate(cfg: EvalConfig, sampling: SamplingConfig, rerank: RerankConfig, fidelity: FidelityConfig) -> dict:
    from ..inference.load import load_vae
    from .dalle_eval import evaluate_dalle
    from .on_data import evaluate_dalle_on_data, evaluate_vae_on_data
    from .vae_eval import evaluate_vae

    pretrained = cfg.taming or cfg.vqgan_model_path or cfg.vqgan_config_path or cfg.openai_vae_path
    if not (cfg.vae_path or cfg.dalle_path or pretrained):
        raise ValueError("give --vae_path and/or --dalle_path (or a pretrained tokenizer: --taming, --openai_vae_path)")
    if pretrained and (cfg.dalle_path or not cfg.image_text_folder):
        raise ValueError("--taming / --openai_vae_path evaluate a pretrained tokenizer alone, on --image_text_folder")
    if cfg.wds and not cfg.image_text_folder:
        raise ValueError(f"--wds {cfg.wds} reads shards: give their URLs in --image_text_folder")
    os.makedirs(cfg.out, exist_ok=True)
    results = {}
    if cfg.image_text_folder:  # your data
        if cfg.dalle_path:
            results["dalle"] = evaluate_dalle_on_data(cfg, sampling, rerank, fidelity)
            if results["dalle"] is None:  # another rank than 0: it generated its share, rank 0 writes the results
                return {}
        else:
            results["vae"] = evaluate_vae_on_data(cfg, fidelity)
    else:  # the built-in dataset, read back by the parser
        scored = fidelity if cfg.fid else None
        if cfg.vae_path:
            results["vae"] = evaluate_vae(
                load_vae(cfg.vae_path)[0], fidelity=scored, out=cfg.out, fid_images=cfg.num_images
            )
        if cfg.dalle_path:
            results["dalle"] = evaluate_dalle(
                cfg.dalle_path, cfg.num_images, cfg.out, sampling, rerank, cfg.candidates, cfg.seed, fidelity=scored
            )
    with open(os.path.join(cfg.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    text = table(results)
    with open(os.path.join(cfg.out, "results.txt"), "w") as f:
        f.write(text + "\n")
    print(text)
    print(f"results: {os.path.join(cfg.out, 'results.json')}")
    return results


if __name__ == "__main__":
    main()
