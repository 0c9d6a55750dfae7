"""How many images a stable FID needs: FID of one DALLE's images against real ones at 1000 and 5000 images each
side, over 3 sampling seeds, as `python -m dalle_pytorch.eval --num_images N --seed S` would give on the same
validation pairs (the first N; only the seed changes). KID beside it (its subsets make it unbiased in N).

    .venv/bin/python bench/fid_spread.py [--dalle_path /tmp/fid-bench/runs/dalle/dalle.safetensors]
        [--inception_weights F] [--sizes 1000,5000] [--seeds 0,1,2]

The DALLE: bench/fid.py's (coloured handwritten digits, 600 steps); run that first, or pass another trained on
../shared/bench/binding.py's data. The real images: 5000 of scikit-learn's handwritten digits drawn as binding.py
draws them (its `draw`: an ink colour on a ground of another), each with a caption of binding's first template;
the generated image of pair i has pair i's caption. Each image goes once through torch-fidelity's Inception v3
(the first N of a seed's images are what a run with --num_images N makes: its batches are seeded by their number);
FID and KID of every (N, seed) come from those features through torch-fidelity's own estimators. Without
--inception_weights the Inception has fixed random values (bench/fid.py's), and the figures say how FID varies
with N, not what a published FID would be.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fid import BINDING, random_inception  # noqa: E402


def binding():
    spec = importlib.util.spec_from_file_location("binding", BINDING)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def real_pairs(n: int, seed: int = 5) -> tuple[torch.Tensor, list[str]]:
    """n real digits drawn as binding.py draws them (any digit of scikit-learn's 1797), uint8 (n, 3, 32, 32)."""
    import numpy as np
    from sklearn.datasets import load_digits

    b = binding()
    digits = load_digits()
    rng = random.Random(seed)
    images, captions = [], []
    for _ in range(n):
        i = rng.randrange(len(digits.target))
        ink = rng.randrange(len(b.NAMES))
        ground = rng.choice([k for k in range(len(b.NAMES)) if k != ink])
        images.append(torch.from_numpy(np.asarray(b.draw(digits.data[i], ink, ground))).permute(2, 0, 1))
        word = b.WORDS[digits.target[i]]
        captions.append(b.TEMPLATES[0].format(c=b.NAMES[ink], d=word, g=b.NAMES[ground]))
    return torch.stack(images), captions


@torch.no_grad()
def generated(dalle_path: str, captions: list[str], seed: int, batch_size: int = 32) -> torch.Tensor:
    """The DALLE's images for `captions`, uint8, batch k seeded as the evaluation seeds it (on_data.py)."""
    from dalle_pytorch.inference.load import load_dalle
    from dalle_pytorch.inference.pipeline import SamplingConfig, candidate_images

    dalle, vae, tokenizer = load_dalle(dalle_path)
    options = SamplingConfig().token_options(dalle)
    out = []
    for k, start in enumerate(range(0, len(captions), batch_size)):
        text, _ = tokenizer.tokenize(captions[start : start + batch_size], dalle.cfg.text_seq_len)
        g = torch.Generator().manual_seed(seed * 1_000_003 + k)
        images = candidate_images(dalle, vae, text, len(text), g, **dict(options))
        out.append((images.clamp(0, 1) * 255).round().to(torch.uint8))  # as its PNGs hold them
    return torch.cat(out)


@torch.no_grad()
def features(extractor, images: torch.Tensor, batch_size: int = 50) -> torch.Tensor:
    return torch.cat([extractor(images[i : i + batch_size])[0] for i in range(0, len(images), batch_size)]).double()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dalle_path", default="/tmp/fid-bench/runs/dalle/dalle.safetensors")
    p.add_argument("--inception_weights", default="")
    p.add_argument("--sizes", default="1000,5000")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args(argv)
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3
    from torch_fidelity.metric_fid import fid_features_to_statistics, fid_statistics_to_metric
    from torch_fidelity.metric_kid import kid_features_to_metric

    if not os.path.isfile(args.dalle_path):
        raise SystemExit(f"{args.dalle_path}: no such DALLE export: run bench/fid.py first, or pass --dalle_path")
    torch.set_num_threads(args.threads)
    sizes = [int(s) for s in args.sizes.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    weights = args.inception_weights or random_inception("/tmp/inception-random.pth")
    extractor = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path=weights)
    extractor.eval()
    t0 = time.perf_counter()
    real, captions = real_pairs(max(sizes))
    real_f = features(extractor, real)
    per_image = (time.perf_counter() - t0) / len(real)
    print(f"{len(real)} real images through Inception: {per_image * 1000:.0f} s per 1000", flush=True)
    rows = {n: [] for n in sizes}
    for seed in seeds:
        fake_f = features(extractor, generated(args.dalle_path, captions, seed))
        for n in sizes:
            fid = fid_statistics_to_metric(
                fid_features_to_statistics(fake_f[:n]), fid_features_to_statistics(real_f[:n]), False
            )["frechet_inception_distance"]
            kid = kid_features_to_metric(fake_f[:n], real_f[:n], kid_subset_size=min(1000, n), verbose=False)
            rows[n].append((fid, kid["kernel_inception_distance_mean"]))
            print(f"seed {seed} N {n}: FID {fid:.4f} KID {kid['kernel_inception_distance_mean']:.6f}", flush=True)
    kind = "the given" if args.inception_weights else "fixed random"
    print(f"\nFID and KID over seeds {args.seeds}, {kind} Inception weights, DALLE {args.dalle_path}")
    print(f"{'images':>7} {'FID mean':>9} {'range':>17} {'spread %':>8} {'KID mean':>10} {'range':>21}")
    for n, found in rows.items():
        fids, kids = [f for f, _ in found], [k for _, k in found]
        mean = statistics.mean(fids)
        print(
            f"{n:>7} {mean:>9.4f} {min(fids):>8.4f}-{max(fids):<8.4f} {100 * (max(fids) - min(fids)) / mean:>8.1f} "
            f"{statistics.mean(kids):>10.6f} {min(kids):>10.6f}-{max(kids):<10.6f}"
        )
    print("(spread %: the range over the seeds as a share of the mean)")


if __name__ == "__main__":
    main()
