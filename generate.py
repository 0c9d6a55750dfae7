"""Turn a trained DALLE export into images.

    python generate.py --dalle_path runs/dalle/dalle.pt --text "a red circle above a blue square"
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
import json
import os
import re

import torch

from predecessor_flags import top_k_arg, top_k_count


def sanitize(prompt: str, max_len: int = 80) -> str:
    """A folder name for `prompt` that cannot leave the output folder: no separators, no dot-only names."""
    name = re.sub(r"[^A-Za-z0-9 _,-]+", "", prompt).strip().replace(" ", "_")[:max_len].strip("._")
    return name or "prompt"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dalle_path", required=True, help="DALLE export written by train_dalle.py")
    p.add_argument("--text", default="", help="prompts separated by |")
    p.add_argument("--text_file", default="", help="a file with one prompt per line")
    p.add_argument("--num_images", type=int, default=4, help="images per prompt")
    p.add_argument("--batch_size", type=int, default=16, help="images generated at once")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0: greedy)")
    p.add_argument(
        "--top_k",
        type=top_k_arg,
        default=0,
        help="sample among the k most likely tokens (0: all); a fraction is the predecessor's threshold (0.9)",
    )
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling mass (1: off)")
    p.add_argument("--cond_scale", type=float, default=1.0, help="classifier-free guidance scale (1: off)")
    p.add_argument("--seed", type=int, default=0, help="random seed: the same seed gives the same images")
    p.add_argument("--img", default="", help="prime with the top rows of this image")
    p.add_argument(
        "--num_init_img_tokens", type=int, default=0, help="image tokens taken from --img (default: a quarter)"
    )
    p.add_argument(
        "--vqgan_model_path", default="", help="where the VQGAN the DALLE was trained with is now (if it moved)"
    )
    p.add_argument(
        "--openai_vae_path", default="", help="where the OpenAI dVAE the DALLE was trained with is now (if it moved)"
    )
    p.add_argument("--clip_path", default="", help="a CLIP export (train_clip.py) that ranks the images")
    p.add_argument("--keep", type=int, default=0, help="with --clip_path: write the best N images (0: all, ranked)")
    p.add_argument("--outputs_dir", default="outputs", help="where the prompt folders go")
    p.add_argument("--device", default="", help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--no_cache", action="store_true", help="recompute the whole prefix every token (slow; for checks)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the decode step (one graph for every position; pays off over many images)",
    )
    p.add_argument(
        "--cuda_graphs", action="store_true", help="with --compile on a GPU: replay the decode step as a CUDA graph"
    )
    p.add_argument(
        "--gentxt",
        "--gentext",
        action="store_true",
        help="complete each --text from the model's caption half first (or invent a caption for an empty one)",
    )
    old = p.add_argument_group("a dalle-pytorch 1.6 dalle.pt (our exports carry their tokenizers)")
    old.add_argument("--bpe_path", default="", help="the YouTokenToMe model it was trained with (JSON with --hug)")
    old.add_argument("--hug", action="store_true", help="--bpe_path is a Hugging Face tokenizers JSON")
    old.add_argument("--chinese", action="store_true", help="it was trained with the Chinese tokenizer")
    old.add_argument("--taming", action="store_true", help="it was trained on a VQGAN (give --vqgan_config_path)")
    old.add_argument("--vqgan_config_path", default="", help="the config of the VQGAN it was trained on")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    return p


def read_prompts(args) -> list[str]:
    prompts = [t.strip() for t in args.text.split("|") if t.strip()]
    if args.text_file:
        if not os.path.exists(args.text_file):
            raise FileNotFoundError(f"--text_file {args.text_file} does not exist")
        with open(args.text_file, encoding="utf-8") as f:
            prompts += [line.strip() for line in f if line.strip()]
    if not prompts and args.gentxt:
        return [""]  # the model invents the caption
    if not prompts:
        raise ValueError('give a prompt with --text "a red circle" or --text_file FILE')
    return prompts


def main(argv=None):
    args = build_parser().parse_args(argv)
    from dalle_pytorch.errors import user_errors

    with user_errors(args.debug):
        return _generate(args)


def _generate(args):
    from PIL import Image
    from torchvision.utils import save_image
    from tqdm import tqdm

    from dalle_pytorch.data.folders import image_transform
    from dalle_pytorch.models.clip import rank_by_clip
    from dalle_pytorch.models.sampling import generate_image_tokens, generate_text_tokens
    from dalle_pytorch.training.export import check_clip_fits, load_clip, load_dalle

    prompts = read_prompts(args)
    if args.cuda_graphs and not args.compile:
        raise ValueError("--cuda_graphs replays the compiled decode step: add --compile")
    if args.num_images < 1 or args.batch_size < 1:
        raise ValueError("--num_images and --batch_size must be at least 1")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    reference = dict(
        bpe_path=args.bpe_path, hug=args.hug, chinese=args.chinese, vqgan_config_path=args.vqgan_config_path
    )
    dalle, vae, tokenizer = load_dalle(args.dalle_path, device, args.vqgan_model_path, args.openai_vae_path, reference)
    cfg = dalle.cfg
    num_logits = cfg.num_text_tokens + cfg.num_image_tokens
    top_k = top_k_count(args.top_k, num_logits, cfg.num_image_tokens)
    clip = None
    if args.keep and not args.clip_path:
        raise ValueError("--keep ranks the images with CLIP: give --clip_path clip.pt (train_clip.py writes one)")
    if args.keep < 0 or args.keep > args.num_images:
        raise ValueError(f"--keep must be between 0 and --num_images {args.num_images} (got {args.keep})")
    if args.clip_path:
        clip, clip_tokenizer = load_clip(args.clip_path, device)
        check_clip_fits(clip, clip_tokenizer, args.dalle_path, args.clip_path)
    prime = None
    if args.img:
        if not os.path.exists(args.img):
            raise FileNotFoundError(f"--img {args.img} does not exist")
        mode = "RGBA" if vae.channels == 4 else "RGB"  # an RGBA model is primed with the image's alpha too
        image = image_transform(vae.image_size, train=False)(Image.open(args.img).convert(mode))[None].to(device)
        n = args.num_init_img_tokens or cfg.image_seq_len // 4
        if not 0 < n < cfg.image_seq_len:
            raise ValueError(f"--num_init_img_tokens must be between 1 and {cfg.image_seq_len - 1} (got {n})")
        prime = vae.get_codebook_indices(image)[:, :n]

    g = torch.Generator(device).manual_seed(args.seed)
    total_tokens = len(prompts) * args.num_images * (cfg.image_seq_len - (0 if prime is None else prime.shape[1]))
    bar = tqdm(total=total_tokens, unit="tok", disable=args.quiet)
    written = []
    for prompt in prompts:
        text, truncated = tokenizer.tokenize(prompt, cfg.text_seq_len)
        if truncated:
            print(f"warning: prompt truncated to {cfg.text_seq_len} tokens: {prompt!r}")
        if args.gentxt:  # the predecessor's threshold counts text and image logits; at most the text vocabulary
            text_k = top_k_count(args.top_k, num_logits, cfg.num_text_tokens, say=lambda _: None)
            text = generate_text_tokens(
                dalle, text.to(device), temperature=args.temperature, top_k=text_k, top_p=args.top_p, generator=g
            ).cpu()
            prompt = tokenizer.decode([i for i in text[0].tolist() if i]) or prompt
            print(f"caption: {prompt}")
        folder = os.path.join(args.outputs_dir, sanitize(prompt))
        os.makedirs(folder, exist_ok=True)
        images = []
        for start in range(0, args.num_images, args.batch_size):
            b = min(args.batch_size, args.num_images - start)
            tokens = generate_image_tokens(
                dalle,
                text.to(device).expand(b, -1),
                temperature=args.temperature,
                top_k=top_k,
                top_p=args.top_p,
                cond_scale=args.cond_scale,
                generator=g,
                use_cache=not args.no_cache,
                compile="reduce-overhead" if args.compile and args.cuda_graphs else args.compile,
                prime=None if prime is None else prime.expand(b, -1),
                on_token=lambda b=b: bar.update(b),
            )
            images.append(vae.decode(tokens))
        images = torch.cat(images)
        settings = {k: v for k, v in vars(args).items() if k not in ("text", "text_file", "quiet", "debug")}
        if clip is not None:  # DALL-E's reranking: CLIP scores every sample, the best are kept, best first
            scores = rank_by_clip(clip, clip_tokenizer, prompt, images, args.batch_size)
            order = scores.argsort(descending=True)[: args.keep or len(images)]
            images = images[order]
            settings["clip_scores"] = [round(v, 5) for v in scores[order].tolist()]
        images = images.cpu()  # every channel: an RGBA model's PNGs keep their alpha
        for i, img in enumerate(images):
            save_image(img, os.path.join(folder, f"{i:04d}.png"))
        save_image(images, os.path.join(folder, "grid.png"), nrow=min(len(images), 8), padding=1)
        with open(os.path.join(folder, "settings.json"), "w") as f:
            json.dump({"prompt": prompt, **settings}, f, indent=2)
        written.append(folder)
    bar.close()
    for folder in written:
        print(f"images: {folder}/")
    return written


if __name__ == "__main__":
    main()
