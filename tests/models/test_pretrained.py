"""Pretrained image tokenizers: our VQGAN / Gumbel-VQ / OpenAI dVAE against the upstream code, loading
from Lightning checkpoints and pickled modules without running their code, and DALLE end to end.

Each equivalence is checked twice: against tests/fixtures/pretrained_reference.pt (written from the
upstream packages by tests/make_pretrained_fixture.py; always runs), and live against the upstream packages
when they are installed (`make install` installs them; see tests/pretrained_refs.py for how they import).
"""

import collections
import json
import os
import pickle
import shutil
import sys
import zipfile

import pytest
import torch
import yaml
from helpers import FIXTURES, TINY_DALLE_MODEL
from pretrained_refs import (
    VQGAN_DDCONFIG,
    block_images,
    dall_e_models,
    dall_e_tokenize,
    random_weights,
    shapes_of,
    taming_model,
    taming_tokenize,
)

from dalle_pytorch.files import safe_load
from dalle_pytorch.models.inert_pickle import load_untrusted
from dalle_pytorch.models.pretrained import load_openai, load_vqgan, read_vqgan_config, vqgan_weights
from dalle_pytorch.models.vqgan import VQGAN, VQGANConfig

FIXTURE = os.path.join(FIXTURES, "pretrained_reference.pt")


class CheckpointCallback:  # stands for Lightning's callbacks: classes weights_only refuses
    def __init__(self):
        self.best_model_score = torch.tensor(0.25)


class HParams:  # stands for hyper-parameters kept as an object (Lightning keeps an OmegaConf container so)
    def __init__(self, **kwargs):
        self.__dict__.update(kwargs)


def write_vqgan(tmp_path, weights, ddconfig, n_embed, embed_dim, gumbel, name="vqgan"):
    """A taming-style model.yaml and a Lightning-style last.ckpt with loss.* weights and pickled classes."""
    target = "taming.models.vqgan." + ("GumbelVQ" if gumbel else "VQModel")
    lossconfig = {"target": "taming.modules.losses.vqperceptual.VQLPIPSWithDiscriminator", "params": {"disc_start": 1}}
    params = {"embed_dim": embed_dim, "n_embed": n_embed, "ddconfig": dict(ddconfig), "lossconfig": lossconfig}
    config = {"model": {"base_learning_rate": 4.5e-6, "target": target, "params": params}}
    os.makedirs(tmp_path / name, exist_ok=True)
    config_path, ckpt_path = tmp_path / name / "model.yaml", tmp_path / name / "last.ckpt"
    config_path.write_text(yaml.safe_dump(config))
    state = {**weights, "loss.discriminator.main.0.weight": torch.randn(8, 3, 4, 4), "loss.logvar": torch.zeros(())}
    ckpt = {
        "epoch": 3,
        "global_step": 1000,
        "state_dict": state,
        "callbacks": {CheckpointCallback: CheckpointCallback()},
        "hyper_parameters": HParams(lr=1e-4),
    }
    torch.save(ckpt, ckpt_path)
    with pytest.raises(pickle.UnpicklingError):  # so the loader's no-code path is what gets tested
        torch.load(ckpt_path, weights_only=True)
    return str(ckpt_path), str(config_path)


def write_openai(tmp_path, enc_weights, dec_weights, name="openai"):
    os.makedirs(tmp_path / name, exist_ok=True)
    torch.save(enc_weights, tmp_path / name / "encoder.pt")
    torch.save(dec_weights, tmp_path / name / "decoder.pt")
    return str(tmp_path / name)


def split(weights):
    return (
        {k[4:]: v for k, v in weights.items() if k.startswith("enc.")},
        {k[4:]: v for k, v in weights.items() if k.startswith("dec.")},
    )


@pytest.fixture(scope="module")
def reference():
    return torch.load(FIXTURE, weights_only=True)


