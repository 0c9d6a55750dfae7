"""Training DALLE as a loop task: captions tokenized in the data workers, images tokenized by the frozen
VAE once per batch under no_grad in fp32, sample grids for fixed captions, and the self-contained export."""

from __future__ import annotations

import multiprocessing

import torch
from torchvision.utils import save_image

from .checkpoints import load_export, save_export
from .dalle import DALLE, DALLEConfig
from .sampling import generate_image_tokens
from .tokenizer import Tokenizer, tokenizer_from_dict
from .vae_task import vae_from_export


class TokenizedCaptions(torch.utils.data.Dataset):
    """(image, caption) -> (image, caption ids (text_seq_len,)); counts truncated captions across workers."""

    def __init__(self, base, tokenizer: Tokenizer, text_seq_len: int, truncate: bool):
        self.base, self.tokenizer, self.text_seq_len, self.truncate = base, tokenizer, text_seq_len, truncate
        self.truncated = multiprocessing.get_context("fork").Value("i", 0)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index):
        return self.tokenize(*self.base[index])

    def tokenize(self, image, caption: str):
        ids, cut = self.tokenizer.tokenize(caption, self.text_seq_len, self.truncate)
        if cut:
            with self.truncated.get_lock():
                self.truncated.value += cut
        return image, ids[0]


class TokenizedStream(torch.utils.data.IterableDataset):
    """The streamed (WebDataset) counterpart of TokenizedCaptions."""

    def __init__(self, base, tokenizer: Tokenizer, text_seq_len: int, truncate: bool):
        self.base = base
        self.tok = TokenizedCaptions([], tokenizer, text_seq_len, truncate)
        self.truncated = self.tok.truncated

    def set_epoch(self, epoch: int) -> None:
        self.base.set_epoch(epoch)

    def __iter__(self):
        for image, caption in self.base:
            yield self.tok.tokenize(image, caption)


class PrecomputedTokens(torch.utils.data.Dataset):
    """(image token ids, caption ids) of every sample, from one VAE pass over the data before training.

    Training then skips image decoding, augmentation and the VAE; the price is a fixed crop per image and
    one caption line per image, drawn once."""

    def __init__(self, image_tokens: torch.Tensor, text: torch.Tensor, truncated: int = 0):
        self.image_tokens, self.text = image_tokens, text
        self.truncated = multiprocessing.get_context("fork").Value("i", truncated)

    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, index):
        return self.image_tokens[index], self.text[index]


@torch.no_grad()
def precompute_tokens(
    dataset: TokenizedCaptions, vae, batch_size: int = 256, num_workers: int = 0
) -> PrecomputedTokens:
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=num_workers)
    device = next(vae.parameters()).device
    images, texts = [], []
    for image, text in loader:
        images.append(vae.get_codebook_indices(image.to(device).float()).cpu())
        texts.append(text)
    return PrecomputedTokens(torch.cat(images), torch.cat(texts), dataset.truncated.value)


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
    ):
        self.model = dalle
        self.vae = vae  # frozen, fp32, outside the optimizer and the backend's wrapping
        self.vae_export = vae_export
        self.tokenizer = tokenizer
        wrap = TokenizedStream if isinstance(dataset, torch.utils.data.IterableDataset) else TokenizedCaptions
        self.dataset = wrap(dataset, tokenizer, dalle.cfg.text_seq_len, truncate=True)
        self.export_path = export_path
        self.tokens_per_sample = dalle.cfg.seq_len  # transformer positions per sample, for tokens/s
        self.sample_captions = sample_captions
        self.seed = seed

    def activation_bytes(self, batch_size: int) -> float:
        """Activation memory of one micro-batch: ~34 x tokens x dim bytes per layer in 16-bit (Korthikanti
        et al. 2022, without recomputation), doubled for fp32, plus the attention scores."""
        c = self.model.cfg
        tokens = batch_size * c.seq_len
        return c.depth * (68 * tokens * c.dim + 4 * batch_size * c.heads * c.seq_len**2)

    def prepare_batch(self, batch, device):
        images, text = batch
        images = images.to(device, non_blocking=True)
        if images.dtype == torch.long:  # --precompute_tokens: already VAE codes
            return text.to(device, non_blocking=True), images
        if next(self.vae.parameters()).device != device:
            self.vae.to(device)
        with torch.no_grad():
            image_tokens = self.vae.get_codebook_indices(images.float())  # (b, fmap^2), VAE in fp32
        return text.to(device, non_blocking=True), image_tokens

    def loss(self, model, batch, step):
        text, image_tokens = batch
        return model(text, image_tokens)

    def window_metrics(self) -> dict:
        return {"truncated_captions": self.dataset.truncated.value}

    @torch.no_grad()
    def write_samples(self, model, step, path):
        if not self.sample_captions:
            return
        device = next(model.parameters()).device
        text, _ = self.tokenizer.tokenize(self.sample_captions, model.cfg.text_seq_len)
        g = torch.Generator(device).manual_seed(self.seed)
        tokens = generate_image_tokens(model, text.to(device), generator=g)
        if path is None:
            return
        save_image(self.vae.decode(tokens)[:, :3].cpu(), path, nrow=len(self.sample_captions), padding=1)
        with open(path.rsplit(".", 1)[0] + ".txt", "w") as f:
            f.write("\n".join(self.sample_captions) + "\n")

    def export(self, weights, path):
        save_export(
            path, "dalle", self.model.cfg.to_dict(), weights, vae=self.vae_export, tokenizer=self.tokenizer.to_dict()
        )


def load_dalle(path: str, device="cpu", vqgan_model_path: str = "", openai_vae_path: str = ""):
    """(dalle, vae, tokenizer) from a DALLE export, in eval mode on `device`. A pretrained image tokenizer is
    read again from the files the export records, or from the given paths if they moved."""
    obj = load_export(path, "dalle")
    dalle = DALLE(DALLEConfig(**obj["config"]))
    dalle.load_state_dict(obj["weights"])
    if obj["vae"]["kind"] == "vae":  # our own VAE, stored in the export
        if vqgan_model_path or openai_vae_path:
            raise ValueError(f"{path} holds its own VAE: --vqgan_model_path and --openai_vae_path do not apply")
        vae = vae_from_export(obj["vae"])
    else:
        from .pretrained import tokenizer_from_record

        vae = tokenizer_from_record(obj["vae"], vqgan_model_path, openai_vae_path)
    return dalle.eval().to(device), vae.to(device), tokenizer_from_dict(obj["tokenizer"])
