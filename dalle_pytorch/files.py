"""Reading and writing this project's files safely: weights-only loading with errors that say what to do,
atomic writes, and the one fingerprint of a model's config and weights. A path ending in .safetensors is read
and written as safetensors (no pickle at all, memory-mapped reads), any other as torch.save's weights-only
pickle. Depends on torch and safetensors only, so the backends, the trainers and generate.py all use it."""

from __future__ import annotations

import hashlib
import json
import os
import re

import torch

SAFETENSORS = ".safetensors"


def safe_load(path: str, map_location="cpu"):
    """torch.load with weights_only=True (a .safetensors file: load_tree), with errors that name the file and
    say what to do."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist")
    if is_safetensors(path):
        return load_tree(path, map_location)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # UnpicklingError, RuntimeError or EOFError depending on the damage
        msg = str(e)
        if "weights_only" in msg or "Unsupported global" in msg or "Unsupported operand" in msg:
            raise ValueError(
                f"refusing to load {path}: it contains pickled code, not only tensors and plain data. "
                "Only load files written by this project."
            ) from None
        raise ValueError(
            f"{path} is truncated or corrupted ({type(e).__name__}: {msg[:160]}); use an earlier checkpoint"
        ) from None


def is_safetensors(path: str) -> bool:
    """By content, not name (a copy may be renamed): safetensors begins with its header's 8-byte length and the
    header's JSON; torch.save's files are zip archives ('PK')."""
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{" and not head.startswith(b"PK")


def atomic_save(obj, path: str) -> None:
    """Write to a temporary name, fsync, then rename over `path`: readers see old or new, never half. A
    .safetensors path holds `obj` (a dict) as save_tree writes it; any other, torch.save's pickle."""
    tmp = f"{path}.tmp{os.getpid()}"
    if path.endswith(SAFETENSORS):
        save_tree(obj, tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # safetensors creates its file 0600: readable as any file the user writes
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
    else:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def atomic_write_json(obj, path: str, **dump) -> None:
    """`obj` as JSON (json.dump's `dump` options), written to a temporary name and renamed over `path`: readers
    (another rank, a restarted job) see the old file or the new one, never half of one."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, **dump)
    os.replace(tmp, path)


def save_tree(tree: dict, path: str) -> None:
    """A nested dict of tensors and plain data (an export) as one safetensors file: each tensor under its path
    in the tree ('weights/bos', 'vae/weights/...'), everything else as JSON in the header's metadata."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}

    def strip(node, where: str):
        if isinstance(node, torch.Tensor):  # a copy of its own: tied weights share storage, which safetensors refuses
            tensors[where] = node.detach().cpu().contiguous().clone()
            return {"__tensor__": where}
        if isinstance(node, dict):
            return {str(k): strip(v, f"{where}/{k}" if where else str(k)) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return [strip(v, f"{where}/{i}") for i, v in enumerate(node)]
        return node

    save_file(tensors, path, metadata={"dalle_pytorch": json.dumps(strip(tree, ""))})


def load_tree(path: str, map_location="cpu") -> dict:
    """What save_tree wrote, tensors read from the memory-mapped file."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt", device=str(map_location)) as f:
            meta = (f.metadata() or {}).get("dalle_pytorch")
            if meta is None:
                raise ValueError(
                    f"{path} is a safetensors file, but not one of this project's (no dalle_pytorch metadata)"
                )

            def fill(node):
                if isinstance(node, dict):
                    if set(node) == {"__tensor__"}:
                        return f.get_tensor(node["__tensor__"])
                    return {k: fill(v) for k, v in node.items()}
                if isinstance(node, list):
                    return [fill(v) for v in node]
                return node

            return fill(json.loads(meta))
    except (SafetensorError, json.JSONDecodeError, OSError) as e:
        raise ValueError(
            f"{path} is truncated or corrupted ({type(e).__name__}: {str(e)[:160]}); use an earlier one"
        ) from None


def fingerprint(config: dict, weights: dict[str, torch.Tensor]) -> str:
    """A short hash of a model's config and weights: resuming or generating with another image tokenizer would
    silently change the meaning of every image token. The same for a .ckpt, .pkl or .pt holding one model."""
    h = hashlib.sha1(json.dumps(config, sort_keys=True).encode())
    for name in sorted(weights):
        h.update(name.encode())
        h.update(weights[name].detach().float().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------ the Hub's names

_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+(/[^\s]+)?$")
MODEL_FILE = "model.safetensors"  # what `python -m dalle_pytorch.hub` writes and `user/name` reads (hub.py)


def resolve(path: str, flag: str = "--dalle_path") -> str:
    """`path` itself where it exists here (or is not a Hub name); else the cached file of the Hub name: `user/name`
    (its model.safetensors) or `user/name/FILE`. One line when the Hub has no such file or cannot be reached."""
    if not path or os.path.exists(path) or not _HUB_NAME.match(path) or "://" in path:
        return path
    if os.path.isdir(path.split("/")[0]):  # runs/dalle.pt with runs/ here: a local path that is missing
        return path
    owner, name, *rest = path.split("/")
    repo, filename = f"{owner}/{name}", "/".join(rest) or MODEL_FILE
    try:
        from huggingface_hub import hf_hub_download
    except ImportError:
        raise FileNotFoundError(f"{flag} {path} does not exist here (a Hub name needs huggingface_hub)") from None
    try:
        return hf_hub_download(repo, filename)
    except Exception as e:  # offline and not cached, no such repository or file, no network, no access
        raise FileNotFoundError(f"{flag} {path} is not a file here, and {why(e, repo, filename)}") from None


def why(e: Exception, repo: str, filename: str) -> str:
    """The Hub's failure in a clause that says what to do."""
    from huggingface_hub import constants

    kind = type(e).__name__
    if constants.HF_HUB_OFFLINE:
        return (
            f"{repo}'s {filename} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) with HF_HUB_OFFLINE set: "
            f"download it once where the Hub is reachable (`hf download {repo} {filename}`), or pass a local path"
        )
    if kind in ("RepositoryNotFoundError", "GatedRepoError"):
        return f"the Hub has no repository {repo} you may read (log in with `hf auth login` for a private one)"
    if kind in ("EntryNotFoundError", "RemoteEntryNotFoundError"):
        return f"the Hub's {repo} has no {filename}"
    first = (str(e).strip().splitlines() or [kind])[0][:160]
    return f"the Hub could not be reached for {repo} ({kind}: {first}): pass a local path, or retry with a network"
