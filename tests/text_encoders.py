"""Tiny pretrained-format text encoders for the tests: a T5 encoder and a CLIP text tower holding fixed random
values, with tokenizers trained by `tokenizers` on a few captions, written by `transformers`' save_pretrained
(no download). Same layout as google/flan-t5-xl's and openai/clip-vit-*'s folders."""

from __future__ import annotations

import os

CAPTIONS = [
    "a red seven on blue",
    "the digit two in green on a cyan background",
    "yellow nine, magenta ground",
    "a blue circle above a small red square",
    "two green triangles",
]


def _trained(model, special: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if model == "unigram":
        tok = Tokenizer(models.Unigram())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        trainer = trainers.UnigramTrainer(vocab_size=vocab, special_tokens=special, unk_token="<unk>")
    else:
        tok = Tokenizer(models.BPE(unk_token="<|endoftext|>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special)
    tok.train_from_iterator(CAPTIONS * 10, trainer)
    return tok


def tiny_t5(path: str, seed: int = 0, d_model: int = 32) -> str:
    """A T5 encoder (2 layers, gated-GELU as FLAN-T5's) in `path`; pad 0, </s> 1 as T5's."""
    import torch
    from tokenizers import processors
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tok = _trained("unigram", ["<pad>", "</s>", "<unk>"], 80)
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    hf = T5TokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>", unk_token="<unk>", extra_ids=0)
    cfg = T5Config(
        vocab_size=len(hf), d_model=d_model, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=8, relative_attention_max_distance=16,
    )  # fmt: skip
    torch.manual_seed(seed)
    T5EncoderModel(cfg).save_pretrained(path)
    hf.save_pretrained(path)
    return path


def tiny_clip(path: str, seed: int = 0) -> str:
    """A CLIP text tower (2 layers, 77 positions) in `path`; its tokenizer adds start and end of text, and pads
    with end of text, as CLIP's does."""
    import torch
    from tokenizers import processors
    from transformers import CLIPTextConfig, CLIPTextModel, PreTrainedTokenizerFast

    if os.path.exists(os.path.join(path, "config.json")):
        return path
    bos, eos = "<|startoftext|>", "<|endoftext|>"
    tok = _trained("bpe", [bos, eos], 300)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A {eos}", special_tokens=[(bos, tok.token_to_id(bos)), (eos, tok.token_to_id(eos))]
    )
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, pad_token=eos, unk_token=eos)
    cfg = CLIPTextConfig(
        vocab_size=len(hf), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=77, bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id,
        pad_token_id=hf.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    CLIPTextModel(cfg).save_pretrained(path)
    hf.save_pretrained(path)
    return path
