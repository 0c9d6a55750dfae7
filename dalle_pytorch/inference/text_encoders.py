"""A frozen pretrained text encoder as the DALLE's caption reader (--text_encoder t5|clip): T5's encoder (Parti,
Imagen, LlamaGen's FLAN-T5-XL) or CLIP's text tower, loaded by `transformers` from a folder or the Hugging Face
cache, run without gradients in bf16 or fp16 where the device has it. Its last hidden states at the caption's real
tokens are the DALLE's caption input; padding is the zero vector (models/dalle.py).

Features are float16 whether computed on the fly or read from token shards (the encode command), so that both
give the DALLE the same numbers. A fingerprint of the weights and the tokenizer ties an export to its encoder."""

from __future__ import annotations

import hashlib

import torch

from ..data.encoder_tokenizer import EncoderTokenizer, _transformers, load_hf

FEATURE_DTYPE = torch.float16  # what a caption's features are, cached or not


def _model_class(encoder: str):
    t = _transformers()
    return {"t5": t.T5EncoderModel, "clip": t.CLIPTextModel}[encoder]


def encoder_dtype(device: torch.device, want: str = "auto") -> torch.dtype:
    """bf16 on a CUDA device that has it (T5 overflows in fp16), else fp16 on CUDA; fp32 on the CPU."""
    if want != "auto":
        return getattr(torch, want)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


class FrozenTextEncoder:
    """The encoder of `tokenizer` (an EncoderTokenizer: its kind and path), its weights frozen on `device`. Not an
    nn.Module of the DALLE: like the VAE it is no part of the trained weights, the optimizer, EMA or the export."""

    def __init__(self, tokenizer: EncoderTokenizer, device="cpu", dtype: str = "auto"):
        self.tokenizer, self.device = tokenizer, torch.device(device)
        model = load_hf(_model_class(tokenizer.encoder).from_pretrained, tokenizer.path)
        self.fingerprint = _fingerprint(model, tokenizer)
        self.dtype = encoder_dtype(self.device, dtype)
        self.model = model.to(self.device, self.dtype).eval().requires_grad_(False)
        self.dim = model.config.hidden_size if tokenizer.encoder == "clip" else model.config.d_model
        self.max_positions = getattr(model.config, "max_position_embeddings", None)  # CLIP: 77; T5: relative

    def check(self, text_seq_len: int) -> None:
        if self.max_positions and text_seq_len > self.max_positions:
            raise ValueError(
                f"--text_seq_len {text_seq_len} is longer than the encoder's {self.max_positions} positions: "
                f"lower --text_seq_len to {self.max_positions} or less"
            )

    @torch.no_grad()
    def features(self, ids: torch.Tensor, dtype: torch.dtype = FEATURE_DTYPE) -> torch.Tensor:
        """(b, T) caption ids (EncoderTokenizer's: the encoder's plus one, 0 padding) -> (b, T, dim) last hidden
        states in `dtype` (float16: what the DALLE reads), zero vectors at padding. Padding is masked in the
        encoder (T5 reads both ways)."""
        ids = ids.to(self.device)
        real = ids > 0
        input_ids = torch.where(real, ids - 1, torch.full_like(ids, self.tokenizer.pad_id))
        out = torch.zeros(*ids.shape, self.dim, dtype=dtype, device=self.device)
        rows = real.any(1)  # a caption with no token at all stays all padding: the DALLE's null caption
        if rows.any():
            n = int(real.sum(1).max())  # the encoder runs over the longest caption, not the padding after it
            h = self.model(input_ids=input_ids[rows, :n], attention_mask=real[rows, :n].long()).last_hidden_state
            out[rows, :n] = (h * real[rows, :n, None]).to(dtype)
        return out

    def record(self) -> dict:
        """What an export keeps of the encoder (its tokenizer's record, with the fingerprint)."""
        return dict(self.tokenizer.to_dict(), fingerprint=self.fingerprint)


def _fingerprint(model: torch.nn.Module, tokenizer: EncoderTokenizer) -> str:
    """sha256 over the weights (names, shapes, dtypes, bytes, as loaded) and the tokenizer's vocabulary."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    h.update(repr(sorted(tokenizer.hf.get_vocab().items())).encode())
    return h.hexdigest()[:16]


def load_text_encoder(record: dict, device="cpu", path: str = "", dtype: str = "auto"):
    """(tokenizer, encoder) of an export's or a run's record, from `path` when given (where the encoder lives on
    this machine); a different encoder there than the one the DALLE was trained with is one line, not garbage."""
    from ..data.tokenizer import tokenizer_from_dict

    tokenizer = tokenizer_from_dict(record, path)
    encoder = FrozenTextEncoder(tokenizer, device, dtype)
    want = record.get("fingerprint")
    if want and encoder.fingerprint != want:
        raise ValueError(
            f"--text_encoder_path {tokenizer.path}: not the encoder this DALLE was trained with "
            f"(fingerprint {encoder.fingerprint}, the export's {want}, trained with {record['path']}): "
            "pass the same encoder's folder or name"
        )
    tokenizer.fingerprint = encoder.fingerprint
    return tokenizer.bind(encoder), encoder
