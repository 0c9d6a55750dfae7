"""What each training script runs, given its parsed configs: the session, the data, the model, the task,
the loop, and the export. The scripts at the root parse flags and call these (fit_vae, fit_dalle, fit_clip).

Each takes the script's own configs (VAERunConfig, DALLERunConfig, CLIPRunConfig: configs.py) and the run's plan
(plan.py: the validated TrainConfig, topology, backend, accumulation); each fit function's `run_name` is its run
directory's name without --name."""

from __future__ import annotations

import dataclasses
import os

from ..data.samples import CODES_KEY, FEATURES_KEY
from ..data.stream import is_stream
from ..data.tokenized import tokenized
from ..data.tokenizer import tokenizer_from_dict
from ..inference.fits import dalle_fit
from ..inference.image_tokenizers import load_image_tokenizer, tokenizer_fingerprint, tokenizer_flag
from ..inference.published import llamagen_kind
from ..inference.text_encoders import FrozenTextEncoder, load_text_encoder
from ..models.clip import CLIP, CLIPConfig
from ..models.dalle import DALLE, DALLEConfig
from ..models.vae import DiscreteVAE, VAEConfig
from .clip_task import CLIPTask
from .configs import CLIPRunConfig, DALLERunConfig, VAERunConfig, VQGANRunConfig
from .dalle_task import DALLETask
from .data import caption_data, datasets, image_data
from .encode import check_codes, encoded_stream
from .image_tokenizer import check_same_tokenizer, precomputed, start_of
from .loop import train
from .plan import RunPlan
from .run_dir import RunDir
from .session import shared_text_tokenizer, training_session
from .vae_task import VAETask


def scoring_clip(path: str, cfg, tokenizer, vae):
    """--val_clip_path's CLIP, refused unless it reads this run's captions and images; None without it."""
    from ..inference.fits import check_clip_fits
    from ..inference.load import load_clip

    if not path:
        return None
    if not cfg.val_fid_every:
        raise ValueError("--val_clip_path scores the images --val_fid_every makes: add --val_fid_every N")
    clip, clip_tokenizer = load_clip(path)
    fit = {"tokenizer": tokenizer.to_dict(), "image_size": vae.image_size, "channels": vae.channels}
    check_clip_fits(clip, clip_tokenizer, fit, "this run", path)
    return clip


def fit_vae(model_cfg: VAEConfig, run_cfg: VAERunConfig, vq: VQGANRunConfig, plan: RunPlan) -> str:
    """train_vae.py's run (a dVAE, or a VQGAN with --model vqgan); returns the export's path."""
    start = _vae_start(run_cfg.vae_path, model_cfg, vq) if run_cfg.vae_path else None
    check_tokenizer_flags(model_cfg, run_cfg, vq)
    cfg = plan.cfg
    configs = {"model": model_cfg, "vae": run_cfg, "vqgan": vq, "train": cfg}
    with training_session(plan, fit_vae.run_name, configs) as (backend, recovery, run):
        spec = image_data(run_cfg, cfg, model_cfg.image_size, model_cfg.channels)
        data = datasets(spec, cfg, backend, run)
        dataset, val = data.train, data.val
        export_path = run_cfg.vae_output or os.path.join(run.path, "vae.safetensors")
        plan = plan.counted(dataset)
        steps = plan.steps
        if vq.model == "vqgan":
            task = vqgan_task(model_cfg, vq, steps, dataset, export_path, val, backend.device, run, start)
        else:  # the temperature anneals over --anneal_steps, or over the whole run as the loop counts it
            temperature = (
                run_cfg.starting_temp,
                run_cfg.temp_min,
                run_cfg.anneal_steps or steps,
                run_cfg.temp_schedule,
            )
            task = VAETask(DiscreteVAE(model_cfg), dataset, export_path, temperature, val_dataset=val)
            if start is not None:
                task.model.load_state_dict(start["weights"])
        if start is not None:
            run.print(f"started from {run_cfg.vae_path} (weights only: a new optimizer and schedule)")
        pos = train(task, plan, backend, recovery, run)
        skipped = getattr(dataset, "num_skipped", 0)
        if skipped:
            run.print(f"skipped {skipped} unreadable images")
        run.print(f"done at step {pos.step}: export {task.export_path}")
        return task.export_path


