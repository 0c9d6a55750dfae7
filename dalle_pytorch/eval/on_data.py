"""Image quality on your own data: a DALLE's images for the captions of validation pairs, or a tokenizer's
reconstructions of their images, scored against those images by torch-fidelity (fidelity.py), and with a CLIP.

    python -m dalle_pytorch.eval --dalle_path RUN/dalle.safetensors --image_text_folder VAL [--wds jpg,txt]
        --num_images N [--clip_path clip.safetensors --candidates K] --out DIR
    python -m dalle_pytorch.eval --vae_path vae.safetensors --image_text_folder VAL --num_images N --out DIR

Under torchrun (or srun, one task per process, with MASTER_ADDR and MASTER_PORT set) every rank generates its
share of the captions, batch by batch, each batch seeded from --seed and its number, so the images are the same at
any world size; rank 0 scores them.

DIR/reference/ holds VAL's first N images at the model's resolution (resized and centre-cropped as training reads
them), exactly the PNGs the feature extractor reads; DIR/generated/ the images scored (the first sample per caption);
with a CLIP and --candidates K > 1 also DIR/generated_reranked/ (the one of K samples CLIP scores highest, DALL-E's
reranking); for a tokenizer DIR/reconstructed/. Each is written into a temporary folder and moved into place
when whole.
"""

from __future__ import annotations

import itertools
import math
import os
import shutil
import tempfile
import warnings

import torch
from torchvision.utils import save_image

from ..config import pick
from ..data.build import DataSpec, build_dataset
from ..data.stream import is_stream
from ..inference.image_tokenizers import ImageTokenizerConfig, load_image_tokenizer
from ..inference.load import load_dalle, pick_device
from ..inference.pipeline import best_of, candidate_images, load_reranker
from ..models.vae import codebook_stats
from .fidelity import MIN_IMAGES, fidelity_metrics, settings


def validation_pairs(folder: str, wds: str, image_size: int, n: int, captions: bool = True) -> list:
    """The first `n` (image (3, s, s) in [0, 1], caption) pairs of the validation data, read as training reads it
    (a caption folder, or WebDataset shards whose keys `wds` names), resized and centre-cropped to `image_size`."""
    if n < MIN_IMAGES:
        raise ValueError(f"--num_images must be at least {MIN_IMAGES}: the Inception Score's splits (got {n})")
    data = build_dataset(DataSpec(folder, "--image_text_folder", wds, captions, image_size))
    if is_stream(data):
        data.count(say=warnings.warn)  # a validation set: counted here, no index kept
        pairs = list(itertools.islice((item for item in data if isinstance(item, tuple)), n))
    else:
        pairs = [data[i] for i in range(min(n, len(data)))]
    if len(pairs) < n:
        raise ValueError(f"--image_text_folder {folder}: {len(pairs)} readable pairs, fewer than --num_images {n}")
    return pairs