# The fixture's codes and images were computed by the upstream packages on another CPU, whose convolution
# kernels sum in another order: between this machine's AVX-512, AVX2 and SSE4.1 kernels (ATEN_CPU_CAPABILITY,
# ONEDNN_MAX_CPU_ISA) the encoders' scores moved by up to 3.3e-6 and the decoded images by up to 3.6e-6.
# A code must match where the upstream model chose it by more than MARGIN (300x that) over the runner-up; the
# decoded images within DECODED_ATOL (28x that), while a weight mapped wrongly moves them by 1e-2 or more.
MARGIN = 1e-3
DECODED_ATOL = 1e-4


def _regenerate(case):
    from make_pretrained_fixture import draws_hash

    shapes = {k: tuple(v) for k, v in case["shapes"].items()}
    new_draws = "torch's integer RNG draws other numbers than when the fixture was written"
    assert draws_hash(shapes, case["seed"]) == case["draws_sha1"], (
        f"{new_draws}: rerun tests/make_pretrained_fixture.py"
    )
    return random_weights(shapes, case["seed"])


def _check_against_fixture(vae, case):
    codes = vae.get_codebook_indices(case["images"])
    decided = case["margins"] > MARGIN
    assert case["codes"].unique().numel() > 8 and decided.float().mean() > 0.9  # the comparison means something
    assert torch.equal(codes[decided], case["codes"][decided])
    torch.testing.assert_close(vae.decode(case["codes"]), case["decoded"], atol=DECODED_ATOL, rtol=0)


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["vqgan", "gumbel_vqgan"])
def test_vqgan_matches_the_taming_fixture(reference, tmp_path, kind):
    case = reference[kind]
    weights = _regenerate(case)
    ckpt, config = write_vqgan(tmp_path, weights, case["ddconfig"], case["n_embed"], case["embed_dim"], kind != "vqgan")
    vae, record = load_vqgan(ckpt, config)
    assert record["kind"] == kind and vae.fmap_size == 8 and vae.num_tokens == 64 and vae.image_size == 16
    _check_against_fixture(vae, case)
    torch.save(weights, tmp_path / "plain.pt")  # a plain state dict, extracted from the checkpoint, reads too
    assert load_vqgan(str(tmp_path / "plain.pt"), config)[1]["fingerprint"] == record["fingerprint"]


@pytest.mark.e2e
def test_openai_matches_the_dall_e_fixture(reference, tmp_path):
    case = reference["openai"]
    directory = write_openai(tmp_path, *split(_regenerate(case)))
    vae, record = load_openai(directory, image_size=32)
    assert record["kind"] == "openai" and vae.fmap_size == 4 and vae.num_tokens == 512
    _check_against_fixture(vae, case)


@pytest.mark.e2e
@pytest.mark.parametrize("kind", ["vqgan", "gumbel_vqgan"])
def test_full_size_vqgans_have_the_upstream_weight_names_and_shapes(reference, tmp_path, kind):
    full = reference[kind]["full_size"]
    ckpt, config = write_vqgan(tmp_path, {}, full["ddconfig"], full["n_embed"], full["embed_dim"], kind != "vqgan")
    cfg = read_vqgan_config(config)
    assert cfg.fmap_size == (16 if kind == "vqgan" else 32) and cfg.gumbel == (kind != "vqgan")
    with torch.device("meta"):
        assert shapes_of(VQGAN(cfg)) == full["shapes"]


@pytest.mark.e2e
def test_full_size_openai_dvae_has_the_upstream_weight_names_and_shapes(reference):
    from dalle_pytorch.models.openai_dvae import OpenAIDiscreteVAE, OpenAIDVAEConfig

    full = reference["openai"]["full_size"]
    with torch.device("meta"):
        vae = OpenAIDiscreteVAE(OpenAIDVAEConfig())  # the defaults are the released model's sizes
    assert shapes_of(vae.enc) == full["enc"] and shapes_of(vae.dec) == full["dec"] and vae.fmap_size == 32


