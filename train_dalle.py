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

import hashlib
import itertools
import json
import os
import time
from dataclasses import dataclass

import torch

from arguments import TrainConfig, build_parser, take
from dalle_pytorch.cli import distributed_run, user_errors
from dalle_pytorch.config_utils import flag
from dalle_pytorch.dalle import DALLE, DALLEConfig

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
    tokenizer: str = flag("yttm", "text tokenizer when no --bpe_path is given", choices=("yttm", "byte"))
    bpe_path: str = flag("", "a YouTokenToMe BPE model to use (default: train one on the captions)")
    hug: bool = flag(False, "--bpe_path is a Hugging Face tokenizers JSON file")
    bpe_vocab_size: int = flag(256, "vocabulary of the BPE trained on the captions")
    dalle_output: str = flag("", "path of the export (default: RUN_DIR/dalle.pt)")
    precompute_tokens: bool = flag(
        False, "run the VAE over the data once before training (cached as RUN_DIR/tokens.pt; fixed crops)"
    )
    sample_captions: list = flag(DEFAULT_SAMPLE_CAPTIONS, "captions drawn in the sample grids")


def main(argv=None):
    parser = build_parser(
        __doc__, (DALLEConfig, "model"), (DALLERunConfig, "DALLE training"), (TrainConfig, "training")
    )
    parser.set_defaults(learning_rate=1e-3, batch_size=32, warmup_steps=50, name="dalle", weight_decay=0.01)
    ns = parser.parse_args(argv)
    with user_errors(ns.debug):
        return _train(take(ns, DALLEConfig), take(ns, DALLERunConfig), take(ns, TrainConfig))


def _captions_for_bpe(dataset, limit: int = 20000) -> list[str]:
    if isinstance(dataset, torch.utils.data.IterableDataset):
        return [caption for _, caption in itertools.islice(iter(dataset), limit)]
    return [
        dataset.caption(i) if hasattr(dataset, "caption") else dataset[i][1] for i in range(min(len(dataset), limit))
    ]


def _tokenizer(run_cfg: DALLERunConfig, dataset, run, backend):
    from dalle_pytorch.tokenizer import ByteTokenizer, HugTokenizer, YttmTokenizer

    if run_cfg.bpe_path:
        return (HugTokenizer if run_cfg.hug else YttmTokenizer).from_file(run_cfg.bpe_path)
    if run_cfg.tokenizer == "byte":
        return ByteTokenizer()
    path = os.path.join(run.path, "bpe.yttm")
    if backend.is_main:  # train once, on rank 0, then every rank loads the same file
        YttmTokenizer.train(_captions_for_bpe(dataset), run_cfg.bpe_vocab_size, path)
        run.print(f"trained a {run_cfg.bpe_vocab_size}-token BPE on the captions: {path}")
    backend.barrier()
    return YttmTokenizer.from_file(path)


