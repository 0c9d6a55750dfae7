"""The command lines of lucidrains' DALLE-pytorch 1.6 (its train_vae.py, train_dalle.py, generate.py), accepted
as they are. A flag whose meaning we have under another name maps to it; one whose meaning differs is
converted and says how; each prints one line naming what it became, so a user learns the new spelling.

Flags with the same name and meaning there and here (--dim, --depth, --vae_path, --image_text_folder,
--attn_types full,axial_row, ...) need nothing. `rewrite_argv` first turns the two spellings argparse cannot
read as ours into forms it can: a bare `--lr_decay` (an on/off switch there, a schedule name here) and
backend names in their capitalization (`--distr_backend DeepSpeed`).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from ..config import flag

# name -> (takes a value, help), per script; the value's type is converted in apply()
_TRAIN_DALLE = {
    "dalle_output_file_name": (True, "the predecessor's output name without .pt -> --dalle_output NAME.pt"),
    "random_resize_crop_lower_ratio": (True, "-> --resize_ratio"),
    "truncate_captions": (False, "captions are always truncated here (and counted)"),
    "chinese": (False, "-> --tokenizer chinese"),
    "stable_softmax": (False, "-> --stable"),
    "reversible": (False, "-> --checkpoint_activations (the same memory saving, by recomputation)"),
    "predecessor_lr_decay": (False, "a bare --lr_decay (ReduceLROnPlateau there) -> --lr_decay cosine"),
}
_TRAIN_VAE = {
    "emb_dim": (True, "-> --codebook_dim"),
    "kl_loss_weight": (True, "-> --kl_div_loss_weight x the token grid's positions (a sum there, a mean here)"),
    "transparent": (False, "-> --channels 4"),
    "lr_decay_rate": (True, "x rate every 100 steps there -> --lr_decay exponential"),
    "anneal_rate": (True, "-> --anneal_steps where the predecessor's temperature reached --temp_min"),
    "num_images_save": (True, "ignored: the sample grids show a fixed number of images"),
}
_TRAINING = {  # both trainers
    "fp16": (False, "-> --precision fp16"),
    "amp": (False, "apex AMP O1 there -> --precision fp16 (autocast with dynamic loss scaling)"),
    "ga_steps": (True, "-> --global_batch_size (accumulation on every backend)"),
    "deepspeed": (False, "-> --distributed_backend deepspeed; --batch_size is then the global batch"),
    "deepscale": (False, "-> --distributed_backend deepspeed"),
    "deepspeed_mpi": (False, "ignored: the launcher's environment is read directly"),
    "distr_backend": (True, "-> --distributed_backend"),
    "wandb_name": (True, "-> --wandb --wandb_project"),
    "flops_profiler": (False, "ignored: `python bench/train.py` measures throughput"),
}
FLAGS = {"train_dalle": {**_TRAIN_DALLE, **_TRAINING}, "train_vae": {**_TRAIN_VAE, **_TRAINING}}
_BACKEND_NAMES = {"dummy": "single", "deepspeed": "deepspeed", "horovod": "horovod"}


def rewrite_argv(argv: list[str], lr_decay_choices=()) -> list[str]:
    out = []
    for i, arg in enumerate(argv):
        nxt = argv[i + 1] if i + 1 < len(argv) else None
        if arg == "--lr_decay" and lr_decay_choices and nxt not in lr_decay_choices:
            out.append("--predecessor_lr_decay")
        elif i and argv[i - 1] in ("--distributed_backend", "--distr_backend"):
            out.append(_BACKEND_NAMES.get(arg.lower(), arg.lower()))
        elif arg.startswith(("--distributed_backend=", "--distr_backend=")):
            name, value = arg.split("=", 1)
            out.append(f"{name}={_BACKEND_NAMES.get(value.lower(), value.lower())}")
        else:
            out.append(arg)
    return out


def add_flags(parser: argparse.ArgumentParser, script: str) -> None:
    group = parser.add_argument_group("lucidrains/DALLE-pytorch 1.6 flags (mapped to the ones above, said on start)")
    for name, (takes_value, text) in FLAGS[script].items():
        if name == "predecessor_lr_decay":
            group.add_argument(f"--{name}", action="store_true", default=None, help=argparse.SUPPRESS)
        elif takes_value:
            group.add_argument(f"--{name}", default=None, help=text)
        else:
            group.add_argument(f"--{name}", action="store_true", default=None, help=text)


def apply(
    ns: argparse.Namespace, script: str, say=print, given_flags: set | frozenset = frozenset(), world_size: int = 1
) -> None:
    """Turn the predecessor's flags present in `ns` into ours (in place), saying one line for each.
    `given_flags`: the flags on the command line (--name), to tell what the user set from our defaults."""
    given = {name: getattr(ns, name) for name in FLAGS[script] if getattr(ns, name, None) is not None}
    for name in FLAGS[script]:
        if hasattr(ns, name):
            delattr(ns, name)

    def set_(flag: str, value, note: str = "") -> None:
        setattr(ns, flag, value)
        shown = "" if value is True else f" {value}"
        old = "lr_decay" if name == "predecessor_lr_decay" else name
        say(f"predecessor flag --{old}: --{flag}{shown}" + (f" ({note})" if note else ""))

    if {"deepspeed", "deepscale", "ga_steps"} & set(given) and "--global_batch_size" in given_flags:
        raise ValueError(
            "--global_batch_size and the predecessor's --deepspeed/--ga_steps both set the batch: keep one"
        )
    deepspeed = bool({"deepspeed", "deepscale"} & set(given)) or given.get("distr_backend") == "deepspeed"

    for name, value in given.items():
        if name == "dalle_output_file_name":
            set_("dalle_output", f"{value}.pt")
        elif name == "random_resize_crop_lower_ratio":
            set_("resize_ratio", float(value))
        elif name == "truncate_captions":
            say("predecessor flag --truncate_captions: always so here (truncated captions are counted in the log)")
        elif name == "chinese":
            set_("tokenizer", "chinese")
        elif name == "stable_softmax":
            set_("stable", True, "LayerScale and max-normalized logits; the softmax is always computed stably")
        elif name == "reversible":
            set_("checkpoint_activations", True, "reversible layers are another network; this saves the same memory")
        elif name == "predecessor_lr_decay":
            set_("lr_decay", "cosine", "ReduceLROnPlateau there, which no step schedule reproduces: approximated")
        elif name == "emb_dim":
            set_("codebook_dim", int(value))
        elif name == "kl_loss_weight":
            positions = (ns.image_size >> ns.num_layers) ** 2
            set_("kl_div_loss_weight", float(value) * positions, f"its KL is summed over the {positions} positions")
        elif name == "transparent":
            set_("channels", 4)
        elif name == "lr_decay_rate":
            set_("lr_decay", "exponential", f"x{value} every 100 steps there; here to --lr_min_factor at the end")
        elif name == "anneal_rate":
            if "--anneal_steps" in given_flags:
                say(f"predecessor flag --anneal_rate: ignored, --anneal_steps {ns.anneal_steps} is given")
                continue
            if "--temp_min" not in given_flags:
                ns.temp_min = 0.5  # its default floor
            _anneal(ns, float(value), set_)
        elif name in ("fp16", "amp"):
            set_("precision", "fp16")
        elif name in ("deepspeed", "deepscale"):
            set_("distributed_backend", "deepspeed")
        elif name == "distr_backend":
            set_("distributed_backend", value)
        elif name == "ga_steps":
            continue  # with the batch, below
        elif name == "wandb_name":
            ns.wandb = True
            set_("wandb_project", value)
        else:  # deepspeed_mpi, flops_profiler, num_images_save
            say(f"predecessor flag --{name}: ignored ({FLAGS[script][name][1].split(': ', 1)[-1]})")
    if deepspeed or "ga_steps" in given:
        said = " ".join(f"--{n}" for n in ("deepspeed", "deepscale", "ga_steps") if n in given) or "--distr_backend"
        _batch(ns, deepspeed, int(given.get("ga_steps", 1)), said, say, world_size)


def _batch(ns, deepspeed: bool, steps: int, said: str, say, world: int) -> None:
    """Its batch flags as ours. Under DeepSpeed its --batch_size was DeepSpeed's train_batch_size, the batch over
    all processes and --ga_steps micro-batches; elsewhere --ga_steps did nothing there (here it accumulates)."""
    if deepspeed:
        if ns.batch_size % (world * steps):
            raise ValueError(
                f"--batch_size {ns.batch_size} (the global batch under --deepspeed) must divide by processes x "
                f"--ga_steps = {world * steps}"
            )
        ns.global_batch_size, ns.batch_size = ns.batch_size, ns.batch_size // (world * steps)
        note = "--batch_size was DeepSpeed's train_batch_size there"
    else:
        ns.global_batch_size = ns.batch_size * world * steps
        note = "--ga_steps applied only under DeepSpeed there"
    say(
        f"predecessor flag {said}: --global_batch_size {ns.global_batch_size} --batch_size {ns.batch_size} "
        f"(per process, {world} processes; {note})"
    )


def _anneal(ns, rate: float, set_) -> None:
    """The predecessor multiplied the temperature by exp(-rate x step) at every 100th step (k-th: step 100k),
    so after k updates it is start x exp(-50 rate k (k+1)): the floor is reached at the first k where that
    passes --temp_min. Here the same start and floor at the same step, annealed exponentially in between."""
    start, end = ns.starting_temp, ns.temp_min
    if rate <= 0 or end >= start:
        set_("anneal_steps", 1, "the temperature starts at its floor")
        return
    k = math.ceil((math.sqrt(1 + 4 * math.log(start / end) / (50 * rate)) - 1) / 2)
    ns.temp_schedule = "exponential"
    set_("anneal_steps", 100 * k, f"--temp_schedule exponential: reaches --temp_min {end} at step {100 * k} as there")


# ---------------------------------------------------------------------------------------------- generate.py


@dataclass
class PredecessorFiles:
    """A dalle-pytorch 1.6 dalle.pt (our exports carry their tokenizers)."""

    bpe_path: str = flag("", "the YouTokenToMe model it was trained with (JSON with --hug)")
    hug: bool = flag(False, "--bpe_path is a Hugging Face tokenizers JSON")
    chinese: bool = flag(False, "it was trained with the Chinese tokenizer")
    taming: bool = flag(False, "it was trained on a VQGAN (give --vqgan_config_path)")
    vqgan_config_path: str = flag("", "the config of the VQGAN it was trained on")

    def how_to_read(self) -> dict:
        """load_export's `predecessor`: what says how to read its dalle.pt (--taming only names the VQGAN)."""
        return {
            "bpe_path": self.bpe_path,
            "hug": self.hug,
            "chinese": self.chinese,
            "vqgan_config_path": self.vqgan_config_path,
        }


def top_k_arg(value: str):
    """--top_k: a count here (16), the predecessor's filter threshold there (0.9: drop the least likely 90%)."""
    number = float(value)
    return int(number) if number.is_integer() and number >= 1 or number == 0 else number


def top_k_count(top_k, num_logits: int, vocabulary: int, say=print) -> int:
    """Our --top_k (0: off) for the given one. The predecessor's threshold t kept max(int((1 - t) x n), 1) of all
    n = text + image logits, the other half's masked, so at most the `vocabulary` of the half being sampled."""
    if isinstance(top_k, int):
        return top_k
    if not 0 < top_k < 1:
        raise ValueError(f"--top_k is a count of tokens, or the predecessor's threshold in (0, 1) (got {top_k})")
    k = min(max(int((1 - top_k) * num_logits), 1), vocabulary)
    kept = 0 if k == vocabulary else k
    say(f"predecessor flag --top_k {top_k}: a threshold there: --top_k {kept} (of {vocabulary} tokens)")
    return kept
