"""What the evaluation on your data costs and what it shows as a run trains: real handwriting (scikit-learn's
digits, inked in colours on coloured grounds by ../shared/bench/binding.py: 3000 images of 32 x 32 with captions
such as "a red seven on blue"), 2500 to train on, 500 held out as VAL. A VAE, then a DALLE whose export is scored
at three points of its run with `python -m dalle_pytorch.eval --image_text_folder VAL`.

    .venv/bin/python bench/fid.py [--out /tmp/fid-bench] [--images 500] [--inception_weights F --vgg16_weights F]

Prints seconds per 1000 generated images and per 1000 scored images (FID, KID, IS on Inception; precision/recall
on VGG-16), and the figures at each point. Without weights files it makes torch-fidelity's Inception v3 and
torchvision's VGG-16 with fixed random values (what this machine can have: no download), and says so: such FIDs
compare checkpoints of one run with each other, not with published figures.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from unittest import mock

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BINDING = os.path.join(os.path.dirname(ROOT), "shared", "bench", "binding.py")


def random_inception(path: str) -> str:
    """torch-fidelity's Inception v3 with fixed random values, saved at `path`: He-initialised convolutions, so that
    features keep their scale through its 94 layers (the module's own init would shrink them towards zero)."""
    from torch_fidelity.feature_extractor_inceptionv3 import FeatureExtractorInceptionV3

    torch.manual_seed(0)
    with mock.patch.object(FeatureExtractorInceptionV3, "load_state_dict"), mock.patch("torch.load", return_value={}):
        net = FeatureExtractorInceptionV3("inception-v3-compat", ["2048"], feature_extractor_weights_path="-")
    for m in net.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear)):
            torch.nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
    torch.save(net.state_dict(), path)
    return path


def random_vgg16(path: str) -> str:
    """torchvision's VGG-16 with fixed random values, saved at `path` in float16 (276 MB; load_state_dict casts
    them back)."""
    import torchvision

    torch.manual_seed(0)
    torch.save({k: v.half() for k, v in torchvision.models.vgg16().state_dict().items()}, path)
    return path


def random_weights(out: str) -> tuple[str, str]:
    """(Inception, VGG-16) weights files of the right architectures with fixed random values (as the tests)."""
    return random_inception(os.path.join(out, "inception-random.pth")), random_vgg16(
        os.path.join(out, "vgg16-random.pth")
    )


def split(data: str, n_val: int) -> tuple[str, str]:
    """DATA/train's pairs as two caption folders of links: the first ones to train on, the last n_val held out."""
    names = sorted((p[:-4] for p in os.listdir(os.path.join(data, "train")) if p.endswith(".png")), key=int)
    folders = os.path.join(data, "fit"), os.path.join(data, "val")
    for folder, part in zip(folders, (names[:-n_val], names[-n_val:])):
        os.makedirs(folder, exist_ok=True)
        for name in part:
            for ext in (".png", ".txt"):
                link = os.path.join(folder, name + ext)
                if not os.path.exists(link):
                    os.symlink(os.path.join(data, "train", name + ext), link)
    return folders


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="/tmp/fid-bench")
    p.add_argument("--images", type=int, default=500, help="VAL pairs scored at each point")
    p.add_argument("--points", default="150,300,600", help="DALLE steps at which its export is scored")
    p.add_argument("--inception_weights", default="")
    p.add_argument("--vgg16_weights", default="")
    args = p.parse_args(argv)
    import train_dalle
    import train_vae
    from dalle_pytorch.eval import evaluate

    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(os.cpu_count())
    data = os.path.join(args.out, "data")
    if not os.path.isdir(os.path.join(data, "train")):
        subprocess.run([sys.executable, BINDING, "make", data], check=True)
    fit, val = split(data, args.images)
    weights = [args.inception_weights, args.vgg16_weights]
    random = not all(weights)
    if random:
        weights = random_weights(args.out)
    common = ["--output_dir", os.path.join(args.out, "runs"), "--num_workers", "1", "--quiet", "--log_every", "100"]
    common += ["--save_every_n_steps", "0", "--sample_every", "0"]
    vae = train_vae.main(["--image_folder", fit, "--image_size", "32", "--steps", "600", "--batch_size", "32", *common])
    dalle_flags = ["--vae_path", vae, "--image_text_folder", fit, "--text_seq_len", "16", "--batch_size", "32"]
    dalle_flags += ["--dim", "192", "--dim_head", "48", *common]
    rows = []
    for i, steps in enumerate(int(s) for s in args.points.split(",")):
        t0 = time.perf_counter()
        export = train_dalle.main([*dalle_flags, "--steps", str(steps)] + (["--resume", "auto"] if i else []))
        trained = time.perf_counter() - t0
        out = os.path.join(args.out, f"eval-{steps}")
        argv = ["--dalle_path", export, "--image_text_folder", val, "--num_images", str(args.images), "--out", out]
        argv += ["--inception_weights", weights[0], "--vgg16_weights", weights[1]]
        t0 = time.perf_counter()
        with mock.patch("dalle_pytorch.eval.on_data.fidelity_metrics", wraps=timed_fidelity):
            results = evaluate.main(argv)["dalle"]
        total = time.perf_counter() - t0
        scored = TIMES.pop()
        rows.append((steps, trained, total - scored, scored, results))
    n = args.images
    print(f"{n} VAL pairs of coloured handwritten digits (32 x 32), 2-core CPU; "
          f"{'fixed random' if random else 'the given'} Inception and VGG-16 weights")  # fmt: skip
    head = f"{'DALLE step':>10} {'FID':>9} {'KID':>9} {'IS':>6} {'prec':>6} {'recall':>6}"
    print(f"{head}   s/1000 generated  s/1000 scored")
    for steps, _, generating, scoring, r in rows:
        print(
            f"{steps:>10} {r['fid']:>9.3f} {r['kid']:>9.5f} {r['inception_score']:>6.3f} {r['precision']:>6.3f} "
            f"{r['recall']:>6.3f}   {1000 * generating / n:>16.1f}  {1000 * scoring / (2 * n):>13.1f}"
        )
    print("(scored: each of the 2 x N images through Inception and VGG-16; generated: loading, sampling, decoding, "
          "writing the PNGs)")  # fmt: skip


TIMES: list[float] = []


def timed_fidelity(*args, **kwargs):
    from dalle_pytorch.eval.fidelity import fidelity_metrics

    t0 = time.perf_counter()
    try:
        return fidelity_metrics(*args, **kwargs)
    finally:
        TIMES.append(time.perf_counter() - t0)


if __name__ == "__main__":
    main()
