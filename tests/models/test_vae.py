import pytest
import torch

from dalle_pytorch.inference.export import save_export
from dalle_pytorch.inference.load import load_vae
from dalle_pytorch.models.vae import DiscreteVAE, VAEConfig, codebook_stats
from dalle_pytorch.training.schedules import gumbel_temperature, lr_factor


def tiny():
    torch.manual_seed(0)
    return DiscreteVAE(VAEConfig(image_size=16, num_tokens=32, codebook_dim=16, hidden_dim=16, num_layers=2))


def test_method_shapes_and_ranges():
    vae = tiny()
    x = torch.rand(2, 3, 16, 16)
    ids = vae.get_codebook_indices(x)
    assert ids.shape == (2, 16) and ids.dtype == torch.long and 0 <= ids.min() and ids.max() < 32
    out = vae.decode(ids)
    assert out.shape == (2, 3, 16, 16) and out.min() >= 0 and out.max() <= 1
    loss, metrics = vae.loss(x, 0.9)
    assert loss.dim() == 0 and torch.isfinite(loss) and "psnr" in metrics


def test_gradients_reach_the_encoder():
    vae = tiny()
    loss, _ = vae.loss(torch.rand(2, 3, 16, 16), 1.0)
    loss.backward()
    first = vae.encoder[0].weight.grad
    assert first is not None and first.abs().sum() > 0


def test_export_reload_identical(tmp_path):
    vae = tiny()
    path = str(tmp_path / "vae.pt")
    save_export(path, "vae", vae.cfg.to_dict(), vae.state_dict())
    loaded, _ = load_vae(path)
    x = torch.rand(2, 3, 16, 16)
    assert torch.equal(vae.get_codebook_indices(x), loaded.get_codebook_indices(x))
    ids = vae.get_codebook_indices(x)
    assert torch.equal(vae.decode(ids), loaded.decode(ids))


def test_config_errors_name_the_flag():
    with pytest.raises(ValueError, match="--image_size"):
        VAEConfig(image_size=24)
    with pytest.raises(ValueError, match="--channels"):
        VAEConfig(channels=2)


def test_codebook_stats():
    s = codebook_stats(torch.tensor([0, 1, 2, 3]), 8)
    assert s["codebook_usage"] == 0.5 and abs(s["codebook_perplexity"] - 4) < 1e-4


def test_schedules_end_points():
    assert lr_factor(0, 100, warmup_steps=10) == pytest.approx(0.1)
    assert lr_factor(10, 100, warmup_steps=10) == pytest.approx(1.0)
    assert lr_factor(100, 100, warmup_steps=10, min_factor=0.1) == pytest.approx(0.1)
    assert lr_factor(100, 100, decay="exponential", min_factor=0.01) == pytest.approx(0.01)
    assert gumbel_temperature(0, 1.0, 0.0625, 100) == pytest.approx(1.0)
    assert gumbel_temperature(100, 1.0, 0.0625, 100) == pytest.approx(0.0625)
    assert gumbel_temperature(10_000, 1.0, 0.0625, 100) == pytest.approx(0.0625)  # floor, no compounding
    assert gumbel_temperature(50, 1.0, 0.0625, 100, "exponential") == pytest.approx(0.25)
