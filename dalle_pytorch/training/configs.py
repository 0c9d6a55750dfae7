"""The run configs: what every trainer shares (TrainConfig) and each trainer's own flags (VAERunConfig,
DALLERunConfig, CLIPRunConfig, with the caption data group they share and the tokenizer groups of data/build.py
and inference/image_tokenizers.py). Every field is a flag with a default and a help text (dalle_pytorch/config.py);
arguments.py builds the scripts' parsers from these, the trainers (trainers.py) and the run's plan (plan.py) take
them typed, and config.json / config.yaml record them."""

from __future__ import annotations

from dataclasses import dataclass

from distributed import BACKENDS

from ..config import flag
from ..data.build import TextTokenizerConfig
from ..data.storage import RETRIES
from ..data.wds import SHUFFLE_BLOCK, StreamOptions
from ..inference.image_tokenizers import ImageTokenizerConfig
from ..models.sampling import DECODINGS, SJD_WINDOW
from .ema import check_decay
from .trackers.mlflow_run import DEFAULT_URI as DEFAULT_MLFLOW_URI

PRECISIONS = ("fp32", "bf16", "fp16")
LR_DECAYS = ("cosine", "exponential", "linear", "constant")


@dataclass
class TrainConfig:
    """What every trainer shares: data, optimisation, precision, distribution, outputs."""

    # data
    dataset_size: int = flag(20000, "samples in the built-in synthetic dataset (used when no data is given)")
    num_workers: int = flag(2, "DataLoader worker processes per rank")
    shards_index: str = flag(
        "",
        "JSON file of the samples in each --wds shard, counted once and read by later runs (default: the run "
        "directory's shards.json)",
    )
    shard_retries: int = flag(RETRIES, "retries of a shard (HTTP) that fails, waiting 1 s, 2 s, 4 s ... between tries")
    max_bad_shards: int = flag(
        -1, "the run stops when more --wds shards than this cannot be read (-1: 1 in 100 of the shards)"
    )
    shuffle_block: int = flag(
        SHUFFLE_BLOCK,
        "--wds: samples shuffled together across whole shards, so that a batch mixes many shards (MosaicML's "
        "py1b); every shard of a block is read (fetched) from the block's first item on; 1: one shard at a time",
    )
    shard_cache: str = flag(
        "",
        "--wds shards from http(s), s3://, gs:// or pipe: are fetched ahead into this folder and read there, the "
        "least recently used evicted (default: $DALLE_SHARD_CACHE, else dalle-shards-UID under the system's "
        "temporary folder); one folder serves every rank and worker of a host",
    )
    shard_cache_gb: float = flag(20.0, "size limit of --shard_cache in GiB (hold two shuffle blocks of shards)")
    shard_fetchers: int = flag(4, "concurrent shard fetches ahead of use, per DataLoader worker")
    # length of training
    epochs: int = flag(1, "passes over the data (ignored when --steps is set)")
    steps: int = flag(0, "optimizer steps to train; 0 means derive from --epochs")
    batch_size: int = flag(32, "micro-batch size per process")
    global_batch_size: int = flag(
        0,
        "samples per optimizer step over all processes; accumulation makes up the difference (0: none)",
    )
    # optimisation
    learning_rate: float = flag(1e-3, "peak learning rate (never rescaled by world size)")
    lr_decay: str = flag("cosine", "learning-rate decay after warmup", choices=LR_DECAYS)
    lr_min_factor: float = flag(0.1, "final learning rate as a fraction of --learning_rate")
    warmup_steps: int = flag(0, "linear learning-rate warmup steps")
    weight_decay: float = flag(0.0, "AdamW weight decay (never applied to norms, biases and embeddings)")
    clip_grad_norm: float = flag(1.0, "clip the global gradient norm to this; 0 disables clipping")
    precision: str = flag("fp32", "numeric precision of the trained model", choices=PRECISIONS)
    compile: bool = flag(False, "torch.compile the trained model (the first steps are slow while it compiles)")
    checkpoint_activations: bool = flag(
        False,
        "recompute each transformer block in backward: activations of one block instead of all, ~1/3 more compute",
    )
    ema: float = flag(
        0.0,
        "keep an exponential moving average of the weights with this decay (e.g. 0.999; 0: none), sharded like "
        "the weights, checkpointed, exported beside them and used by generate.py and the evaluation",
    )
    seed: int = flag(42, "random seed (data order, initialization, sampling)")
    # distribution
    distributed_backend: str = flag("auto", "auto picks from the launcher", choices=BACKENDS)
    threads: int = flag(0, "torch CPU threads per process; 0 splits the cores among local ranks")
    # fp16 dynamic loss scaling, on every backend
    initial_scale_power: int = flag(16, "fp16 dynamic loss scale starts at 2**N")
    loss_scale_window: int = flag(1000, "fp16: steps without overflow before the loss scale grows")
    # outputs
    val_every: int = flag(0, "validation loss every N steps (0: none); held-out samples: see --val_fraction")
    val_batches: int = flag(8, "validation batches per rank each time (--batch_size samples each)")
    val_fid_every: int = flag(
        0,
        "FID and KID of the model's images (a DALLE's for validation captions, a VAE's reconstructions) against "
        "--val_fid_samples validation images every N steps, logged as val_fid, val_kid (0: never)",
    )
    val_fid_samples: int = flag(1000, "validation images --val_fid_every measures (FID wants thousands)")
    inception_weights: str = flag(
        "",
        "--val_fid_every: torch-fidelity's Inception weights file (weights-inception-2015-12-05-6726825d.pth); "
        "default: downloaded once into torch's hub cache",
    )
    val_fraction: float = flag(
        0.0,
        "hold out this fraction of the training samples for validation (without a validation folder; the built-in "
        "data draws samples of its own)",
    )
    hooks: str = flag(
        "",
        "your code in the loop: MODULE:CLASS or path/to/file.py:CLASS (comma-separated), a subclass of "
        "dalle_pytorch.training.hooks.Hooks (examples/hooks/early_stopping.py)",
    )
    dist_timeout: float = flag(
        300.0,
        "seconds a collective waits for every rank (and the ranks for each other at start) before the job stops "
        "with a line naming the ranks that did not answer; raise it when rank 0 alone works longer (a BPE on "
        "millions of captions)",
    )
    exit_code_on_stop: int = flag(
        0,
        "exit status after SIGTERM stopped the run with a checkpoint saved (a finished run exits 0): e.g. 143 "
        "under a Kubernetes operator whose restart policy retries codes >= 128",
    )
    exit_code_on_hang: int = flag(
        2, "exit status when ranks stopped answering (--dist_timeout) and the others stopped: e.g. 142 to be retried"
    )
    output_dir: str = flag("runs", "parent folder of run directories")
    name: str = flag("", "run directory name under --output_dir (default: the trainer's name)")
    log_every: int = flag(10, "log metrics every N optimizer steps (each rank's figures too: rankN/step_ms, ...)")
    straggler_patience: int = flag(
        3,
        "name a rank that holds the others back (its own time per step above theirs, see --straggler_margin) after "
        "this many log steps in a row; 0: never",
    )
    straggler_margin: float = flag(
        0.25, "a rank is slow when its own time per step (data, forward, hooks) exceeds the others' median by this"
    )
    sample_every: int = flag(200, "write sample image grids every N steps; 0 disables")
    save_every_n_steps: int = flag(500, "write a resume checkpoint every N steps; 0 only at the end")
    keep_n_checkpoints: int = flag(2, "resume checkpoints to keep (older ones are deleted after a new one is complete)")
    resume: str = flag("", "resume from a checkpoint directory, or 'auto' for the newest complete one in the run")
    tensorboard: bool = flag(True, "write TensorBoard event files into the run directory")
    wandb: bool = flag(False, "log to Weights & Biases too (offline unless WANDB_MODE says otherwise)")
    wandb_project: str = flag("dalle-pytorch", "Weights & Biases project")
    wandb_entity: str = flag("", "Weights & Biases entity (user or team; default: your account's)")
    mlflow: str = flag(
        "",
        "log to MLflow: the config as parameters, the metrics with each rank's, sample grids and the export as "
        "artifacts; --resume goes on in the same MLflow run. --mlflow URI (http://host:5000, sqlite:///mlflow.db); "
        "--mlflow alone: MLFLOW_TRACKING_URI or MLflow's default store",
        const=DEFAULT_MLFLOW_URI,
    )
    mlflow_experiment: str = flag("dalle-pytorch", "MLflow experiment (created when missing)")
    quiet: bool = flag(False, "no progress bar")
    debug: bool = flag(False, "show Python tracebacks for user errors")

    def validate(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"--batch_size must be at least 1 (got {self.batch_size})")
        if self.steps < 0 or self.epochs < 1 and self.steps == 0:
            raise ValueError("set --steps to a positive count or --epochs to at least 1")
        if self.learning_rate <= 0:
            raise ValueError(f"--learning_rate must be positive (got {self.learning_rate})")
        if self.clip_grad_norm < 0:
            raise ValueError(f"--clip_grad_norm must be >= 0 (got {self.clip_grad_norm})")
        if self.ema:
            check_decay(self.ema)
        if not self.dist_timeout > 0:
            raise ValueError(f"--dist_timeout must be a positive number of seconds (got {self.dist_timeout:g})")
        for name in ("exit_code_on_stop", "exit_code_on_hang"):
            if not 0 <= getattr(self, name) <= 255:
                raise ValueError(f"--{name} must be an exit status from 0 to 255 (got {getattr(self, name)})")
        if self.straggler_patience < 0 or not self.straggler_margin > 0:
            raise ValueError(
                "--straggler_patience must be >= 0 and --straggler_margin positive (got "
                f"{self.straggler_patience} and {self.straggler_margin:g})"
            )
        if self.shard_retries < 0:
            raise ValueError(f"--shard_retries must be >= 0 (got {self.shard_retries})")
        if self.shuffle_block < 1 or self.shard_fetchers < 1 or not self.shard_cache_gb > 0:
            raise ValueError(
                "--shuffle_block and --shard_fetchers must be >= 1 and --shard_cache_gb positive (got "
                f"{self.shuffle_block}, {self.shard_fetchers} and {self.shard_cache_gb:g})"
            )
        if self.max_bad_shards < -1:
            raise ValueError(
                f"--max_bad_shards must be >= 0, or -1 for 1 in 100 of the shards (got {self.max_bad_shards})"
            )

    def stream_options(self) -> StreamOptions:
        """How --wds shards are read, as the data package takes it."""
        return StreamOptions(self.shard_retries, self.max_bad_shards, self.shuffle_block, self.shard_cache,
                             self.shard_cache_gb, self.shard_fetchers)  # fmt: skip

    def check_elastic(self) -> None:
        """What must not depend on the number of workers, since workers come and go and joiners compute it anew."""
        if not self.steps:
            raise ValueError(
                "horovodrun --min-np/--max-np: set --steps (with --epochs the step count would change with the workers)"
            )
        if self.global_batch_size:
            raise ValueError(
                "horovodrun --min-np/--max-np: drop --global_batch_size; the global batch follows the workers "
                "(--batch_size per worker)"
            )

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step so that batch_size x world_size x steps == global_batch_size."""
        if self.global_batch_size == 0:
            return 1
        per_step = self.batch_size * world_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"--global_batch_size {self.global_batch_size} is not a multiple of --batch_size x world size "
                f"= {self.batch_size} x {world_size} = {per_step}: change one of them"
            )
        return self.global_batch_size // per_step


# ----------------------------------------------------------------------------------- the trainers' run configs


@dataclass
class CaptionDataConfig:
    """Image/caption data: train_dalle.py's and train_clip.py's."""

    image_text_folder: str = flag(
        "", "folder of x.jpg + x.txt pairs, or WebDataset shard URLs with --wds; empty: the built-in synthetic dataset"
    )
    wds: str = flag(
        "", "image and caption keys of WebDataset shards, e.g. jpg,txt: --image_text_folder holds the shard URLs"
    )
    val_image_text_folder: str = flag(
        "", "validation pairs (x.jpg + x.txt), or with --wds shard URLs, read every --val_every steps"
    )
    resize_ratio: float = flag(0.75, "random resized crop keeps at least this fraction of each image (folders only)")


@dataclass
class VAERunConfig:
    """train_vae.py's own flags."""

    image_folder: str = flag(
        "", "folder of images (searched recursively), or WebDataset shard URLs with --wds; empty: the built-in dataset"
    )
    wds: str = flag("", "image key of WebDataset shards (e.g. jpg): --image_folder then holds the shard URLs")
    val_image_folder: str = flag("", "validation images, or with --wds shard URLs, read every --val_every steps")
    resize_ratio: float = flag(1.0, "random resized crop keeps at least this fraction of the image (1: no crop)")
    starting_temp: float = flag(1.0, "Gumbel-softmax temperature at step 0")
    temp_min: float = flag(0.0625, "temperature floor reached after --anneal_steps")
    anneal_steps: int = flag(0, "steps over which the temperature anneals; 0: the whole run")
    temp_schedule: str = flag("cosine", "temperature anneal shape", choices=("cosine", "exponential", "linear"))
    vae_output: str = flag("", "path of the export (default: RUN_DIR/vae.safetensors; a .pt path: torch's pickle)")
    vae_path: str = flag(
        "",
        "start from these weights: an export of train_vae.py or LlamaGen's VQ checkpoint (vq_ds16_t2i.pt); the file "
        "fixes the architecture (--image_size the side), the run a new optimizer",
    )


