"""Train CLIP on caption/image pairs, to rerank the images a DALLE generates (generate.py --clip_path).

    python train_clip.py --dalle_path runs/dalle/dalle.safetensors   # the built-in dataset, the DALLE's tokenizer
    python train_clip.py --dalle_path dalle.pt --image_text_folder DIR      # x.jpg beside x.txt, nested
    torchrun --nproc_per_node 2 train_clip.py --dalle_path dalle.pt --image_text_folder DIR
    python train_clip.py --dalle_path dalle.pt --image_text_folder DIR --ray_workers 4
    deepspeed --num_gpus 2 train_clip.py ...;  horovodrun -np 2 python train_clip.py ...

--dalle_path takes the text tokenizer, the caption length and the image size from the DALLE export the
CLIP will rerank for (a CLIP that reads other captions or images is refused at generation). The loss
uses every rank's pairs as negatives, so N ranks x batch b trains as one process with batch N x b.
Writes runs/clip/ (config.json, metrics.jsonl, train.log, samples/, checkpoints/) and the export clip.safetensors.
"""

from __future__ import annotations

from arguments import build_parser, run_fit, take
from dalle_pytorch.errors import user_errors
from dalle_pytorch.models.clip import CLIPConfig
from dalle_pytorch.training.configs import CLIPRunConfig, TrainConfig


def main(argv=None):
    configs = (CLIPConfig, "model"), (CLIPRunConfig, "CLIP training"), (TrainConfig, "training")
    parser = build_parser(__doc__, *configs)
    parser.set_defaults(learning_rate=1e-3, batch_size=64, warmup_steps=50, name="clip", weight_decay=0.1)
    ns = parser.parse_args(argv)
    with user_errors(ns.debug):
        from dalle_pytorch.training.trainers import fit_clip

        return run_fit(fit_clip, ns, take(ns, CLIPConfig), take(ns, CLIPRunConfig))


if __name__ == "__main__":
    main()
