"""Run lucidrains' dalle-pytorch 1.6.6 itself: build its DiscreteVAE and DALLE with random weights, save
them as its train_vae.py / train_dalle.py do, and record its VAE codes and DALLE logits on fixed inputs.

    python -I tests/reference_run.py REFERENCE_DIR OUT_DIR CASE TEXT_VOCAB

Run in its own process (`python -I`: the repository is not on sys.path), since the predecessor's package is
also called `dalle_pytorch`. REFERENCE_DIR holds `pip install --no-deps --target` of dalle-pytorch==1.6.6,
axial_positional_embedding==0.2.1 and rotary-embedding-torch==0.1.5 (scripts/install.sh puts it in
~/.cache/dalle-pytorch/reference). Its imports that only the tokenizers and pretrained VAEs use
(transformers, omegaconf, taming, ftfy, regex, pkg_resources) get empty stand-ins when missing.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import types

import torch

CASES = {  # the DALLE options each case turns on (the rest are train_dalle.py's defaults)
    "plain": dict(),
    "shift_sandwich": dict(shift_tokens=True, sandwich_norm=True),
    "shared": dict(share_input_output_emb=True, shared_attn_ids=(0, 0, 1), shared_ff_ids=(0, 1, 1)),
}
VAE_HPARAMS = dict(image_size=32, num_layers=2, num_tokens=64, channels=3, codebook_dim=32, hidden_dim=16)
DALLE_HPARAMS = dict(text_seq_len=12, dim=32, depth=3, heads=2, dim_head=16, loss_img_weight=7)


def _stand_ins() -> None:
    """Modules the predecessor imports at the top of files we do not exercise."""
    for name in ("transformers", "omegaconf", "ftfy", "regex", "pkg_resources", "taming", "taming.models",
                 "taming.models.vqgan"):  # fmt: skip
        try:
            importlib.import_module(name)
        except Exception:
            module = types.ModuleType(name)
            module.__path__ = []
            for attr in ("BertTokenizer", "OmegaConf", "VQModel", "GumbelVQ", "get_distribution"):
                setattr(module, attr, None)
            sys.modules[name] = module


def main(reference_dir: str, out: str, case: str, text_vocab: str) -> None:
    sys.path.insert(0, reference_dir)
    _stand_ins()
    from dalle_pytorch import DALLE, DiscreteVAE

    torch.manual_seed(0)
    resblocks = 0 if case == "plain" else 1  # 0: the decoder's first layer reads the codebook directly
    vae_params = dict(VAE_HPARAMS, num_resnet_blocks=resblocks)
    vae = DiscreteVAE(**vae_params)
    with torch.no_grad():  # default init gives logits dominated by their bias: a few codes everywhere
        vae.encoder[-1].weight.mul_(20)
    hparams = dict(DALLE_HPARAMS, **CASES[case], num_text_tokens=int(text_vocab), attn_types=("full",),
                   reversible=False, stable=False, rotary_emb=False, ff_dropout=0.0, attn_dropout=0.0)  # fmt: skip
    hparams.setdefault("shift_tokens", False)
    dalle = DALLE(vae=vae, **hparams)
    with torch.no_grad():  # LayerScale starts at 0.1 everywhere: vary it so that folding it is tested
        for name, p in dalle.named_parameters():
            if name.endswith(".scale") or "norm" in name:
                p.add_(0.05 * torch.randn_like(p))
    os.makedirs(out, exist_ok=True)
    # the predecessor's own save formats (train_vae.py save_model, train_dalle.py save_model)
    torch.save({"hparams": vae_params, "weights": vae.state_dict()}, os.path.join(out, "vae.pt"))
    dalle_obj = {"hparams": hparams, "vae_params": vae_params, "epoch": 0, "version": "1.6.6",
                 "vae_class_name": "DiscreteVAE", "weights": dalle.state_dict(), "opt_state": None,
                 "scheduler_state": None}  # fmt: skip
    torch.save(dalle_obj, os.path.join(out, "dalle.pt"))

    g = torch.Generator().manual_seed(1)
    # one colour per 4x4 block, the area each token sees: codes vary with the blocks instead of collapsing
    blocks = torch.rand(3, 3, 8, 8, generator=g)
    images = torch.nn.functional.interpolate(blocks, scale_factor=4, mode="nearest")
    text = torch.randint(1, int(text_vocab), (3, DALLE_HPARAMS["text_seq_len"]), generator=g)
    text[0, 5:] = 0  # padding, which the predecessor gives a token per position
    text[1, :] = 0
    vae.eval()
    dalle.eval()
    with torch.no_grad():
        codes = vae.get_codebook_indices(images)
        top2 = vae(images, return_logits=True).topk(2, dim=1).values  # (b, 2, h, w)
        margins = (top2[:, 0] - top2[:, 1]).flatten(1)  # how far each code is ahead of the runner-up
        logits = dalle(text, codes)  # (b, text + image positions, all tokens), masked with -max
    expected = {"images": images, "text": text, "codes": codes, "margins": margins, "logits": logits}
    torch.save(expected, os.path.join(out, "expected.pt"))
    with open(os.path.join(out, "case.json"), "w") as f:
        json.dump({"case": case, "hparams": {k: list(v) if isinstance(v, tuple) else v for k, v in hparams.items()}}, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