@dataclass
class VQGANRunConfig:
    """train_vae.py --model vqgan: the VQGAN's own flags. It shares --image_size, --channels, --num_tokens,
    --num_layers (downsamplings), --hidden_dim (channels at full resolution) and --num_resnet_blocks (per
    resolution) with the dVAE."""

    model: str = flag(
        "dvae",
        "the tokenizer to train: dvae (DALL-E's Gumbel-softmax discrete VAE) or vqgan (vector-quantized, with a "
        "perceptual loss and a patch discriminator, as taming-transformers and LlamaGen train it)",
        choices=("dvae", "vqgan"),
    )
    code_dim: int = flag(8, "--model vqgan: dimension of the codebook's vectors (LlamaGen's 8)")
    l2_norm_codes: bool = flag(True, "--model vqgan: look codes up by cosine (l2-normalized vectors and codebook)")
    commitment_weight: float = flag(0.25, "--model vqgan: weight of the commitment loss (beta)")
    entropy_weight: float = flag(0.0, "--model vqgan: weight of LlamaGen's entropy loss on code use (0: none)")
    perceptual_weight: float = flag(1.0, "--model vqgan: weight of the LPIPS perceptual loss (0: train without)")
    perceptual_weights: str = flag(
        "",
        "--model vqgan: torchvision's VGG-16 ImageNet weights file (vgg16-397923af.pth) under LPIPS; default: "
        "downloaded once into torch's hub cache",
    )
    disc_weight: float = flag(0.5, "--model vqgan: weight of the generator's adversarial (hinge) loss")
    disc_start: int = flag(-1, "--model vqgan: step at which the discriminator's losses start (-1: half the run)")
    disc_hidden_dim: int = flag(64, "--model vqgan: the discriminator's first channels")
    disc_layers: int = flag(3, "--model vqgan: the discriminator's downsampling layers")


