"""Shared by the tests: the tiny model shapes every end-to-end test trains."""

import os

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

# In-process runs: the trainers' --threads 0 gives each process all its share of the cores, undoing conftest's
# torch.set_num_threads(1); two OpenMP threads on 2 busy cores wait at spinning barriers, measured 10-100x slower
# (a 60-step VAE run: 0.5 s alone, 56 s beside another job). Launched ranks get 1 thread each either way.
ONE_THREAD = ["--threads", "1"]

# Where things are, from any test subfolder
TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
FIXTURES = os.path.join(TESTS, "fixtures")
