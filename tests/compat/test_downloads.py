"""Downloads of the predecessor's default tokenizers (compat/downloads.py) against a local HTTP server:
verification, resuming, servers that ignore Range, offline machines, one download for concurrent ranks,
and the tokenizers loaded through it (a bare --taming, no VAE with a data folder, generate.py's export)."""

import dataclasses
import hashlib
import json
import multiprocessing
import os
import socket

import pytest
import torch

from dalle_pytorch.compat import downloads
from dalle_pytorch.compat.downloads import Remote, fetch
from dalle_pytorch.errors import user_errors

DATA = os.urandom(300_000)  # three blocks of downloads.CHUNK once the tests shrink it


@pytest.fixture(autouse=True)
def small_file(server, monkeypatch):
    """A 300 kB file named `small` in the registry, served by the local server (conftest.py)."""
    server.files["small.bin"] = DATA
    monkeypatch.setattr(downloads, "CHUNK", 100_000)
    monkeypatch.setitem(downloads.REGISTRY, "small", Remote("https://example.invalid/small.bin", "small.bin"))
    server.path = os.path.join(os.environ["DALLE_CACHE"], "pretrained", "small.bin")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_download_verifies_records_and_rereads(server, capsys):
    path = fetch("small")
    assert path == server.path and open(path, "rb").read() == DATA and not os.path.exists(path + ".part")
    assert server.log == [("small.bin", None)]
    assert "downloading http://127.0.0.1" in capsys.readouterr().out
    with open(path + ".download.json") as f:  # nothing is published: what the first download saw is kept
        assert json.load(f) == {
            "url": f"{os.environ['DALLE_PYTORCH_URL_BASE']}/small.bin",
            "size": 300_000,
            "sha256": sha(DATA),
        }
    assert fetch("small") == path and len(server.log) == 1  # read again from the cache, verified
    with open(path, "r+b") as f:  # a damaged file is deleted, and the error says so
        f.write(bytes([DATA[0] ^ 1]))
    with pytest.raises(ValueError, match=f"{path} does not match .*small.bin: sha256 .* deleted it"):
        fetch("small")
    assert not os.path.exists(path)
    assert fetch("small") == path and open(path, "rb").read() == DATA and len(server.log) == 2


def test_the_registry_follows_the_url_base(server, monkeypatch):
    base = os.environ["DALLE_PYTORCH_URL_BASE"]
    assert downloads.url_of(downloads.REGISTRY["openai_encoder"]) == f"{base}/encoder.pkl"
    assert downloads.url_of(downloads.REGISTRY["vqgan_1024_model"]) == f"{base}/vqgan.1024.model.ckpt"
    monkeypatch.delenv("DALLE_PYTORCH_URL_BASE")
    assert downloads.url_of(downloads.REGISTRY["openai_decoder"]) == "https://cdn.openai.com/dall-e/decoder.pkl"
    with pytest.raises(ValueError, match="no downloadable file 'nope': expected one of openai_encoder"):
        fetch("nope")


def test_a_dropped_download_resumes_with_the_remainder_only(server):
    server.cut_at = 120_000
    with pytest.raises(FileNotFoundError) as e:
        fetch("small")
    message = str(e.value)
    assert "closed after 120000 of 300000 bytes" in message and f"place the file at {server.path}" in message
    assert f"resume from the 120000 bytes in {server.path}.part" in message and "\n" not in message
    assert os.path.getsize(server.path + ".part") == 120_000 and not os.path.exists(server.path)
    server.sent = 0
    assert open(fetch("small"), "rb").read() == DATA
    assert server.log[-1] == ("small.bin", "bytes=120000-") and server.sent == 180_000


def test_a_server_that_ignores_range_restarts_from_the_start(server, capsys):
    os.makedirs(os.path.dirname(server.path))
    with open(server.path + ".part", "wb") as f:
        f.write(DATA[:150_000])
    server.ignore_range = True
    assert open(fetch("small"), "rb").read() == DATA
    assert server.log == [("small.bin", "bytes=150000-")] and server.sent == 300_000
    assert "ignores HTTP Range: downloading it from the start" in capsys.readouterr().out


