"""python -m dalle_pytorch.eval --vae_path vae.pt [--dalle_path dalle.pt] [--out DIR]: see evaluate.py."""

from .evaluate import main

main()