class Ranks:
    """This process's place among the evaluation's processes: torchrun's or SLURM's variables, or alone. The group is
    torch.distributed's own (Gloo, NCCL on GPUs): the evaluation needs a broadcast, a gather and a barrier."""

    def __init__(self):
        env = os.environ
        if "WORLD_SIZE" in env:  # torchrun
            self.rank, self.world, self.local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"])
        elif int(env.get("SLURM_NTASKS", "1")) > 1:  # srun
            self.rank, self.world = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
            self.local = int(env.get("SLURM_LOCALID", "0"))
            if not (env.get("MASTER_ADDR") and env.get("MASTER_PORT")):
                raise ValueError("under srun, export MASTER_ADDR (the first node) and MASTER_PORT for the evaluation")
        else:
            self.rank, self.world, self.local = 0, 1, 0
        self.device = pick_device(f"cuda:{self.local}" if torch.cuda.is_available() else "cpu")
        if self.world > 1:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)  # NCCL's object collectives use the current device
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            torch.distributed.init_process_group(backend, rank=self.rank, world_size=self.world)

    def share(self, value):
        """Rank 0's `value` on every rank."""
        if self.world == 1:
            return value
        box = [value]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value) -> list:
        if self.world == 1:
            return [value]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, value)
        return out

    def close(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()


class Folders:
    """The result folders under `out`, written into a temporary folder beside them (made by rank 0, shared) and moved
    into place by `keep()` once everything is written: a run that stops midway leaves the previous results whole."""

    def __init__(self, out: str, *names: str, ranks: Ranks | None = None):
        tmp = None
        if ranks is None or ranks.rank == 0:
            os.makedirs(out, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".partial-", dir=out)
            for name in names:
                os.makedirs(os.path.join(tmp, name))
        self.out = out
        self.tmp = tmp if ranks is None else ranks.share(tmp)
        self.paths = {name: os.path.join(self.tmp, name) for name in names}

    def write(self, name: str, images: torch.Tensor, start: int) -> None:
        for i, image in enumerate(images):
            save_image(image, os.path.join(self.paths[name], f"{start + i:06d}.png"))

    def keep(self) -> None:
        for name, path in self.paths.items():
            final = os.path.join(self.out, name)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(path, final)
            self.paths[name] = final
        shutil.rmtree(self.tmp)

    def drop(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


@torch.no_grad()
def clip_scores(clip, tokenizer, captions: list[str], images: torch.Tensor) -> torch.Tensor:
    """CLIP score of each image with its caption (a string)."""
    text, _ = tokenizer.tokenize(captions, clip.cfg.text_seq_len)
    return clip_score(clip, text.to(images.device), images)


def describe_clip(clip, path: str) -> dict:
    """Which CLIP scored, for results.json: a published one by its open_clip name, ours by its export."""
    if hasattr(clip, "describe"):
        return clip.describe()
    return {"kind": "train_clip.py", "path": os.path.abspath(path)}


@torch.no_grad()
def clip_score(clip, text: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """CLIP score of each image with its caption's token ids: 100 x max(cosine similarity, 0) of their embeddings,
    as torchmetrics' CLIPScore (Hessel et al. 2021 weigh it by 2.5 instead)."""
    cos = (clip.embed_text(text) * clip.embed_image(images.float())).sum(-1)
    return 100 * cos.clamp_min(0)


@torch.no_grad()
def evaluate_dalle_on_data(cfg, sampling, rerank, fidelity, batch_size: int = 32) -> dict | None:
    """Generated images for VAL's captions against VAL's images: FID, KID, IS, precision/recall, and with a CLIP
    the CLIP score, of the first sample per caption and (--candidates > 1) of CLIP's best of them. Under several
    processes every rank generates its share and rank 0 scores (the others return None)."""
    ranks = Ranks()
    try:
        return _dalle_on_data(cfg, sampling, rerank, fidelity, batch_size, ranks)
    finally:
        ranks.close()


def _dalle_on_data(cfg, sampling, rerank, fidelity, batch_size: int, ranks: Ranks) -> dict | None:
    device = ranks.device
    dalle, vae, tokenizer = load_dalle(
        cfg.dalle_path, device=device, weights=sampling.weights, text_encoder_path=sampling.text_encoder_path
    )
    clip = None
    if rerank.clip_path:
        clip, clip_tokenizer = load_reranker(rerank.clip_path, cfg.dalle_path, dalle, vae, tokenizer, device)
    per_caption = cfg.candidates if clip is not None else 1
    pairs = validation_pairs(cfg.image_text_folder, cfg.wds, vae.image_size, cfg.num_images)
    captions = [c for _, c in pairs]
    names = ["reference", "generated"] + (["generated_reranked"] if per_caption > 1 else [])
    folders = Folders(cfg.out, *names, ranks=ranks)
    options = sampling.token_options(dalle)
    scores = {name: {} for name in names[1:]}  # batch number -> CLIP scores of its images
    try:
        step = max(batch_size // per_caption, 1)
        for k, start in enumerate(range(0, len(pairs), step)):
            if k % ranks.world != ranks.rank:
                continue
            chunk = captions[start : start + step]
            folders.write("reference", torch.stack([img for img, _ in pairs[start : start + step]]), start)
            text, _ = tokenizer.captions(chunk, dalle.cfg.text_seq_len)
            rows = text.to(device).repeat_interleave(per_caption, 0)
            g = torch.Generator(device).manual_seed(cfg.seed * 1_000_003 + k)  # the batch's images at any world size
            images = candidate_images(dalle, vae, rows, len(rows), g, **options)
            images = images.view(len(chunk), per_caption, *images.shape[1:])  # (captions, samples, c, s, s)
            kept = {"generated": images[:, 0]}
            if per_caption > 1:
                kept["generated_reranked"] = torch.stack(
                    [group[best_of(clip, clip_tokenizer, c, group, 1)[0][0]] for c, group in zip(chunk, images)]
                )
            for name, batch in kept.items():
                folders.write(name, batch, start)
                if clip is not None:
                    scores[name][k] = clip_scores(clip, clip_tokenizer, chunk, batch).cpu()
        gathered = ranks.gather(scores)  # also: every rank has written its share
        if ranks.rank != 0:
            return None
        for name in scores:
            for theirs in gathered:
                scores[name].update(theirs[name])
        result = {"num_images": len(pairs), "sampling": options, "fidelity": settings(fidelity)}
        result.update(fidelity_metrics(folders.paths["generated"], folders.paths["reference"], fidelity, device.type))
        if clip is not None:
            result["clip_score"] = torch.cat(list(scores["generated"].values())).mean().item()
            result["clip"] = describe_clip(clip, rerank.clip_path)
        if per_caption > 1:
            reranked = fidelity_metrics(
                folders.paths["generated_reranked"], folders.paths["reference"], fidelity, device.type
            )
            result["reranked"] = {"candidates": per_caption, **reranked}
            result["reranked"]["clip_score"] = torch.cat(list(scores["generated_reranked"].values())).mean().item()
        folders.keep()
    except BaseException:
        if ranks.rank == 0:
            folders.drop()
        raise
    write_grid(cfg.out, captions, "generated")
    return result


@torch.no_grad()
def evaluate_vae_on_data(cfg, fidelity, batch_size: int = 32) -> dict:
    """A tokenizer's reconstructions of VAL's images against them: reconstruction FID (rFID) and its friends,
    PSNR, SSIM, and how much of the codebook the images use (usage, perplexity)."""
    from torchmetrics.functional.image import structural_similarity_index_measure

    device = pick_device()
    tokenizer = pick(ImageTokenizerConfig, cfg)  # as train_dalle.py reads these flags
    vae = load_image_tokenizer(tokenizer, bool(cfg.image_text_folder))[0].to(device)
    pairs = validation_pairs(cfg.image_text_folder, cfg.wds, vae.image_size, cfg.num_images, captions=False)
    folders = Folders(cfg.out, "reference", "reconstructed")
    mse, ssim, codes = 0.0, 0.0, []
    try:
        for start in range(0, len(pairs), batch_size):
            images = torch.stack([img for img, _ in pairs[start : start + batch_size]]).to(device)
            ids = vae.get_codebook_indices(images)
            recon = vae.decode(ids).clamp(0, 1)
            codes.append(ids.cpu())
            mse += torch.nn.functional.mse_loss(recon, images, reduction="sum").item()
            ssim += structural_similarity_index_measure(recon, images, data_range=1.0, reduction="sum").item()
            folders.write("reference", images, start)
            folders.write("reconstructed", recon, start)
        n = len(pairs)
        mse /= n * pairs[0][0].numel()
        metrics = fidelity_metrics(folders.paths["reconstructed"], folders.paths["reference"], fidelity, device.type)
        folders.keep()
    except BaseException:
        folders.drop()
        raise
    stats = codebook_stats(torch.cat(codes), vae.num_tokens)
    result = {"num_images": n, "fidelity": settings(fidelity), "psnr": -10 * math.log10(max(mse, 1e-10))}
    result.update(ssim=ssim / n, **{k: v.item() for k, v in stats.items()}, **reconstruction_figures(metrics))
    return result


def reconstruction_figures(metrics: dict) -> dict:
    """A tokenizer's figures from fidelity_metrics of its reconstructions: reconstruction FID and KID (rfid, rkid)
    and precision/recall; an Inception Score of reconstructions says nothing."""
    named = {"r" + k if k.startswith(("fid", "kid")) else k: v for k, v in metrics.items()}
    return {k: v for k, v in named.items() if "inception" not in k}


def score_sets(out: str, reference: torch.Tensor, fidelity, **sets: torch.Tensor) -> dict:
    """Writes `reference` and each of `sets` (images in [0, 1]) as folders of PNGs under `out`, whole or not at all,
    and returns each set's FID and friends against the reference: {name: figures}."""
    folders = Folders(out, "reference", *sets)
    try:
        folders.write("reference", reference, 0)
        for name, images in sets.items():
            folders.write(name, images, 0)
        found = {name: fidelity_metrics(folders.paths[name], folders.paths["reference"], fidelity) for name in sets}
        folders.keep()
    except BaseException:
        folders.drop()
        raise
    return found


def write_grid(out: str, captions: list[str], name: str, count: int = 32) -> None:
    """The first images of DIR/`name` in a grid (8 per row), their captions beside it in grid.txt, numbered."""
    from PIL import Image
    from torchvision.transforms.functional import to_tensor

    paths = sorted(os.listdir(os.path.join(out, name)))[:count]
    images = torch.stack([to_tensor(Image.open(os.path.join(out, name, p)).convert("RGB")) for p in paths])
    save_image(images, os.path.join(out, "grid.png"), nrow=8, padding=1)
    with open(os.path.join(out, "grid.txt"), "w") as f:
        f.write("".join(f"{i:3d} {c}\n" for i, c in enumerate(captions[: len(paths)])))