DEFAULT_SAMPLE_CAPTIONS = [
    "a large red circle on the left",
    "a small blue triangle above a large yellow square",
    "a big green square to the right of a small purple circle",
    "a small cyan triangle in the center",
]


@dataclass
class DALLERunConfig(ImageTokenizerConfig, CaptionDataConfig, TextTokenizerConfig):
    """train_dalle.py's own flags, with the image tokenizer, caption data and text tokenizer groups."""

    dalle_path: str = flag(
        "",
        "start from this DALLE export (or a dalle-pytorch 1.6 dalle.pt): its model, weights, tokenizers and VAE; "
        "the model and tokenizer flags are not used",
    )
    bpe_lowercase: bool = flag(
        False, "lowercase captions for a --bpe_path YouTokenToMe model (runs before 2026-12 did)"
    )
    dalle_output: str = flag("", "path of the export (default: RUN_DIR/dalle.safetensors; a .pt path: torch's pickle)")
    precompute_tokens: bool = flag(
        False, "run the VAE over the data once before training (cached as RUN_DIR/tokens.pt; fixed crops)"
    )
    sample_captions: list = flag(DEFAULT_SAMPLE_CAPTIONS, "captions drawn in the sample grids")
    val_clip_path: str = flag(
        "",
        "--val_fid_every: also the CLIP score of the images for their validation captions, val_clip_score, by this "
        "CLIP: an export of train_clip.py with this run's text tokenizer and image size, or open_clip's "
        "(ViT-B-32:openai, hf-hub:NAME, MODEL:FILE)",
    )
    decoding: str = flag(
        "sequential",
        "--val_fid_every's images: sequential, or sjd (speculative Jacobi decoding, fewer passes)",
        choices=DECODINGS,
    )
    sjd_window: int = flag(SJD_WINDOW, "--decoding sjd: draft tokens per pass")
    val_heldout_captions: int = flag(
        16,
        "built-in data: each validation (--val_every) also generates images for N captions of colour-shape pairs "
        "never trained on and reads them back with the parser (val_heldout_full, val_heldout_color, ...); 0: none",
    )


@dataclass
class CLIPRunConfig(CaptionDataConfig, TextTokenizerConfig):
    """train_clip.py's own flags, with the caption data and text tokenizer groups."""

    dalle_path: str = flag("", "the DALLE export to rerank for: its tokenizer, caption length and image size")
    image_size: int = flag(32, "image side without --dalle_path")
    channels: int = flag(3, "image channels without --dalle_path")
    text_seq_len: int = flag(32, "caption tokens without --dalle_path")
    clip_output: str = flag("", "path of the export (default: RUN_DIR/clip.safetensors; a .pt path: torch's pickle)")
