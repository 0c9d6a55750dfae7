"""DALLE: a decoder-only transformer over [<bos>, caption tokens, image tokens] (Ramesh et al. 2021).

The frozen VAE stays outside this module: the model sees image token ids, the trainer tokenizes images.
Text and image have their own embeddings and output heads, which is the logits mask in structural form:
text positions can only predict text tokens and image positions only image tokens.

A caption reaches the model in one of two forms. Token ids (b, text_seq_len), embedded here and predicted too
(DALL-E's text loss). Or, with a frozen pretrained encoder (--text_encoder; the encoder stays outside as the VAE
does), its features (b, text_seq_len, text_feature_dim) with zero vectors at padding: projected by an MLP into
the caption positions (LlamaGen's CaptionEmbedder), padding never attended to, no text loss. A caption with no
real token at all (a dropped caption, the unconditional row of guidance) reads a learned null caption instead.

LlamaGen's text-to-image layout (`llamagen_layout`, set by reading one of its checkpoints: models/llamagen.py): no
bos (the caption's text_seq_len positions come first, its real tokens last), LlamaGen's 2-D rotary table (zero at
the caption), and a null caption read under the caption's own mask, as LlamaGen trains and samples it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..config import flag
from .layers import FEED_FORWARDS, NORMS, norm_layer
from .transformer import ATTN_TYPES, KVCache, Transformer, attention_mask


@dataclass
class DALLEConfig:
    dim: int = flag(256, "model width")
    depth: int = flag(4, "transformer blocks")
    heads: int = flag(4, "attention heads")
    dim_head: int = flag(64, "width of each attention head")
    ff_mult: int = flag(4, "feed-forward expansion (swiglu: 2/3 of it, as Llama's)")
    norm: str = flag("layernorm", "the blocks' and the output's norm: layernorm (2021) or rmsnorm (Llama)", NORMS)
    ff: str = flag("geglu", "feed-forward: geglu (the reference's) or swiglu (Llama's, no biases)", FEED_FORWARDS)
    ff_multiple_of: int = flag(256, "swiglu's hidden width is rounded up to a multiple of this (Llama, LlamaGen: 256)")
    kv_heads: int = flag(0, "key/value heads: fewer than --heads is grouped-query attention; 0 = --heads")
    attn_dropout: float = flag(0.0, "attention dropout")
    ff_dropout: float = flag(0.0, "feed-forward dropout")
    attn_types: list = flag(["full"], "attention pattern per layer, cycled over depth: " + ", ".join(ATTN_TYPES))
    text_seq_len: int = flag(32, "caption tokens (longer captions are truncated)")
    loss_img_weight: float = flag(7.0, "weight of the image loss against the text loss")
    shift_tokens: bool = flag(False, "token shift: mix in the previous / left / upper token's features")
    rotary_emb: bool = flag(False, "rotary positions (1-D for text, 2-D axial for the image) instead of learned")
    share_input_output_emb: bool = flag(False, "tie each output head to its input embedding")
    stable: bool = flag(False, "CogView-style stabilization: LayerScale branches and max-normalized logits")
    sandwich_norm: bool = flag(False, "normalize each branch output as well as its input")
    qk_norm: bool = flag(False, "LayerNorm on queries and keys per head")
    z_loss_weight: float = flag(0.0, "weight of the z-loss (mean squared log-partition of the logits)")
    null_cond_prob: float = flag(0.0, "probability of dropping the caption in training (enables --cond_scale)")
    shared_attn_ids: list = flag(
        [], "layers with the same id share their attention weights, ids cycled over depth (0 0 1 1, or 0,0,1,1)"
    )
    shared_ff_ids: list = flag([], "layers with the same id share their feed-forward weights (as --shared_attn_ids)")
    # lucidrains' dalle-pytorch 1.6 layout, set by `convert --from_reference` (not a flag): padding at text
    # position i is its own token (the last text_seq_len ids of the text vocabulary), the output heads have a
    # bias, and token shift moves half of a text token's features and a quarter each from above and the left
    reference_layout: bool = False
    # set from the tokenizer and the VAE, not from flags
    num_text_tokens: int = 257
    num_image_tokens: int = 128
    image_fmap_size: int = 8
    # the frozen text encoder's width: captions arrive as features, num_text_tokens is 0 (set by --text_encoder)
    text_feature_dim: int = 0
    # LlamaGen's T2I layout (see the module's docstring; set by reading its checkpoint, not a flag)
    llamagen_layout: bool = False

    def __post_init__(self):
        # `--attn_types full axial_row` or the predecessor's `--attn_types full,axial_row`
        self.attn_types = [t for item in self.attn_types for t in str(item).split(",") if t]
        self.shared_attn_ids = [i for item in self.shared_attn_ids for i in str(item).split(",") if i]
        self.shared_ff_ids = [i for item in self.shared_ff_ids for i in str(item).split(",") if i]
        if not self.attn_types:
            raise ValueError("--attn_types needs at least one type")
        for t in self.attn_types:
            if t not in ATTN_TYPES:
                raise ValueError(f"--attn_types: unknown type {t!r}; use any of {', '.join(ATTN_TYPES)}")
        f, patterns = self.image_fmap_size, sorted(set(self.attn_types) - {"full"})
        full = attention_mask("full", 0, f) if patterns else None  # the image part alone decides the fit
        for t in patterns:
            if torch.equal(attention_mask(t, 0, f), full):
                raise ValueError(
                    f"--attn_types {t} does not fit a {f}x{f} image token grid: it would keep every earlier image "
                    "token, as full does at more cost; use full, or a VAE with more tokens per side"
                )
        for name in ("depth", "heads", "dim_head"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be at least 1 (got {getattr(self, name)})")
        for name, kinds in (("norm", NORMS), ("ff", FEED_FORWARDS)):
            if getattr(self, name) not in kinds:
                raise ValueError(f"--{name}: unknown {getattr(self, name)!r}; use one of {', '.join(kinds)}")
        if self.kv_heads < 0 or (self.kv_heads and self.heads % self.kv_heads):
            raise ValueError(f"--kv_heads must divide --heads {self.heads} (got {self.kv_heads}); 0 means --heads")
        if self.ff_multiple_of < 1:
            raise ValueError(f"--ff_multiple_of must be at least 1 (got {self.ff_multiple_of})")
        if self.dim % 4 or self.dim < 4:
            raise ValueError(f"--dim must be a positive multiple of 4 (got {self.dim})")
        if not 0 <= self.null_cond_prob < 1:
            raise ValueError(f"--null_cond_prob must be in [0, 1) (got {self.null_cond_prob})")
        if self.llamagen_layout and not (self.text_feature_dim and self.rotary_emb and not self.shift_tokens):
            raise ValueError("LlamaGen's layout reads caption features with its rotary positions and no token shift")

    @property
    def image_seq_len(self) -> int:
        return self.image_fmap_size**2

    @property
    def prefix_len(self) -> int:
        """Positions before the first image token: bos + text, or LlamaGen's caption alone."""
        return self.text_seq_len + (0 if self.llamagen_layout else 1)

    @property
    def seq_len(self) -> int:
        """Input positions: bos + text + image - 1 (the last image token is never an input)."""
        return self.prefix_len - 1 + self.image_seq_len

    def to_dict(self) -> dict:
        return asdict(self)


