"""Training DALLE as a loop task: captions tokenized in the data workers, images tokenized by the frozen
VAE once per batch under no_grad in fp32, captions read by a frozen text encoder the same way (--text_encoder;
or its features come cached in the token shards), sample grids for fixed captions, and the self-contained export."""

from __future__ import annotations

import torch
from torchvision.utils import save_image

from ..data.shapes import ShapesDataset
from ..data.tokenizer import Tokenizer
from ..eval.on_data import clip_score, clip_scores
from ..eval.parse import ATTRIBUTES, parse_image, score
from ..inference.export import save_export
from ..models.dalle import DALLE
from ..models.sampling import generate_image_tokens

HELDOUT_TEMPERATURE = 0.3  # the demo's and the README's sampling: sharper than the model, fewer malformed shapes


class DALLETask:
    name = "dalle"

    def __init__(
        self,
        dalle: DALLE,
        vae,
        vae_export: dict,
        tokenizer: Tokenizer,
        dataset,
        export_path: str,
        sample_captions: list[str],
        seed: int = 0,
        val_dataset=None,
        heldout: ShapesDataset | None = None,
        clip=None,
        text_encoder=None,
        decoding: dict | None = None,
    ):
        """`dataset` yields (image, caption ids) (data.tokenized) or (image token ids, caption ids) precomputed;
        `heldout`: built-in scenes of colour-shape pairs never trained on, generated and parsed at validation;
        `clip`: a CLIP with this run's tokenizer that scores --val_fid_every's images (--val_clip_path);
        `text_encoder`: the frozen encoder (inference/text_encoders.py) whose features the DALLE reads;
        `decoding`: generate_image_tokens' decoding and window for --val_fid_every's images."""
        self.model = dalle
        self.decoding = decoding or {}
        self.vae = vae  # frozen, fp32, outside the optimizer and the backend's wrapping
        self.vae_export = vae_export
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.val_dataset = val_dataset  # held-out (image, caption ids), or None: no validation
        self.export_path = export_path
        self.tokens_per_sample = dalle.cfg.seq_len
        self.sample_captions = sample_captions
        self.seed = seed
        self.heldout = heldout
        self.clip = clip
        self.text_encoder = text_encoder  # frozen, outside the optimizer and the backend's wrapping, as the VAE

    def captions(self, text: torch.Tensor, device) -> torch.Tensor:
        """The DALLE's caption input on `device`: the ids, or the encoder's features of them; features read from
        token shards (float already) pass as they are."""
        if self.text_encoder is not None and not text.is_floating_point():
            text = self.text_encoder.features(text)
        return text.to(device, non_blocking=True)

    def activation_bytes(self, batch_size: int) -> float:
        """~34 x tokens x dim bytes per layer in 16-bit (Korthikanti et al. 2022, without recomputation),
        doubled for fp32, plus the attention scores."""
        c = self.model.cfg
        tokens = batch_size * c.seq_len
        return c.depth * (68 * tokens * c.dim + 4 * batch_size * c.heads * c.seq_len**2)

    def prepare_batch(self, batch, device):
        images, text = batch
        images = images.to(device, non_blocking=True)
        if images.dtype == torch.long:  # --precompute_tokens: already VAE codes
            return self.captions(text, device), images
        if next(self.vae.parameters()).device != device:
            self.vae.to(device)
        with torch.no_grad():
            image_tokens = self.vae.get_codebook_indices(images.float())  # (b, fmap^2), VAE in fp32
        return self.captions(text, device), image_tokens

    def loss(self, model, batch, step):
        text, image_tokens = batch
        return model(text, image_tokens)

    def window_metrics(self) -> dict:
        return {"truncated_captions": self.dataset.truncated.value}

    @torch.no_grad()
    def val_scores(self, whole_model, rank, world_size) -> dict:
        """The built-in data's held-out captions (this rank's equal share), generated and read back by the
        parser: the fraction fully right (heldout_full) and right in each attribute. The same captions and
        seed every time, so the curve moves with the model only."""
        if self.heldout is None:
            return {}
        share = range(rank, len(self.heldout) // world_size * world_size, world_size)
        with whole_model() as model:
            device = next(model.parameters()).device
            text, _ = self.tokenizer.tokenize([self.heldout.caption(i) for i in share], model.cfg.text_seq_len)
            g = torch.Generator(device).manual_seed(self.seed)
            text = self.captions(text, device)
            tokens = generate_image_tokens(model, text, temperature=HELDOUT_TEMPERATURE, generator=g)
        images = self.vae.decode(tokens).float().cpu()
        scores = [score(self.heldout.scene(i), parse_image(image)) for i, image in zip(share, images)]
        return {f"heldout_{k}": torch.tensor(sum(s[k] for s in scores) / len(scores)) for k in ("full", *ATTRIBUTES)}

    def fid_reference(self, indices):
        images = torch.stack([self.val_dataset[i][0] for i in indices])
        if images.dtype == torch.long:  # --precompute_tokens: the VAE's decoding of the stored codes
            with torch.no_grad():
                images = self.vae.cpu().decode(images).float()
        return images.clamp(0, 1)

    @torch.no_grad()
    def fid_images(self, whole_model, indices, seed):
        with whole_model() as model:  # every rank enters it, one with no share too (more ranks than images)
            if not indices:
                return torch.zeros(0)
            text = torch.stack([self.val_dataset[i][1] for i in indices])
            device = next(model.parameters()).device
            g = torch.Generator(device).manual_seed(seed)
            tokens = generate_image_tokens(model, self.captions(text, device), generator=g, **self.decoding)
        return self.vae.decode(tokens).float().clamp(0, 1).cpu()

    @torch.no_grad()
    def fid_scores(self, indices, images) -> dict:
        """Sums over `images` (fid_images of `indices`) of per-image scores: the CLIP score with its caption."""
        if self.clip is None:
            return {}
        if not indices:
            return {"val_clip_score": 0.0}
        device = next(self.vae.parameters()).device
        clip = self.clip.to(device)
        if getattr(clip, "pretrained", False):  # a published CLIP reads the caption as the DALLE read it, in words
            captions = [self.tokenizer.decode(self.val_dataset[i][1].tolist()) for i in indices]
            return {"val_clip_score": clip_scores(clip, clip.tokenizer, captions, images.to(device)).sum().item()}
        text = torch.stack([self.val_dataset[i][1] for i in indices]).to(device)
        n = clip.cfg.text_seq_len  # the same tokenizer (checked), perhaps another caption length
        text = torch.nn.functional.pad(text, (0, max(n - text.shape[1], 0)))[:, :n]
        return {"val_clip_score": clip_score(clip, text, images.to(device)).sum().item()}

    @torch.no_grad()
    def write_samples(self, model, step, path):
        if not self.sample_captions:
            return
        device = next(model.parameters()).device
        text, _ = self.tokenizer.tokenize(self.sample_captions, model.cfg.text_seq_len)
        g = torch.Generator(device).manual_seed(self.seed)
        tokens = generate_image_tokens(model, self.captions(text, device), generator=g)
        if path is None:
            return
        # all channels: a 4-channel (RGBA) VAE's grid keeps its alpha
        save_image(self.vae.decode(tokens).cpu(), path, nrow=len(self.sample_captions), padding=1)
        with open(path.rsplit(".", 1)[0] + ".txt", "w") as f:
            f.write("\n".join(self.sample_captions) + "\n")

    def export(self, weights, ema=None):
        save_export(
            self.export_path,
            "dalle",
            self.model.cfg.to_dict(),
            weights,
            ema=ema,
            vae=self.vae_export,
            tokenizer=self.tokenizer.to_dict(),
        )
