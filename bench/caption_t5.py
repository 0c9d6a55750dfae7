"""A small T5 pretrained on a caption folder's text inside a CPU budget: the one frozen encoder to be had on a
machine that can download none (google/flan-t5-xl is what a user would take). Denoising, as T5's span corruption
in its simplest form: 15% of each caption's tokens replaced by one mask token, the decoder restores the caption.
Writes what `train_dalle.py --text_encoder t5 --text_encoder_path OUT` reads: the encoder and its tokenizer, as
transformers' save_pretrained writes them.

    .venv/bin/python bench/caption_t5.py DATA_DIR/train OUT_DIR [--seconds 45] [--seed 0]

It tells what a frozen encoder of the captions' own words does to binding against an embedding learned with the
DALLE; it says nothing of what a pretrained T5's knowledge of language would add (docs/binding.md).
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import sys
import time

import torch

# bench/tokenizers.py would shadow the `tokenizers` package that transformers imports
sys.path = [q for q in sys.path if os.path.abspath(q or ".") != os.path.dirname(os.path.abspath(__file__))]


def captions(folder: str) -> list[str]:
    lines = []
    for path in sorted(glob.glob(os.path.join(folder, "*.txt"))):
        with open(path) as f:
            lines += [t.strip() for t in f if t.strip()]
    if not lines:
        raise SystemExit(f"no captions (*.txt) under {folder}")
    return lines


def tokenizer_of(lines: list[str]):
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(lines, trainers.WordLevelTrainer(special_tokens=["<pad>", "</s>", "<unk>", "<mask>"]))
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    # a word-level vocabulary: saved as the generic fast tokenizer (T5's class would rebuild it as a Unigram)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder")
    p.add_argument("out")
    p.add_argument("--seconds", type=float, default=45.0, help="training time at one thread")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--d_model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=64)
    a = p.parse_args(argv)
    from transformers import T5Config, T5ForConditionalGeneration

    torch.set_num_threads(1)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    lines = captions(a.folder)
    tok = tokenizer_of(lines)
    mask = tok.convert_tokens_to_ids("<mask>")
    cfg = T5Config(
        vocab_size=len(tok), d_model=a.d_model, d_kv=a.d_model // 4, d_ff=2 * a.d_model, num_layers=a.layers,
        num_decoder_layers=a.layers, num_heads=4, feed_forward_proj="gated-gelu", decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
    )  # fmt: skip
    model = T5ForConditionalGeneration(cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    start, step = time.perf_counter(), 0
    while time.perf_counter() - start < a.seconds:
        batch = tok(rng.sample(lines, a.batch_size), padding=True, return_tensors="pt")
        ids, keep = batch["input_ids"], batch["attention_mask"].bool()
        corrupt = (torch.rand(ids.shape) < 0.15) & keep & (ids != 1)
        labels = ids.masked_fill(~keep, -100)
        loss = model(input_ids=ids.masked_fill(corrupt, mask), attention_mask=keep.long(), labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        step += 1
    print(f"caption T5: {sum(q.numel() for q in model.encoder.parameters()) / 1e6:.2f}M encoder parameters, "
          f"{len(tok)} words, {step} steps in {time.perf_counter() - start:.0f} s, loss {loss.item():.3f}")  # fmt: skip
    from transformers import T5EncoderModel

    enc = T5EncoderModel(cfg)  # the encoder's folder, what --text_encoder t5 loads
    missing, _ = enc.load_state_dict(model.state_dict(), strict=False)
    assert not missing, missing
    enc.save_pretrained(a.out)
    tok.save_pretrained(a.out)


if __name__ == "__main__":
    main()