# flags that only one tokenizer reads: (dataclass, names)
DVAE_ONLY = (
    (VAEConfig, ("codebook_dim", "temperature", "straight_through", "kl_div_loss_weight", "smooth_l1_loss")),
    (VAERunConfig, ("starting_temp", "temp_min", "anneal_steps", "temp_schedule")),
)


def check_tokenizer_flags(model_cfg: VAEConfig, run_cfg: VAERunConfig, vq: VQGANRunConfig) -> None:
    """One line for a flag the chosen tokenizer does not read (a value other than its default)."""

    def changed(obj, names):
        defaults = {f.name: f.default for f in dataclasses.fields(obj)}
        return [n for n in names if getattr(obj, n) != defaults[n]]

    if vq.model == "vqgan":
        for obj, (_, names) in zip((model_cfg, run_cfg), DVAE_ONLY):
            for name in changed(obj, names):
                raise ValueError(f"--{name} is a dVAE flag: --model vqgan does not read it (see --help, --model vqgan)")
    else:
        for name in changed(vq, [f.name for f in dataclasses.fields(vq) if f.name != "model"]):
            raise ValueError(f"--{name} is read with --model vqgan: add it, or leave the flag out for the dVAE")


# what a tokenizer's file fixes when a run starts from it (train_vae.py --vae_path)
_VAE_ARCHITECTURE = ("num_tokens", "num_layers", "num_resnet_blocks", "hidden_dim", "channels", "codebook_dim")


def _vae_start(path: str, model_cfg: VAEConfig, vq: VQGANRunConfig) -> dict:
    """The export train_vae.py --vae_path starts from (ours, or LlamaGen's VQ read at --image_size); the flags set
    to the file's model: --model, and the dVAE's architecture, which a flag may not contradict."""
    from ..inference.export import load_export

    published = llamagen_kind(path) == "vq"  # LlamaGen's VQ tokenizes any side: the run's --image_size
    start = load_export(path, "vae", image_size=model_cfg.image_size if published else 0)
    config = dict(start["config"])
    vq.model = "vqgan" if config.pop("model", "dvae") == "vqgan" else "dvae"
    defaults = VAEConfig()
    names = _VAE_ARCHITECTURE + (() if published else ("image_size",))
    theirs = {k: config[k] for k in names if k in config}
    fixed = [k for k, v in theirs.items() if getattr(model_cfg, k) not in (v, getattr(defaults, k))]
    if fixed:
        raise ValueError(f"--vae_path {path} fixes the architecture: drop --{', --'.join(fixed)}")
    model_cfg.image_size = config["image_size"]
    if vq.model == "dvae":
        for key, value in config.items():
            setattr(model_cfg, key, tuple(tuple(t) for t in value) if key == "normalization" else value)
    return start


