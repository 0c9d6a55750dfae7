"""The README and docs/ stay true: every flag they name exists (ours in the entry points' own parsers, the other
tools' in a list of their own), every README command names only flags its script has, the README's commands on
the built-in data run as written (with tiny sizes appended), and every shipped recipe trains a step."""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest
from docs_flags import ENTRY_POINTS, all_flags, flags_of
from helpers import ONE_THREAD, ROOT, TINY_DALLE_MODEL, TINY_VAE_MODEL

DOCS = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9_-]*")

# Flags of the other tools the docs show (launchers, schedulers, servers, img2dataset, torch-fidelity, pip)
OTHER_TOOLS = {
    "torchrun": {"--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port", "--max-restarts",
                 "--rdzv_backend", "--rdzv_endpoint", "--rdzv_id", "--rdzv-backend", "--rdzv-endpoint"},
    "deepspeed": {"--num_gpus", "--hostfile", "--no_ssh"},
    "horovodrun": {"--min-np", "--max-np", "--host-discovery-script", "--network-interface", "--gloo"},
    "sbatch/srun": {"--ntasks-per-node", "--requeue", "--signal", "--chdir", "--batch", "--full"},
    "ray": {"--address", "--head"},
    "kubernetes": {"--shutdown_timeout"},
    "img2dataset": {"--url_list", "--input_format", "--url_col", "--caption_col", "--output_format",
                    "--output_folder"},
    "torch-fidelity": {"--input1", "--input2"},
    "mlflow": {"--backend-store-uri"},
    "tensorboard": {"--logdir"},
    "pip": {"--no-build-isolation"},
}  # fmt: skip


def commands(path: str) -> list[list[str]]:
    """The shell commands of the ```bash blocks of `path`, continued lines joined, comments dropped."""
    out, block = [], None
    for line in open(path).read().splitlines():
        if line.startswith("```"):
            block = [] if block is None and line.strip() == "```bash" else None
            continue
        if block is not None:
            if block and block[-1].endswith("\\"):
                block[-1] = block[-1][:-1] + " " + line.strip()
            else:
                block.append(line)
            if not line.endswith("\\"):
                words = shlex.split(block[-1], comments=True)
                if words:
                    out.append(words)
    return out


def entry_point(words: list[str]) -> tuple[str, list[str]] | None:
    """(the entry point, its arguments) of a command, through any launcher before it."""
    for i, w in enumerate(words):
        if w == "-m" and i + 1 < len(words) and words[i + 1] in ENTRY_POINTS:
            return words[i + 1], words[i + 2 :]
        if w in ENTRY_POINTS:
            return w, words[i + 1 :]
    return None


def test_every_flag_the_docs_name_exists():
    ours = all_flags()
    other = set().union(*OTHER_TOOLS.values())
    assert not other & ours, f"listed as another tool's but ours: {sorted(other & ours)}"
    stale = {}
    for path in DOCS:
        for flag in FLAG.findall(open(path).read()):
            if flag not in ours and flag not in other:
                stale.setdefault(flag, []).append(os.path.relpath(path, ROOT))
    assert not stale, f"flags no entry point has (renamed or gone?): {stale}"


def test_the_readme_commands_name_only_their_scripts_flags():
    seen = 0
    for words in commands(os.path.join(ROOT, "README.md")):
        found = entry_point(words)
        if found is None:
            continue
        entry, args = found
        known = flags_of(entry)
        wrong = [a.split("=")[0] for a in args if a.startswith("--") and a.split("=")[0] not in known]
        assert not wrong, f"{' '.join(words)}: {entry} has no {wrong}"
        seen += 1
    assert seen >= 10  # the README's commands were found


# appended to a README command on the built-in data: tiny models, 2 steps, one thread
TINY = {
    "train_vae.py": [*TINY_VAE_MODEL, *ONE_THREAD, "--steps", "2", "--batch_size", "4", "--dataset_size", "16",
                     "--num_workers", "0", "--sample_every", "0", "--quiet"],
    "train_dalle.py": [*TINY_DALLE_MODEL, *ONE_THREAD, "--steps", "2", "--batch_size", "4", "--dataset_size", "16",
                       "--num_workers", "0", "--sample_every", "0", "--quiet"],
    "train_clip.py": ["--dim_text", "32", "--dim_image", "32", "--dim_latent", "32", "--heads", "2", "--patch_size",
                      "4", *ONE_THREAD, "--num_workers", "0", "--quiet", "--dataset_size", "16", "--steps", "2",
                      "--batch_size", "4"],
    "generate.py": ["--num_images", "2", "--batch_size", "2"],
    "dalle_pytorch.eval": ["--num_images", "4"],
}  # fmt: skip
WITH_CLIP = {"generate.py": ["--keep", "1"], "dalle_pytorch.eval": ["--candidates", "2"]}  # fewer than the images


