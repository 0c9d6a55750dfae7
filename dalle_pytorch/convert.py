"""Turn a resume checkpoint of any backend into an export that generate.py and train_dalle.py read.

    python -m dalle_pytorch.convert runs/dalle/checkpoints/step-00001000 --out dalle.pt
    python -m dalle_pytorch.convert runs/vae/checkpoints/step-00000500 --out vae.pt

Reads the checkpoint's weights without a process group (`distributed.read_weights` knows every backend's
layout). The model config, the VAE and the tokenizer come from the run's config.json; a pretrained
tokenizer (VQGAN, OpenAI's dVAE) as the record that train_dalle.py kept there, so its weights are not read again.
"""

from __future__ import annotations

import argparse
import json
import os

from distributed import read_weights

from .data.build import build_text_tokenizer
from .errors import user_errors
from .training.build import load_image_tokenizer
from .training.export import save_export


def convert(ckpt_dir: str, out: str) -> str:
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(ckpt_dir)))
    config_path = os.path.join(run_dir, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} is missing: the checkpoint must sit in RUN_DIR/checkpoints/")
    with open(config_path) as f:
        config = json.load(f)
    weights = read_weights(ckpt_dir)
    if "vae" in config:  # a train_vae.py run
        save_export(out, "vae", config["model"], weights)
        return out
    run = config["dalle"]
    vae_export = config.get("pretrained_tokenizer")  # the record train_dalle.py kept of a pretrained tokenizer
    if vae_export is None:  # our VAE, whose export the DALLE export copies
        vae_export = load_image_tokenizer(run)[1]
    tokenizer = build_text_tokenizer(run, run_dir)
    save_export(out, "dalle", config["model"], weights, vae=vae_export, tokenizer=tokenizer.to_dict())
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint directory: RUN_DIR/checkpoints/step-XXXXXXXX")
    p.add_argument("--out", required=True, help="the export to write (vae.pt or dalle.pt)")
    args = p.parse_args(argv)
    with user_errors(False):
        print(f"export: {convert(args.checkpoint, args.out)}")


if __name__ == "__main__":
    main()