class DivideMax(nn.Module):
    """x / max(x) over the last dim, detached (CogView's PB-relax for the final logits)."""

    def forward(self, x):
        return x / x.amax(dim=-1, keepdim=True).detach().clamp_min(1e-4)


class DALLE(nn.Module):
    def __init__(self, cfg: DALLEConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.dim
        self.bos = None if cfg.llamagen_layout else nn.Parameter(torch.randn(d) * 0.02)
        if cfg.text_feature_dim:  # LlamaGen's CaptionEmbedder: an MLP from the encoder's width, tanh-GELU between
            f = cfg.text_feature_dim
            self.caption_proj = nn.Sequential(nn.Linear(f, d), nn.GELU(approximate="tanh"), nn.Linear(d, d))
            self.null_caption = nn.Parameter(torch.randn(cfg.text_seq_len, d) * 0.02)
            self.text_emb = self.text_head = None
        else:
            self.text_emb = nn.Embedding(cfg.num_text_tokens, d)
        self.image_emb = nn.Embedding(cfg.num_image_tokens, d)
        if not cfg.rotary_emb:
            self.text_pos = nn.Embedding(cfg.text_seq_len + 1, d)
            self.image_row = nn.Embedding(cfg.image_fmap_size, d)
            self.image_col = nn.Embedding(cfg.image_fmap_size, d)
        self.transformer = Transformer(cfg)
        self.norm = norm_layer(cfg.norm, d)
        self.divide_max = DivideMax() if cfg.stable else nn.Identity()
        if not cfg.text_feature_dim:
            self.text_head = nn.Linear(d, cfg.num_text_tokens, bias=cfg.reference_layout)
        self.image_head = nn.Linear(d, cfg.num_image_tokens, bias=cfg.reference_layout)
        if cfg.share_input_output_emb:
            if self.text_head is not None:
                self.text_head.weight = self.text_emb.weight
            self.image_head.weight = self.image_emb.weight
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
            if getattr(m, "bias", None) is not None:
                nn.init.zeros_(m.bias)

    # ------------------------------------------------------------------------------------------ layout
    @property
    def reads_features(self) -> bool:
        """Whether captions arrive as a frozen encoder's features rather than token ids."""
        return bool(self.cfg.text_feature_dim)

    def _check(self, text: torch.Tensor, image: torch.Tensor | None) -> None:
        c = self.cfg
        if self.reads_features:
            want = (c.text_seq_len, c.text_feature_dim)
            if text.dim() != 3 or tuple(text.shape[1:]) != want or not text.is_floating_point():
                raise ValueError(f"text must be (b, {want[0]}, {want[1]}) caption features, got {tuple(text.shape)}")
        elif text.dim() != 2 or text.shape[1] != c.text_seq_len:
            raise ValueError(f"text must be (b, {c.text_seq_len}) token ids, got {tuple(text.shape)}")
        if image is not None and (image.dim() != 2 or image.shape[1] > c.image_seq_len):
            raise ValueError(f"image must be (b, <= {c.image_seq_len}) token ids, got {tuple(image.shape)}")

    def _embed_image(self, tokens: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Image tokens (b, k) at image indices idx (k,) -> (b, k, dim), with their row and column positions."""
        x = self.image_emb(tokens)
        if not self.cfg.rotary_emb:
            f = self.cfg.image_fmap_size
            x = x + self.image_row(idx // f) + self.image_col(idx % f)
        return x

    def placed(self, text: torch.Tensor) -> torch.Tensor:
        """Caption features (b, T, F) with their real tokens first, as the data gives them, moved to where the
        layout reads them: LlamaGen's puts them last, after the padding."""
        if not self.cfg.llamagen_layout:
            return text
        t = text.shape[1]
        pad = t - (text != 0).any(-1).sum(1, keepdim=True)  # (b, 1)
        source = (torch.arange(t, device=text.device) - pad) % t  # position j reads real token j - pad
        return text.gather(1, source[..., None].expand_as(text))

    def caption_keys(self, text: torch.Tensor, null: torch.Tensor | None = None) -> torch.Tensor | None:
        """(b, prefix_len) which of [bos, caption] may be attended to: a features caption's real tokens, or all
        of a null caption's (LlamaGen's layout: only at the caption's real tokens, unless it has none); None for
        token ids (their padding is a token the model reads, as in DALL-E). `text` as `placed` gives it."""
        if not self.reads_features:
            return None
        real = (text != 0).any(-1)  # (b, T): padding is the zero vector
        if null is not None and not self.cfg.llamagen_layout:
            real = real | null[:, None]
        real = real | ~real.any(-1, keepdim=True)  # no real token: the learned null caption, read whole
        if self.bos is None:
            return real
        return torch.cat([real.new_ones(real.shape[0], 1), real], dim=1)

    def _caption(self, text: torch.Tensor, null: torch.Tensor | None = None) -> torch.Tensor:
        """(b, T) ids or (b, T, F) features (`placed`) -> (b, T, dim); rows where `null` read the null caption."""
        if not self.reads_features:
            return self.text_emb(self._padded(text) if self.cfg.reference_layout else text)
        dtype = self.caption_proj[0].weight.dtype
        has_caption = (text != 0).any(-1).any(-1)  # (b,)
        if null is not None:
            has_caption = has_caption & ~null
        projected = self.caption_proj(text.to(dtype))
        return torch.where(has_caption[:, None, None], projected, self.null_caption.to(projected.dtype))

    def embed(self, text: torch.Tensor, image: torch.Tensor | None, null: torch.Tensor | None = None) -> torch.Tensor:
        """Embeddings of the input positions [bos, text, image tokens given]: (b, prefix_len + k, dim). `text` as
        `placed` gives it."""
        b, c = text.shape[0], self.cfg
        x = self._caption(text, null)
        if self.bos is not None:
            x = torch.cat([self.bos.to(x.dtype).expand(b, 1, -1), x], dim=1)  # (b, T+1, d)
        if not c.rotary_emb:
            x = x + self.text_pos.weight
        if image is not None and image.shape[1]:
            x = torch.cat([x, self._embed_image(image, torch.arange(image.shape[1], device=image.device))], dim=1)
        return x

    def _padded(self, text: torch.Tensor) -> torch.Tensor:
        """Reference layout: padding (0) at position i becomes the id reserved for padding there."""
        c = self.cfg
        pad_ids = torch.arange(c.num_text_tokens - c.text_seq_len, c.num_text_tokens, device=text.device)
        return torch.where(text == 0, pad_ids, text)

    def _final(self, h: torch.Tensor) -> torch.Tensor:
        return self.divide_max(self.norm(h))

    def _hidden(self, text, image, cache: KVCache | None = None, null: torch.Tensor | None = None) -> torch.Tensor:
        """`null` (b,) bool: rows that read the null caption instead of theirs (a dropped caption, guidance's
        unconditional row): for token ids, all padding."""
        if null is not None and not self.reads_features:
            text, null = torch.where(null[:, None], 0, text), None
        text = self.placed(text) if self.reads_features else text
        return self._final(self.transformer(self.embed(text, image, null), cache, self.caption_keys(text, null)))

    def logits(self, text: torch.Tensor, image: torch.Tensor, null: torch.Tensor | None = None) -> torch.Tensor:
        """(b, seq_len, num_text_tokens + num_image_tokens), -inf where a position may not predict a token."""
        self._check(text, image)
        h = self._hidden(text, image[:, :-1], None, null)
        c = self.cfg
        t, i = c.prefix_len - 1, c.num_text_tokens
        out = torch.full((*h.shape[:2], i + c.num_image_tokens), float("-inf"), device=h.device, dtype=h.dtype)
        if self.text_head is not None:  # a features caption has no vocabulary: its positions predict nothing
            out[:, :t, :i] = self.text_head(h[:, :t])
        out[:, t:, i:] = self.image_head(h[:, t:])
        return out

    def text_logits(self, text: torch.Tensor) -> torch.Tensor:
        """(b, text_seq_len, num_text_tokens): at position p the logits of text token p given tokens < p (the
        caption half alone; causal attention, so the tokens after p do not matter)."""
        self._no_features("predicting caption tokens (--gentxt)")
        self._check(text, None)
        return self.text_head(self._hidden(text, None)[:, : self.cfg.text_seq_len]).float()

    def _no_features(self, what: str) -> None:
        if self.reads_features:
            raise ValueError(
                f"{what} needs a DALLE that reads caption tokens: this one reads a frozen text encoder's "
                "features and predicts no caption (train with --tokenizer and no --text_encoder for it)"
            )

    def is_padding(self, ids: torch.Tensor) -> torch.Tensor:
        """Which text ids mean padding: 0, and with the reference layout the padding id of every position."""
        c = self.cfg
        pad = ids == 0
        return pad | (ids >= c.num_text_tokens - c.text_seq_len) if c.reference_layout else pad

    # ------------------------------------------------------------------------------------------ training
    def forward(self, text: torch.Tensor, image: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """The training loss (weighted text + image cross-entropy) and metrics; `forward` so wrappers see it."""
        self._check(text, image)
        c = self.cfg
        null = None
        if self.training and c.null_cond_prob > 0:  # caption dropout for classifier-free guidance
            null = torch.rand(text.shape[0], device=text.device) < c.null_cond_prob
        h = self._hidden(text, image[:, :-1], None, null)  # (b, prefix + I - 1, d)
        image_logits = self.image_head(h[:, c.prefix_len - 1 :]).float()  # prefix - 1 + k predicts image token k
        if self.reads_features:  # nothing to predict in the caption: the image loss alone
            image_loss = F.cross_entropy(image_logits.transpose(1, 2), image)
            return self._with_z_loss(image_loss, {"image_loss": image_loss.detach()}, [image_logits])
        text_logits = self.text_head(h[:, : c.text_seq_len]).float()  # position p predicts text token p
        if c.reference_layout:  # the predecessor's: every position, padding as its own per-position token
            text_loss = F.cross_entropy(text_logits.transpose(1, 2), self._padded(text))
        else:  # padding (id 0) gets no loss; an all-padding caption contributes nothing to the text loss
            text_loss = F.cross_entropy(text_logits.transpose(1, 2), text, ignore_index=0, reduction="sum")
            text_loss = text_loss / (text != 0).sum().clamp_min(1)
        image_loss = F.cross_entropy(image_logits.transpose(1, 2), image)
        loss = (text_loss + c.loss_img_weight * image_loss) / (c.loss_img_weight + 1)
        metrics = {"text_loss": text_loss.detach(), "image_loss": image_loss.detach()}
        return self._with_z_loss(loss, metrics, [text_logits, image_logits])

    def _with_z_loss(self, loss: torch.Tensor, metrics: dict, logits: list) -> tuple[torch.Tensor, dict]:
        if self.cfg.z_loss_weight > 0:  # PaLM's z-loss keeps the log-partition near 0
            z_loss = torch.cat([x.logsumexp(-1).flatten() for x in logits]).pow(2).mean()
            loss = loss + self.cfg.z_loss_weight * z_loss
            metrics["z_loss"] = z_loss.detach()
        return loss, metrics

    # ------------------------------------------------------------------------------------------ decoding
    def new_cache(self, batch: int, device, dtype=torch.float32, extra: int = 0) -> KVCache:
        """`extra` spare positions past the sequence: where a speculative window's overhang writes (window_step)."""
        c = self.cfg
        kv = c.kv_heads or c.heads
        return KVCache(batch, c.seq_len + extra, c.depth, kv, c.dim_head, c.dim, device, dtype, c.shift_tokens)

    def prefill(
        self,
        text: torch.Tensor,
        cache: KVCache,
        image_prime: torch.Tensor | None = None,
        null: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the caption (and any priming image tokens (b, k)) through the model, filling the cache's
        positions 0..prefix+k-1; logits for the next image token (b, num_image_tokens). `null` as in _hidden."""
        self._check(text, image_prime)
        h = self._hidden(text, image_prime, cache, null)
        return self.image_head(h[:, -1]).float()

    def decode_step(self, token: torch.Tensor, pos: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """The newest image token (b,) at input position `pos` (a 0-dim long tensor, after prefill filled
        positions 0..pos-1) -> logits for the next image token (b, num_image_tokens). The one decode path,
        eager and compiled: no shape depends on the position, so torch.compile builds one graph for every
        step. Attention reads the whole static cache with later keys masked (measured on CPU: ~10% slower
        per step in eager mode than attending over a slice of the filled keys)."""
        idx = (pos - self.cfg.prefix_len).view(1)  # the token's index in the image
        h = self._final(self.transformer.decode(self._embed_image(token[:, None], idx), pos, cache))
        return self.image_head(h[:, -1]).float()

    def window_step(self, tokens: torch.Tensor, start: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Image tokens (b, w), row r's at image indices start[r] .. start[r] + w - 1 (each row its own, after
        prefill and earlier windows filled the cache before them) -> logits (b, w, num_image_tokens): at column j,
        those of image token start[r] + j + 1. Indices past the image write into the cache's spare rows
        (new_cache's `extra`) and their logits mean nothing. Speculative decoding's pass (models/sjd.py)."""
        if self.cfg.shift_tokens:
            raise ValueError(
                "--decoding sjd does not support --shift_tokens models (the shift reads one position's "
                "neighbours): use --decoding sequential"
            )
        idx = start[:, None] + torch.arange(tokens.shape[1], device=tokens.device)  # (b, w)
        x = self._embed_image(tokens, idx.clamp(max=self.cfg.image_seq_len - 1))
        h = self._final(self.transformer.window(x, self.cfg.prefix_len + idx, cache))
        return self.image_head(h).float()
