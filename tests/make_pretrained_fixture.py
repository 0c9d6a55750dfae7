"""Write tests/fixtures/pretrained_reference.pt: codes and decoded images of the upstream tokenizers.

    .venv/bin/pip install --no-deps taming-transformers-rom1504==0.0.6 DALL-E==0.1 attrs   # make install does
    .venv/bin/python tests/make_pretrained_fixture.py

The weights are not stored: they are regenerated from a seed by tests/pretrained_refs.random_weights, whose
values are exact (integer draws times powers of two), so the same on every CPU; the fixture keeps their names,
shapes and a hash of the integer draws, and stays small. Beside each case's codes it keeps each code's margin
over the runner-up in the upstream model's own scores, so that test_pretrained.py can tell which codes another
CPU must reproduce exactly. test_pretrained.py compares our re-implementations with it even where the
upstream packages are not installed.
"""

import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pretrained_refs import (  # noqa: E402
    FULL_SIZE,
    VQGAN_DDCONFIG,
    block_images,
    dall_e_margins,
    dall_e_models,
    dall_e_tokenize,
    integer_draws,
    random_weights,
    shapes_of,
    taming_margins,
    taming_model,
    taming_tokenize,
)

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "pretrained_reference.pt")
SMALL_DDCONFIG = {**VQGAN_DDCONFIG, "resolution": 16, "attn_resolutions": [8]}  # 16x16 images keep it small


def draws_hash(shapes: dict, seed: int) -> str:
    """sha1 of the integer draws behind random_weights (integers: no CPU's kernels change them; a new torch
    whose RNG draws other integers does)."""
    h = hashlib.sha1()
    draws = integer_draws(shapes, seed)
    for k in sorted(draws):
        h.update(k.encode() + draws[k].to(torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()


def main():
    torch.set_num_threads(1)
    cases = {}
    for seed, (name, gumbel) in enumerate((("vqgan", False), ("gumbel_vqgan", True))):
        model = taming_model(gumbel, ddconfig=SMALL_DDCONFIG)
        shapes = shapes_of(model)
        weights = random_weights(shapes, seed)
        model.load_state_dict(weights)
        images = block_images(2, 16, 100 + seed)
        codes, decoded = taming_tokenize(model, images, gumbel)
        cases[name] = {
            "ddconfig": SMALL_DDCONFIG,
            "n_embed": 64,
            "embed_dim": 32,
            "target": "taming.models.vqgan." + ("GumbelVQ" if gumbel else "VQModel"),
            "seed": seed,
            "shapes": {k: list(v) for k, v in shapes.items()},
            "draws_sha1": draws_hash(shapes, seed),
            "images": images,
            "codes": codes,
            "margins": taming_margins(model, images, gumbel),
            "decoded": decoded,
        }
    enc, dec = dall_e_models()
    shapes = {
        **{f"enc.{k}": v for k, v in shapes_of(enc).items()},
        **{f"dec.{k}": v for k, v in shapes_of(dec).items()},
    }
    weights = random_weights(shapes, 2)
    enc.load_state_dict({k[4:]: v for k, v in weights.items() if k.startswith("enc.")})
    dec.load_state_dict({k[4:]: v for k, v in weights.items() if k.startswith("dec.")})
    images = block_images(4, 32, 102)  # a 4x4 grid each: 64 codes
    codes, decoded = dall_e_tokenize(enc, dec, images)
    cases["openai"] = {
        "seed": 2,
        "shapes": {k: list(v) for k, v in shapes.items()},
        "draws_sha1": draws_hash(shapes, 2),
        "images": images,
        "codes": codes,
        "margins": dall_e_margins(enc, images),
        "decoded": decoded,
    }
    # names and shapes of the released models' weights, so that full-size configs are checked too
    with torch.device("meta"):
        for name, (dd, n_embed, embed_dim) in FULL_SIZE.items():
            model = taming_model(name == "gumbel_vqgan", n_embed, embed_dim, ddconfig=dd)
            cases[name]["full_size"] = {
                "ddconfig": dd,
                "n_embed": n_embed,
                "embed_dim": embed_dim,
                "shapes": shapes_of(model),
            }
        enc, dec = dall_e_models(n_hid=256, n_blk_per_group=2, vocab_size=8192, n_init=128)
        cases["openai"]["full_size"] = {"enc": shapes_of(enc), "dec": shapes_of(dec)}
    from importlib.metadata import version

    cases["produced_with"] = {
        "torch": str(torch.__version__),
        "taming-transformers-rom1504": version("taming-transformers-rom1504"),
        "DALL-E": version("DALL-E"),
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    torch.save(cases, OUT)
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
