"""What a frozen text encoder costs: milliseconds per caption on this machine, and the bytes per caption of its
features cached in token shards (the encode command's feats.npz). Weights of the published architectures with
fixed random values (nothing can be downloaded here): the time of a forward does not depend on the values, the
disk size barely (float16 values, savez without compression).

    .venv/bin/python bench/text_encoder.py [--captions DATA_DIR/train] [--models flan-t5-base flan-t5-xl clip-l]
        [--threads 2] [--batch 32]

Captions: a caption folder's *.txt lines (the binding check's data) or a built-in sample of the shapes set, read by
a tokenizer trained on them (the published tokenizers cannot be downloaded either): the figures per token carry
over, and --tokens (20, about a web caption's T5 tokens) turns them into figures per caption.
"""

from __future__ import annotations

import argparse
import glob
import io
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path = [q for q in sys.path if os.path.abspath(q or ".") != os.path.dirname(os.path.abspath(__file__))]
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# published configurations (config.json of google/flan-t5-base, google/flan-t5-xl, openai/clip-vit-large-patch14)
T5 = {
    "flan-t5-base": dict(d_model=768, d_kv=64, d_ff=2048, num_layers=12, num_heads=12),
    "flan-t5-xl": dict(d_model=2048, d_kv=64, d_ff=5120, num_layers=24, num_heads=32),
}
CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12)


def captions(folder: str, n: int) -> list[str]:
    if folder:
        lines = [t.strip() for p in sorted(glob.glob(os.path.join(folder, "*.txt"))) for t in open(p) if t.strip()]
    else:
        from dalle_pytorch.data.shapes import ShapesDataset

        data = ShapesDataset(length=n)
        lines = [data.caption(i) for i in range(n)]
    return lines[:n]


def build(name: str, path: str, lines: list[str]):
    """A folder in `name`'s architecture (random values) with a tokenizer trained on `lines` (vocabulary as the
    published one's size)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import text_encoders as fixtures
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    fixtures.CAPTIONS = lines[:500]
    kind = "clip" if name.startswith("clip") else "t5"
    (fixtures.tiny_clip if kind == "clip" else fixtures.tiny_t5)(path)  # its tokenizer; the model replaced below
    cfg_path = os.path.join(path, "config.json")
    if kind == "t5":
        cfg = T5Config.from_pretrained(path)
        cfg.update({**T5[name], "feed_forward_proj": "gated-gelu", "relative_attention_num_buckets": 32,
                    "relative_attention_max_distance": 128})  # fmt: skip
        model = T5EncoderModel(cfg)
    else:
        cfg = CLIPTextConfig.from_pretrained(path)
        cfg.update(CLIP_L)
        model = CLIPTextModel(cfg)
    os.remove(cfg_path)
    model.save_pretrained(path)
    return kind


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--captions", default="", help="a caption folder (*.txt); default: the built-in shapes' captions")
    p.add_argument("--models", nargs="+", default=["flan-t5-base", "flan-t5-xl", "clip-l"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--text_seq_len", type=int, default=120)
    p.add_argument("--tokens", type=int, default=20, help="a typical caption's tokens, for the per-million figures")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    from dalle_pytorch.data.encoder_tokenizer import EncoderTokenizer
    from dalle_pytorch.inference.text_encoders import FrozenTextEncoder

    lines = captions(a.captions, a.batch * a.batches)
    print(f"{len(lines)} captions, batch {a.batch}, {a.threads} threads, fp32 on the CPU ({torch.__version__})")
    for name in a.models:
        with tempfile.TemporaryDirectory() as d:
            kind = build(name, d, lines)
            enc = FrozenTextEncoder(EncoderTokenizer(kind, d), "cpu")
            n_params = sum(t.numel() for t in enc.model.parameters())
            seq = min(a.text_seq_len, enc.max_positions or a.text_seq_len)
            batches = [enc.tokenizer.tokenize(lines[i : i + a.batch], seq)[0] for i in range(0, len(lines), a.batch)]
            enc.features(batches[0])  # warm-up
            t = time.perf_counter()
            feats = [enc.features(b) for b in batches]
            ms = (time.perf_counter() - t) * 1000 / len(lines)
            tokens = sum(int((b > 0).sum()) for b in batches) / len(lines)
            size = 0
            for b, f in zip(batches, feats):
                for ids, x in zip(b, f):
                    buf = io.BytesIO()
                    real = x[ids > 0].numpy()
                    np.savez(buf, lengths=np.array([len(real)], np.int32), features=real)
                    size += len(buf.getvalue())
            per = size / len(lines)
            per_token = per / tokens
            million = per_token * a.tokens * 1e6 / 2**30
            padded = seq * enc.dim * 4 * 1e6 / 2**30
            print(
                f"{name}: {n_params / 1e6:.0f}M parameters, {enc.dim} features; {tokens:.1f} tokens a caption here: "
                f"{ms:.1f} ms a caption ({ms / tokens:.2f} ms a token); cached {per / 1024:.1f} KiB a caption "
                f"({per_token / 1024:.2f} KiB a token). At {a.tokens} tokens a caption: {ms / tokens * a.tokens:.0f} "
                f"ms and {million:.0f} GiB per million captions (padded to {seq} in float32 instead: {padded:.0f} GiB)"
            )


if __name__ == "__main__":
    main()
