"""Training CLIP as a loop task: (image, caption ids) pairs, the contrastive loss over every rank's pairs
(through the gather function the trainer passes), a retrieval table for fixed pairs, and the export."""

from __future__ import annotations

import torch

from ..data.stream import is_stream
from ..data.tokenizer import Tokenizer
from ..inference.export import save_export
from ..models.clip import CLIP


class CLIPTask:
    name = "clip"

    def __init__(
        self, clip: CLIP, tokenizer: Tokenizer, dataset, export_path: str, gather, num_fixed: int = 16, val_dataset=None
    ):
        """`dataset` yields (image, caption ids) (data.tokenized); `gather(x) -> (every rank's x, offset)`."""
        self.model = clip
        self.tokenizer = tokenizer
        self.dataset = dataset
        self.val_dataset = val_dataset  # held-out (image, caption ids), or None: no validation
        self.export_path = export_path
        self.gather = gather
        grid = clip.cfg.image_size // clip.cfg.patch_size
        self.tokens_per_sample = clip.cfg.text_seq_len + grid * grid
        if is_stream(dataset):
            self._fixed = None  # a stream has no fixed pairs to draw
        else:
            pairs = [dataset[i] for i in range(min(num_fixed, len(dataset)))]
            self._fixed = (torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]))

    def activation_bytes(self, batch_size: int) -> float:
        """~34 x tokens x width bytes per layer in 16-bit, doubled for fp32 (as for DALLE), both encoders."""
        c = self.model.cfg
        grid = c.image_size // c.patch_size
        return 68 * batch_size * (c.text_depth * c.text_seq_len * c.dim_text + c.image_depth * grid**2 * c.dim_image)

    def prepare_batch(self, batch, device):
        images, text = batch
        return text.to(device, non_blocking=True), images.to(device, non_blocking=True).float()

    def loss(self, model, batch, step):
        text, images = batch
        return model(text, images, self.gather)

    def window_metrics(self) -> dict:
        return {}

    def val_scores(self, whole_model, rank, world_size) -> dict:
        return {}

    @torch.no_grad()
    def write_samples(self, model, step, path):
        """For fixed training pairs: which image each caption retrieves among them (a text file)."""
        if self._fixed is None or path is None:
            return
        device = next(model.parameters()).device
        images, text = (t.to(device) for t in self._fixed)
        sims = model.embed_text(text) @ model.embed_image(images.float()).T  # (n, n)
        best = sims.argmax(-1).tolist()
        lines = [
            f"{'ok ' if b == i else 'BAD'} {i:2d} -> {b:2d}  {self.tokenizer.decode(text[i].tolist())}"
            for i, b in enumerate(best)
        ]
        accuracy = sum(b == i for i, b in enumerate(best)) / len(best)
        with open(path.rsplit(".", 1)[0] + ".txt", "w") as f:
            f.write(f"step {step}: text -> image retrieval among {len(best)} pairs {accuracy:.0%}\n" + "\n".join(lines))

    def export(self, weights, ema=None):
        save_export(
            self.export_path, "clip", self.model.cfg.to_dict(), weights, ema=ema, tokenizer=self.tokenizer.to_dict()
        )
