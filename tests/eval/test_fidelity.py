"""Image quality on your data (`python -m dalle_pytorch.eval --image_text_folder VAL`): FID, KID, IS, precision/recall
equal torch-fidelity's own command on the folders the evaluation wrote, with the same weights files. No weights can
be downloaded here, so the files are torch-fidelity's Inception v3 and torchvision's VGG-16 architectures holding
fixed random values."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from unittest import mock

import pytest
import torch
from helpers import ROOT
from launch import BIN, PORTS
from torchvision.utils import save_image

from dalle_pytorch.data.shapes import ShapesDataset
from dalle_pytorch.eval import evaluate
from dalle_pytorch.eval.fidelity import FidelityConfig, fidelity_metrics

pytestmark = pytest.mark.e2e
N = 12  # images scored: the Inception Score's 10 splits need 10


@pytest.fixture(scope="module")
def weights(inception, vgg16):
    return ["--inception_weights", inception, "--vgg16_weights", vgg16]


@pytest.fixture(scope="module")
def val(tmp_path_factory):
    """A caption folder as users have them: 24 images (64 x 64, resized to the model's 16 on reading) with a .txt
    caption beside each."""
    root = tmp_path_factory.mktemp("val")
    data = ShapesDataset(24, 64, seed=7, split="train")
    for i in range(24):
        image, caption = data[i]
        save_image(image, root / f"{i:03d}.png")
        (root / f"{i:03d}.txt").write_text(caption)
    return str(root)


def library_command(generated: str, reference: str, inception: str, vgg16: str = "") -> dict:
    """torch-fidelity's own command line on the two folders: IS, FID, KID (its default: Inception), then
    precision/recall (its default: VGG-16), each with its weights file."""
    command = [os.path.join(os.path.dirname(sys.executable), "fidelity"), "--input1", generated, "--input2", reference]
    command += ["--cpu", "--json", "--no-cache", "--samples-find-ext", "png", "--kid-subset-size", str(N)]
    figures = {}
    for metrics, weights in ((["--isc", "--fid", "--kid"], inception), (["--prc"], vgg16)):
        if not weights:
            continue
        run = [*command, *metrics, "--feature-extractor-weights-path", weights]
        figures.update(json.loads(subprocess.run(run, capture_output=True, text=True, timeout=600, check=True).stdout))
    return figures


def assert_library_figures(ours: dict, theirs: dict) -> None:
    names = {
        "fid": "frechet_inception_distance",
        "kid": "kernel_inception_distance_mean",
        "inception_score": "inception_score_mean",
        "precision": "precision",
        "recall": "recall",
    }
    for name, key in names.items():
        assert abs(ours[name] - theirs[key]) <= 1e-4 * max(1.0, abs(theirs[key])), (name, ours[name], theirs[key])


def dalle_argv(exports, val, weights, out) -> list[str]:
    dalle, clip = exports
    return ["--dalle_path", dalle, "--image_text_folder", val, "--num_images", str(N), *weights, "--clip_path", clip]


@pytest.fixture(scope="module")
def one_process(exports, val, weights, tmp_path_factory):
    """The evaluation of a DALLE with a CLIP that keeps the best of 2 samples per caption, in this process."""
    out = tmp_path_factory.mktemp("eval") / "eval"
    results = evaluate.main([*dalle_argv(exports, val, weights, out), "--candidates", "2", "--out", str(out)])["dalle"]
    return out, results


def test_a_dalle_on_your_data_scores_as_torch_fidelitys_command(one_process, inception, vgg16):
    out, results = one_process
    for folder in ("reference", "generated", "generated_reranked"):
        assert sorted(os.listdir(out / folder)) == [f"{i:06d}.png" for i in range(N)]
    assert not [p for p in os.listdir(out) if p.startswith(".partial")]
    assert json.loads((out / "results.json").read_text())["dalle"] == results
    assert results["num_images"] == N and "torch-fidelity" in results["fidelity"]["library"]
    assert_library_figures(results, library_command(str(out / "generated"), str(out / "reference"), inception, vgg16))
    assert results["reranked"]["candidates"] == 2 and results["reranked"]["fid"] > 0  # the same path
    assert 0 <= results["clip_score"] <= 100 and results["reranked"]["clip_score"] >= results["clip_score"] - 1e-6
    assert "fid" in (out / "results.txt").read_text() and (out / "grid.png").exists()


@pytest.mark.launcher
def test_under_torchrun_each_rank_generates_its_share_and_the_figures_are_the_same(
    one_process, exports, val, weights, tmp_path
):
    single, expected = one_process
    out = tmp_path / "eval"
    port = str(next(PORTS))
    command = [
        os.path.join(BIN, "torchrun"),
        "--nproc_per_node",
        "2",
        "--master_port",
        port,
        "-m",
        "dalle_pytorch.eval",
    ]
    command += [*dalle_argv(exports, val, weights, out), "--candidates", "2", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for folder in ("reference", "generated", "generated_reranked"):
        for name in sorted(os.listdir(single / folder)):
            assert (out / folder / name).read_bytes() == (single / folder / name).read_bytes(), (folder, name)
    results = json.loads((out / "results.json").read_text())["dalle"]
    assert results.keys() == expected.keys()
    for name in ("fid", "kid", "inception_score", "precision", "recall", "clip_score"):
        assert results[name] == pytest.approx(expected[name], rel=1e-6, abs=1e-9), name


def test_the_figures_behave_on_known_sets(val, inception, vgg16, tmp_path):
    """A set against itself: FID 0. Two halves of one set: far below either half against noise."""
    halves = [tmp_path / "a", tmp_path / "b", tmp_path / "noise"]
    for folder in halves:
        folder.mkdir()
    images = sorted(p for p in os.listdir(val) if p.endswith(".png"))
    for i, name in enumerate(images):
        os.symlink(os.path.join(val, name), halves[i % 2] / name)
    g = torch.Generator().manual_seed(0)
    for i in range(N):
        save_image(torch.rand(3, 64, 64, generator=g), halves[2] / f"{i:03d}.png")
    cfg = FidelityConfig(inception_weights=inception, vgg16_weights=vgg16)
    itself = fidelity_metrics(str(halves[0]), str(halves[0]), cfg)
    assert abs(itself["fid"]) < 1e-3 and itself["precision"] == itself["recall"] == 1.0
    halves_fid = fidelity_metrics(str(halves[0]), str(halves[1]), cfg, precision_recall=False)["fid"]
    noise_fid = fidelity_metrics(str(halves[0]), str(halves[2]), cfg, precision_recall=False)["fid"]
    assert halves_fid < noise_fid / 3, (halves_fid, noise_fid)


def test_a_tokenizer_alone_reports_rfid_psnr_ssim_and_codebook_use(vae_path, val, inception, vgg16, weights, tmp_path):
    out = tmp_path / "eval"
    argv = ["--vae_path", vae_path, "--image_text_folder", val, "--num_images", str(N), "--out", str(out)]
    v = evaluate.main([*argv, *weights, "--no-precision_recall"])["vae"]  # P/R: the DALLE's test above
    assert sorted(os.listdir(out / "reconstructed")) == [f"{i:06d}.png" for i in range(N)]
    assert v["rfid"] > 0 and 0 < v["ssim"] <= 1 and v["psnr"] > 5 and 0 < v["codebook_usage"] <= 1
    assert "inception_score" not in v
    theirs = library_command(str(out / "reconstructed"), str(out / "reference"), inception)  # P/R: the test above
    assert abs(v["rfid"] - theirs["frechet_inception_distance"]) <= 1e-4 * theirs["frechet_inception_distance"]


def test_bad_input_is_one_line_and_nothing_is_written_half(vae_path, val, inception, weights, tmp_path, capsys):
    def fails(*extra: str) -> str:
        argv = ["--vae_path", vae_path, "--image_text_folder", val, "--out", str(tmp_path / "eval"), *extra]
        with pytest.raises(SystemExit):
            evaluate.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1, err
        return err[0]

    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no images under" in fails("--image_text_folder", str(empty), *weights)
    assert "24 readable pairs, fewer than --num_images 30" in fails("--num_images", "30", *weights)
    assert "--num_images must be at least 10" in fails("--num_images", "5", *weights)
    wrong = tmp_path / "wrong.pth"
    torch.save(torch.nn.Linear(2, 2).state_dict(), wrong)
    assert f"--inception_weights {wrong}: not the inception-v3-compat network" in fails(
        "--num_images", str(N), *weights, "--inception_weights", str(wrong)
    )
    assert not os.path.exists(tmp_path / "eval" / "reference")  # scoring failed: no folder kept
    assert not [p for p in os.listdir(tmp_path / "eval") if p.startswith(".partial")]
    assert "no such file" in fails("--num_images", str(N), "--inception_weights", str(tmp_path / "missing.pth"))
    with mock.patch.dict(os.environ, {"TORCH_HOME": str(tmp_path / "torch")}):  # no weights cached, no network
        line = fails("--num_images", str(N))
    assert "FID needs weights-inception-2015-12-05-6726825d.pth and it could not be downloaded" in line
    assert line.endswith("or pass --inception_weights PATH")


def test_a_pretrained_taming_vqgan_is_evaluated_from_its_files(val, inception, weights, tmp_path):
    """A taming VQGAN as its repository writes it (model.yaml + a Lightning last.ckpt), random weights."""
    import yaml
    from pretrained_refs import VQGAN_DDCONFIG

    from dalle_pytorch.models.vqgan import VQGAN, VQGANConfig

    torch.manual_seed(0)
    model = VQGAN(VQGANConfig(**{k: v for k, v in VQGAN_DDCONFIG.items() if k != "dropout"}, n_embed=64, embed_dim=32))
    params = {"embed_dim": 32, "n_embed": 64, "ddconfig": dict(VQGAN_DDCONFIG)}
    config = tmp_path / "model.yaml"
    config.write_text(yaml.safe_dump({"model": {"target": "taming.models.vqgan.VQModel", "params": params}}))
    torch.save({"state_dict": model.state_dict()}, tmp_path / "last.ckpt")
    out = tmp_path / "eval"
    argv = ["--taming", "--vqgan_model_path", str(tmp_path / "last.ckpt"), "--vqgan_config_path", str(config), *weights]
    argv += ["--no-precision_recall"]
    v = evaluate.main([*argv, "--image_text_folder", val, "--num_images", str(N), "--out", str(out)])["vae"]
    assert v["rfid"] > 0 and 0 < v["codebook_usage"] <= 1 and v["num_images"] == N
    assert len(os.listdir(out / "reconstructed")) == N


def test_a_bare_taming_and_openais_dvae_are_downloaded_as_train_dalle_downloads_them(
    pretrained_server, val, weights, tmp_path
):
    """The predecessor's default tokenizers (tiny ones from the tests' server): `--taming` alone, and
    `--openai_vae_path` naming a folder without OpenAI's files, load as train_dalle.py loads them."""
    empty = tmp_path / "dall_e"
    empty.mkdir()
    for name, flags in (("taming", ["--taming"]), ("openai", ["--openai_vae_path", str(empty)])):
        argv = [*flags, *weights, "--image_text_folder", val, "--num_images", str(N), "--out", str(tmp_path / name)]
        argv += ["--no-precision_recall"]
        v = evaluate.main(argv)["vae"]
        assert v["rfid"] > 0 and 0 < v["codebook_usage"] <= 1 and v["num_images"] == N
        assert len(os.listdir(tmp_path / name / "reconstructed")) == N
    fetched = sorted(name for name, _ in pretrained_server.log)
    assert fetched == ["decoder.pkl", "encoder.pkl", "vqgan.1024.config.yml", "vqgan.1024.model.ckpt"]