def vae_fingerprint(export: dict) -> str:
    """A short hash of the VAE's config and weights: resuming with another VAE would silently change the
    meaning of every image token."""
    h = hashlib.sha1(json.dumps(export["config"], sort_keys=True).encode())
    for name in sorted(export["weights"]):
        h.update(name.encode())
        h.update(export["weights"][name].detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def tokenizer_flag(run_cfg: DALLERunConfig) -> str:
    """The flags that chose the image tokenizer, for messages."""
    if run_cfg.taming:
        return f"--taming --vqgan_model_path {run_cfg.vqgan_model_path}"
    if run_cfg.openai_vae_path:
        return f"--openai_vae_path {run_cfg.openai_vae_path}"
    return f"--vae_path {run_cfg.vae_path}"


def _check_same_vae(run_dir: str, vae_id: str, vae_flag: str) -> None:
    path = os.path.join(run_dir, "config.json")
    if not os.path.exists(path):
        return
    with open(path) as f:
        recorded = json.load(f).get("vae_fingerprint")
    if recorded and recorded != vae_id:
        raise ValueError(
            f"{vae_flag} is not the VAE this run was trained with (fingerprint {vae_id}, the run "
            f"recorded {recorded}): pass the original VAE, or start a new run with another --name"
        )


def _precomputed(dataset, vae, vae_id: str, run, backend):
    """Image tokens of the whole dataset, computed once on rank 0 and cached in the run directory."""
    from dalle_pytorch.checkpoints import atomic_save, safe_load
    from dalle_pytorch.dalle_task import PrecomputedTokens, precompute_tokens

    if isinstance(dataset, torch.utils.data.IterableDataset):
        raise ValueError(
            "--precompute_tokens needs a caption folder or the built-in dataset, not streamed --wds shards"
        )
    path = os.path.join(run.path, "tokens.pt")
    if backend.is_main:
        cached = safe_load(path) if os.path.exists(path) else None
        if cached is None or cached["vae_fingerprint"] != vae_id or len(cached["text"]) != len(dataset):
            t = time.perf_counter()
            data = precompute_tokens(dataset, vae.to(backend.device))
            atomic_save({"vae_fingerprint": vae_id, "image_tokens": data.image_tokens, "text": data.text}, path)
            run.print(f"precomputed image tokens of {len(data)} samples in {time.perf_counter() - t:.1f}s: {path}")
    backend.barrier()
    cached = safe_load(path)
    return PrecomputedTokens(cached["image_tokens"], cached["text"])


def _train(model_cfg: DALLEConfig, run_cfg: DALLERunConfig, cfg: TrainConfig):
    from dalle_pytorch.dalle_task import DALLETask
    from dalle_pytorch.data import CaptionFolder
    from dalle_pytorch.loop import train
    from dalle_pytorch.pretrained import load_image_tokenizer
    from dalle_pytorch.shapes import ShapesDataset

    vae, vae_export = load_image_tokenizer(vars(run_cfg))
    pretrained = "weights" not in vae_export  # a pretrained tokenizer's record: config, paths, fingerprint
    vae_id = vae_export["fingerprint"] if pretrained else vae_fingerprint(vae_export)
    if cfg.resume:
        _check_same_vae(os.path.join(cfg.output_dir, cfg.name or "dalle"), vae_id, tokenizer_flag(run_cfg))
    configs = {"model": model_cfg, "dalle": run_cfg, "train": cfg, "vae_fingerprint": vae_id}
    if pretrained:  # convert.py copies it into an export without reading the tokenizer's weights again
        configs["pretrained_tokenizer"] = vae_export
    with distributed_run(cfg, "dalle", configs) as (backend, run):
        if run_cfg.wds:
            if not run_cfg.image_text_folder:
                raise ValueError("--wds needs the shard URLs in --image_text_folder, e.g. 'shards/{000..099}.tar'")
            if "," not in run_cfg.wds:
                raise ValueError(
                    f"--wds must name the image and caption keys, as in --wds jpg,txt (got {run_cfg.wds!r})"
                )
            from dalle_pytorch.wds import WebDatasetPairs

            dataset = WebDatasetPairs(
                run_cfg.image_text_folder,
                run_cfg.wds,
                vae.image_size,
                vae.channels,
                run_cfg.resize_ratio,
                backend.rank,
                backend.world_size,
                cfg.seed,
            )
        elif run_cfg.image_text_folder:
            dataset = CaptionFolder(run_cfg.image_text_folder, vae.image_size, vae.channels, run_cfg.resize_ratio)
        else:
            dataset = ShapesDataset(cfg.dataset_size, vae.image_size, seed=cfg.seed)
        size = f"{len(dataset.shards)} shards" if run_cfg.wds else f"{len(dataset)} pairs"
        run.print(f"data: {size} from {run_cfg.image_text_folder or 'the built-in synthetic dataset'}")
        tokenizer = _tokenizer(run_cfg, dataset, run, backend)
        model_cfg.num_text_tokens = tokenizer.vocab_size
        model_cfg.num_image_tokens = vae.num_tokens
        model_cfg.image_fmap_size = vae.fmap_size
        run.update_config("model", model_cfg)
        dalle = DALLE(model_cfg)
        n_params = sum(p.numel() for p in dalle.parameters())
        run.print(f"DALLE: {n_params / 1e6:.2f}M parameters, sequence {model_cfg.seq_len}, {tokenizer_flag(run_cfg)}")
        task = DALLETask(
            dalle,
            vae,
            vae_export,
            tokenizer,
            dataset,
            run_cfg.dalle_output or os.path.join(run.path, "dalle.pt"),
            run_cfg.sample_captions,
            cfg.seed,
        )
        if run_cfg.precompute_tokens:
            task.dataset = _precomputed(task.dataset, vae, vae_id, run, backend)
        pos = train(task, cfg, backend, run)
        skipped = getattr(dataset, "num_skipped", 0)
        if skipped:
            run.print(f"skipped {skipped} unreadable samples")
        if task.dataset.truncated.value:
            run.print(f"truncated {task.dataset.truncated.value} captions to --text_seq_len {model_cfg.text_seq_len}")
        run.print(f"done at step {pos.step}: export {task.export_path}")
        return task.export_path


if __name__ == "__main__":
    main()