def test_a_stale_part_the_server_cannot_continue_is_dropped(server):
    os.makedirs(os.path.dirname(server.path))
    with open(server.path + ".part", "wb") as f:
        f.write(b"y" * 400_000)  # longer than the file: 416, then the whole file
    assert open(fetch("small"), "rb").read() == DATA
    assert server.log == [("small.bin", "bytes=400000-"), ("small.bin", None)]


@pytest.mark.parametrize("pin", ["size", "sha256"])
def test_a_file_that_differs_from_its_pin_is_refused(server, monkeypatch, pin):
    wrong = {"size": 300_001} if pin == "size" else {"sha256": sha(b"another file")}
    monkeypatch.setitem(downloads.REGISTRY, "small", Remote("https://example.invalid/small.bin", "small.bin", **wrong))
    with pytest.raises(ValueError) as e:
        fetch("small")
    message = str(e.value)
    if pin == "size":
        assert "announces 300000 bytes, expected 300001 (pinned in dalle_pytorch/compat/downloads.py)" in message
    else:
        assert f"sha256 {sha(DATA)}, expected {wrong['sha256']} (pinned" in message and "deleted it" in message
        assert not os.path.exists(server.path + ".part")
    assert not os.path.exists(server.path) and f"place the right file at {server.path}" in message
    right = {"size": 300_000, "sha256": sha(DATA)}
    monkeypatch.setitem(downloads.REGISTRY, "small", Remote("https://example.invalid/small.bin", "small.bin", **right))
    assert open(fetch("small"), "rb").read() == DATA


def test_an_offline_machine_gets_one_line_naming_the_path(server, monkeypatch, capsys):
    monkeypatch.setitem(downloads.REGISTRY, "gone", Remote("https://example.invalid/gone.bin", "gone.bin"))
    with pytest.raises(
        FileNotFoundError, match=r"gone.bin \(HTTP 404 .*\): place the file at .*gone.bin \(no published"
    ):
        fetch("gone")
    with socket.socket() as s:  # a port nothing listens on: connection refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("DALLE_PYTORCH_URL_BASE", f"http://127.0.0.1:{port}")
    monkeypatch.setitem(
        downloads.REGISTRY, "small", Remote("https://example.invalid/small.bin", "small.bin", 3, "ab" * 32)
    )
    with pytest.raises(SystemExit), user_errors(debug=False):
        fetch("small")
    err = capsys.readouterr().err
    assert err.startswith(f"error: could not download http://127.0.0.1:{port}/small.bin (")
    assert f"refused): place the file at {server.path} (sha256 {'ab' * 32})" in err and err.count("\n") == 1


def test_a_file_placed_by_hand_is_used_and_recorded(server):
    os.makedirs(os.path.dirname(server.path))
    with open(server.path, "wb") as f:
        f.write(DATA)
    assert fetch("small") == server.path and server.log == []
    with open(server.path + ".download.json") as f:
        assert json.load(f)["sha256"] == sha(DATA)


def test_the_predecessors_download_is_copied(server, tmp_path, capsys):
    os.makedirs(tmp_path / "predecessor")
    (tmp_path / "predecessor" / "small.bin").write_bytes(DATA)
    assert open(fetch("small"), "rb").read() == DATA and server.log == []
    assert "copying the predecessor's download" in capsys.readouterr().out


def _fetch_in_child(start, results):
    start.wait(10)
    path = fetch("small")
    results.put(sha(open(path, "rb").read()))


def test_concurrent_ranks_download_once(server, capfd):
    server.delay = 0.1  # 0.6 s for the download: the second process arrives while the first holds the lock
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_fetch_in_child, args=(start, results)) for _ in range(2)]
    for p in procs:
        p.start()
    start.set()
    got = [results.get(timeout=30) for _ in procs]
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert got == [sha(DATA)] * 2 and server.log == [("small.bin", None)]
    assert "waiting for another process to download" in capfd.readouterr().out