@pytest.mark.parametrize("gumbel", [False, True], ids=["VQModel", "GumbelVQ"])
def test_vqgan_matches_taming_live(tmp_path, gumbel):
    try:
        model = taming_model(gumbel)
    except ImportError as e:
        pytest.skip(f"taming-transformers is not installed ({e}); the fixture test still ran")
    weights = random_weights(shapes_of(model), seed=10 + int(gumbel))
    model.load_state_dict(weights)
    images = block_images(3, 32, seed=int(gumbel))
    ref_codes, ref_images = taming_tokenize(model, images, gumbel)
    ckpt, config = write_vqgan(tmp_path, weights, VQGAN_DDCONFIG, 64, 32, gumbel)
    vae, _ = load_vqgan(ckpt, config)
    codes = vae.get_codebook_indices(images)
    assert codes.unique().numel() > 8  # the comparison means something
    assert torch.equal(codes, ref_codes)
    torch.testing.assert_close(vae.decode(codes), ref_images, atol=1e-5, rtol=0)


def test_openai_matches_dall_e_live(tmp_path, monkeypatch):
    try:
        enc, dec = dall_e_models()
    except ImportError as e:
        pytest.skip(f"DALL-E is not installed ({e}); the fixture test still ran")
    enc.load_state_dict(random_weights(shapes_of(enc), seed=20))
    dec.load_state_dict(random_weights(shapes_of(dec), seed=21))
    images = block_images(4, 32, seed=3)
    ref_codes, ref_images = dall_e_tokenize(enc, dec, images)
    # OpenAI's released files are whole pickled modules; read them with the dall_e package unimportable
    os.makedirs(tmp_path / "pkl")
    torch.save(enc, tmp_path / "pkl" / "encoder.pkl")
    torch.save(dec, tmp_path / "pkl" / "decoder.pkl", _use_new_zipfile_serialization=False)  # torch < 1.6's format
    for name in ("dall_e", "dall_e.encoder", "dall_e.decoder", "dall_e.utils", "attr"):
        monkeypatch.setitem(sys.modules, name, None)
    vae, record = load_openai(str(tmp_path / "pkl"), image_size=32)
    codes = vae.get_codebook_indices(images)
    assert codes.unique().numel() > 8  # the comparison means something
    assert torch.equal(codes, ref_codes)
    torch.testing.assert_close(vae.decode(codes), ref_images, atol=1e-5, rtol=0)
    # their state dicts give the same tokenizer and the same fingerprint
    _, from_state_dicts = load_openai(write_openai(tmp_path, enc.state_dict(), dec.state_dict()), image_size=32)
    assert from_state_dicts["fingerprint"] == record["fingerprint"]


class RunsCode:
    def __init__(self, function, argument):
        self.function, self.argument = function, argument

    def __reduce__(self):
        return (self.function, (self.argument,))


@pytest.mark.parametrize("function", [os.system, exec], ids=["os.system", "exec"])
def test_pickled_code_is_never_run(tmp_path, function):
    pwned = tmp_path / "pwned"
    code = f"echo pwned > {pwned}" if function is os.system else f"open({str(pwned)!r}, 'w')"
    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": RunsCode(function, code)}, path)
    if function is os.system:  # a module torch's weights-only loader blocks: the file is refused outright
        with pytest.raises(ValueError, match="refusing .* it names posix.system"):
            load_untrusted(str(path), "--vqgan_model_path")
    else:  # a placeholder stands for it and records the argument
        obj = load_untrusted(str(path), "--vqgan_model_path")
        assert repr(obj["state_dict"]) == "<placeholder for builtins.exec>" and obj["state_dict"].args == (code,)
        with pytest.raises(ValueError, match="holds no state dict"):
            vqgan_weights(str(path))
    assert not pwned.exists()


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_pickled_modules_read_in_both_formats(tmp_path, legacy):
    """Whole pickled nn.Modules, as OpenAI released its dVAE; the legacy format names their classes in
    "module" records, which become placeholder classes too."""
    from dalle_pytorch.models.inert_pickle import module_state_dict

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.ReLU(), torch.nn.BatchNorm2d(4))
    torch.save(model, tmp_path / "model.pkl", _use_new_zipfile_serialization=not legacy)
    obj = load_untrusted(str(tmp_path / "model.pkl"), "--openai_vae_path")
    assert repr(obj) == "<placeholder for torch.nn.modules.container.Sequential>"
    weights = module_state_dict(obj)
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert not list(tmp_path.glob("*.patch"))


