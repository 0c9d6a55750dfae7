"""Turn a resume checkpoint of any backend, or a file of lucidrains' dalle-pytorch 1.6, into an export that
generate.py and train_dalle.py read.

    python -m dalle_pytorch.convert runs/dalle/checkpoints/step-00001000 --out dalle.pt
    python -m dalle_pytorch.convert runs/vae/checkpoints/step-00000500 --out vae.pt
    python -m dalle_pytorch.convert --from_reference old_vae.pt --out vae.pt
    python -m dalle_pytorch.convert --from_reference old_dalle.pt --out dalle.pt [--bpe_path bpe.model | --chinese]
    python -m dalle_pytorch.convert --from_llamagen t2i_XL_stage1_256.pt --vae_path vq_ds16_t2i.pt \
        --text_encoder_path google/flan-t5-xl --out llamagen.safetensors      (LlamaGen's: inference/published.py)

A predecessor's file is read weights-only (no code from it runs); its text tokenizer is the one its flags chose
(the CLIP BPE by default, --bpe_path [--hug], --chinese), and a VQGAN it used needs --vqgan_config_path.

Reads the checkpoint's weights without a process group (`distributed.read_weights` knows every backend's
layout). The model config, the VAE and the tokenizer come from the run's config.json; a pretrained
tokenizer (VQGAN, OpenAI's dVAE) as the record that train_dalle.py kept there, so its weights are not read again.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass

from distributed import read_weights

from .compat.flags import PredecessorFiles
from .compat.weights import is_predecessor, predecessor_export
from .config import FileParser, add_flags, flag, pick, take
from .data.build import build_text_tokenizer
from .errors import user_errors
from .files import safe_load
from .inference.export import save_export
from .inference.image_tokenizers import load_image_tokenizer
from .training.configs import DALLERunConfig
from .training.image_tokenizer import start_of


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
    record = config["dalle"]
    run = pick(DALLERunConfig, record)
    if run.dalle_path:  # started from an export (or the predecessor's dalle.pt): its VAE and tokenizer
        start, _ = start_of(run)
        vae_export, tokenizer = start["vae"], start["tokenizer"]
    else:
        vae_export = config.get("pretrained_tokenizer")  # the record train_dalle.py kept of a pretrained tokenizer
        if vae_export is None:  # our VAE, whose export the DALLE export copies
            vae_export = load_image_tokenizer(run, bool(run.image_text_folder))[1]
        # a run recorded before --bpe_lowercase existed lowercased its captions
        tokenizer = config.get("text_encoder")  # its frozen text encoder's record (path, fingerprint)
        if tokenizer is None:
            tokenizer = build_text_tokenizer(run, run_dir, lowercase=record.get("bpe_lowercase", True)).to_dict()
    save_export(out, "dalle", config["model"], weights, vae=vae_export, tokenizer=tokenizer)
    return out


def convert_predecessor(path: str, out: str, **predecessor) -> str:
    """A dalle-pytorch 1.6 vae.pt or dalle.pt -> our export; a pretrained image tokenizer inside a DALLE is
    written beside it (OUT.tokenizer/)."""
    obj = safe_load(path)
    if not is_predecessor(obj):
        raise ValueError(f"{path} is not a dalle-pytorch checkpoint (no hparams and weights): drop --from_reference")
    kind = "dalle" if "vae_params" in obj else "vae"
    files_dir = os.path.splitext(os.path.abspath(out))[0] + ".tokenizer"
    export = predecessor_export(obj, path, kind, files_dir=files_dir, **predecessor)
    save_export(
        out, kind, export["config"], export["weights"], **{k: export[k] for k in ("vae", "tokenizer") if k in export}
    )
    return out


@dataclass
class ConvertConfig:
    checkpoint: str = flag("", "a checkpoint directory: RUN_DIR/checkpoints/step-XXXXXXXX", positional=True)
    from_reference: str = flag("", "a vae.pt or dalle.pt written by lucidrains' dalle-pytorch 1.6")
    from_llamagen: str = flag("", "LlamaGen's text-to-image GPT (t2i_XL_stage1_256.pt), with --vae_path and ...")
    vae_path: str = flag("", "--from_llamagen: its VQ tokenizer (vq_ds16_t2i.pt)")
    text_encoder_path: str = flag("", "--from_llamagen: its text encoder, FLAN-T5-XL (a folder or google/flan-t5-xl)")
    pretrained_image_size: int = flag(0, "--from_llamagen: the image side its VQ tokenizes (256; 512 for stage 2)")
    out: str = flag("", "the export to write (vae.pt or dalle.pt; required)")
    debug: bool = flag(False, "show tracebacks for user errors")


def main(argv=None):
    p = FileParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, ConvertConfig, "what to convert")
    add_flags(p, PredecessorFiles, "--from_reference: " + PredecessorFiles.__doc__)
    ns = p.parse_args(argv)
    args, old = take(ns, ConvertConfig), take(ns, PredecessorFiles)
    with user_errors(args.debug):
        if not args.out:
            raise ValueError("--out is required: the export to write (vae.pt or dalle.pt)")
        if bool(args.checkpoint) + bool(args.from_reference) + bool(args.from_llamagen) != 1:
            raise ValueError("give a checkpoint directory, --from_reference OLD.pt or --from_llamagen GPT.pt (one)")
        if args.from_llamagen:
            from .inference.published import llamagen_dalle_export

            export = llamagen_dalle_export(
                args.from_llamagen, args.vae_path, args.text_encoder_path, args.pretrained_image_size
            )
            save_export(args.out, "dalle", **{k: export[k] for k in ("config", "weights", "vae", "tokenizer")})
            out = args.out
        elif args.from_reference:
            out = convert_predecessor(args.from_reference, args.out, **old.how_to_read())
        else:
            out = convert(args.checkpoint, args.out)
        print(f"export: {out}")


if __name__ == "__main__":
    main()
