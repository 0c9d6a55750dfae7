"""Turn a trained DALLE export into images.

    python generate.py --dalle_path runs/dalle/dalle.safetensors --text "a red circle above a blue square"
    python generate.py --dalle_path dalle.pt --text "a red circle|a blue square" --num_images 8 --cond_scale 3
    python generate.py --dalle_path dalle.pt --text_file prompts.txt --seed 1
    python generate.py --dalle_path dalle.pt --text "a red circle" --clip_path clip.pt --num_images 64 --keep 8
    python generate.py --dalle_path dalle.pt --text "a small" --gentxt     # the model completes the caption first

Writes outputs/<prompt>/0000.png ..., grid.png and settings.json per prompt. With --clip_path the images are
ranked by CLIP (train_clip.py): the best --keep are written, best first, with their scores in settings.json.
A dalle.pt of lucidrains' dalle-pytorch 1.6 is read as it is (converted on the fly; its text tokenizer is the
one its flags say: --bpe_path [--hug], --chinese, or the CLIP BPE), and its commands' flags are accepted.
"""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    from dalle_pytorch.compat.flags import PredecessorFiles
    from dalle_pytorch.config import FileParser, add_flags
    from dalle_pytorch.inference.generate import GenerateConfig
    from dalle_pytorch.inference.pipeline import RerankConfig, SamplingConfig

    p = FileParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, GenerateConfig, "what to generate")
    add_flags(p, SamplingConfig, "sampling")
    add_flags(p, RerankConfig, "reranking with CLIP")
    add_flags(p, PredecessorFiles, PredecessorFiles.__doc__)
    return p


def main(argv=None):
    from dalle_pytorch.compat.flags import PredecessorFiles
    from dalle_pytorch.config import take
    from dalle_pytorch.errors import user_errors
    from dalle_pytorch.inference.generate import GenerateConfig, generate
    from dalle_pytorch.inference.pipeline import RerankConfig, SamplingConfig

    ns = build_parser().parse_args(argv)
    with user_errors(ns.debug):
        configs = [take(ns, cls) for cls in (GenerateConfig, SamplingConfig, RerankConfig, PredecessorFiles)]
        return generate(*configs)


if __name__ == "__main__":
    main()