# ---------------------------------------------------------------------------- the tokenizers through it


def flags(**given):
    from dalle_pytorch.inference.image_tokenizers import ImageTokenizerConfig

    return ImageTokenizerConfig(**given)


def test_a_bare_taming_loads_the_default_vqgan(pretrained_server):
    from dalle_pytorch.inference.image_tokenizers import load_image_tokenizer, tokenizer_flag

    taming = flags(taming=True)
    vae, record, fingerprint = load_image_tokenizer(taming)
    cache = os.path.dirname(pretrained_server.path)
    assert record["kind"] == "vqgan" and vae.image_size == 16 and fingerprint == record["fingerprint"]
    assert record["paths"] == {
        "vqgan_model_path": os.path.join(cache, "vqgan.1024.model.ckpt"),
        "vqgan_config_path": os.path.join(cache, "vqgan.1024.config.yml"),
    }
    assert record["downloaded"] == {"vqgan_model_path": ["vqgan_1024_model"]}
    assert [name for name, _ in pretrained_server.log] == ["vqgan.1024.config.yml", "vqgan.1024.model.ckpt"]
    assert tokenizer_flag(taming) == "--taming (the predecessor's default VQGAN, downloaded)"
    with pytest.raises(ValueError, match=r"--vqgan_config_path \(\.yaml\) together, or neither"):
        load_image_tokenizer(flags(taming=True, vqgan_model_path="m.ckpt"))


def test_no_vae_with_a_data_folder_loads_openais_dvae_and_generate_refetches_it(pretrained_server, tmp_path, capsys):
    from dalle_pytorch.inference.export import save_export
    from dalle_pytorch.inference.image_tokenizers import load_image_tokenizer
    from dalle_pytorch.inference.load import load_dalle
    from dalle_pytorch.models.dalle import DALLE, DALLEConfig

    vae, record, _ = load_image_tokenizer(flags(pretrained_image_size=16), data_given=True)
    out = capsys.readouterr().out
    assert "no --vae_path: using OpenAI's pretrained dVAE, the predecessor's default (pass --vae_path" in out
    cache = os.path.dirname(pretrained_server.path)
    assert record["kind"] == "openai" and record["paths"] == {"openai_vae_path": cache} and vae.num_tokens == 64
    os.makedirs(tmp_path / "empty")  # a folder without the files: downloaded too (here: already in the cache)
    _, again, _ = load_image_tokenizer(flags(pretrained_image_size=16, openai_vae_path=str(tmp_path / "empty")))
    assert again["fingerprint"] == record["fingerprint"] and len(pretrained_server.log) == 2
    with pytest.raises(ValueError, match="--vae_path is required: .* OpenAI's dVAE is downloaded"):
        load_image_tokenizer(flags(pretrained_image_size=16))

    # generate.py on a machine whose cache lacks the files fetches them again
    cfg = DALLEConfig(dim=32, depth=1, heads=2, dim_head=16, text_seq_len=8, num_image_tokens=64, image_fmap_size=2)
    dalle = DALLE(cfg)
    export = str(tmp_path / "dalle.pt")
    byte_tokenizer = {"kind": "byte", "data": ""}
    save_export(export, "dalle", dataclasses.asdict(cfg), dalle.state_dict(), vae=record, tokenizer=byte_tokenizer)
    for name in ("encoder.pkl", "decoder.pkl"):
        os.remove(os.path.join(cache, name))
    _, vae2, _ = load_dalle(export)
    assert [name for name, _ in pretrained_server.log[2:]] == ["encoder.pkl", "decoder.pkl"]
    images = torch.rand(1, 3, 16, 16)
    assert torch.equal(vae2.get_codebook_indices(images), vae.get_codebook_indices(images))
