"""Train the image tokenizer that turns images into tokens and back: DALL-E's discrete VAE, or a VQGAN.

    python train_vae.py                                   # the built-in synthetic dataset
    python train_vae.py --image_folder DIR                # any folder of images, nested or flat
    python train_vae.py --model vqgan --image_folder DIR  # a VQGAN (perceptual loss, patch discriminator)
    torchrun --nproc_per_node 2 train_vae.py --image_folder DIR
    python train_vae.py --image_folder DIR --ray_workers 4                   # Ray Train workers (ray start)

Writes runs/vae/ (config.json, metrics.jsonl, train.log, samples/, checkpoints/) and the export vae.safetensors.
"""

from __future__ import annotations

from arguments import build_parser, run_fit, take
from dalle_pytorch.errors import user_errors
from dalle_pytorch.models.vae import VAEConfig
from dalle_pytorch.training.configs import TrainConfig, VAERunConfig, VQGANRunConfig


def main(argv=None):
    configs = (VAEConfig, "model"), (VAERunConfig, "VAE training"), (VQGANRunConfig, "VQGAN"), (TrainConfig, "training")
    parser = build_parser(__doc__, *configs, predecessor="train_vae")
    parser.set_defaults(learning_rate=2e-3, batch_size=32, sample_every=100, name="vae", log_every=20)
    ns = parser.parse_args(argv)
    with user_errors(ns.debug):
        from dalle_pytorch.training.trainers import fit_vae

        return run_fit(fit_vae, ns, take(ns, VAEConfig), take(ns, VAERunConfig), take(ns, VQGANRunConfig))


if __name__ == "__main__":
    main()
