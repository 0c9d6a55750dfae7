"""Serve a trained DALLE over HTTP: the models load once; a JSON API and a web page; requests that arrive
together share their decode steps (dalle_pytorch/inference/serving.py).

    python serve.py --dalle_path runs/dalle/dalle.safetensors                    # http://127.0.0.1:8000/
    python serve.py --dalle_path dalle.safetensors --clip_path clip.safetensors --port 8080 --max_batch 32
    curl -s localhost:8000/generate -d '{"text": "a red circle", "num_images": 4, "seed": 1}'

Each image comes with its seed and the generate.py command that redraws it. It listens on 127.0.0.1 unless
--host says otherwise.
"""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    from dalle_pytorch.config import FileParser, add_flags
    from dalle_pytorch.inference.service import ServeConfig

    p = FileParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, ServeConfig, "serving")
    return p


def main(argv=None):
    from dalle_pytorch.config import take
    from dalle_pytorch.errors import user_errors
    from dalle_pytorch.inference.service import ServeConfig

    ns = build_parser().parse_args(argv)
    with user_errors(ns.debug):
        cfg = take(ns, ServeConfig)
        app = load_app(cfg)
        import uvicorn

        print(f"serving {cfg.dalle_path} on http://{cfg.host}:{cfg.port}/", flush=True)
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")


def load_app(cfg):
    """The service over the models `cfg` names, loaded once."""
    import torch

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(f"serve.py needs fastapi and uvicorn ({e}): run `make install`") from None
    from dalle_pytorch.inference.load import load_dalle
    from dalle_pytorch.inference.pipeline import load_reranker
    from dalle_pytorch.inference.service import make_app

    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dalle, vae, tokenizer = load_dalle(cfg.dalle_path, device, weights=cfg.weights)
    clip = clip_tokenizer = None
    if cfg.clip_path:
        clip, clip_tokenizer = load_reranker(cfg.clip_path, cfg.dalle_path, dalle, vae, tokenizer, device)
    return make_app(cfg, dalle, vae, tokenizer, clip, clip_tokenizer)


if __name__ == "__main__":
    main()