def _with_pickle(path, payload):
    """A zip-format torch file whose data.pkl is `payload` (the reviewer's PoC)."""
    torch.save({}, path.with_suffix(".base"))
    with zipfile.ZipFile(path.with_suffix(".base")) as zin, zipfile.ZipFile(path, "w") as zout:
        for item in zin.infolist():
            zout.writestr(item, payload if item.filename.endswith("data.pkl") else zin.read(item.filename))


def _str(b: bytes) -> bytes:  # BINUNICODE
    return b"X" + len(b).to_bytes(4, "little") + b


def _build_class(module_and_name: bytes, state: bytes) -> bytes:  # GLOBAL cls, BUILD with (None, {state})
    return b"c" + module_and_name + b"\nN}" + state + b"\x86b"


@pytest.mark.parametrize("target", [b"collections\nCounter", b"taming.models\nVQModel"], ids=["allowed", "placeholder"])
def test_a_pickle_cannot_change_a_class(tmp_path, target):
    """BUILD on a class would set its attributes for the whole process; torch's unpickler only builds
    instances (a placeholder class is no more writable than an allowed one)."""
    path = tmp_path / "evil.ckpt"
    state = _str(b"most_common") + b"ctorch.serialization\n_get_layout\ns"
    _with_pickle(path, b"\x80\x02" + _build_class(target, state) + b".")
    before = collections.Counter.most_common
    with pytest.raises(ValueError, match="could not be read without running the code it pickles"):
        load_untrusted(str(path), "--vqgan_model_path")
    assert collections.Counter.most_common is before


@pytest.mark.parametrize("pop", [True, False], ids=["poc", "one-tuple"])
def test_a_legacy_pickle_cannot_write_a_patch_file(tmp_path, pop):
    """torch's legacy reader writes CLASS.__name__ + '.patch' for a 'module' record whose class has
    dump_patches set; the weights-only reader refuses BUILD on a class and every record but storages."""
    from torch.serialization import MAGIC_NUMBER, PROTOCOL_VERSION

    from dalle_pytorch.models.pretrained import openai_weights

    target = str(tmp_path / "pwned").encode()
    build = _build_class(
        b"collections\nCounter", _str(b"dump_patches") + b"\x88s" + _str(b"__name__") + _str(target) + b"s"
    )
    record = b"(" + _str(b"module") + b"ccollections\nCounter\n" + _str(b"x.py") + _str(b"echo pwned\n") + b"tQ"
    main = b"\x80\x02" + (build + b"0" + record + b"." if pop else b"(" + build + record + b"t.")
    os.makedirs(tmp_path / "oai")
    with open(tmp_path / "oai" / "encoder.pkl", "wb") as f:
        for obj in (MAGIC_NUMBER, PROTOCOL_VERSION, {}):
            pickle.dump(obj, f, 2)
        f.write(main)
        pickle.dump([], f, 2)
    with pytest.raises(ValueError, match="could not be read without running the code it pickles"):
        openai_weights(str(tmp_path / "oai"))
    assert not (tmp_path / "pwned.patch").exists()
    assert collections.Counter.__name__ == "Counter" and not hasattr(collections.Counter, "dump_patches")


def test_files_that_cannot_be_read_say_why(tmp_path):
    ckpt, config = tiny_vqgan_files(tmp_path)
    with pytest.raises(ValueError, match="is not a taming config.*did you swap --vqgan_model_path"):
        load_vqgan(config, ckpt)  # swapped
    with pytest.raises(ValueError, match="is not a torch checkpoint .did you swap --vqgan_model_path") as e:
        vqgan_weights(config)
    assert "weights_only=False" not in str(e.value)
    torch.save({"state_dict": {}, "hparams": HParamsDict(lr=1.0)}, tmp_path / "dict_subclass.ckpt")
    with pytest.raises(ValueError, match="could not be read without running") as e:
        vqgan_weights(str(tmp_path / "dict_subclass.ckpt"))
    assert "only if, the file comes from a source you trust" in str(e.value)


