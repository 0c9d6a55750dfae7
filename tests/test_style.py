"""The shape STYLE.md asks for, kept by tests: the layers import one way, models import no infrastructure,
the loop names no backend."""

import ast
import os

from helpers import ROOT

LEAVES = {"dalle_pytorch.config", "dalle_pytorch.errors", "dalle_pytorch.files"}  # depend on nothing of ours
# folder -> what its modules may import of ours (besides themselves and the leaves)
MODELS, DATA, COMPAT, INFERENCE = (
    "dalle_pytorch.models",
    "dalle_pytorch.data",
    "dalle_pytorch.compat",
    "dalle_pytorch.inference",
)
ALLOWED = {
    "dalle_pytorch/models": set(),
    "dalle_pytorch/data": set(),
    "dalle_pytorch/compat": {MODELS, DATA},
    "dalle_pytorch/inference": {MODELS, DATA, COMPAT},  # neither training nor distributed
    "dalle_pytorch/eval": {MODELS, DATA, INFERENCE},  # neither training nor distributed
    # eval: the parser scores generated images during validation (eval imports nothing of training)
    "dalle_pytorch/training": {MODELS, DATA, COMPAT, INFERENCE, "dalle_pytorch.eval", "distributed"},
    "distributed": set(),
}
OURS = (
    "dalle_pytorch",
    "distributed",
    "arguments",
    "train_vae",
    "train_dalle",
    "generate",
    "train_clip",
    "serve",
)
INFRASTRUCTURE = {"distributed", "arguments", "deepspeed", "horovod", "wandb", "tensorboard", "logging", "tqdm"}


def python_files(folder):
    for d, _, files in os.walk(os.path.join(ROOT, folder)):
        yield from (os.path.relpath(os.path.join(d, f), ROOT) for f in sorted(files) if f.endswith(".py"))


def imports(path):
    """Absolute names of every module `path` imports, relative imports resolved."""
    package = os.path.dirname(path).replace(os.sep, ".")
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            yield module
            yield from (f"{module}.{a.name}" for a in node.names)  # `from . import x` imports module x


def layer(name):
    if name in LEAVES or any(name.startswith(leaf + ".") for leaf in LEAVES):
        return "leaf"
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "dalle_pytorch" and len(parts) > 1 else parts[0]


def test_the_layers_import_one_way():
    bad = []
    for folder, allowed in ALLOWED.items():
        own = folder.replace("/", ".")
        for path in python_files(folder):
            for name in imports(path):
                if name.split(".")[0] not in OURS:
                    continue
                target = layer(name)
                if target in ("leaf", own) or target in allowed or name == "dalle_pytorch":
                    continue
                bad.append(f"{path} imports {name}")
    assert not bad, "\n".join(bad)


def test_the_leaves_import_nothing_of_ours():
    for leaf in LEAVES:
        path = leaf.replace(".", "/") + ".py"
        assert not [n for n in imports(path) if n.split(".")[0] in OURS], path


def test_nothing_imports_a_script():
    scripts = {"train_vae", "train_dalle", "generate", "train_clip", "serve", "arguments"}
    for folder in ("dalle_pytorch", "distributed"):
        for path in python_files(folder):
            found = {n.split(".")[0] for n in imports(path)} & scripts
            assert not found, f"{path} imports {found}"


def test_models_import_no_infrastructure():
    for path in python_files("dalle_pytorch/models"):
        bad = INFRASTRUCTURE & {n.split(".")[0] for n in imports(path)}
        assert not bad, f"{path} imports {bad}"


def test_models_never_call_cuda():
    for path in python_files("dalle_pytorch/models"):
        assert ".cuda(" not in open(os.path.join(ROOT, path)).read(), path


def test_the_loop_names_no_backend():
    for name in ("loop.py", "metrics.py", "batches.py", "task.py"):
        source = open(os.path.join(ROOT, "dalle_pytorch", "training", name)).read().lower()
        for word in ("deepspeed", "horovod", "fsdp", "distributeddataparallel", "isinstance(backend"):
            assert word not in source, f"{name} names {word}"


def _module_of(path):
    return path[:-3].replace(os.sep, ".").removesuffix(".__init__")


def test_no_import_circles():
    """No module of ours reaches itself through the imports of others (lazy imports inside functions count)."""
    modules = {_module_of(p): p for folder in ("dalle_pytorch", "distributed") for p in python_files(folder)}
    graph = {m: {n for n in imports(p) if n in modules and n != m} for m, p in modules.items()}
    circles = set()

    def visit(m, path):
        for n in graph[m]:
            if n == path[0]:
                circles.add(" -> ".join(sorted(path)))
            elif n not in path and n > path[0]:  # each circle found once, from its smallest module
                visit(n, [*path, n])

    for m in sorted(graph):
        visit(m, [m])
    assert not circles, "\n".join(sorted(circles))


def test_the_root_scripts_are_thin():
    """They parse flags and call the package (training/trainers.py, inference/generate.py)."""
    for name in ("train_vae.py", "train_dalle.py", "train_clip.py", "generate.py", "serve.py"):
        lines = open(os.path.join(ROOT, name)).read().count("\n")
        assert lines <= 60, f"{name} has {lines} lines: move what it builds into the package"


def test_generate_and_serve_need_no_training():
    """generate.py and serve.py run on any machine without a process group: neither training nor distributed."""
    for name in ("generate.py", "serve.py"):
        found = [n for n in imports(name) if n.startswith(("dalle_pytorch.training", "distributed", "arguments"))]
        assert not found, f"{name} imports {found}"
