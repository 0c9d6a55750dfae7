import pytest

from dalle_pytorch.data.shapes import HELD_OUT_PAIRS, ShapesDataset, sample
from dalle_pytorch.eval.parse import parse_image, score


@pytest.mark.parametrize("size", [32, 64])
def test_parser_reads_clean_images(size):
    n = 300
    full = sum(score(sample(3, i, size)[2], parse_image(sample(3, i, size)[0]))["full"] for i in range(n))
    assert full / n >= 0.99


def test_parser_rejects_wrong_scene():
    img, _, scene = sample(0, 5, 32)
    other = next(sample(0, j, 32)[2] for j in range(6, 100) if sample(0, j, 32)[2].objects != scene.objects)
    assert score(scene, parse_image(img))["full"]
    assert not score(other, parse_image(img))["full"]


def test_deterministic_and_splits_disjoint():
    a, b = sample(7, 11, 32), sample(7, 11, 32)
    assert a[1] == b[1] and a[0].tobytes() == b[0].tobytes()
    for i in range(200):
        train = sample(0, i, 32, "train")[2]
        held = sample(0, i, 32, "heldout")[2]
        assert not any((o.color, o.shape) in HELD_OUT_PAIRS for o in train.objects)
        assert any((o.color, o.shape) in HELD_OUT_PAIRS for o in held.objects)


def test_captions_name_every_attribute():
    for i in range(100):
        _, cap, scene = sample(1, i, 32)
        for o in scene.objects:
            assert o.color in cap and o.shape in cap


def test_dataset_item():
    ds = ShapesDataset(10, 32)
    img, cap = ds[3]
    assert img.shape == (3, 32, 32) and 0 <= img.min() and img.max() <= 1 and isinstance(cap, str)
    with pytest.raises(ValueError, match="image_size"):
        ShapesDataset(10, 8)