def vqgan_task(
    model_cfg: VAEConfig, vq: VQGANRunConfig, steps: int, dataset, export_path, val, device, run, start=None
):
    """The VQGAN (the tokenizer flags it shares with the dVAE, and its own) with its discriminator, and LPIPS;
    `start`: the export whose tokenizer it starts from (its architecture, the run's losses)."""
    from ..models.vq_tokenizer import VQGANLoss, VQGANLossConfig, VQTokenizerConfig
    from .perceptual import lpips_vgg
    from .vae_task import VQGANTask

    disc_start = steps // 2 if vq.disc_start < 0 else vq.disc_start
    if disc_start > steps:
        raise ValueError(
            f"--disc_start {disc_start} is beyond the run's {steps} steps: the discriminator would never train; "
            "lower it, or -1 for half the run"
        )
    tokenizer = VQTokenizerConfig(
        image_size=model_cfg.image_size, channels=model_cfg.channels, num_tokens=model_cfg.num_tokens,
        code_dim=vq.code_dim, num_layers=model_cfg.num_layers, hidden_dim=model_cfg.hidden_dim,
        num_resnet_blocks=model_cfg.num_resnet_blocks, l2_norm=vq.l2_norm_codes,
        commitment_weight=vq.commitment_weight, entropy_weight=vq.entropy_weight,
    )  # fmt: skip
    if start is not None:
        file_cfg = {k: v for k, v in start["config"].items() if k != "model"}
        losses = {"commitment_weight": vq.commitment_weight, "entropy_weight": vq.entropy_weight}
        tokenizer = VQTokenizerConfig(**{**file_cfg, **losses})
    loss = VQGANLossConfig(vq.perceptual_weight, vq.disc_weight, disc_start, vq.disc_hidden_dim, vq.disc_layers)
    perceptual = lpips_vgg(vq.perceptual_weights, device) if vq.perceptual_weight else None
    run.print(f"VQGAN: the discriminator's losses start at step {disc_start}")
    model = VQGANLoss(tokenizer, loss)
    if start is not None:
        model.tokenizer.load_state_dict(start["weights"])
    return VQGANTask(model, dataset, export_path, perceptual, val_dataset=val)


