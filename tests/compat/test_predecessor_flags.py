"""dalle_pytorch/compat/flags.py: each flag of lucidrains' DALLE-pytorch 1.6 becomes ours, with its conversion."""

from __future__ import annotations

import contextlib
import io
import math

import pytest

from arguments import build_parser
from dalle_pytorch.compat.flags import top_k_arg, top_k_count


def parse(script, argv, monkeypatch=None, world: int = 1):
    """The namespace the script's parser gives for `argv`, and the lines it said (on rank 0 of `world`)."""
    if monkeypatch is not None:
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    parser = build_parser(__doc__, *_configs(script), predecessor=script)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        ns = parser.parse_args(argv)
    return ns, out.getvalue().splitlines()


def _configs(script):
    from dalle_pytorch.models.dalle import DALLEConfig
    from dalle_pytorch.models.vae import VAEConfig
    from dalle_pytorch.training.configs import DALLERunConfig, TrainConfig, VAERunConfig

    if script == "train_dalle":
        return (DALLEConfig, "model"), (DALLERunConfig, "run"), (TrainConfig, "training")
    return (VAEConfig, "model"), (VAERunConfig, "run"), (TrainConfig, "training")


def test_renamed_flags_map_and_say_so():
    ns, lines = parse(
        "train_dalle",
        ["--random_resize_crop_lower_ratio=0.8", "--chinese", "--dalle_output_file_name", "mine", "--fp16",
         "--wandb_name", "proj", "--stable_softmax", "--truncate_captions", "--reversible"],
    )  # fmt: skip
    assert (ns.resize_ratio, ns.tokenizer, ns.dalle_output, ns.precision) == (0.8, "chinese", "mine.pt", "fp16")
    assert ns.wandb and ns.wandb_project == "proj" and ns.stable and ns.checkpoint_activations
    assert len(lines) == 8 and all(line.startswith("predecessor flag --") for line in lines)
    assert not hasattr(ns, "fp16")  # consumed: nothing downstream sees the old names


def test_bare_lr_decay_and_backend_spellings():
    ns, lines = parse("train_dalle", ["--lr_decay", "--distr_backend", "DeepSpeed", "--batch_size", "8"])
    assert ns.lr_decay == "cosine" and ns.distributed_backend == "deepspeed" and "approximated" in lines[0]
    ns, _ = parse("train_dalle", ["--lr_decay", "linear"])  # ours, untouched
    assert ns.lr_decay == "linear"
    ns, _ = parse("train_dalle", ["--distributed_backend", "dummy"])
    assert ns.distributed_backend == "single"


def test_deepspeed_batch_is_global_and_ga_steps_accumulate(monkeypatch, capsys):
    ns, lines = parse("train_dalle", ["--deepspeed", "--batch_size", "32", "--ga_steps", "2"], monkeypatch, world=4)
    assert (ns.batch_size, ns.global_batch_size, ns.distributed_backend) == (4, 32, "deepspeed")  # 4 x 4 ranks x 2
    ns, lines = parse("train_dalle", ["--batch_size", "8", "--ga_steps", "2"], monkeypatch, world=4)
    assert (ns.batch_size, ns.global_batch_size) == (8, 64) and "only under DeepSpeed there" in lines[0]
    with pytest.raises(SystemExit):
        parse("train_dalle", ["--deepspeed", "--batch_size", "8", "--ga_steps", "3"], monkeypatch, world=4)
    assert "must divide by processes x --ga_steps = 12" in capsys.readouterr().err


def test_vae_flags_convert_their_meaning():
    ns, lines = parse(
        "train_vae",
        ["--image_size", "64", "--num_layers", "3", "--emb_dim", "128", "--kl_loss_weight", "0.5", "--transparent"],
    )
    assert (ns.codebook_dim, ns.channels) == (128, 4)
    assert ns.kl_div_loss_weight == 0.5 * 64  # its KL summed over the 8 x 8 token grid; ours is the mean


def _predecessor_floor_step(start: float, floor: float, rate: float, steps_per_epoch: int = 10**9) -> int:
    """The predecessor's train_vae.py loop: at every batch i with i % 100 == 0 (i restarts each epoch),
    temp = max(temp * exp(-rate * global_step), floor). The first global step where it reaches the floor."""
    temp, global_step = start, 0
    while True:
        if global_step % steps_per_epoch % 100 == 0:
            temp = max(temp * math.exp(-rate * global_step), floor)
            if temp == floor:
                return global_step
        global_step += 1


def test_anneal_rate_reaches_the_floor_where_the_predecessor_did():
    ns, lines = parse("train_vae", ["--anneal_rate", "1e-6"])  # its defaults: from 1.0 to 0.5
    assert (ns.starting_temp, ns.temp_min, ns.temp_schedule) == (1.0, 0.5, "exponential")
    assert ns.anneal_steps == _predecessor_floor_step(1.0, 0.5, 1e-6) == 11800
    ns, _ = parse("train_vae", ["--temp_min", "0.1", "--anneal_rate", "1e-5"])
    assert ns.anneal_steps == _predecessor_floor_step(1.0, 0.1, 1e-5)
    ns, lines = parse("train_vae", ["--anneal_rate", "1e-5", "--anneal_steps", "500"])
    assert ns.anneal_steps == 500 and "ignored" in lines[0]


def test_a_bad_combination_is_one_line(capsys):
    with pytest.raises(SystemExit):
        parse("train_dalle", ["--deepspeed", "--global_batch_size", "64"])
    err = capsys.readouterr().err
    assert "error: --global_batch_size and the predecessor's --deepspeed/--ga_steps" in err and "Traceback" not in err


def test_shared_layer_ids_take_the_comma_form():
    from dalle_pytorch.models.dalle import DALLEConfig

    ns, lines = parse("train_dalle", ["--shared_attn_ids", "0,0,1", "--shared_ff_ids", "0", "1"])
    cfg = DALLEConfig(shared_attn_ids=ns.shared_attn_ids, shared_ff_ids=ns.shared_ff_ids)
    assert (cfg.shared_attn_ids, cfg.shared_ff_ids, lines) == (["0", "0", "1"], ["0", "1"], [])


def test_top_k_threshold_is_converted_exactly():
    assert top_k_arg("16") == 16 and top_k_arg("0") == 0 and top_k_arg("0.9") == 0.9
    said = []
    # 0.9 of 8448 + 1024 logits: it kept int(0.1 x 9472) = 947 of them, all image logits at image positions
    assert top_k_count(0.9, 8448 + 1024, 1024, said.append) == 947
    assert "--top_k 947" in said[0]
    assert top_k_count(0.5, 8448 + 1024, 1024, said.append) == 0  # 4736 > 1024: nothing filtered
    assert top_k_count(0.9, 8448 + 1024, 8448) == 947  # the text half (--gentxt)
    assert top_k_count(16, 8448 + 1024, 1024) == 16
    with pytest.raises(ValueError, match="threshold in"):
        top_k_count(1.5, 10, 10)
