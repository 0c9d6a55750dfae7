"""Write the built-in dataset to disk, so that the real loaders run on it.

python -m dalle_pytorch.data.shapes_export --out DIR --num 10000                 # DIR/00000/000001.png + .txt
python -m dalle_pytorch.data.shapes_export --out DIR --num 10000 --wds           # DIR/shard-000000.tar ...
"""

from __future__ import annotations

import argparse
import io
import os

from .shapes import SPLITS, sample


def export_folder(
    out: str, num: int, image_size: int = 32, seed: int = 0, split: str = "train", per_dir: int = 1000
) -> None:
    for i in range(num):
        img, caption, _ = sample(seed, i, image_size, split)
        folder = os.path.join(out, f"{i // per_dir:05d}")
        os.makedirs(folder, exist_ok=True)
        img.save(os.path.join(folder, f"{i:06d}.png"))
        with open(os.path.join(folder, f"{i:06d}.txt"), "w") as f:
            f.write(caption + "\n")


def export_wds(
    out: str, num: int, image_size: int = 32, seed: int = 0, split: str = "train", per_shard: int = 1000
) -> list[str]:
    import webdataset as wds

    os.makedirs(out, exist_ok=True)
    pattern = os.path.join(out, "shard-%06d.tar")
    with wds.ShardWriter(pattern, maxcount=per_shard, verbose=0) as sink:
        for i in range(num):
            img, caption, _ = sample(seed, i, image_size, split)
            buf = io.BytesIO()
            img.save(buf, format="PNG")
            sink.write({"__key__": f"{i:08d}", "png": buf.getvalue(), "txt": caption.encode()})
    return sorted(os.path.join(out, f) for f in os.listdir(out) if f.endswith(".tar"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--num", type=int, default=10000, help="samples to write")
    p.add_argument("--image_size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split", default="train", choices=SPLITS)
    p.add_argument("--wds", action="store_true", help="WebDataset tar shards instead of a caption folder")
    p.add_argument("--per_shard", type=int, default=1000, help="samples per tar shard")
    args = p.parse_args(argv)
    if args.wds:
        shards = export_wds(args.out, args.num, args.image_size, args.seed, args.split, args.per_shard)
        urls = f"{args.out}/shard-{{000000..{len(shards) - 1:06d}}}.tar"
        print(f"{len(shards)} shards in {args.out}: train with --wds png,txt --image_text_folder '{urls}'")
    else:
        export_folder(args.out, args.num, args.image_size, args.seed, args.split)
        print(f"{args.num} pairs in {args.out}: train with --image_text_folder {args.out}")


if __name__ == "__main__":
    main()
