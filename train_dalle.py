"""Train the DALLE transformer on caption/image pairs with a frozen VAE.

    python train_dalle.py --vae_path runs/vae/vae.safetensors                        # the built-in synthetic dataset
    python train_dalle.py --vae_path vae.pt --image_text_folder DIR         # x.jpg beside x.txt, nested
    python train_dalle.py --taming --vqgan_model_path last.ckpt --vqgan_config_path model.yaml --image_text_folder DIR
    python train_dalle.py --openai_vae_path DIR_WITH_ENCODER_AND_DECODER --image_text_folder DIR
    torchrun --nproc_per_node 2 train_dalle.py --vae_path vae.pt --image_text_folder DIR
    python train_dalle.py --vae_path vae.pt --image_text_folder DIR --ray_workers 4 --ray_address HEAD:6379

Writes runs/dalle/ (config.json, metrics.jsonl, train.log, samples/, checkpoints/, the tokenizer) and the
export dalle.safetensors, which holds the VAE and the tokenizer too: generate.py needs nothing else. A pretrained
tokenizer (--taming, --openai_vae_path) is not copied into the export: it records the files, their config
and a fingerprint of their weights, and generate.py reads the files again.
"""

from __future__ import annotations

from arguments import build_parser, run_fit, take
from dalle_pytorch.errors import user_errors
from dalle_pytorch.models.dalle import DALLEConfig
from dalle_pytorch.training.configs import DALLERunConfig, TrainConfig


def main(argv=None):
    configs = (DALLEConfig, "model"), (DALLERunConfig, "DALLE training"), (TrainConfig, "training")
    parser = build_parser(__doc__, *configs, predecessor="train_dalle")
    parser.set_defaults(learning_rate=1e-3, batch_size=32, warmup_steps=50, name="dalle", weight_decay=0.01)
    ns = parser.parse_args(argv)
    with user_errors(ns.debug):
        from dalle_pytorch.training.trainers import fit_dalle

        return run_fit(fit_dalle, ns, take(ns, DALLEConfig), take(ns, DALLERunConfig))


if __name__ == "__main__":
    main()
