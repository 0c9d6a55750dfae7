import dataclasses
import hashlib
import json
import os

import pytest
import torch

from dalle_pytorch.data.folders import CaptionFolder, ImageFolder
from dalle_pytorch.data.shapes import pil_to_tensor, sample
from dalle_pytorch.data.shapes_export import export_folder, export_wds
from dalle_pytorch.data.wds import WebDatasetPairs


def test_image_folder_nested_and_corrupt(tmp_path):
    export_folder(str(tmp_path), 6, image_size=16, per_dir=3)  # two nested folders
    (tmp_path / "00001" / "broken.png").write_bytes(b"not a png")
    ds = ImageFolder(str(tmp_path), 16)
    assert len(ds) == 7
    with pytest.warns(UserWarning, match="skipping unreadable"):
        items = [ds[i][0] for i in range(len(ds))]
    assert all(x.shape == (3, 16, 16) for x in items)
    assert ds.num_skipped == 1


def test_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no images under .* expected files ending in .png"):
        ImageFolder(str(tmp_path), 16)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ImageFolder(str(tmp_path / "missing"), 16)


def test_caption_folder_pairs_by_path(tmp_path):
    for sub, color in (("a", (255, 0, 0)), ("b", (0, 0, 255))):
        os.makedirs(tmp_path / sub)
        from PIL import Image

        Image.new("RGB", (16, 16), color).save(tmp_path / sub / "1.png")
        (tmp_path / sub / "1.txt").write_text(f"\n{sub} caption\n\n")
    (tmp_path / "a" / "lonely.png").write_bytes(b"")  # no caption: not a pair
    ds = CaptionFolder(str(tmp_path), 16, resize_ratio=1.0)
    assert len(ds) == 2
    (img_a, cap_a), (img_b, cap_b) = ds[0], ds[1]
    assert cap_a == "a caption" and img_a[0].mean() > 0.9  # red image with its own caption
    assert cap_b == "b caption" and img_b[2].mean() > 0.9


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.mul(255).round().byte().numpy().tobytes()).hexdigest()


def test_webdataset_split_by_rank_and_worker_reads_each_sample_once(tmp_path):
    shards = export_wds(str(tmp_path), 40, image_size=16, per_shard=5)  # 8 shards
    assert len(shards) == 8
    expected = sorted(_digest(pil_to_tensor(sample(0, i, 16)[0])) for i in range(40))
    seen = []
    urls = str(tmp_path / "shard-{000000..000007}.tar")
    for rank in range(2):
        ds = WebDatasetPairs(urls, "png,txt", 16, resize_ratio=1.0, rank=rank, world_size=2)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
        seen += [_digest(img) for img, cap in loader]
    assert sorted(seen) == expected


@pytest.mark.parametrize("shards, world", [(1, 2), (2, 3)])
def test_webdataset_with_fewer_shards_than_processes_splits_by_sample(tmp_path, shards, world):
    """One big tar on more processes than shards (the predecessor allowed it): each reads all, keeps its share."""
    export_wds(str(tmp_path), 12, image_size=16, per_shard=12 // shards)
    expected = sorted(_digest(pil_to_tensor(sample(0, i, 16)[0])) for i in range(12))
    seen = []
    for rank in range(world):
        ds = WebDatasetPairs(str(tmp_path), "png,txt", 16, resize_ratio=1.0, rank=rank, world_size=world)
        loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="fork")
        mine = [_digest(img) for img, _ in loader]
        assert len(mine) == 12 // world
        seen += mine
    assert sorted(seen) == expected


def test_webdataset_json_captions(tmp_path):
    """img2dataset's `jpg,json` layout: the record's caption field (the predecessor tokenized the raw JSON)."""
    import io
    import json

    import webdataset as wds

    with wds.TarWriter(str(tmp_path / "a.tar")) as sink:
        for i, record in enumerate(({"caption": "a red circle"}, {"url": "no caption"})):
            buf = io.BytesIO()
            sample(0, i, 16)[0].save(buf, format="PNG")
            sink.write({"__key__": f"{i}", "png": buf.getvalue(), "json": json.dumps(record).encode()})
    ds = WebDatasetPairs(str(tmp_path / "a.tar"), "png,json", 16)
    with pytest.warns(UserWarning, match='no "caption" or "text"'):
        assert [item[1] for item in ds if item is not None] == ["a red circle"]
    assert ds.num_skipped == 1


def test_webdataset_corrupt_sample_skipped(tmp_path):
    import io
    import tarfile

    path = tmp_path / "bad.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in (("x.png", b"garbage"), ("x.txt", b"a caption")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ds = WebDatasetPairs(str(path), "png,txt", 16)
    with pytest.warns(UserWarning, match="skipping an unreadable"):
        assert list(ds) == [None]  # a skipped sample's place (its batch fills it)
    assert ds.num_skipped == 1 and ds.skip_counts()["bad_image"] == 1


@pytest.mark.e2e
def test_streamed_run_knows_its_epoch_from_the_counted_shards(tmp_path, capsys):
    """The shards' samples are counted once (shards.json in the run), so --epochs works on a stream too."""
    from helpers import TINY_VAE_MODEL

    import train_vae

    export_wds(str(tmp_path / "shards"), 16, image_size=16, per_shard=4)
    urls = str(tmp_path / "shards" / "shard-{000000..000003}.tar")
    train_vae.main(
        [*TINY_VAE_MODEL, "--wds", "png", "--image_folder", urls, "--output_dir", str(tmp_path), "--epochs", "2",
         "--batch_size", "4", "--num_workers", "0", "--sample_every", "0", "--save_every_n_steps", "0"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "4 WebDataset shards, 16 samples" in out and "done at step 8" in out
    with open(tmp_path / "vae" / "shards.json") as f:
        assert sorted(json.load(f)["samples"].values()) == [4, 4, 4, 4]


def test_the_text_tokenizer_builder(tmp_path):
    """One builder for the trainers and convert: a BPE trained on rank 0 beside the run, kept when resuming,
    retrained for a new run, read back without data (convert), and a clear error when it is missing."""
    from dalle_pytorch.data.build import TextTokenizerConfig, build_text_tokenizer
    from dalle_pytorch.data.shapes import ShapesDataset

    flags = TextTokenizerConfig(tokenizer="yttm", bpe_vocab_size=64)
    shared = []
    tok = build_text_tokenizer(flags, str(tmp_path), ShapesDataset(50, 16), share=lambda t: shared.append(t) or t)
    assert shared == [(tmp_path / "bpe.yttm").read_text()] and tok.vocab_size == 64
    # another rank gets the text from rank 0 (through the process group), not from a file it may not see
    other = build_text_tokenizer(flags, str(tmp_path / "elsewhere"), ShapesDataset(50, 16), is_main=False,
                                 share=lambda t: shared[0])  # fmt: skip
    assert other.encode("a red circle") == tok.encode("a red circle")
    assert not (tmp_path / "elsewhere").exists()
    path = tmp_path / "bpe.yttm"
    stamp = path.stat().st_mtime_ns
    build_text_tokenizer(flags, str(tmp_path), ShapesDataset(50, 16), resuming=True)
    assert path.stat().st_mtime_ns == stamp  # a resumed run keeps its vocabulary
    read = build_text_tokenizer(flags, str(tmp_path))
    assert read.encode("a red circle") == tok.encode("a red circle")
    assert build_text_tokenizer(dataclasses.replace(flags, tokenizer="byte"), str(tmp_path)).vocab_size == 257
    with pytest.raises(FileNotFoundError, match="bpe.yttm is missing"):
        build_text_tokenizer(flags, str(tmp_path / "elsewhere"))
