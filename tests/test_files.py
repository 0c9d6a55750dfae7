"""dalle_pytorch/files.py: a .safetensors path holds a whole export (nested config, tokenizer, several models'
weights) with no pickle; damaged or foreign files end in one line."""

import json
import os
import stat

import pytest
import torch
from safetensors import safe_open

from dalle_pytorch.files import atomic_save, safe_load


def test_a_nested_export_round_trips_without_pickle(tmp_path):
    emb = torch.randn(5, 3)
    tree = {
        "format_version": 1,
        "kind": "dalle",
        "config": {"dim": 3, "normalization": ((0.5,) * 3, (0.5,) * 3), "name": "x", "flag": None},
        "weights": {"text_emb.weight": emb, "to_logits.weight": emb, "bos": torch.arange(3, dtype=torch.int64)},
        "vae": {"kind": "vae", "weights": {"enc.0.weight": torch.ones(2, 2, dtype=torch.bfloat16)}},
        "tokenizer": {"kind": "byte", "vocab": ["a", "b"]},
    }
    path = str(tmp_path / "dalle.safetensors")
    atomic_save(tree, path)  # tied weights (one tensor under two names) are stored twice
    back = safe_load(path)
    assert back["config"] == {"dim": 3, "normalization": [[0.5] * 3, [0.5] * 3], "name": "x", "flag": None}
    assert torch.equal(back["weights"]["text_emb.weight"], emb) and torch.equal(
        back["weights"]["to_logits.weight"], emb
    )
    assert (
        back["weights"]["bos"].dtype == torch.int64 and back["vae"]["weights"]["enc.0.weight"].dtype == torch.bfloat16
    )
    assert back["tokenizer"] == tree["tokenizer"]
    with safe_open(path, framework="pt") as f:  # plain safetensors: any reader sees the tensors and the JSON
        assert set(f.keys()) == {
            "weights/text_emb.weight",
            "weights/to_logits.weight",
            "weights/bos",
            "vae/weights/enc.0.weight",
        }
        assert json.loads(f.metadata()["dalle_pytorch"])["kind"] == "dalle"


def test_damaged_and_foreign_files_say_so(tmp_path):
    path = tmp_path / "dalle.safetensors"
    atomic_save({"weights": {"w": torch.zeros(100)}}, str(path))
    path.write_bytes(path.read_bytes()[:60])
    with pytest.raises(ValueError, match="truncated or corrupted"):
        safe_load(str(path))
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not one of this project's"):
        safe_load(str(tmp_path / "other.safetensors"))


def test_exports_of_either_format_load_whatever_their_name(tmp_path):
    """The default export is safetensors; a .pt one (earlier versions, or --dalle_output x.pt) loads as before,
    and a renamed copy is read by its content."""
    import shutil

    from dalle_pytorch.inference.export import load_export, save_export

    weights = {"w": torch.randn(3, 2)}
    for name in ("vae.safetensors", "vae.pt"):
        save_export(str(tmp_path / name), "vae", {"dim": 2, "normalization": None}, weights)
    shutil.copy(tmp_path / "vae.safetensors", tmp_path / "renamed.pt")
    assert (tmp_path / "vae.pt").read_bytes()[:2] == b"PK"  # torch's zip
    for name in ("vae.safetensors", "vae.pt", "renamed.pt"):
        export = load_export(str(tmp_path / name), "vae")
        assert export["kind"] == "vae" and torch.equal(export["weights"]["w"], weights["w"]), name


@pytest.mark.parametrize("name", ["export.safetensors", "export.pt"])
def test_exports_get_the_users_file_mode(tmp_path, name):
    """As any file the user writes (umask 022: 0644), not safetensors' private 0600: a cluster's shared run
    folder is read by others."""
    old = os.umask(0o022)
    try:
        atomic_save({"weights": {"w": torch.zeros(3)}}, str(tmp_path / name))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644
