"""Train the DALLE transformer on caption/image pairs with a frozen VAE.

    python train_dalle.py --vae_path runs/vae/vae.pt                        # the built-in synthetic dataset
    python train_dalle.py --vae_path vae.pt --image_text_folder DIR         # x.jpg beside x.txt, nested
    python train_dalle.py --taming --vqgan_model_path last.ckpt --vqgan_config_path model.yaml --image_text_folder DIR
    python train_dalle.py --openai_vae_path DIR_WITH_ENCODER_AND_DECODER --image_text_folder DIR
    torchrun --nproc_per_node 2 train_dalle.py --vae_path vae.pt --image_text_folder DIR

Writes runs/dalle/ (config.json, metrics.jsonl, train.log, samples/, checkpoints/, the tokenizer) and the
export dalle.pt, which holds the VAE and the tokenizer too: generate.py needs nothing else. A pretrained
tokenizer (--taming, --openai_vae_path) is not copied into the export: it records the files, their config
and a fingerprint of their weights, and generate.py reads the files again.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from arguments import TrainConfig, build_parser, take, take_backend_options
from dalle_pytorch.config import flag
from dalle_pytorch.errors import user_errors
from dalle_pytorch.models.dalle import DALLE, DALLEConfig

DEFAULT_SAMPLE_CAPTIONS = [
    "a large red circle on the left",
    "a small blue triangle above a large yellow square",
    "a big green square to the right of a small purple circle",
    "a small cyan triangle in the center",
]


@dataclass
class DALLERunConfig:
    vae_path: str = flag(
        "", "VAE export written by train_vae.py (or a pretrained tokenizer: --taming, --openai_vae_path)"
    )
    dalle_path: str = flag(
        "",
        "start from this DALLE export (or a dalle-pytorch 1.6 dalle.pt): its model, weights, tokenizers and VAE; "
        "the model and tokenizer flags are not used",
    )
    taming: bool = flag(False, "tokenize images with a pretrained taming-transformers VQGAN or Gumbel-VQ")
    vqgan_model_path: str = flag("", "--taming: the VQGAN's Lightning checkpoint (.ckpt) or state dict")
    vqgan_config_path: str = flag("", "--taming: the VQGAN's config (.yaml)")
    openai_vae_path: str = flag("", "a folder with OpenAI's dVAE: encoder.pkl + decoder.pkl, or their state dicts .pt")
    pretrained_image_size: int = flag(
        0, "image side for a pretrained tokenizer (0: the VQGAN config's resolution; 256 for OpenAI's dVAE)"
    )
    image_text_folder: str = flag(
        "", "folder of x.jpg + x.txt pairs, or WebDataset shard URLs with --wds; empty: the built-in synthetic dataset"
    )
    wds: str = flag(
        "", "image and caption keys of WebDataset shards, e.g. jpg,txt: --image_text_folder holds the shard URLs"
    )
    resize_ratio: float = flag(0.75, "random resized crop keeps at least this fraction of each image (folders only)")
    tokenizer: str = flag(
        "yttm",
        "text tokenizer: yttm or byte (either gives way to a --bpe_path), clip (OpenAI CLIP's BPE, bundled: "
        "lucidrains' DALLE-pytorch's default), chinese (bert-base-chinese's WordPiece, its vocab.txt from "
        "--bpe_path or the cn-clip package)",
        choices=("yttm", "byte", "clip", "chinese"),
    )
    bpe_path: str = flag("", "a YouTokenToMe BPE model to use (default: train one on the captions)")
    hug: bool = flag(False, "--bpe_path is a Hugging Face tokenizers JSON file")
    bpe_lowercase: bool = flag(
        False, "lowercase captions for a --bpe_path YouTokenToMe model (runs before 2026-12 did)"
    )
    bpe_vocab_size: int = flag(256, "vocabulary of the BPE trained on the captions")
    dalle_output: str = flag("", "path of the export (default: RUN_DIR/dalle.pt)")
    precompute_tokens: bool = flag(
        False, "run the VAE over the data once before training (cached as RUN_DIR/tokens.pt; fixed crops)"
    )
    sample_captions: list = flag(DEFAULT_SAMPLE_CAPTIONS, "captions drawn in the sample grids")


def main(argv=None):
    parser = build_parser(
        __doc__,
        (DALLEConfig, "model"),
        (DALLERunConfig, "DALLE training"),
        (TrainConfig, "training"),
        predecessor="train_dalle",
    )
    parser.set_defaults(learning_rate=1e-3, batch_size=32, warmup_steps=50, name="dalle", weight_decay=0.01)
    ns = parser.parse_args(argv)
    with user_errors(ns.debug):
        return _train(take(ns, DALLEConfig), take(ns, DALLERunConfig), take(ns, TrainConfig), take_backend_options(ns))


def _train(model_cfg: DALLEConfig, run_cfg: DALLERunConfig, cfg: TrainConfig, backend_options: dict):
    from dalle_pytorch.data.tokenized import tokenized
    from dalle_pytorch.data.tokenizer import tokenizer_from_dict
    from dalle_pytorch.training.build import check_same_tokenizer, load_image_tokenizer, precomputed, tokenizer_flag
    from dalle_pytorch.training.dalle_task import DALLETask
    from dalle_pytorch.training.loop import train
    from dalle_pytorch.training.session import distributed_run, run_dataset, run_text_tokenizer

    flags = vars(run_cfg)
    start = None
    if run_cfg.dalle_path:
        start, model_cfg, vae, vae_export, vae_id = _start_from(run_cfg, model_cfg)
    else:
        vae, vae_export, vae_id = load_image_tokenizer(flags)
    if cfg.resume:
        run_dir = os.path.join(cfg.output_dir, cfg.name or "dalle")
        check_same_tokenizer(run_dir, vae_id, tokenizer_flag(flags))
        if run_cfg.bpe_path and not _recorded(run_dir, "bpe_lowercase"):
            run_cfg.bpe_lowercase = True  # a run started before the flag existed lowercased its captions
            flags = vars(run_cfg)
    configs = {"model": model_cfg, "dalle": run_cfg, "train": cfg, "vae_fingerprint": vae_id}
    if "weights" not in vae_export:  # a pretrained tokenizer's record: convert copies it into the export
        configs["pretrained_tokenizer"] = vae_export
    with distributed_run(cfg, "dalle", configs, backend_options) as (backend, recovery, run):
        pairs = run_dataset(
            run_cfg.image_text_folder,
            run_cfg.wds,
            True,
            vae.image_size,
            vae.channels,
            run_cfg.resize_ratio,
            cfg,
            backend,
            run,
            "--image_text_folder",
        )
        if start is None:
            tokenizer = run_text_tokenizer(flags, cfg, backend, run, pairs)
            model_cfg = dataclasses.replace(
                model_cfg,
                num_text_tokens=tokenizer.vocab_size,
                num_image_tokens=vae.num_tokens,
                image_fmap_size=vae.fmap_size,
            )
        else:  # the export's model, which fits its tokenizers
            tokenizer = tokenizer_from_dict(start["tokenizer"])
        run.update_config("model", model_cfg)
        dalle = DALLE(model_cfg)
        if start is not None:
            dalle.load_state_dict(start["weights"])
            run.print(f"started from {run_cfg.dalle_path} (weights only: a new optimizer and schedule)")
        n_params = sum(p.numel() for p in dalle.parameters())
        run.print(f"DALLE: {n_params / 1e6:.2f}M parameters, sequence {model_cfg.seq_len}, {tokenizer_flag(flags)}")
        dataset = tokenized(pairs, tokenizer, model_cfg.text_seq_len)
        if run_cfg.precompute_tokens:
            dataset = precomputed(dataset, vae, vae_id, run, backend)
        export_path = run_cfg.dalle_output or os.path.join(run.path, "dalle.pt")
        task = DALLETask(dalle, vae, vae_export, tokenizer, dataset, export_path, run_cfg.sample_captions, cfg.seed)
        pos = train(task, cfg, backend, recovery, run)
        skipped = getattr(pairs, "num_skipped", 0)
        if skipped:
            run.print(f"skipped {skipped} unreadable samples")
        if dataset.truncated.value:
            run.print(f"truncated {dataset.truncated.value} captions to --text_seq_len {model_cfg.text_seq_len}")
        run.print(f"done at step {pos.step}: export {task.export_path}")
        return task.export_path


def _recorded(run_dir: str, key: str) -> bool:
    """Whether the run's config.json records `key` in its dalle section (True for a run without a config yet)."""
    import json

    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        return True
    with open(path) as f:
        return key in json.load(f).get("dalle", {})


