"""The shape STYLE.md asks for, kept by tests: models import no infrastructure, the loop names no backend."""

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODELS = [
    "dalle_pytorch/vae.py",
    "dalle_pytorch/dalle.py",
    "dalle_pytorch/transformer.py",
    "dalle_pytorch/vqgan.py",
    "dalle_pytorch/vqgan_modules.py",
    "dalle_pytorch/openai_dvae.py",
]
FORBIDDEN = {"distributed", "arguments", "deepspeed", "horovod", "wandb", "tensorboard", "logging", "tqdm"}


def imported_modules(path):
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module.split(".")[0]


def test_models_import_no_infrastructure():
    for path in MODELS:
        bad = FORBIDDEN & set(imported_modules(path))
        assert not bad, f"{path} imports {bad}"


def test_models_never_call_cuda():
    for path in MODELS:
        assert ".cuda(" not in open(os.path.join(ROOT, path)).read(), path


def test_the_loop_names_no_backend():
    source = open(os.path.join(ROOT, "dalle_pytorch", "loop.py")).read().lower()
    for name in ("deepspeed", "horovod", "fsdp", "distributeddataparallel", "isinstance(backend"):
        assert name not in source, name
