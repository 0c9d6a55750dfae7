"""The Hugging Face Hub, as users share models: any flag that takes a model file also takes a Hub name, and a run's
export becomes a Hub model folder that can be pushed.

    --dalle_path user/name                          the model folder's model.safetensors (written by `push` below)
    --vae_path FoundationVision/LlamaGen/vq_ds16_t2i.pt     one file of a Hub repository
    python -m dalle_pytorch.hub write RUN_DIR OUT_DIR      the model folder: model.safetensors, config.json, README.md
    python -m dalle_pytorch.hub push RUN_DIR user/name [--private]     written (RUN_DIR/hub) and uploaded

Downloads go through huggingface_hub: its cache (HF_HOME, HF_HUB_CACHE), resumed downloads, HF_HUB_OFFLINE=1 (the
cache alone), tokens from the usual places (HF_TOKEN, `hf auth login`). A local path always wins over a Hub name.
The model card says what the run was: its kind and model, its command (config.yaml relaunches it), its data and its
last figures (metrics.jsonl; results.json of an evaluation in RUN_DIR/eval)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from .files import MODEL_FILE

KINDS = ("dalle", "vae", "clip")


# ------------------------------------------------------------------------------------------ model folders


def run_export(run_dir: str) -> tuple[str, str]:
    """(kind, export path) of a run directory written by train_dalle.py, train_vae.py or train_clip.py."""
    config_path = os.path.join(run_dir, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{run_dir} is not a run directory (no config.json): pass RUN_DIR, e.g. runs/dalle")
    config = json.load(open(config_path))
    kind = next((k for k in KINDS if k in config), None)
    output = (config.get(kind, {}) or {}).get(f"{kind}_output") if kind else None
    path = output or os.path.join(run_dir, f"{kind}.safetensors")
    if kind is None or not os.path.exists(path):
        raise FileNotFoundError(f"{run_dir} holds no export ({path}): the run has not finished; convert a checkpoint")
    return kind, path


def write_folder(run_dir: str, out: str) -> str:
    """The Hub model folder of a run: its export as model.safetensors (safetensors, as every export reads), the
    model's config.json, the run's config.yaml, and a model card (README.md)."""
    from .files import is_safetensors
    from .inference.export import load_export, save_export

    kind, export = run_export(run_dir)
    os.makedirs(out, exist_ok=True)
    target = os.path.join(out, MODEL_FILE)
    obj = load_export(export, kind)
    if is_safetensors(export):
        shutil.copyfile(export, target)
    else:  # a .pt export: the same content as safetensors
        save_export(target, kind, **{k: v for k, v in obj.items() if k not in ("format_version", "kind")})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump({"kind": kind, "format_version": obj["format_version"], "model": obj["config"]}, f, indent=2)
    if os.path.exists(os.path.join(run_dir, "config.yaml")):
        shutil.copyfile(os.path.join(run_dir, "config.yaml"), os.path.join(out, "config.yaml"))
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(model_card(run_dir, kind, obj))
    return out


def _last_figures(run_dir: str) -> dict:
    figures = {}
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        for line in open(path):
            row = json.loads(line)
            figures.update({k: v for k, v in row.items() if isinstance(v, (int, float)) and "/" not in k})
    return figures


def model_card(run_dir: str, kind: str, obj: dict) -> str:
    config = json.load(open(os.path.join(run_dir, "config.json")))
    script = {"dalle": "train_dalle.py", "vae": "train_vae.py", "clip": "train_clip.py"}[kind]
    data = config.get(kind, {}) or {}
    source = data.get("image_text_folder") or data.get("image_folder") or "the built-in synthetic captioned shapes"
    train, derived = config.get("train", {}), config.get("derived", {})
    figures = _last_figures(run_dir)
    keep = [
        k for k in ("step", "loss", "image_loss", "text_loss", "val_loss", "val_fid", "val_clip_score") if k in figures
    ]
    lines = [
        "---",
        "library_name: dalle-pytorch",
        "tags: [text-to-image, dalle]" if kind == "dalle" else f"tags: [{kind}]",
        "---",
        f"# {os.path.basename(os.path.abspath(run_dir))} ({kind})",
        "",
        f"Trained with `{script}` of this repository; `config.yaml` relaunches the run:",
        "",
        f"    python {script} --config config.yaml",
        "",
        f"- data: {source}" + (f" (WebDataset keys {data['wds']})" if data.get("wds") else ""),
        f"- steps: {figures.get('step', '?')}, global batch {derived.get('global_batch_size', '?')} on "
        f"{derived.get('world_size', '?')} ranks ({derived.get('backend', '?')}), learning rate "
        f"{train.get('learning_rate', '?')}",
        f"- model: {json.dumps(obj['config'], sort_keys=True)}",
    ]
    if kind == "dalle":
        tok = obj.get("tokenizer", {})
        lines.append(f"- captions: {tok.get('kind')}" + (f" ({tok.get('path')})" if tok.get("path") else ""))
    if keep:
        lines += ["", "| figure | value |", "| --- | --- |"] + [f"| {k} | {figures[k]:.6g} |" for k in keep]
    results = os.path.join(run_dir, "eval", "results.json")
    if os.path.exists(results):
        lines += [
            "",
            "Evaluation (`python -m dalle_pytorch.eval`):",
            "",
            "```json",
            open(results).read().strip(),
            "```",
        ]
    flag = {"dalle": "--dalle_path", "vae": "--vae_path", "clip": "--clip_path"}[kind]
    lines += ["", "Use:", "", f"    python generate.py {flag} USER/NAME --text 'a red circle'" if kind == "dalle"
              else f"    python train_dalle.py {flag} USER/NAME ...", ""]  # fmt: skip
    return "\n".join(lines)


def push(run_dir: str, repo: str, private: bool = False, folder: str = "") -> str:
    """Write the model folder (RUN_DIR/hub unless `folder`) and upload it to `repo`; the repository's URL."""
    out = write_folder(run_dir, folder or os.path.join(run_dir, "hub"))
    try:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(repo, private=private, exist_ok=True)
        api.upload_folder(
            repo_id=repo, folder_path=out, commit_message=f"{os.path.basename(run_dir)} from dalle-pytorch"
        )
    except Exception as e:
        raise ConnectionError(
            f"uploading to {repo} needs the Hub and a token with write access ({type(e).__name__}): the folder is "
            f"ready at {out}; run `hf upload {repo} {out}` once online"
        ) from None
    return f"https://huggingface.co/{repo}"


def main(argv=None) -> None:
    from .errors import user_errors

    p = argparse.ArgumentParser(prog="python -m dalle_pytorch.hub", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    w = sub.add_parser("write", help="write a run's Hub model folder")
    w.add_argument("run_dir")
    w.add_argument("out")
    u = sub.add_parser("push", help="write a run's Hub model folder and upload it")
    u.add_argument("run_dir")
    u.add_argument("repo", help="user/name on the Hub")
    u.add_argument("--private", action="store_true")
    u.add_argument("--folder", default="", help="where to write the folder (default: RUN_DIR/hub)")
    for q in (w, u):
        q.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    args = p.parse_args(argv)
    with user_errors(args.debug):
        if args.command == "write":
            print(f"model folder: {write_folder(args.run_dir, args.out)}")
        else:
            print(f"pushed: {push(args.run_dir, args.repo, args.private, args.folder)}")


if __name__ == "__main__":
    main(sys.argv[1:])