def fit_dalle(model_cfg: DALLEConfig, run_cfg: DALLERunConfig, plan: RunPlan) -> str:
    """train_dalle.py's run; returns the export's path."""
    cfg = plan.cfg
    say = print if plan.topo.rank == 0 else (lambda *_: None)  # before the run's log: every local rank gets here
    start = None
    if run_cfg.dalle_path:
        start, model_cfg, vae, vae_export, vae_id = _start_from(run_cfg, model_cfg, say)
    else:
        vae, vae_export, vae_id = load_image_tokenizer(run_cfg, bool(run_cfg.image_text_folder), say)
    vae_flag = tokenizer_flag(run_cfg, run_cfg.dalle_path)
    previous = RunDir.recorded(RunDir.path_of(cfg, fit_dalle.run_name)) if cfg.resume else None
    if previous is not None:
        check_same_tokenizer(previous, vae_id, vae_flag)
        if run_cfg.bpe_path and "bpe_lowercase" not in previous.get("dalle", {}):
            run_cfg.bpe_lowercase = True  # a run started before the flag existed lowercased its captions
    configs = {"model": model_cfg, "dalle": run_cfg, "train": cfg, "vae_fingerprint": vae_id}
    if "weights" not in vae_export:  # a pretrained tokenizer's record: convert copies it into the export
        configs["pretrained_tokenizer"] = vae_export
    if (previous or {}).get("text_encoder"):  # kept until this run's encoder is checked against it
        configs["text_encoder"] = previous["text_encoder"]
    with training_session(plan, fit_dalle.run_name, configs) as (backend, recovery, run):
        spec = caption_data(run_cfg, cfg, vae.image_size, vae.channels, run_cfg.val_heldout_captions)
        data = datasets(spec, cfg, backend, run)
        pairs, val_pairs, heldout = data.train, data.val, data.heldout
        encoder = None
        if start is None:
            tokenizer = shared_text_tokenizer(run_cfg, cfg, backend, recovery, run, pairs, run_cfg.bpe_lowercase)
            if run_cfg.text_encoder:
                encoder = FrozenTextEncoder(tokenizer, backend.device)
                tokenizer.fingerprint = encoder.fingerprint
            model_cfg = dataclasses.replace(
                model_cfg,
                num_text_tokens=0 if encoder else tokenizer.vocab_size,
                text_feature_dim=encoder.dim if encoder else 0,
                num_image_tokens=vae.num_tokens,
                image_fmap_size=vae.fmap_size,
            )
        elif start["tokenizer"]["kind"] == "text_encoder":  # the export's encoder, where it lives here
            made = start["tokenizer"]["encoder"]
            if run_cfg.text_encoder and run_cfg.text_encoder != made:
                raise ValueError(f"--text_encoder {run_cfg.text_encoder}: {run_cfg.dalle_path} reads a {made} encoder")
            tokenizer, encoder = load_text_encoder(start["tokenizer"], backend.device, run_cfg.text_encoder_path)
        else:  # the export's model, which fits its tokenizers
            tokenizer = tokenizer_from_dict(start["tokenizer"])
        if encoder is not None:
            encoder.check(model_cfg.text_seq_len)
            was = ((previous or {}).get("text_encoder") or {}).get("fingerprint")
            if was and was != encoder.fingerprint:  # another encoder changes what every caption feature means
                raise ValueError(
                    f"--text_encoder_path {tokenizer.path} is not the encoder this run was trained with (fingerprint "
                    f"{encoder.fingerprint}, the run recorded {was}): pass the original, or start a new run"
                )
            run.print(
                f"captions read by a frozen {run_cfg.text_encoder or start['tokenizer']['encoder']} encoder: "
                f"{tokenizer.path} ({encoder.dim} features, {encoder.dtype}, fingerprint {encoder.fingerprint})"
            )
        run.update_config("model", model_cfg)
        if encoder is not None:  # convert writes it into an export made from a checkpoint
            run.update_config("text_encoder", tokenizer.to_dict())
        dalle = DALLE(model_cfg)
        if start is not None:
            dalle.load_state_dict(start["weights"])
            run.print(f"started from {run_cfg.dalle_path} (weights only: a new optimizer and schedule)")
        n_params = sum(p.numel() for p in dalle.parameters())
        run.print(f"DALLE: {n_params / 1e6:.2f}M parameters, sequence {model_cfg.seq_len}, {vae_flag}")
        streamed = is_stream(pairs)
        cached = streamed and pairs.caption_key == FEATURES_KEY  # features from the encode command's shards
        if cached and run_cfg.val_clip_path:
            raise ValueError(
                "--val_clip_path scores the validation captions' text: it cannot read cached caption features "
                f"(--wds {run_cfg.wds}); train on the txt captions (--wds codes.npy,txt) to score with a CLIP"
            )
        if cached and encoder is None:
            raise ValueError(
                f"--wds {run_cfg.wds}: cached caption features need the encoder that made them: pass --text_encoder "
                "and --text_encoder_path as the shards' encode.json records them"
            )
        if streamed and pairs.image_key == CODES_KEY:  # token shards (python -m dalle_pytorch.training.encode)
            check_codes(run_cfg.image_text_folder, vae_id, encoder if cached else None)
        elif streamed and run_cfg.precompute_tokens:
            pairs = encoded_stream(pairs, spec, vae, vae_id, run, backend, encoder, model_cfg.text_seq_len)
        dataset = tokenized(pairs, tokenizer, model_cfg.text_seq_len)
        if run_cfg.precompute_tokens and not streamed:
            dataset = precomputed(dataset, vae, vae_id, run, backend)
        export_path = run_cfg.dalle_output or os.path.join(run.path, "dalle.safetensors")
        val = tokenized(val_pairs, tokenizer, model_cfg.text_seq_len) if val_pairs is not None else None
        task = DALLETask(
            dalle, vae, vae_export, tokenizer, dataset, export_path, run_cfg.sample_captions, cfg.seed,
            val_dataset=val, heldout=heldout, clip=scoring_clip(run_cfg.val_clip_path, cfg, tokenizer, vae),
            text_encoder=encoder, decoding={"decoding": run_cfg.decoding, "window": run_cfg.sjd_window},
        )  # fmt: skip
        pos = train(task, plan.counted(task.dataset), backend, recovery, run)
        skipped = getattr(pairs, "num_skipped", 0)
        if skipped:
            run.print(f"skipped {skipped} unreadable samples")
        if dataset.truncated.value:
            run.print(f"truncated {dataset.truncated.value} captions to --text_seq_len {model_cfg.text_seq_len}")
        run.print(f"done at step {pos.step}: export {task.export_path}")
        return task.export_path