# what --dalle_path fixes (its export's model) and what a fine-tuning run may still change
_TRAINING_ONLY = ("attn_dropout", "ff_dropout", "loss_img_weight", "z_loss_weight", "null_cond_prob")


def _start_from(run_cfg: DALLERunConfig, model_cfg: DALLEConfig):
    """(export, its model config with the training-only flags given, image tokenizer, its export or record,
    its fingerprint) of --dalle_path. --vqgan_model_path / --openai_vae_path say where its tokenizer moved."""
    from dalle_pytorch.training.build import start_of, tokenizer_fingerprint

    given = [f for f in ("vae_path", "taming") if getattr(run_cfg, f)]
    if given:
        raise ValueError(f"--dalle_path brings its own VAE: drop --{', --'.join(given)}")
    start, vae = start_of(vars(run_cfg))
    theirs, defaults = DALLEConfig(**start["config"]), DALLEConfig()
    fixed = [
        f.name
        for f in dataclasses.fields(DALLEConfig)
        if "help" in f.metadata and f.name not in _TRAINING_ONLY
        and getattr(model_cfg, f.name) not in (getattr(defaults, f.name), getattr(theirs, f.name))
    ]  # fmt: skip
    if fixed:
        raise ValueError(f"--dalle_path fixes the model ({run_cfg.dalle_path}'s): drop --{', --'.join(fixed)}")
    changed = {k: getattr(model_cfg, k) for k in _TRAINING_ONLY if getattr(model_cfg, k) != getattr(defaults, k)}
    return start, dataclasses.replace(theirs, **changed), vae, start["vae"], tokenizer_fingerprint(start["vae"])


if __name__ == "__main__":
    main()