def test_on_the_built_in_data_fid_sits_beside_the_parsers_rates(exports, vae_path, inception, weights, tmp_path):
    """--fid on the built-in dataset: each split's first sample per caption scored against the dataset's own images
    for those captions, in the same results as the parser's rates; a VAE's rFID beside its parsed reconstructions.
    (CLIP's best of the samples goes through the same code: evaluate_dalle's docstring.)"""
    dalle, _ = exports
    out = tmp_path / "eval"
    argv = ["--dalle_path", dalle, "--vae_path", vae_path, "--num_images", str(N), "--fid", *weights]
    argv += ["--no-precision_recall"]  # the figures' path is the on-data test's; VGG-16 would double the time
    results = evaluate.main([*argv, "--out", str(out)])
    d, v = results["dalle"], results["vae"]
    for split in ("seen", "heldout"):
        for folder in ("reference", "generated"):
            assert sorted(os.listdir(out / split / folder)) == [f"{i:06d}.png" for i in range(N)], (split, folder)
        assert 0 <= d[split]["full"]["mean"] <= 1 and d[split]["num_images"] == N and d[split]["fid"] > 0
    assert "precision" not in d["seen"] and results["dalle"]["fidelity"]["precision_recall_features"] == "none"
    assert v["rfid"] > 0 and "full" in v["parse"] and v["num_images"] == N
    assert len(os.listdir(out / "reconstructed")) == N
    text = (out / "results.txt").read_text()
    assert "parsed correctly" in text and "seen, 12 images" in text and "rfid" in text
