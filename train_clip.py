"""Train CLIP on caption/image pairs, to rerank the images a DALLE generates (generate.py --clip_path).

    python train_clip.py --dalle_path runs/dalle/dalle.pt                  # the built-in dataset, the DALLE's tokenizer
    python train_clip.py --dalle_path dalle.pt --image_text_folder DIR      # x.jpg beside x.txt, nested
    torchrun --nproc_per_node 2 train_clip.py --dalle_path dalle.pt --image_text_folder DIR
    deepspeed --num_gpus 2 train_clip.py ...;  horovodrun -np 2 python train_clip.py ...

--dalle_path takes the text tokenizer, the caption length and the image size from the DALLE export the
CLIP will rerank for (a CLIP that reads other captions or images is refused at generation). The loss
uses every rank's pairs as negatives, so N ranks x batch b trains as one process with batch N x b.
Writes runs/clip/ (config.json, metrics.jsonl, train.log, samples/, checkpoints/) and the export clip.pt.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from arguments import TrainConfig, build_parser, take, take_backend_options
from dalle_pytorch.config import flag
from dalle_pytorch.errors import user_errors
from dalle_pytorch.models.clip import CLIP, CLIPConfig


@dataclass
class CLIPRunConfig:
    dalle_path: str = flag("", "the DALLE export to rerank for: its tokenizer, caption length and image size")
    image_text_folder: str = flag(
        "", "folder of x.jpg + x.txt pairs, or WebDataset shard URLs with --wds; empty: the built-in synthetic dataset"
    )
    wds: str = flag(
        "", "image and caption keys of WebDataset shards, e.g. jpg,txt: --image_text_folder holds the shard URLs"
    )
    resize_ratio: float = flag(0.75, "random resized crop keeps at least this fraction of each image (folders only)")
    image_size: int = flag(32, "image side without --dalle_path")
    channels: int = flag(3, "image channels without --dalle_path")
    text_seq_len: int = flag(32, "caption tokens without --dalle_path")
    tokenizer: str = flag("yttm", "text tokenizer without --dalle_path or --bpe_path", choices=("yttm", "byte"))
    bpe_path: str = flag("", "a YouTokenToMe BPE model to use (default: train one on the captions)")
    hug: bool = flag(False, "--bpe_path is a Hugging Face tokenizers JSON file")
    bpe_vocab_size: int = flag(256, "vocabulary of the BPE trained on the captions")
    clip_output: str = flag("", "path of the export (default: RUN_DIR/clip.pt)")


def main(argv=None):
    parser = build_parser(__doc__, (CLIPConfig, "model"), (CLIPRunConfig, "CLIP training"), (TrainConfig, "training"))
    parser.set_defaults(learning_rate=1e-3, batch_size=64, warmup_steps=50, name="clip", weight_decay=0.1)
    ns = parser.parse_args(argv)
    with user_errors(ns.debug):
        return _train(take(ns, CLIPConfig), take(ns, CLIPRunConfig), take(ns, TrainConfig), take_backend_options(ns))


def _train(model_cfg: CLIPConfig, run_cfg: CLIPRunConfig, cfg: TrainConfig, backend_options: dict):
    from dalle_pytorch.data.tokenized import tokenized
    from dalle_pytorch.data.tokenizer import tokenizer_from_dict
    from dalle_pytorch.inference.fits import dalle_fit
    from dalle_pytorch.training.clip_task import CLIPTask
    from dalle_pytorch.training.loop import train
    from dalle_pytorch.training.session import distributed_run, run_dataset, run_text_tokenizer

    fit = dalle_fit(run_cfg.dalle_path) if run_cfg.dalle_path else None
    size = fit["image_size"] if fit else run_cfg.image_size
    channels = fit["channels"] if fit else run_cfg.channels
    configs = {"model": model_cfg, "clip": run_cfg, "train": cfg}
    with distributed_run(cfg, "clip", configs, backend_options) as (backend, recovery, run):
        pairs = run_dataset(
            run_cfg.image_text_folder,
            run_cfg.wds,
            True,
            size,
            channels,
            run_cfg.resize_ratio,
            cfg,
            backend,
            run,
            "--image_text_folder",
        )
        if fit:
            tokenizer = tokenizer_from_dict(fit["tokenizer"])
        else:
            tokenizer = run_text_tokenizer(vars(run_cfg), cfg, backend, run, pairs)
        model_cfg = dataclasses.replace(
            model_cfg,
            num_text_tokens=tokenizer.vocab_size,
            text_seq_len=fit["text_seq_len"] if fit else run_cfg.text_seq_len,
            image_size=size,
            channels=channels,
        )
        run.update_config("model", model_cfg)
        clip = CLIP(model_cfg)
        run.print(f"CLIP: {sum(p.numel() for p in clip.parameters()) / 1e6:.2f}M parameters")
        task = CLIPTask(
            clip,
            tokenizer,
            tokenized(pairs, tokenizer, model_cfg.text_seq_len),
            run_cfg.clip_output or os.path.join(run.path, "clip.pt"),
            gather=lambda x: (backend.all_gather(x), backend.rank * x.shape[0]),
        )
        pos = train(task, cfg, backend, recovery, run)
        run.print(f"done at step {pos.step}: export {task.export_path}")
        return task.export_path


if __name__ == "__main__":
    main()
