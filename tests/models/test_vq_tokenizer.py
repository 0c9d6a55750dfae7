"""The trainable VQGAN (models/vq_tokenizer.py): one loss whose adversarial term reaches only the tokenizer and
whose discriminator term reaches only the discriminator; the tokenizer interface; the l2-normalized lookup."""

from __future__ import annotations

import pytest
import torch

from dalle_pytorch.models.vq_tokenizer import VQGANLoss, VQGANLossConfig, VQTokenizer, VQTokenizerConfig

CFG = VQTokenizerConfig(image_size=16, num_tokens=16, hidden_dim=32, num_layers=1)


def grads_of(module) -> dict:
    return {n: p.grad for n, p in module.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}


def test_each_adversarial_term_reaches_only_its_own_side():
    torch.manual_seed(0)
    m = VQGANLoss(CFG, VQGANLossConfig(disc_hidden_dim=16, disc_layers=1))
    x = torch.rand(4, 3, 16, 16)
    recon, _, _ = m.tokenizer.quantized(x)
    (-m.discriminator(recon, frozen=True).mean()).backward()  # the generator's term
    assert grads_of(m.tokenizer) and not grads_of(m.discriminator)
    m.zero_grad()
    recon, _, _ = m.tokenizer.quantized(x)
    torch.relu(1 + m.discriminator(recon.detach())).mean().backward()  # the discriminator's term
    assert grads_of(m.discriminator) and not grads_of(m.tokenizer)


def test_before_disc_start_the_discriminator_is_in_the_graph_with_zero_gradients():
    """Every parameter is in every step's graph (DDP and ZeRO reduce each), with no effect before the start."""
    torch.manual_seed(0)
    m = VQGANLoss(CFG, VQGANLossConfig(disc_hidden_dim=16, disc_layers=1, disc_start=10))
    loss, metrics = m(torch.rand(4, 3, 16, 16), step=3)
    loss.backward()
    assert all(p.grad is not None for p in m.parameters())
    assert not grads_of(m.discriminator)
    for name in ("recon", "psnr", "g_loss", "d_loss", "d_real_accuracy", "d_fake_accuracy", "commitment"):
        assert torch.isfinite(metrics[name]), name
    loss, _ = m(torch.rand(4, 3, 16, 16), step=10)
    m.zero_grad()
    loss.backward()
    assert grads_of(m.discriminator)


def test_the_tokenizer_interface_and_the_l2_normalized_lookup():
    torch.manual_seed(0)
    tok = VQTokenizer(CFG).eval()
    x = torch.rand(3, 3, 16, 16)
    ids = tok.get_codebook_indices(x)
    assert ids.shape == (3, 64) and ids.dtype == torch.long and 0 <= ids.min() and ids.max() < 16
    out = tok.decode(ids)
    assert out.shape == x.shape and 0 <= out.min() and out.max() <= 1
    z, neg_dist = tok.encode(x)
    assert torch.allclose(z.norm(dim=-1), torch.ones(()), atol=1e-5)  # cosine lookup: unit vectors
    e = torch.nn.functional.normalize(tok.codebook.weight, dim=-1)
    by_cosine = (z @ e.t()).argmax(-1).flatten(1)
    assert torch.equal(by_cosine, ids)
    with pytest.raises(ValueError, match="expected images of shape"):
        tok.get_codebook_indices(torch.rand(1, 3, 32, 32))


def test_bad_configs_say_what_to_do():
    with pytest.raises(ValueError, match="not a multiple of 2\\*\\*--num_layers"):
        VQTokenizerConfig(image_size=20, num_layers=3)
    with pytest.raises(ValueError, match="multiple of 32"):
        VQTokenizerConfig(hidden_dim=48)