class HParamsDict(dict):  # torch's unpickler sets items only in dict, OrderedDict and Counter
    pass


def test_config_and_weight_errors_say_what_is_wrong(tmp_path):
    model = VQGAN(VQGANConfig(**{k: v for k, v in VQGAN_DDCONFIG.items() if k != "dropout"}, n_embed=64, embed_dim=32))
    weights = random_weights(shapes_of(model), 0)
    ckpt, config = write_vqgan(tmp_path, weights, VQGAN_DDCONFIG, 64, 32, gumbel=False)
    with pytest.raises(ValueError, match="does not match its config"):
        load_vqgan(ckpt, write_vqgan(tmp_path, weights, VQGAN_DDCONFIG, 128, 32, False, "other")[1])
    with pytest.raises(ValueError, match="does not match its config"):  # VQModel weights, GumbelVQ config
        load_vqgan(ckpt, write_vqgan(tmp_path, weights, VQGAN_DDCONFIG, 64, 32, True, "gumbel")[1])
    data = yaml.safe_load(open(config))
    data["model"]["target"] = "taming.models.vqgan.EMAVQ"
    (tmp_path / "ema.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="EMAVQ is not supported"):
        read_vqgan_config(str(tmp_path / "ema.yaml"))
    data["model"]["target"] = "ldm.models.autoencoder.VQModel"  # the same class name, another package
    (tmp_path / "ldm.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="ldm.models.autoencoder.VQModel is not supported"):
        read_vqgan_config(str(tmp_path / "ldm.yaml"))
    data["model"]["target"] = "taming.models.vqgan.VQModel"
    data["model"]["params"]["ddconfig"]["give_pre_end"] = True
    (tmp_path / "pre_end.yaml").write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="give_pre_end is true"):
        read_vqgan_config(str(tmp_path / "pre_end.yaml"))
    with pytest.raises(FileNotFoundError, match="--vqgan_model_path .* does not exist"):
        load_vqgan(str(tmp_path / "missing.ckpt"), config)
    with pytest.raises(FileNotFoundError, match="no encoder.pkl"):
        load_openai(str(tmp_path))


# --------------------------------------------------------------------------------------------- end to end

TRAIN = [*TINY_DALLE_MODEL, "--batch_size", "4", "--num_workers", "0", "--quiet", "--dataset_size", "16"]
TRAIN += ["--log_every", "1", "--sample_every", "2", "--save_every_n_steps", "0", "--steps", "2"]


def tiny_vqgan_files(tmp_path, seed=0, name="vqgan"):
    dd = {**VQGAN_DDCONFIG, "resolution": 16, "attn_resolutions": [8]}
    model = VQGAN(VQGANConfig(**{k: v for k, v in dd.items() if k != "dropout"}, n_embed=32, embed_dim=32))
    return write_vqgan(tmp_path, random_weights(shapes_of(model), seed), dd, 32, 32, gumbel=False, name=name)


@pytest.mark.e2e
def test_train_and_generate_with_a_vqgan(tmp_path, capsys):
    from PIL import Image

    import generate
    import train_dalle

    ckpt, config = tiny_vqgan_files(tmp_path)
    out = str(tmp_path / "runs")
    export = train_dalle.main(
        [*TRAIN, "--taming", "--vqgan_model_path", ckpt, "--vqgan_config_path", config, "--output_dir", out]
    )
    record = safe_load(export)["vae"]
    assert record["kind"] == "vqgan" and "weights" not in record and record["image_size"] == 16
    assert os.path.exists(os.path.join(out, "dalle", "samples", "step-00000002.png"))
    gen = ["--dalle_path", export, "--text", "a red circle", "--num_images", "2", "--quiet", "--device", "cpu"]
    (folder,) = generate.main([*gen, "--outputs_dir", str(tmp_path / "out")])
    assert Image.open(os.path.join(folder, "0000.png")).size == (16, 16)

    moved = str(tmp_path / "moved.ckpt")
    shutil.move(ckpt, moved)
    with pytest.raises(SystemExit):
        generate.main([*gen, "--outputs_dir", str(tmp_path / "out2")])
    err = capsys.readouterr().err
    assert "which does not exist here: pass its new location with --vqgan_model_path" in err
    assert generate.main([*gen, "--outputs_dir", str(tmp_path / "out3"), "--vqgan_model_path", moved])
    other, _ = tiny_vqgan_files(tmp_path, seed=1, name="other")
    with pytest.raises(SystemExit):
        generate.main([*gen, "--outputs_dir", str(tmp_path / "out4"), "--vqgan_model_path", other])
    assert "holds other weights than the vqgan tokenizer this DALLE was trained with" in capsys.readouterr().err
    # resuming with another VQGAN is refused; a resume checkpoint converts to an export with the same record
    with pytest.raises(SystemExit):
        train_dalle.main(
            [*TRAIN, "--taming", "--vqgan_model_path", other, "--vqgan_config_path", config, "--output_dir", out]
            + ["--resume", "auto"]
        )
    assert "is not the VAE this run was trained with" in capsys.readouterr().err
    from dalle_pytorch.convert import convert
    from dalle_pytorch.training.checkpoints import step_dirs

    with open(os.path.join(out, "dalle", "config.json")) as f:
        assert json.load(f)["pretrained_tokenizer"] == record
    os.remove(moved)  # convert copies the run's record and never reads the tokenizer's weights
    converted = convert(step_dirs(os.path.join(out, "dalle", "checkpoints"))[0], str(tmp_path / "converted.pt"))
    assert safe_load(converted)["vae"] == record


@pytest.mark.e2e
def test_train_and_generate_with_openai_dvae(tmp_path):
    import generate
    import train_dalle
    from dalle_pytorch.models.openai_dvae import OpenAIDiscreteVAE, OpenAIDVAEConfig

    vae = OpenAIDiscreteVAE(OpenAIDVAEConfig(n_hid=16, n_blk_per_group=1, vocab_size=64, n_init=8), 16)
    directory = write_openai(tmp_path, vae.enc.state_dict(), vae.dec.state_dict())
    out = str(tmp_path / "runs")
    export = train_dalle.main(
        [*TRAIN, "--openai_vae_path", directory, "--pretrained_image_size", "16", "--output_dir", out]
    )
    record = safe_load(export)["vae"]
    assert record["kind"] == "openai" and record["config"]["vocab_size"] == 64
    gen = ["--dalle_path", export, "--text", "a blue square", "--num_images", "1", "--quiet", "--device", "cpu"]
    (folder,) = generate.main([*gen, "--outputs_dir", str(tmp_path / "out")])
    assert os.path.exists(os.path.join(folder, "0000.png"))


@pytest.mark.e2e
@pytest.mark.parametrize(
    "flags, message",
    [
        (["--vae_path", "vae.pt", "--openai_vae_path", "dir"], "--vae_path and --openai_vae_path each choose"),
        (["--taming", "--vqgan_model_path", "m.ckpt"], "--taming needs --vqgan_model_path"),
        (["--vqgan_model_path", "m.ckpt"], "add --taming"),
        (["--vae_path", "{vae}", "--pretrained_image_size", "64"], "--pretrained_image_size is for"),
        ([], "--vae_path is required"),
    ],
)
def test_tokenizer_flag_errors_are_one_line(tmp_path, capsys, flags, message, vae_path):
    import train_dalle

    with pytest.raises(SystemExit):  # {vae}: our VAE's export, which has its own size (LlamaGen's VQ takes one)
        train_dalle.main([*(f.format(vae=vae_path) for f in flags), "--output_dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