# what --dalle_path fixes (its export's model) and what a fine-tuning run may still change
_TRAINING_ONLY = ("attn_dropout", "ff_dropout", "loss_img_weight", "z_loss_weight", "null_cond_prob")


def _start_from(run_cfg: DALLERunConfig, model_cfg: DALLEConfig, say=print):
    """(export, its model config with the training-only flags given, image tokenizer, its export or record,
    its fingerprint) of --dalle_path. --vqgan_model_path / --openai_vae_path say where its tokenizer moved."""

    given = [f for f in ("vae_path", "taming") if getattr(run_cfg, f)]
    published = llamagen_kind(run_cfg.dalle_path)  # LlamaGen's GPT: its VQ comes from --vae_path
    if given and given != ["vae_path"] * bool(published):
        raise ValueError(f"--dalle_path brings its own VAE: drop --{', --'.join(given)}")
    start, vae = start_of(run_cfg, say)
    theirs, defaults = DALLEConfig(**start["config"]), DALLEConfig()
    fixed = [
        f.name
        for f in dataclasses.fields(DALLEConfig)
        if "help" in f.metadata and f.name not in _TRAINING_ONLY
        and getattr(model_cfg, f.name) not in (getattr(defaults, f.name), getattr(theirs, f.name))
    ]  # fmt: skip
    if fixed:
        raise ValueError(f"--dalle_path fixes the model ({run_cfg.dalle_path}'s): drop --{', --'.join(fixed)}")
    changed = {k: getattr(model_cfg, k) for k in _TRAINING_ONLY if getattr(model_cfg, k) != getattr(defaults, k)}
    return start, dataclasses.replace(theirs, **changed), vae, start["vae"], tokenizer_fingerprint(start["vae"])


def fit_clip(model_cfg: CLIPConfig, run_cfg: CLIPRunConfig, plan: RunPlan) -> str:
    """train_clip.py's run; returns the export's path."""
    cfg = plan.cfg
    fit = dalle_fit(run_cfg.dalle_path) if run_cfg.dalle_path else None
    size = fit["image_size"] if fit else run_cfg.image_size
    channels = fit["channels"] if fit else run_cfg.channels
    configs = {"model": model_cfg, "clip": run_cfg, "train": cfg}
    with training_session(plan, fit_clip.run_name, configs) as (backend, recovery, run):
        data = datasets(caption_data(run_cfg, cfg, size, channels), cfg, backend, run)
        pairs, val_pairs = data.train, data.val
        if fit:
            tokenizer = tokenizer_from_dict(fit["tokenizer"])
        else:
            tokenizer = shared_text_tokenizer(run_cfg, cfg, backend, recovery, run, pairs)
        model_cfg = dataclasses.replace(
            model_cfg,
            num_text_tokens=tokenizer.vocab_size,
            text_seq_len=fit["text_seq_len"] if fit else run_cfg.text_seq_len,
            image_size=size,
            channels=channels,
        )
        run.update_config("model", model_cfg)
        clip = CLIP(model_cfg)
        run.print(f"CLIP: {sum(p.numel() for p in clip.parameters()) / 1e6:.2f}M parameters")
        task = CLIPTask(
            clip,
            tokenizer,
            tokenized(pairs, tokenizer, model_cfg.text_seq_len),
            run_cfg.clip_output or os.path.join(run.path, "clip.safetensors"),
            gather=lambda x: (backend.all_gather(x), backend.rank * x.shape[0]),
            val_dataset=tokenized(val_pairs, tokenizer, model_cfg.text_seq_len) if val_pairs is not None else None,
        )
        pos = train(task, plan.counted(task.dataset), backend, recovery, run)
        run.print(f"done at step {pos.step}: export {task.export_path}")
        return task.export_path


fit_vae.run_name, fit_dalle.run_name, fit_clip.run_name = "vae", "dalle", "clip"
