"""pyproject.toml's [project]: the wheel the build backend makes from the checkout holds both packages and the
scripts, declares the extras, and installs console scripts; an editable install maps them to the checkout."""

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest
from helpers import ROOT


def test_the_declared_dependencies_cover_what_the_code_imports():
    project = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["project"]
    names = {d.split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip().lower() for d in project["dependencies"]}
    extras = project["optional-dependencies"]
    assert {"torch", "einops", "safetensors", "pyyaml", "webdataset", "python-hostlist"} <= names
    assert {"deepspeed", "horovod", "wandb", "plot", "dev"} <= set(extras)


@pytest.mark.e2e
def test_the_wheel_holds_the_packages_scripts_and_entry_points(tmp_path):
    # a copy of the checkout: setuptools builds in the source tree (build/, *.egg-info)
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv", ".git", "tests", "build", "runs", "__pycache__"))
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    out = subprocess.run([*pip, "-w", str(tmp_path), str(src)], capture_output=True, text=True, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    [wheel] = [p for p in os.listdir(tmp_path) if p.endswith(".whl")]
    names = zipfile.ZipFile(tmp_path / wheel).namelist()
    for expected in ("train_dalle.py", "generate.py", "arguments.py", "dalle_pytorch/training/loop.py",
                     "distributed/topology.py", "dalle_pytorch/data/bpe_simple_vocab_16e6.txt.gz"):  # fmt: skip
        assert expected in names, expected
    assert not any(n.startswith("tests/") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "dalle-train = train_dalle:main" in zipfile.ZipFile(tmp_path / wheel).read(entry).decode()


def test_the_lock_file_holds_every_pin_of_requirements_txt():
    """make install installs requirements.lock (every package, one version: `make lock` makes it with uv from
    requirements.txt); a pin changed in requirements.txt without `make lock` would not be installed."""

    def pins(name):
        out = {}
        for line in open(os.path.join(ROOT, name)):
            line = line.split("#")[0].strip()
            if "==" in line:
                package, version = line.split("==")
                out[package.split("[")[0].strip().lower().replace("_", "-")] = version.strip()  # ray[train]: ray
        return out

    locked = pins("requirements.lock")
    stale = {p: v for p, v in pins("requirements.txt").items() if locked.get(p) != v}
    assert not stale, f"requirements.lock is behind requirements.txt for {stale}: run `make lock`"