def _on_built_in_data(entry: str, args: list[str]) -> bool:
    paths = [a for a in args if "/" in a and not a.startswith("--")]
    return entry in TINY and all(p.startswith(("runs/", "recipes/", "outputs/")) for p in paths)


@pytest.mark.e2e
def test_the_readme_commands_on_the_built_in_data_run(tmp_path):
    """In a fresh folder, in the README's order: train the three models, generate, evaluate."""
    ran = []
    for words in commands(os.path.join(ROOT, "README.md")):
        found = entry_point(words)
        if words[0] != "python" or found is None or not _on_built_in_data(*found):
            continue
        entry, args = found
        script = os.path.join(ROOT, entry) if entry.endswith(".py") else None
        cmd = [sys.executable, script] if script else [sys.executable, "-m", entry]
        tiny = TINY[entry] + (WITH_CLIP.get(entry, []) if "--clip_path" in args else [])
        done = subprocess.run([*cmd, *args, *tiny], cwd=tmp_path, capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": ROOT}, timeout=300)  # fmt: skip
        assert done.returncode == 0, f"{' '.join(words)}:\n{done.stdout[-2000:]}{done.stderr[-3000:]}"
        ran.append(entry)
    assert ran[:3] == ["train_vae.py", "train_dalle.py", "train_clip.py"] and "generate.py" in ran, ran
    assert "dalle_pytorch.eval" in ran and os.path.exists(tmp_path / "eval" / "results.txt")


RECIPE_TINY = {  # the recipes' model sizes made tiny; their other settings as shipped
    "train_vae.py": ["--image_size", "32", "--num_tokens", "16", "--num_layers", "2", "--hidden_dim", "32",
                     "--dataset_size", "8", "--steps", "1", "--batch_size", "2",
                     "--num_workers", "0", "--sample_every", "0", "--save_every_n_steps", "0", "--quiet",
                     *ONE_THREAD],
    "train_dalle.py": [*TINY_DALLE_MODEL, "--dataset_size", "8", "--steps", "1", "--batch_size", "2",
                       "--num_workers", "0", "--sample_every", "0", "--save_every_n_steps", "0", "--val_every", "0",
                       "--quiet", *ONE_THREAD],
}  # fmt: skip


@pytest.mark.e2e
@pytest.mark.parametrize("recipe", ["photos-256", "binding", "t2i-256"])
def test_every_shipped_recipe_trains_a_step(recipe, tmp_path):
    from text_encoders import tiny_t5

    import train_dalle
    import train_vae

    tokenizer = "photos-256" if recipe == "t2i-256" else recipe  # t2i-256 uses photos-256's VQGAN
    vqgan = ["--perceptual_weight", "0", "--disc_start", "0"] if tokenizer == "photos-256" else []  # no VGG download
    vae = train_vae.main(["--config", f"{ROOT}/recipes/{tokenizer}/vae.yaml", *RECIPE_TINY["train_vae.py"], *vqgan,
                          "--output_dir", str(tmp_path)])  # fmt: skip
    # FLAN-T5-XL cannot be downloaded here: a tiny T5 in its place
    t5 = ["--text_encoder_path", tiny_t5(str(tmp_path / "t5"))] if recipe == "t2i-256" else []
    export = train_dalle.main(["--config", f"{ROOT}/recipes/{recipe}/dalle.yaml", "--vae_path", vae,
                               *RECIPE_TINY["train_dalle.py"], *t5, "--output_dir", str(tmp_path)])  # fmt: skip
    assert os.path.exists(export)


def test_every_relative_link_in_the_docs_leads_somewhere():
    broken = []
    for path in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", open(path).read()):
            if "://" not in target and not os.path.exists(os.path.join(os.path.dirname(path), target)):
                broken.append(f"{os.path.relpath(path, ROOT)} -> {target}")
    assert not broken, broken
