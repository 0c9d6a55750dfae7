"""Turn a resume checkpoint of any backend into an export that generate.py and train_dalle.py read.

    python -m dalle_pytorch.convert runs/dalle/checkpoints/step-00001000 --out dalle.pt
    python -m dalle_pytorch.convert runs/vae/checkpoints/step-00000500 --out vae.pt

Reads the checkpoint's weights without a process group and without DeepSpeed's helper scripts: the DCP
copy that every backend writes through torch.distributed.checkpoint, or, for a checkpoint holding only
DeepSpeed's own ZeRO shards, through deepspeed.utils.zero_to_fp32. The model config, the VAE and the
tokenizer come from the run's config.json; a pretrained tokenizer (VQGAN, OpenAI's dVAE) as the record that
train_dalle.py kept there, so its weights are not read again.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

from .checkpoints import safe_load


def checkpoint_weights(ckpt_dir: str) -> dict:
    """Full model weights (CPU, fp32) from a resume checkpoint directory of any backend."""
    if os.path.isdir(os.path.join(ckpt_dir, "dcp")):
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "full.pt")
            dcp_to_torch_save(os.path.join(ckpt_dir, "dcp"), path)
            return {k: v.float() for k, v in safe_load(path)["model"].items()}
    if os.path.isdir(os.path.join(ckpt_dir, "deepspeed")):
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return {k: v.float() for k, v in get_fp32_state_dict_from_zero_checkpoint(ckpt_dir, tag="deepspeed").items()}
    raise FileNotFoundError(f"{ckpt_dir} holds no checkpoint: expected a dcp/ or deepspeed/ folder inside")


def convert(ckpt_dir: str, out: str) -> str:
    from .checkpoints import save_export

    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(ckpt_dir)))
    config_path = os.path.join(run_dir, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{config_path} is missing: the checkpoint must sit in RUN_DIR/checkpoints/")
    with open(config_path) as f:
        config = json.load(f)
    weights = checkpoint_weights(ckpt_dir)
    if "vae" in config:  # a train_vae.py run
        save_export(out, "vae", config["model"], weights)
        return out
    from .pretrained import load_image_tokenizer
    from .tokenizer import ByteTokenizer, HugTokenizer, YttmTokenizer

    run = config["dalle"]
    vae_export = config.get("pretrained_tokenizer")  # the record train_dalle.py kept of a pretrained tokenizer
    if vae_export is None:  # our VAE, whose export the DALLE export copies (or a run older than the record)
        vae_export = load_image_tokenizer(run)[1]
    if run["bpe_path"]:
        tokenizer = (HugTokenizer if run["hug"] else YttmTokenizer).from_file(run["bpe_path"])
    elif run["tokenizer"] == "byte":
        tokenizer = ByteTokenizer()
    else:
        tokenizer = YttmTokenizer.from_file(os.path.join(run_dir, "bpe.yttm"))
    save_export(out, "dalle", config["model"], weights, vae=vae_export, tokenizer=tokenizer.to_dict())
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="a checkpoint directory: RUN_DIR/checkpoints/step-XXXXXXXX")
    p.add_argument("--out", required=True, help="the export to write (vae.pt or dalle.pt)")
    args = p.parse_args(argv)
    from .cli import user_errors

    with user_errors(False):
        print(f"export: {convert(args.checkpoint, args.out)}")


if __name__ == "__main__":
    main()
