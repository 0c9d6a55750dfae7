"""generate.py's flags and work: prompts -> images per prompt folder (0000.png ..., grid.png, settings.json)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass

import torch

from ..compat.flags import PredecessorFiles
from ..config import flag
from .load import load_dalle, pick_device
from .pipeline import RerankConfig, SamplingConfig, best_of, candidate_images, load_reranker


@dataclass
class GenerateConfig:
    """What to generate, from which model, and where the images go."""

    dalle_path: str = flag("", "DALLE export written by train_dalle.py (required)")
    text: str = flag("", "prompts separated by |")
    text_file: str = flag("", "a file with one prompt per line")
    num_images: int = flag(4, "images per prompt")
    batch_size: int = flag(16, "images generated at once")
    seed: int = flag(0, "random seed: the same seed gives the same images")
    img: str = flag("", "prime with the top rows of this image")
    num_init_img_tokens: int = flag(0, "image tokens taken from --img (0: a quarter)")
    vqgan_model_path: str = flag("", "where the VQGAN the DALLE was trained with is now (if it moved)")
    openai_vae_path: str = flag("", "where the OpenAI dVAE the DALLE was trained with is now (if it moved)")
    outputs_dir: str = flag("outputs", "where the prompt folders go")
    device: str = flag("", "cpu, cuda, cuda:1 ... (empty: cuda when available)")
    no_cache: bool = flag(False, "recompute the whole prefix every token (slow; for checks)")
    compile: bool = flag(
        False, "torch.compile the decode step (one graph for every position; pays off over many images)"
    )
    cuda_graphs: bool = flag(False, "with --compile on a GPU: replay the decode step as a CUDA graph")
    gentxt: bool = flag(
        False,
        "complete each --text from the model's caption half first (or invent a caption for an empty one)",
        aliases=("gentext",),
    )
    quiet: bool = flag(False, "no progress bar")
    debug: bool = flag(False, "show tracebacks for user errors")

    def __post_init__(self):
        if not self.dalle_path:
            raise ValueError("--dalle_path is required: the dalle.pt that train_dalle.py wrote")
        if self.cuda_graphs and not self.compile:
            raise ValueError("--cuda_graphs replays the compiled decode step: add --compile")
        if self.num_images < 1 or self.batch_size < 1:
            raise ValueError("--num_images and --batch_size must be at least 1")


def sanitize(prompt: str, max_len: int = 80) -> str:
    """A folder name for `prompt` that cannot leave the output folder: no separators, no dot-only names."""
    name = re.sub(r"[^A-Za-z0-9 _,-]+", "", prompt).strip().replace(" ", "_")[:max_len].strip("._")
    return name or "prompt"


def read_prompts(cfg: GenerateConfig) -> list[str]:
    prompts = [t.strip() for t in cfg.text.split("|") if t.strip()]
    if cfg.text_file:
        if not os.path.exists(cfg.text_file):
            raise FileNotFoundError(f"--text_file {cfg.text_file} does not exist")
        with open(cfg.text_file, encoding="utf-8") as f:
            prompts += [line.strip() for line in f if line.strip()]
    if not prompts and cfg.gentxt:
        return [""]  # the model invents the caption
    if not prompts:
        raise ValueError('give a prompt with --text "a red circle" or --text_file FILE')
    return prompts


def _prime(cfg: GenerateConfig, vae, image_seq_len: int, device):
    """The first image tokens of --img (1, n), or None."""
    from PIL import Image

    from ..data.folders import image_transform

    if not cfg.img:
        return None
    if not os.path.exists(cfg.img):
        raise FileNotFoundError(f"--img {cfg.img} does not exist")
    mode = "RGBA" if vae.channels == 4 else "RGB"  # an RGBA model is primed with the image's alpha too
    image = image_transform(vae.image_size, train=False)(Image.open(cfg.img).convert(mode))[None].to(device)
    n = cfg.num_init_img_tokens or image_seq_len // 4
    if not 0 < n < image_seq_len:
        raise ValueError(f"--num_init_img_tokens must be between 1 and {image_seq_len - 1} (got {n})")
    return vae.get_codebook_indices(image)[:, :n]


def write_folder(folder: str, images: torch.Tensor, settings: dict) -> None:
    """0000.png ... (best first where ranked), grid.png and settings.json in `folder`."""
    from torchvision.utils import save_image

    images = images.cpu()  # every channel: an RGBA model's PNGs keep their alpha
    for i, img in enumerate(images):
        save_image(img, os.path.join(folder, f"{i:04d}.png"))
    save_image(images, os.path.join(folder, "grid.png"), nrow=min(len(images), 8), padding=1)
    with open(os.path.join(folder, "settings.json"), "w") as f:
        json.dump(settings, f, indent=2)


def generate(cfg: GenerateConfig, sampling: SamplingConfig, rerank: RerankConfig, old: PredecessorFiles) -> list[str]:
    """The prompt folders written, one per prompt."""
    from tqdm import tqdm

    from ..models.sampling import generate_text_tokens

    prompts = read_prompts(cfg)
    if rerank.keep and not rerank.clip_path:
        raise ValueError("--keep ranks the images with CLIP: give --clip_path clip.pt (train_clip.py writes one)")
    if rerank.keep < 0 or rerank.keep > cfg.num_images:
        raise ValueError(f"--keep must be between 0 and --num_images {cfg.num_images} (got {rerank.keep})")
    device = pick_device(cfg.device)
    dalle, vae, tokenizer = load_dalle(
        cfg.dalle_path,
        device,
        cfg.vqgan_model_path,
        cfg.openai_vae_path,
        old.how_to_read(),
        sampling.weights,
        sampling.text_encoder_path,
    )
    dcfg = dalle.cfg
    options = sampling.token_options(dalle)
    clip = None
    if rerank.clip_path:
        clip, clip_tokenizer = load_reranker(rerank.clip_path, cfg.dalle_path, dalle, vae, tokenizer, device)
    prime = _prime(cfg, vae, dcfg.image_seq_len, device)
    options.update(
        prime=prime,
        use_cache=not cfg.no_cache,
        compile="reduce-overhead" if cfg.compile and cfg.cuda_graphs else cfg.compile,
    )

    g = torch.Generator(device).manual_seed(cfg.seed)
    total_tokens = len(prompts) * cfg.num_images * (dcfg.image_seq_len - (0 if prime is None else prime.shape[1]))
    bar = tqdm(total=total_tokens, unit="tok", disable=cfg.quiet)
    written = []
    shown = {**dataclasses.asdict(cfg), **dataclasses.asdict(sampling), **dataclasses.asdict(rerank)}
    shown.update(dataclasses.asdict(old))
    settings = {k: v for k, v in shown.items() if k not in ("text", "text_file", "quiet", "debug")}
    for prompt in prompts:
        text, truncated = tokenizer.captions(prompt, dcfg.text_seq_len)
        if truncated:
            print(f"warning: prompt truncated to {dcfg.text_seq_len} tokens: {prompt!r}")
        if cfg.gentxt:  # the predecessor's threshold counts text and image logits; at most the text vocabulary
            text_options = sampling.token_options(dalle, dcfg.num_text_tokens, say=lambda _: None)
            for image_only in ("cond_scale", "decoding", "window"):
                text_options.pop(image_only)
            text = generate_text_tokens(dalle, text.to(device), generator=g, **text_options).cpu()
            prompt = tokenizer.decode([i for i in text[0].tolist() if i]) or prompt
            print(f"caption: {prompt}")
        folder = os.path.join(cfg.outputs_dir, sanitize(prompt))
        os.makedirs(folder, exist_ok=True)
        rows = text.to(device).expand(cfg.num_images, *text.shape[1:])
        images = candidate_images(dalle, vae, rows, cfg.batch_size, g, on_token=bar.update, **options)
        written_settings = {"prompt": prompt, **settings}
        if clip is not None:  # DALL-E's reranking: CLIP scores every sample, the best are kept, best first
            order, scores = best_of(clip, clip_tokenizer, prompt, images, rerank.keep, cfg.batch_size)
            images = images[order]
            written_settings["clip_scores"] = [round(v, 5) for v in scores.tolist()]
        write_folder(folder, images, written_settings)
        written.append(folder)
    bar.close()
    for folder in written:
        print(f"images: {folder}/")
    return written
