"""The cost of the 2024 recipe's parts against 2021's, per training step and per decoded image, in one run:
2021's blocks (LayerNorm, GEGLU, learned positions), Llama's (RMSNorm, SwiGLU, rotary; and grouped-query
attention), and captions read through a frozen encoder's features (the encoder's own time per batch apart).
Rounds interleave the variants, so the ratios hold on a loaded machine; medians of the rounds.

    .venv/bin/python bench/blocks.py [--threads 1] [--rounds 5]      # the binding recipe's DALLE (recipes/binding)

Defaults: the binding recipe's shape (dim 192, dim_head 48, 4 heads, depth 4, 16 caption tokens, an 8 x 8 grid
of 64 codes, batch 32) and bench/caption_t5.py's encoder size (d_model 128, 2 layers).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import common  # noqa: F401  (puts the checkout on sys.path)
import torch

# bench/tokenizers.py would shadow the `tokenizers` package that transformers imports
sys.path = [q for q in sys.path if os.path.abspath(q or ".") != os.path.dirname(os.path.abspath(__file__))]

from dalle_pytorch.models.dalle import DALLE, DALLEConfig  # noqa: E402
from dalle_pytorch.models.sampling import generate_image_tokens  # noqa: E402

VARIANTS = {
    "2021 blocks (layernorm, geglu, learned positions)": {},
    "rmsnorm + swiglu": dict(norm="rmsnorm", ff="swiglu"),
    "rmsnorm + swiglu at geglu's width (ff_mult 6)": dict(norm="rmsnorm", ff="swiglu", ff_mult=6),
    "rmsnorm + swiglu + rotary (Llama)": dict(norm="rmsnorm", ff="swiglu", rotary_emb=True),
    "Llama + kv_heads 1": dict(norm="rmsnorm", ff="swiglu", rotary_emb=True, kv_heads=1),
    "frozen encoder's features (128 wide)": dict(text_feature_dim=128, num_text_tokens=0),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="training steps per round and variant")
    p.add_argument("--batch", type=int, default=32)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    base = DALLEConfig(dim=192, dim_head=48, heads=4, depth=4, text_seq_len=16, num_text_tokens=256,
                       num_image_tokens=64, image_fmap_size=8)  # fmt: skip
    models, opts, data = {}, {}, {}
    g = torch.Generator().manual_seed(0)
    for name, kw in VARIANTS.items():
        torch.manual_seed(0)
        models[name] = m = DALLE(dataclasses.replace(base, **kw))
        opts[name] = torch.optim.AdamW(m.parameters(), lr=1e-4)
        if m.reads_features:
            text = torch.randn(a.batch, 16, 128, generator=g)
            text[:, 10:] = 0  # padding, as a caption of 10 tokens
        else:
            text = torch.randint(1, 256, (a.batch, 16), generator=g)
        data[name] = (text, torch.randint(0, 64, (a.batch, 64), generator=g))
    train = {n: [] for n in VARIANTS}
    decode = {n: [] for n in VARIANTS}
    for _ in range(a.rounds):
        for name, m in models.items():
            text, image = data[name]
            m.train()
            t = time.perf_counter()
            for _ in range(a.steps):
                loss, _ = m(text, image)
                opts[name].zero_grad()
                loss.backward()
                opts[name].step()
            train[name].append((time.perf_counter() - t) / a.steps)
            m.eval()
            t = time.perf_counter()
            generate_image_tokens(m, text[:4], temperature=1.0, generator=torch.Generator().manual_seed(1))
            decode[name].append((time.perf_counter() - t) / 4)
    encoder_ms = caption_encoder_ms(a.batch, a.rounds)
    first = next(iter(VARIANTS))
    t0, d0 = statistics.median(train[first]), statistics.median(decode[first])
    print(f"binding recipe's DALLE, batch {a.batch}, {a.threads} thread(s), {a.rounds} rounds, medians")
    print(f"{'variant':52s} {'params':>8s} {'step ms':>8s} {'ratio':>6s} {'decode ms/img':>14s} {'ratio':>6s}")
    for name, m in models.items():
        t, d = statistics.median(train[name]), statistics.median(decode[name])
        n = sum(q.numel() for q in m.parameters()) / 1e6
        print(f"{name:52s} {n:7.2f}M {t * 1e3:8.1f} {t / t0:6.2f} {d * 1e3:14.1f} {d / d0:6.2f}")
    print(f"the frozen encoder itself (bench/caption_t5.py's size) on a batch's captions: {encoder_ms:.1f} ms "
          f"({encoder_ms / 1e3 / t0:.3f} of a 2021 step)")  # fmt: skip


def caption_encoder_ms(batch: int, rounds: int) -> float:
    """bench/caption_t5.py's T5 encoder (d_model 128, 2 layers) on a batch of 10-token captions, median ms."""
    from transformers import T5Config, T5EncoderModel

    cfg = T5Config(vocab_size=32, d_model=128, d_kv=32, d_ff=256, num_layers=2, num_heads=4,
                   feed_forward_proj="gated-gelu")  # fmt: skip
    model = T5EncoderModel(cfg).eval()
    ids = torch.randint(2, 32, (batch, 10))
    times = []
    with torch.no_grad():
        for _ in range(rounds + 1):
            t = time.perf_counter()
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3


if __name__ == "__main__":
    main()
