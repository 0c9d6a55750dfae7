"""Serve a trained DALLE over HTTP: the models load once; a JSON API and a web page; requests that arrive
together share their decode steps (dalle_pytorch/inference/batcher.py).

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
    from dalle_pytorch.inference.http_app import ServeConfig

    p = FileParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, ServeConfig, "serving")
    return p


def main(argv=None):
    from dalle_pytorch.config import take
    from dalle_pytorch.errors import user_errors
    from dalle_pytorch.inference.http_app import ServeConfig, load_app

    ns = build_parser().parse_args(argv)
    with user_errors(ns.debug):
        cfg = take(ns, ServeConfig)
        app = load_app(cfg)
        import uvicorn

        print(f"serving {cfg.dalle_path} on http://{cfg.host}:{cfg.port}/", flush=True)
        uvicorn.run(app, host=cfg.host, port=cfg.port, log_level="warning")


if __name__ == "__main__":
    main()
