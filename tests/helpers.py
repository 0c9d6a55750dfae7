"""Shared by the tests: the tiny model shapes every end-to-end test trains."""

TINY_VAE_MODEL = ["--image_size", "16", "--num_tokens", "16", "--hidden_dim", "16", "--codebook_dim", "16"]
TINY_DALLE_MODEL = [
    "--dim",
    "32",
    "--depth",
    "2",
    "--heads",
    "2",
    "--dim_head",
    "16",
    "--text_seq_len",
    "12",
    "--tokenizer",
    "byte",
]
