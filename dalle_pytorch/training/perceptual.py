"""The VQGAN's perceptual loss: LPIPS on VGG-16 (Zhang et al. 2018), as torchmetrics 1.9 builds it (its `_LPIPS`,
with the learned linear layers from the file it ships), the VGG-16 backbone read from torchvision's ImageNet
weights file: downloaded once into torch's hub cache, or `--perceptual_weights PATH` on a machine without internet."""

from __future__ import annotations

import torch

from ..eval.fidelity import vgg16_url, weights_file


def lpips_vgg(path: str = "", device="cpu") -> torch.nn.Module:
    """Frozen LPIPS: (x, y) in [-1, 1] (b, 3, s, s) -> (b, 1, 1, 1) distances. `path`: VGG-16's weights file."""
    import torchvision
    from torchmetrics.functional.image.lpips import _LPIPS

    path = weights_file(vgg16_url(), path, "--perceptual_weights", "the VQGAN's perceptual loss (LPIPS)")
    vgg = torchvision.models.vgg16()
    try:
        vgg.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    except (RuntimeError, KeyError, AttributeError, TypeError) as e:
        raise ValueError(
            f"--perceptual_weights {path}: not torchvision's VGG-16 ({str(e).splitlines()[0][:160]}): pass "
            "vgg16-397923af.pth, or --perceptual_weight 0 to train without the perceptual loss"
        ) from None
    net = _LPIPS(pretrained=True, net="vgg", pnet_rand=True)  # linear layers: torchmetrics' file; backbone: below
    for i in range(1, 6):
        for name, layer in getattr(net.net, f"slice{i}").named_children():
            layer.load_state_dict(vgg.features[int(name)].state_dict())
    return net.eval().requires_grad_(False).to(device)
