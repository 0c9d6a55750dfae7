"""Files of lucidrains' dalle-pytorch 1.6.6 become our exports with the same VAE codes and DALLE logits.

The reference side is the real package, run in its own process by tests/reference_run.py when `make install`
has put it in ~/.cache/dalle-pytorch/reference; without it, the same script's output checked in under
tests/fixtures/reference (written by `python -I tests/reference_run.py DIR tests/fixtures/reference/CASE CASE 60`).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import TESTS

from dalle_pytorch import convert
from dalle_pytorch.compat.weights import predecessor_dalle_config
from dalle_pytorch.inference.export import load_export
from dalle_pytorch.inference.load import load_dalle, vae_from_export

FIXTURES = os.path.join(TESTS, "fixtures", "reference")
BPE = os.path.join(FIXTURES, "bpe.yttm")  # the YouTokenToMe model both sides use (60 tokens)
CACHE = os.environ.get("DALLE_CACHE") or os.path.expanduser("~/.cache/dalle-pytorch")
REFERENCE_DIR = os.path.join(CACHE, "reference", "dalle-pytorch-1.6.6")
LIVE = os.path.exists(os.path.join(REFERENCE_DIR, "dalle_pytorch", "dalle_pytorch.py"))
CASES = ("plain", "shift_sandwich", "shared")
# Without the package, ours runs here against what the predecessor computed on another CPU. Between this
# machine's AVX-512, AVX2 and SSE4.1 kernels (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), and between the
# two implementations, the logits differed by at most 8.3e-7: LOGITS_ATOL is 12x that, while a weight mapped
# wrongly moves them by 1e-2 or more. Codes are argmaxes: from the fixture, only those that the predecessor
# chose by more than MARGIN (its logits are at most 6.6) must be the same; live, on this machine, all of them.
LOGITS_ATOL = 1e-5
MARGIN = 1e-4


@pytest.fixture(scope="module", params=CASES)
def reference(request, tmp_path_factory):
    """A folder with the predecessor's vae.pt, dalle.pt and expected.pt (inputs, codes, logits)."""
    case = request.param
    if not LIVE:
        return os.path.join(FIXTURES, case)
    out = str(tmp_path_factory.mktemp(case))
    script = os.path.join(TESTS, "reference_run.py")
    subprocess.run([sys.executable, "-I", script, REFERENCE_DIR, out, case, "60"], check=True)
    return out


def _expected(folder):
    return torch.load(os.path.join(folder, "expected.pt"), weights_only=True)


def _check_logits(dalle, expected):
    with torch.no_grad():
        ours = dalle.logits(expected["text"], expected["codes"])
    theirs = expected["logits"]
    allowed = torch.isfinite(ours)
    assert torch.equal(allowed, theirs > -1e30), "text and image positions predict different vocabularies"
    torch.testing.assert_close(ours[allowed], theirs[allowed], rtol=0, atol=LOGITS_ATOL)


def _check_codes(vae, expected):
    codes = vae.get_codebook_indices(expected["images"])
    decided = torch.ones_like(codes, dtype=torch.bool) if LIVE else expected["margins"] > MARGIN
    assert len(codes.unique()) >= 8 and decided.float().mean() > 0.9  # varied codes, so equality says something
    assert torch.equal(codes[decided], expected["codes"][decided])


@pytest.mark.e2e
def test_vae_gives_the_same_codes(reference, tmp_path):
    out = str(tmp_path / "vae.pt")
    convert.main(["--from_reference", os.path.join(reference, "vae.pt"), "--out", out])
    vae = vae_from_export(load_export(out, "vae"))
    _check_codes(vae, _expected(reference))


@pytest.mark.e2e
def test_dalle_gives_the_same_logits(reference, tmp_path):
    out = str(tmp_path / "dalle.pt")
    convert.main(["--from_reference", os.path.join(reference, "dalle.pt"), "--out", out, "--bpe_path", BPE])
    dalle, vae, tokenizer = load_dalle(out)
    expected = _expected(reference)
    _check_codes(vae, expected)
    _check_logits(dalle, expected)  # from the predecessor's codes, so a code chosen otherwise changes nothing
    # the predecessor fed YouTokenToMe ids as they came, without lowercasing
    assert tokenizer.encode("A Cat") != tokenizer.encode("a cat")


@pytest.mark.e2e
def test_a_predecessor_file_loads_directly(reference):
    dalle, _, _ = load_dalle(os.path.join(reference, "dalle.pt"), predecessor={"bpe_path": BPE})
    _check_logits(dalle, _expected(reference))


@pytest.mark.e2e
def test_a_tokenizer_of_another_size_is_refused(reference, tmp_path, capsys):
    with pytest.raises(SystemExit):
        convert.main(["--from_reference", os.path.join(reference, "dalle.pt"), "--out", str(tmp_path / "x.pt")])
    assert "text vocabulary of 60 tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option, value",
    [("reversible", True), ("rotary_emb", True), ("stable", True), ("attn_types", ("full", "axial_row"))],
)
def test_options_without_an_equivalent_are_refused_by_name(option, value):
    hparams = dict(dim=32, depth=2, text_seq_len=8, num_text_tokens=60, **{option: value})
    with pytest.raises(ValueError, match=f"option {option}"):
        predecessor_dalle_config(hparams, 64, 8, "old.pt")


def test_its_chinese_tokenizer_takes_the_vocabulary_from_bpe_path(tmp_path):
    from dalle_pytorch.compat.weights import predecessor_text_tokenizer

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "你", "好"]) + "\n")
    tokenizer = predecessor_text_tokenizer(bpe_path=str(vocab), chinese=True)
    assert tokenizer.kind == "chinese" and tokenizer.encode("你好") == [5, 6]


@pytest.mark.e2e
def test_generate_reads_a_predecessor_file(reference, tmp_path):
    import generate

    folders = generate.main(
        ["--dalle_path", os.path.join(reference, "dalle.pt"), "--bpe_path", BPE, "--text", "a red circle",
         "--num_images", "2", "--outputs_dir", str(tmp_path), "--quiet"]
    )  # fmt: skip
    assert os.path.exists(os.path.join(folders[0], "0001.png"))
