"""Record LlamaGen's own figures on the files of tests/llamagen_files.py: the test tier compares the project's
encode/decode and logits with them (tests/models/test_llamagen.py). Run with a checkout of LlamaGen:

    git clone https://github.com/FoundationVision/LlamaGen /tmp/llamagen
    python scripts/record_llamagen.py --llamagen /tmp/llamagen [--sizes small real]

It imports LlamaGen's model code (tokenizer/tokenizer_image/vq_model.py, autoregressive/models/gpt.py) from that
checkout, loads the files with strict=True, and writes tests/fixtures/llamagen.json with the checkout's commit. Figures
are float32 on the CPU; the test compares them within 1e-4."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
OUT = os.path.join(ROOT, "tests", "fixtures", "llamagen.json")
VOCAB_SHOWN = 8  # the first logits of each recorded position, beside the log-partition over the whole vocabulary


def logit_figures(logits: torch.Tensor) -> dict:
    """(b, n, V) -> the first VOCAB_SHOWN logits and the logsumexp of each position."""
    return {"head": logits[..., :VOCAB_SHOWN].tolist(), "lse": logits.logsumexp(-1).tolist()}


def image_figures(x: torch.Tensor) -> dict:
    """An image batch's values at a fixed stride, and its mean and mean absolute value."""
    flat = x.flatten()
    return {
        "strided": flat[:: max(1, flat.numel() // 256)].tolist(),
        "mean": x.mean().item(),
        "abs": x.abs().mean().item(),
    }


def record_vq(size: str) -> dict:
    import llamagen_files as files
    from tokenizer.tokenizer_image.vq_model import Decoder, Encoder, ModelArgs, VQModel

    s = files.VQ[size]
    args = ModelArgs(
        codebook_size=s["codes"], codebook_embed_dim=s["code_dim"], encoder_ch_mult=s["ch_mult"],
        decoder_ch_mult=s["ch_mult"], z_channels=s["z_channels"],
    )  # fmt: skip
    model = VQModel(args)
    if s["ch"] != 128:  # LlamaGen's ModelArgs has no width: its Encoder's and Decoder's own argument
        model.encoder = Encoder(ch=s["ch"], ch_mult=s["ch_mult"], z_channels=s["z_channels"])
        model.decoder = Decoder(ch=s["ch"], ch_mult=s["ch_mult"], z_channels=s["z_channels"])
    sd = files.vq_state_dict(size)
    model.load_state_dict(sd, strict=True)
    model.eval()
    with torch.no_grad():
        images = files.images(size)
        _, _, (_, _, codes) = model.encode(images)
        f = s["image"] // 2 ** (len(s["ch_mult"]) - 1)
        codes = codes.view(2, f, f)
        decoded = model.decode_code(codes.flatten(), (2, s["code_dim"], f, f))
    return {"layout": files.layout_hash(model.state_dict()), "codes": codes.tolist(), "decoded": image_figures(decoded)}


def record_gpt(size: str) -> dict:
    import llamagen_files as files
    from autoregressive.models.gpt import ModelArgs, Transformer

    s = files.GPT[size]
    heads = {128: 2, 1280: 20}[s["dim"]]
    args = ModelArgs(
        dim=s["dim"], n_layer=s["layers"], n_head=heads, vocab_size=files.VQ[size]["codes"], model_type="t2i",
        caption_dim=s["caption_dim"], cls_token_num=s["caption_len"], block_size=s["fmap"] ** 2,
    )  # fmt: skip
    model = Transformer(args)
    sd = files.gpt_state_dict(size)
    model.load_state_dict(sd, strict=True)
    model.eval()
    t, n_img = s["caption_len"], s["fmap"] ** 2
    feats, tokens = files.captions(size), files.image_tokens(size)
    # LlamaGen's sampling layout (sample_t2i.py): the real tokens last, the padding masked
    lengths = files.CAPTION_LENGTHS[size]
    caption = torch.stack([torch.cat([f[n:], f[:n]]) for f, n in zip(feats, lengths)])
    emb_mask = torch.stack([torch.arange(t) >= t - n for n in lengths]).float()
    out = {"layout": files.layout_hash(model.state_dict())}
    with torch.no_grad():
        # the whole sequence at once, with the mask LlamaGen's T2I training builds (dataset/t2i.py)
        seq = t + n_img - 1
        mask = torch.tril(torch.ones(seq, seq))
        mask = mask[None].repeat(2, 1, 1)
        mask[:, :, :t] = mask[:, :, :t] * emb_mask[:, None, :]
        eye = torch.eye(seq)
        mask = (mask * (1 - eye) + eye).bool()[:, None]
        logits, _ = model(tokens[:, :-1], caption, input_pos=torch.arange(seq), mask=mask)
        out["forward"] = logit_figures(logits[:, t - 1 :])
        # guidance as generate() runs it: prefill [cond, uncond] rows, then teacher-forced decode steps
        steps = 3
        model.setup_caches(max_batch_size=4, max_seq_length=t + steps + 1, dtype=torch.float32)
        rows = torch.cat([caption, torch.zeros_like(caption) + model.cls_embedding.uncond_embedding])
        model.causal_mask[:, :, :t] = model.causal_mask[:, :, :t] * torch.cat([emb_mask, emb_mask]).unsqueeze(1)
        eye = torch.eye(model.causal_mask.size(1), model.causal_mask.size(2))
        model.causal_mask[:] = model.causal_mask * (1 - eye) + eye
        prefill, _ = model(None, rows, torch.arange(t))
        step_logits = [prefill[:, -1]]
        for k in range(steps):
            x = torch.cat([tokens[:, k : k + 1], tokens[:, k : k + 1]])
            logits, _ = model(x, cond_idx=None, input_pos=torch.tensor([t + k]))
            step_logits.append(logits[:, -1])
        out["guided_steps"] = logit_figures(torch.stack(step_logits, dim=1))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llamagen", required=True, help="a checkout of FoundationVision/LlamaGen")
    parser.add_argument("--sizes", nargs="+", default=["small", "real"])
    parser.add_argument("--commit", default="", help="the checkout's commit, where it is not a git work tree")
    args = parser.parse_args()
    sys.path.insert(0, args.llamagen)
    torch.manual_seed(0)
    commit = subprocess.run(["git", "-C", args.llamagen, "rev-parse", "HEAD"], capture_output=True, text=True)
    old = json.load(open(OUT)) if os.path.exists(OUT) else {}
    record = {
        "llamagen_commit": commit.stdout.strip() or args.commit or "unknown",
        "torch": torch.__version__,
        "vq": old.get("vq", {}),
        "gpt": old.get("gpt", {}),
    }
    for size in args.sizes:
        record["vq"][size] = record_vq(size)
        record["gpt"][size] = record_gpt(size)
        print(f"recorded {size}")
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(record, f)
    print(f"wrote {OUT} (LlamaGen {record['llamagen_commit']})")


if __name__ == "__main__":
    main()
