"""The service's batching: requests that arrive together share one batch, an image is the same alone or batched
(its own generator), requests with other settings wait for their own round, a cancelled one is dropped."""

import threading
import time

import pytest
import torch

from dalle_pytorch.inference.batcher import Batcher, Settings
from dalle_pytorch.models.dalle import DALLE, DALLEConfig
from dalle_pytorch.models.sampling import generate_image_tokens
from dalle_pytorch.models.vae import DiscreteVAE, VAEConfig


def models():
    torch.manual_seed(0)
    vae = DiscreteVAE(VAEConfig(image_size=16, num_tokens=32, codebook_dim=16, hidden_dim=16, num_layers=2)).eval()
    dalle = DALLE(
        DALLEConfig(dim=32, depth=2, heads=2, dim_head=16, text_seq_len=6, num_text_tokens=20, num_image_tokens=32,
                    image_fmap_size=4)
    ).eval()  # fmt: skip
    return dalle, vae


def caption(i):
    return torch.arange(1, 7) * (i + 1) % 19 + 1


def alone(dalle, vae, text, seed, settings=Settings()):
    """What generate.py draws with --seed SEED --num_images 1: one row, a generator of that seed."""
    g = torch.Generator().manual_seed(seed)
    tokens = generate_image_tokens(dalle, text[None], generator=g, **vars(settings))
    return vae.decode(tokens)


@pytest.mark.parametrize("settings", [Settings(), Settings(cond_scale=2.0, decoding="sjd", window=5)],
                         ids=["sequential", "sjd"])  # fmt: skip
def test_requests_arriving_together_share_a_batch_and_draw_what_they_draw_alone(settings):
    """With --decoding sjd too: each row at its own positions, its own noise, as generate.py draws it."""
    dalle, vae = models()
    batcher = Batcher(dalle, vae, max_batch=16, max_wait=0.5)
    try:
        futures = [batcher.submit(caption(i), [10 * i, 10 * i + 1], settings) for i in range(4)]
        images = [f.result(timeout=60) for f in futures]
    finally:
        batcher.close()
    assert list(batcher.batches) == [8] and batcher.batches_run == 1  # 4 requests x 2 images: one decode loop
    for i, got in enumerate(images):
        assert got.shape == (2, 3, 16, 16)
        for j, seed in enumerate([10 * i, 10 * i + 1]):
            assert torch.equal(got[j : j + 1], alone(dalle, vae, caption(i), seed, settings)), (i, j)


def test_other_settings_wait_for_their_round_and_max_batch_holds():
    dalle, vae = models()
    batcher = Batcher(dalle, vae, max_batch=4, max_wait=0.5)
    hot = Settings(temperature=2.0, top_k=5)
    try:
        futures = [batcher.submit(caption(0), [1, 2, 3]), batcher.submit(caption(1), [4], hot)]
        futures += [batcher.submit(caption(2), [5, 6]), batcher.submit(caption(3), [7])]
        images = [f.result(timeout=60) for f in futures]
    finally:
        batcher.close()
    assert list(batcher.batches) == [4, 1, 2]  # [3 + 1 (default)], [1 hot], [2 left over]
    assert torch.equal(images[1], alone(dalle, vae, caption(1), 4, hot))
    assert torch.equal(images[2][1:], alone(dalle, vae, caption(2), 6))


def test_a_cancelled_request_is_dropped_and_an_error_reaches_its_batch_only():
    dalle, vae = models()
    batcher = Batcher(dalle, vae, max_batch=16, max_wait=0.3)
    gate = threading.Event()
    real = batcher._sample
    batcher._sample = lambda jobs: (gate.wait(10), real(jobs))  # hold the first round until told
    try:
        first = batcher.submit(caption(0), [1])
        time.sleep(0.5)  # the first round has started (and waits at the gate)
        dropped, kept = batcher.submit(caption(1), [2]), batcher.submit(caption(2), [3])
        assert dropped.cancel()
        gate.set()
        first.result(timeout=60), kept.result(timeout=60)
        bad = batcher.submit(torch.full((6,), 99), [4])  # an id outside the text vocabulary
        try:
            bad.result(timeout=60)
            raise AssertionError("an out-of-vocabulary caption sampled")
        except (IndexError, RuntimeError):
            pass
        assert batcher.submit(caption(3), [5]).result(timeout=60).shape == (1, 3, 16, 16)  # still serving
    finally:
        batcher.close()
    assert list(batcher.batches)[:2] == [1, 1]  # the cancelled request took no row
